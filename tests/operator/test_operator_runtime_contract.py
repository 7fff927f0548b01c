"""The rendered runtime command line against the real `kvfleet serve`: it starts, becomes ready, reports
the metrics the autoscaler reads (without the API key the pods guard their routes with), and drains, hands
back a stream still running and exits within the grace period the pod gets past its preStop pause.

The operator never imports the runtime; this test runs it as a separate process, as a pod would.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import httpx
import pytest
import yaml
from kvfleet.contract.kv_transfer import ROLES
from kvfleet.operator.api import API_KEY_ENV, KV_TRANSFER_CONFIG_FLAG
from kvfleet.operator.autoscaler import PodMetrics
from kvfleet.operator.render_pod import (
    PRESTOP_DELAY_SECONDS,
    TraceExport,
    pod_template,
    runtime_args,
    termination_grace_seconds,
)
from kvfleet.operator.scrape import FleetScraper, ScrapeTarget
from kvfleet.operator.spec import parse_spec
from kvfleet.runtime.kv_transfer.config import KVTransferConfig
from ports import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
API_KEY = "contract-test-key"
READY_TIMEOUT_SECONDS = 180


def wait_ready(base: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        assert process.poll() is None, "the runtime exited before it was ready"
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready within {READY_TIMEOUT_SECONDS}s")


async def scrape_twice_around_requests(target: ScrapeTarget, base: str) -> tuple[object, object]:
    """Scrapes with no key (as the operator does), and sends the requests with the API key."""
    async with aiohttp.ClientSession() as session:
        scraper = FleetScraper(session, timeout_seconds=5)
        (before,) = await scraper.scrape([target])
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=base, timeout=60, headers=headers) as client:
            body = {"model": "tiny", "prompt": "hello there", "max_tokens": 8}
            replies = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(4)))
        assert all(reply.status_code == 200 for reply in replies)
        (after,) = await scraper.scrape([target])
    return before, after


def stream_events(base: str, events: list[str], started: threading.Event) -> None:
    """A completion as long as the context allows, streamed into `events` (each event's data)."""
    body = {"model": "tiny", "prompt": "long", "max_tokens": 500, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                started.set()


@pytest.mark.slow
def test_rendered_command_runs_the_real_runtime(make_model: Callable[..., Path], tmp_path: Path) -> None:
    raw_spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    raw_spec.setdefault("engine", {})["apiKeySecret"] = "tiny-api-key"
    # No drain at all: the stream in flight is handed back at once, and the exit is all the grace is for.
    raw_spec["engine"]["drainTimeoutSeconds"] = 0
    spec = parse_spec(raw_spec, name="tiny")
    args = runtime_args(spec)
    (container,) = pod_template(spec, {}, "kvfleet/runtime", "m")["spec"]["containers"]
    (api_key,) = [entry for entry in container["env"] if "valueFrom" in entry]
    secret_ref = {"name": "tiny-api-key", "key": API_KEY_ENV}
    assert api_key == {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": secret_ref}}
    port = free_port()
    # What a pod would get, with the model where this machine has it and a port of its own.
    args[args.index("--model") + 1] = str(make_model("llama", "tiny", 0))
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    log = (tmp_path / "serve.log").open("wb")
    # The kubelet resolves the secretKeyRef into the variable; here the test plays the Secret.
    env = {**os.environ, API_KEY_ENV: API_KEY}
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvfleet", "serve", *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, process)
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        refused = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=5)
        assert refused.status_code == 401, "the API key from the Secret guards the OpenAI routes"
        before, after = asyncio.run(
            scrape_twice_around_requests(ScrapeTarget("tiny-0", "127.0.0.1", port), base)
        )
        assert isinstance(before, PodMetrics) and (before.waiting, before.running) == (0.0, 0.0)
        assert before.kv_cache_usage is not None
        assert isinstance(after, PodMetrics) and after.ttft_seconds is not None and after.ttft_seconds > 0
        streamed, started = [], threading.Event()
        stream = threading.Thread(target=stream_events, args=(base, streamed, started))
        stream.start()
        assert started.wait(60), "the stream started"
        process.send_signal(signal.SIGTERM)
        # The kubelet counts the preStop pause in the grace period; SIGTERM comes after it.
        assert process.wait(timeout=termination_grace_seconds(spec) - PRESTOP_DELAY_SECONDS) == 0, (
            "drained and exited within the grace"
        )
        stream.join(10)
        assert streamed[-1] == "[DONE]" and json.loads(streamed[-2])["error"]["code"] == "draining"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


# Parses a command line as `kvfleet serve` does, without starting it.
_PARSE_SERVE_ARGS = (
    "import sys; from kvfleet.runtime.server.cli import serve; serve.make_context('serve', sys.argv[1:])"
)


def test_rendered_batch_quantization_expert_and_trace_flags_are_runtime_options(tmp_path: Path) -> None:
    raw_spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    raw_spec["batch"] = {"storage": "EmptyDir", "maxFileBytes": 1 << 20}
    raw_spec["scaling"] = {"replicas": 1}
    raw_spec["engine"] = {**raw_spec.get("engine", {}), "quantization": "compressed-tensors"}
    raw_spec["engine"]["enableExpertParallel"] = True
    args = runtime_args(parse_spec(raw_spec, name="tiny"), traces=TraceExport("http://collector:4317"))
    flags = {"--batch-store", "--max-batch-file-bytes", "--quantization", "--enable-expert-parallel"}
    assert flags | {"--otlp-traces-endpoint"} <= set(args)
    result = subprocess.run(
        [sys.executable, "-P", "-c", _PARSE_SERVE_ARGS, *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


# Every flag `kvfleet serve` takes, a line each.
_SERVE_FLAGS = (
    "from kvfleet.runtime.server.cli import serve; "
    "print('\\n'.join(flag for option in serve.params for flag in [*option.opts, *option.secondary_opts]))"
)


def test_the_charts_allowed_extra_args_are_runtime_flags() -> None:
    """A flag the admission policy lets through that the runtime does not take would fail every pod."""
    chart_values = yaml.safe_load((EXAMPLE.parents[1] / "charts" / "kvfleet" / "values.yaml").read_text())
    allowed = set(chart_values["admissionPolicy"]["allowedExtraArgs"])
    result = subprocess.run(
        [sys.executable, "-P", "-c", _SERVE_FLAGS], capture_output=True, text=True, timeout=120, check=True
    )
    assert allowed - set(result.stdout.split()) == set()


# The kubelet expands $(NAME) in arguments from the container's variables; here the pod's address is this.
_POD_ADDRESS = "127.0.0.1"


def test_rendered_role_flags_are_runtime_options() -> None:
    raw_spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    raw_spec["scaling"] = {}
    raw_spec["disaggregation"] = {"decode": {"extraArgs": ["--max-num-seqs", "8"]}}
    spec = parse_spec(raw_spec, name="tiny")
    for role in ROLES:
        (container,) = pod_template(spec.for_role(role), {}, "kvfleet/runtime", "tiny", role=role)["spec"][
            "containers"
        ]
        (address,) = [e["name"] for e in container["env"] if e.get("valueFrom", {}).get("fieldRef")]
        args = [arg.replace(f"$({address})", _POD_ADDRESS) for arg in container["args"]]
        result = subprocess.run(
            [sys.executable, "-P", "-c", _PARSE_SERVE_ARGS, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, (role, result.stderr)
        # The runtime's own check of the connector's settings (the command line parse does not read them).
        config = KVTransferConfig.parse(args[args.index(KV_TRANSFER_CONFIG_FLAG) + 1])
        assert config.kv_ip == _POD_ADDRESS and config.is_producer == (role == "prefill")
