"""The fleet gateway's added latency: short completions at a fixed rate, straight to a replica, through
`kvfleet gateway`, and through a gateway that traces every request, in separate processes on one machine.

The replica is a stand-in that answers every completion at once with a short OpenAI body, so what differs
between the runs is the gateway alone. The load is open-loop (requests leave on schedule whether or not
earlier ones finished), over keep-alive connections. The traced gateway sends its spans over OTLP/HTTP to a
stand-in collector that answers every export at once.

    python bench/gateway_overhead.py --rate 200 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import aiohttp
from aiohttp import web

ANSWER = {
    "id": "cmpl-bench",
    "object": "text_completion",
    "created": 0,
    "model": "bench",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
}
BODY = json.dumps({"model": "bench", "prompt": "The quick brown fox", "max_tokens": 1}).encode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_collector(port: int) -> None:
    """An OTLP/HTTP endpoint that takes every export (an empty ExportTraceServiceResponse: an empty body)."""

    async def export(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", export)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def start_gateway(port: int, replica_url: str, traces_endpoint: str | None = None) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-P", "-m", "kvfleet", "--log-level", "warning", "gateway"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--model", f"bench={replica_url}"]
    command += ["--max-in-flight", "100000"]
    env = dict(os.environ)
    if traces_endpoint is not None:
        command += ["--otlp-traces-endpoint", traces_endpoint]
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    return subprocess.Popen(command, env=env)


def run_replica(port: int) -> None:
    payload = json.dumps(ANSWER).encode()

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=payload, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def wait_listening(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            try:
                async with session.post(f"{url}/v1/completions", data=BODY) as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never answered")


async def drive(url: str, rate: float, seconds: float) -> tuple[list[float], int]:
    """Latencies (s) of the requests that succeeded, and how many failed."""
    latencies: list[float] = []
    failures = 0
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal failures
            started = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/completions", data=BODY, headers=headers) as answer:
                    await answer.read()
                    ok = answer.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                failures += 1

        total = int(rate * seconds)
        begin = time.perf_counter()
        tasks = []
        for index in range(total):
            delay = begin + index / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies, failures


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    options = parser.parse_args()

    replica_port, gateway_port, traced_port, collector_port = (free_port() for _ in range(4))
    helpers = [
        multiprocessing.Process(target=run_replica, args=(replica_port,), daemon=True),
        multiprocessing.Process(target=run_collector, args=(collector_port,), daemon=True),
    ]
    for helper in helpers:
        helper.start()
    replica_url = f"http://127.0.0.1:{replica_port}"
    collector_url = f"http://127.0.0.1:{collector_port}/v1/traces"
    gateways = [
        start_gateway(gateway_port, replica_url),
        start_gateway(traced_port, replica_url, traces_endpoint=collector_url),
    ]
    urls = {
        "direct": replica_url,
        "gateway": f"http://127.0.0.1:{gateway_port}",
        "traced": f"http://127.0.0.1:{traced_port}",
    }
    try:
        for url in urls.values():
            asyncio.run(wait_listening(url))
        results = {}
        for name, url in urls.items():
            asyncio.run(drive(url, options.rate, options.warmup_seconds))
            latencies, failures = asyncio.run(drive(url, options.rate, options.seconds))
            results[name] = latencies
            p50, p99 = percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000
            mean = statistics.fmean(latencies) * 1000
            counts = f"{len(latencies)} ok, {failures} failed"
            print(f"{name:8s} {counts}: p50 {p50:.2f} ms, p99 {p99:.2f} ms, mean {mean:.2f} ms")
        for name in ("gateway", "traced"):
            for label, fraction in (("p50", 0.5), ("p99", 0.99)):
                added = percentile(results[name], fraction) - percentile(results["direct"], fraction)
                print(f"added {label} ({name}): {added * 1000:.2f} ms")
        print(f"load: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    finally:
        for gateway in gateways:
            gateway.send_signal(signal.SIGTERM)
        for gateway in gateways:
            gateway.wait(30)
        for helper in helpers:
            helper.terminate()
            helper.join(30)


if __name__ == "__main__":
    main()
