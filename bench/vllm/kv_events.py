"""KV-cache events between kvfleet and vLLM's CPU build, both ways (`make kv-events-vs-vllm`):

1. vLLM reads kvfleet's events: a kvfleet replica publishes (the default encoding); a subscriber in vLLM's
   own environment decodes every batch with vLLM's classes (bench/vllm/kv_events_subscriber.py). Each full
   block of a prompt of known tokens must be stored once, with its tokens, its parent link and the hash
   the block-hash rule gives.
2. kvfleet's gateway routes vLLM replicas on their events: two vLLM servers publish, and
   `kvfleet gateway --policy precise-prefix --rehash-kv-events ...` follows both. Each tenant's first
   request goes straight to a replica of the script's choosing, which the gateway cannot guess; every
   request after it, through the gateway, must be routed as a device hit and land on that replica, as
   vLLM's own prefix-cache counters show.

Every process started here runs in its own process group and is stopped by it, also on failure.

    python bench/vllm/kv_events.py --vllm-python PATH --model SMALL_MODEL_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
from kvfleet.contract.block_hash import block_hashes, external_block_hash
from prometheus_client.parser import text_string_to_metric_families

MODEL = "small"
TENANTS = 4
REQUESTS_PER_TENANT = 5
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def process_group(
    command: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen]:
    """The command in a process group of its own, stopped (TERM, then KILL) with all its children on exit."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )
        try:
            yield process
        finally:
            _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


def wait_for(
    what: str, probe: Callable[[], T | None], seconds: float, process: subprocess.Popen | None = None
) -> T:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the process for {what} exited with {process.returncode}")
        try:
            value = probe()
        except httpx.TransportError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {seconds:.0f} s")


def completion(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()


def counters(url: str, names: tuple[str, ...]) -> dict[str, float]:
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def _decisions(gateway_url: str) -> dict[str, float]:
    """The gateway's precise-prefix decisions by reason."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{gateway_url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "kvfleet_gateway_precise_prefix_decisions_total":
                reason = sample.labels["reason"]
                found[reason] = found.get(reason, 0.0) + sample.value
    return found


def vllm_reads_kvfleet(args: argparse.Namespace, workdir: Path) -> None:
    port, events = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}"}
    serve = [sys.executable, "-P", "-m", "kvfleet", "serve", "--model", str(args.model)]
    serve += ["--served-model-name", MODEL, "--dtype", "float32", "--num-gpu-blocks-override", "256"]
    serve += ["--kv-events-config", json.dumps(config), "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    subscribe = [args.vllm_python, "-P", str(Path(__file__).parent / "kv_events_subscriber.py")]
    subscribe += ["--endpoint", f"tcp://127.0.0.1:{events}", "--seconds", "300"]
    with ExitStack() as stack:
        server = stack.enter_context(process_group(serve, workdir / "kvfleet-serve.log"))
        wait_for("the kvfleet replica", lambda: httpx.get(f"{url}/ready").status_code == 200, 600, server)
        subscriber = subprocess.Popen(subscribe, stdout=subprocess.PIPE, text=True, start_new_session=True)
        stack.callback(_stop_group, subscriber)
        assert subscriber.stdout is not None
        if json.loads(subscriber.stdout.readline()) != {"ready": True}:
            raise RuntimeError("vLLM's subscriber did not start")
        block_size = 16
        prompt = [16 + (index * 7) % 500 for index in range(5 * block_size + 3)]
        completion(url, prompt)
        expected = [external_block_hash(h) for h in block_hashes(prompt, block_size, None)]
        stored: dict[int, tuple[int | None, list[int]]] = {}
        while not set(expected) <= set(stored):
            line = json.loads(subscriber.stdout.readline())
            if "error" in line:
                raise AssertionError(f"vLLM could not decode batch {line['seq']}: {line['error']}")
            if line["type"] == "BlockStored":
                parent = line["parent_block_hash"]
                for index, block_hash in enumerate(line["block_hashes"]):
                    tokens = line["token_ids"][index * block_size : (index + 1) * block_size]
                    stored[block_hash] = (parent, tokens)
                    parent = block_hash
        for index, block_hash in enumerate(expected):
            parent, tokens = stored[block_hash]
            assert tokens == prompt[index * block_size : (index + 1) * block_size], f"block {index}'s tokens"
            assert parent == (expected[index - 1] if index else None), f"block {index}'s parent"
    print(
        f"vLLM's decoder read kvfleet's events: the prompt's {len(expected)} blocks, tokens and parents match"
    )


def gateway_routes_vllm(args: argparse.Namespace, workdir: Path) -> None:
    replicas = []
    with ExitStack() as stack:
        for index in range(2):
            port, events, replay = free_port(), free_port(), free_port()
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            command = [args.vllm_python, "-P", "-m", "vllm.entrypoints.openai.api_server"]
            command += ["--model", str(args.model), "--served-model-name", MODEL, "--dtype", "float32"]
            command += ["--max-num-seqs", "8", "--kv-events-config", json.dumps(config)]
            command += ["--host", "127.0.0.1", "--port", str(port)]
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
            process = stack.enter_context(process_group(command, workdir / f"vllm-{index}.log", env))
            replicas.append(
                (
                    f"http://127.0.0.1:{port}",
                    f"tcp://127.0.0.1:{events}",
                    f"tcp://127.0.0.1:{replay}",
                    process,
                )
            )
        for url, _, _, process in replicas:
            wait_for(f"vLLM at {url}", lambda url=url: completion(url, [16, 17, 18]), 900, process)
        gateway_port = free_port()
        gateway = [sys.executable, "-P", "-m", "kvfleet", "gateway", "--policy", "precise-prefix"]
        gateway += ["--model", f"{MODEL}=" + ",".join(url for url, *_ in replicas)]
        for url, events, replay, _ in replicas:
            gateway += ["--kv-events", f"{url}={events},{replay}", "--rehash-kv-events", url]
        # vLLM serves no tokenizer to fetch: the gateway reads the model's own files.
        gateway += ["--tokenizer", f"{MODEL}={args.model}"]
        gateway += ["--host", "127.0.0.1", "--port", str(gateway_port)]
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        gateway_process = stack.enter_context(process_group(gateway, workdir / "gateway.log"))
        wait_for(
            "the gateway", lambda: httpx.get(f"{gateway_url}/health").status_code == 200, 60, gateway_process
        )
        hits = "vllm:prefix_cache_hits_total"
        placements: dict[int, list[int]] = {}
        for tenant in range(TENANTS):
            prefix = [16 + (tenant * 1009 + index * 13) % 4000 for index in range(600)]
            home = tenant % len(replicas)
            completion(replicas[home][0], [*prefix, 16 + tenant, 16, 18])
            # The replica's events reach the gateway within moments.
            time.sleep(1.0)
            for number in range(1, REQUESTS_PER_TENANT):
                before = [counters(url, (hits,))[hits] for url, *_ in replicas]
                completion(gateway_url, [*prefix, 16 + tenant, 17 + number, 18])
                after = [counters(url, (hits,))[hits] for url, *_ in replicas]
                gained = [late - early for early, late in zip(before, after, strict=True)]
                placements.setdefault(tenant, []).append(max(range(len(gained)), key=gained.__getitem__))
                assert max(gained) >= 512, f"tenant {tenant}, request {number}: cached {gained}"
            assert set(placements[tenant]) == {home}, f"tenant {tenant}: {placements[tenant]}, not {home}"
        decisions = _decisions(gateway_url)
        assert decisions.get("device_hit") == TENANTS * (REQUESTS_PER_TENANT - 1), decisions
    print(
        f"the gateway routed {TENANTS} tenants x {REQUESTS_PER_TENANT - 1} requests over 2 vLLM replicas on "
        f"their events, each to the replica its tenant's prefix was sent to directly: placements "
        f"{placements}; decisions {decisions}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not (args.model / "config.json").exists():
        make = [sys.executable, "-P", "-m", "kvfleet", "make-model", "--arch", "llama", "--preset", "small"]
        subprocess.run([*make, "--seed", "0", str(args.model)], check=True)
    vllm_reads_kvfleet(args, args.workdir)
    gateway_routes_vllm(args, args.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
