"""`kvfleet bench routing`: the gateway's routing policies side by side on one multi-tenant workload, with two
gateway replicas sharing the traffic, against an oracle that knows every replica's cache.

Each tenant's requests share a long prefix of its own (a system prompt and documents) and end in a question
of their own; tenants are drawn with Zipf popularity, and requests arrive as a seeded Poisson process. The
replicas' device caches are sized so that the fleet cannot hold every tenant's prefix: blocks are evicted
and spill to each replica's host tier. Two gateways, each knowing every replica, take the requests in turn,
as the chart's two gateway replicas behind one Service do.

For each policy the replicas start afresh (empty caches) and the same requests are sent at the same times.
Reported: the time to first token as the client sees it (p50, p90), the fleet's prefix hit rate (prompt
tokens found on the device or loaded from the host tier, from the replicas' own counters), and the oracle's
hit rate: for each request as it is sent, the longest prefix that any replica holds on either medium, read
by this benchmark's own subscriber from every replica's KV events. It is what the best placement could hit
with the caches that policy's placements produced.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from kvfleet.contract.block_hash import block_hashes, external_block_hash
from kvfleet.runtime.bench.processes import MODEL_NAME, BenchProcess, ServeProcess, counter_totals, free_port
from kvfleet.runtime.bench.serve_client import ServeRequest, bench_client, send_request
from kvfleet.runtime.bench.serve_report import MetricSelection, RequestResult, summarize
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)

POLICIES = ("precise-prefix", "cache-aware", "prefix-hash", "round-robin")
TTFT_MEDIAN_AND_P90 = MetricSelection(("ttft",), (90.0,))
GATEWAYS = 2
# The replicas' counters the fleet's hit rate is read from, without their prefix and _total.
_HIT_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "kv_offload_prefix_blocks_loaded")


@dataclass(frozen=True)
class TenantSettings:
    tenants: int = 12
    prefix_len: tuple[int, int] = (768, 1024)
    question_len: tuple[int, int] = (16, 48)
    output_len: int = 4
    requests: int = 200
    rate: float = 1.0
    # Zipf exponent of the tenants' popularity: 0 draws them uniformly.
    zipf: float = 0.5
    seed: int = 0


def tenant_workload(settings: TenantSettings, vocab_size: int) -> list[ServeRequest]:
    """The requests in sending order, all from the seed; token ids skip the first 16 (special) ids."""
    rng = random.Random(settings.seed)

    def tokens(length: tuple[int, int]) -> list[int]:
        return [rng.randrange(16, vocab_size) for _ in range(rng.randint(*length))]

    prefixes = [tokens(settings.prefix_len) for _ in range(settings.tenants)]
    weights = [1 / (rank + 1) ** settings.zipf for rank in range(settings.tenants)]
    requests, clock = [], 0.0
    for _ in range(settings.requests):
        clock += rng.expovariate(settings.rate)
        prompt = rng.choices(prefixes, weights)[0] + tokens(settings.question_len)
        requests.append(ServeRequest(prompt, settings.output_len, None, clock))
    return requests


class CacheOracle:
    """Every replica's cached blocks on every medium, from its KV events; read by the sending loop, written by
    one thread that polls every replica's socket."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self._context = zmq.Context()
        self._sockets = []
        for endpoint in endpoints:
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(endpoint)
            self._sockets.append(socket)
        self._held: list[dict[int, set[str | None]]] = [{} for _ in endpoints]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-oracle", daemon=True)
        self._thread.start()

    def best_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """The most leading blocks of `hashes` that one replica holds, on any medium."""
        with self._lock:
            best = 0
            for held in self._held:
                count = 0
                while count < len(hashes) and held.get(hashes[count]):
                    count += 1
                best = max(best, count)
            return best

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for socket in self._sockets:
            socket.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        for socket in self._sockets:
            poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(100):
                _, _, payload = socket.recv_multipart()
                batch = decode_batch(payload)
                with self._lock:
                    self._apply(self._held[self._sockets.index(socket)], batch)

    @staticmethod
    def _apply(held: dict[int, set[str | None]], batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    held.setdefault(block_hash, set()).add(event.medium)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    media = held.get(block_hash)
                    if media is not None:
                        media.discard(event.medium)
            elif isinstance(event, AllBlocksCleared):
                held.clear()


def run_routing_bench(
    config: EngineConfig,
    settings: TenantSettings,
    *,
    replicas: int,
    policies: Sequence[str],
    load_bound: float,
    vocab_size: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Each policy in turn on a fresh fleet; its summary (see summarize), hit rates and the oracle's."""
    workload = tenant_workload(settings, vocab_size)
    report: dict[str, Any] = {"requests": len(workload), "load_average": os.getloadavg(), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-routing-") as temp:
        for policy in policies:
            log(f"{policy}: {replicas} replicas behind {GATEWAYS} gateways")
            workdir = Path(temp) / policy
            workdir.mkdir()
            report["runs"][policy] = _run_policy(config, workdir, policy, replicas, load_bound, workload)
    report["load_average_after"] = os.getloadavg()
    return report


def _run_policy(
    config: EngineConfig,
    workdir: Path,
    policy: str,
    replicas: int,
    load_bound: float,
    workload: list[ServeRequest],
) -> dict[str, Any]:
    servers, endpoints = [], []
    for index in range(replicas):
        events, replay = free_port(), free_port()
        events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        args = ["--kv-events-config", json.dumps(events_config)]
        servers.append(
            ServeProcess(config, workdir, args, log_name=f"replica-{index}.log", env={"OMP_NUM_THREADS": "1"})
        )
        endpoints.append((f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))
    urls = ",".join(server.url for server in servers)
    gateway_args = ["gateway", "--model", f"{MODEL_NAME}={urls}", "--policy", policy]
    gateway_args += ["--load-bound", str(load_bound)]
    for server, (events, replay) in zip(servers, endpoints, strict=True):
        gateway_args += ["--kv-events", f"{server.url}={events},{replay}"]
    gateways = [
        BenchProcess(gateway_args, workdir / f"gateway-{index}.log", ready_path="/health")
        for index in range(GATEWAYS)
    ]
    processes: list[BenchProcess] = [*servers, *gateways]
    oracle = None
    try:
        for process in processes:
            process.wait_ready()
        oracle = CacheOracle([events for events, _ in endpoints])
        results, duration, oracle_tokens = asyncio.run(
            _send_all([gateway.url for gateway in gateways], workload, oracle, config.block_size)
        )
        counters = counter_totals([server.url for server in servers], _HIT_COUNTERS)
    finally:
        if oracle is not None:
            oracle.close()
        for process in reversed(processes):
            process.stop()
    queried = counters["prefix_cache_queries"]
    hits = counters["prefix_cache_hits"] + counters["kv_offload_prefix_blocks_loaded"] * config.block_size
    prompt_tokens = sum(len(request.prompt_token_ids) for request in workload)
    return {
        **summarize(results, duration, TTFT_MEDIAN_AND_P90),
        "hit_rate": hits / queried if queried else 0.0,
        "oracle_hit_rate": oracle_tokens / prompt_tokens,
    }


async def _send_all(
    urls: list[str], workload: list[ServeRequest], oracle: CacheOracle, block_size: int
) -> tuple[list[RequestResult], float, int]:
    """Each request at its time, through the gateways in turn; the results, the wall time, and the prompt
    tokens the oracle finds cached as each request is sent."""
    clients = [bench_client(url, len(workload), timeout=600.0) for url in urls]
    oracle_tokens = 0
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for number, request in enumerate(workload):
            await asyncio.sleep(max(0.0, start + request.send_at - loop.time()))
            tokens = request.prompt_token_ids
            # The engine computes at least the prompt's last token, so a block holding it is never a hit.
            hashes = [
                external_block_hash(block_hash) for block_hash in block_hashes(tokens[:-1], block_size, None)
            ]
            oracle_tokens += oracle.best_prefix_blocks(hashes) * block_size
            client = clients[number % len(clients)]
            tasks.append(asyncio.create_task(send_request(client, MODEL_NAME, request)))
        results = list(await asyncio.gather(*tasks))
        return results, loop.time() - start, oracle_tokens
    finally:
        for client in clients:
            await client.aclose()


def format_routing_report(report: dict[str, Any]) -> str:
    load, after = report["load_average"], report["load_average_after"]
    lines = [
        f"{report['requests']} requests; load average {load[0]:.2f} before, {after[0]:.2f} after",
        "",
        "| policy | TTFT p50 ms | TTFT p90 ms | failed | hit rate | oracle hit rate |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for policy, run in report["runs"].items():
        lines.append(
            f"| {policy} | {run['median_ttft_ms']:.1f} | {run['p90_ttft_ms']:.1f} | {run['failed']} | "
            f"{run['hit_rate']:.1%} | {run['oracle_hit_rate']:.1%} |"
        )
    return "\n".join(lines)
