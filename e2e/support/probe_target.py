"""A small HTTP server the pod runner's own tests run in pods, in place of `kvfleet serve`.

It lets a test steer what a kubelet would see (readiness delay, readiness flips, crashes, slow drains) and
read back what the process was given (argv, environment, hostname, its view of the API with the pod's
account) and what it sees of the cluster's network: a name resolved, a URL fetched, from inside the pod. A
stream of server-sent events holds back its last event until released, to show a proxy passes each event
on as it comes.

    probe_target.py --host H --port P [--ready-after S] [--exit-after S --exit-code N] [--drain-seconds S]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml


class State:
    def __init__(self, ready_after: float) -> None:
        self.ready_at = time.monotonic() + ready_after
        self.forced_unready = False
        self.draining = False
        self.stream_released = threading.Event()


def api_status(path: str) -> int:
    """The HTTP status the API server answers GET path with, authenticated by KUBECONFIG's token."""
    with open(os.environ["KUBECONFIG"]) as f:
        config = yaml.safe_load(f)
    cluster = config["clusters"][0]["cluster"]
    token = config["users"][0]["user"]["token"]
    if "certificate-authority-data" in cluster:
        with tempfile.NamedTemporaryFile("wb", suffix=".crt", delete=False) as ca:
            ca.write(base64.b64decode(cluster["certificate-authority-data"]))
        context = ssl.create_default_context(cafile=ca.name)
    else:
        context = ssl.create_default_context(cafile=cluster["certificate-authority"])
    request = urllib.request.Request(cluster["server"] + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def resolve(name: str) -> dict[str, Any]:
    """The IPv4 addresses the pod's resolver gives for name, or why it gave none."""
    try:
        found = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as error:
        return {"error": str(error)}
    return {"addresses": sorted({entry[4][0] for entry in found})}


def fetch(url: str) -> dict[str, Any]:
    """GET url from inside the pod: its status and body, or why it failed."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return {"status": response.status, "body": response.read().decode()}
    except urllib.error.HTTPError as error:
        return {"status": error.code, "body": error.read().decode()}
    except OSError as error:
        return {"error": str(error)}


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self) -> None:
            """Two server-sent events; the second only after POST /release-stream."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b"data: first\n\n")
            self.wfile.flush()
            state.stream_released.wait()
            self.wfile.write(b"data: second\n\n")
            self.wfile.flush()
            self.close_connection = True

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            if self.path == "/health":
                self._reply(200, {"status": "ok"})
            elif self.path == "/ready":
                ready = time.monotonic() >= state.ready_at and not state.forced_unready and not state.draining
                self._reply(200 if ready else 503, {"ready": ready})
            elif self.path == "/info":
                info = {
                    "argv": sys.argv,
                    "env": dict(os.environ),
                    "cwd": os.getcwd(),
                    "pid": os.getpid(),
                    "hostname": socket.gethostname(),
                }
                self._reply(200, info)
            elif url.path in ("/resolve", "/fetch") and len(query) != 1:
                self._reply(400, {"error": "give exactly one of ?name= (resolve) or ?url= (fetch)"})
            elif url.path == "/resolve":
                self._reply(200, resolve(query["name"]))
            elif url.path == "/fetch":
                self._reply(200, fetch(query["url"]))
            elif self.path == "/stream":
                self._stream()
            elif self.path.startswith("/api-status"):
                self._reply(200, {"status": api_status(self.path[len("/api-status") :])})
            else:
                self._reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path in ("/unready", "/ready"):
                state.forced_unready = self.path == "/unready"
                self._reply(200, {"forced_unready": state.forced_unready})
            elif self.path == "/release-stream":
                state.stream_released.set()
                self._reply(200, {"released": True})
            else:
                self._reply(404, {"error": "not found"})

        def log_message(self, format: str, *args: Any) -> None:
            print(format % args, flush=True)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", nargs="?", default="serve")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--exit-after", type=float, default=None)
    parser.add_argument("--exit-code", type=int, default=1)
    parser.add_argument("--drain-seconds", type=float, default=0.0)
    args, _ = parser.parse_known_args()

    state = State(args.ready_after)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    print(f"listening on {args.host}:{args.port}", flush=True)

    def drain(signum: int, frame: Any) -> None:
        print(f"got signal {signum}, draining for {args.drain_seconds}s", flush=True)
        state.draining = True
        threading.Timer(args.drain_seconds, server.shutdown).start()

    signal.signal(signal.SIGTERM, drain)
    if args.exit_after is not None:

        def crash() -> None:
            print(f"exiting with {args.exit_code} as asked", flush=True)
            os._exit(args.exit_code)

        threading.Timer(args.exit_after, crash).start()
    server.serve_forever()
    print("drained, exiting", flush=True)


if __name__ == "__main__":
    main()
