"""A replica gone wrong: answers /metrics with a chunked body that does not end (up to a bound).

    endless_metrics_server.py --answer-bytes N --lifetime S

Listens on two loopback ports, printed as `ports NORMAL ENDLESS` once both listen: NORMAL answers a
regular kvfleet page, ENDLESS streams metric lines until the client goes away or N bytes are sent. After each
endless answer it prints `sent BYTES`. It exits when its stdin closes, and by itself after S seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import threading

from aiohttp import web

LINE = b'kvfleet:num_requests_waiting{model_name="endless"} 1\n'
CHUNK = LINE * (65536 // len(LINE))
PAGE = 'kvfleet:num_requests_waiting{model_name="m"} 1\nkvfleet:num_requests_running{model_name="m"} 2\n'


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def serve(answer_bytes: int, lifetime: float) -> None:
    async def normal(_: web.Request) -> web.Response:
        return web.Response(text=PAGE)

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        await response.prepare(request)
        sent = 0
        try:
            while sent < answer_bytes:
                await response.write(CHUNK)
                sent += len(CHUNK)
        except ConnectionError:
            pass  # the scraper hung up: what a capped scrape does
        finally:
            print(f"sent {sent}", flush=True)
        return response

    runners = []
    ports = []
    for handler in (normal, endless):
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = listener()
        await web.SockSite(runner, sock).start()
        runners.append(runner)
        ports.append(sock.getsockname()[1])
    print(f"ports {ports[0]} {ports[1]}", flush=True)
    stdin_closed = asyncio.Event()
    loop = asyncio.get_running_loop()

    def watch_stdin() -> None:
        sys.stdin.read()
        loop.call_soon_threadsafe(stdin_closed.set)

    # A daemon thread: after the lifetime, nothing waits for stdin to close.
    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stdin_closed.wait(), timeout=lifetime)
    finally:
        for runner in runners:
            await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer-bytes", type=int, required=True)
    parser.add_argument("--lifetime", type=float, required=True)
    options = parser.parse_args()
    asyncio.run(serve(options.answer_bytes, options.lifetime))


if __name__ == "__main__":
    main()
