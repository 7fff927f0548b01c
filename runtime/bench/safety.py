"""`kvfleet bench safety`: what each checker adds to the time to first token, and what checking output in
windows costs in throughput.

Each policy runs on a `kvfleet serve` of its own (same model, same seeded token-id prompts, prefix caching
off): first one request at a time (the TTFT that input checks add beside queueing and prefill), then many at
once (output tokens per second). The guard runs on the same server's model, its verdict forced to "safe"
with logit_bias so that every request runs to its end; the hook is a local HTTP server answering "not
flagged" at once, so its figure is the cost of the round trip. The last column counts the requests
answered: refused ones (a guard that timed out and failed closed) are in no figure.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvfleet.runtime.bench.batch import interactive_ttft, serve_throughput
from kvfleet.runtime.bench.processes import MODEL_NAME, ServeProcess
from kvfleet.runtime.bench.serve import BenchSettings
from kvfleet.runtime.config import EngineConfig


def logit_bias_against(model: str | Path, first_characters: str) -> dict[str, float]:
    """logit_bias ruling out every token of the model's vocabulary that begins with one of
    `first_characters`. Under the guard's grammar that leaves one way at a branch: against "u", only "safe"
    remains."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return {
        str(token_id): -100.0
        for token_id in range(tokenizer.get_vocab_size())
        if tokenizer.decode([token_id]).startswith(tuple(first_characters))
    }


# The policies measured, by the key `--policy` takes; "none" is the baseline the others are read against.
POLICY_KEYS = ("none", "input-rules", "input-guard", "input-hook", "output-rules", "output-guard")


def policies(model: str, hook_url: str, window: int) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """key -> (name in the report, --safety-config) of every policy the bench can measure."""
    rules = {"blocklist": ["bomb recipe"]}
    # A timeout long enough for a loaded server: the figures are the guard's cost, not its failures.
    guard = {"endpoint": "self", "timeout": 120, "extraBody": {"logit_bias": logit_bias_against(model, "u")}}
    hook = {"url": hook_url}
    return {
        "none": ("none", None),
        "input-rules": ("rules on input", {"input": ["rules"], "rules": rules}),
        "input-guard": ("guard model on input (same server)", {"input": ["guard"], "guard": guard}),
        "input-hook": ("hook on input", {"input": ["hook"], "hook": hook}),
        "output-rules": (
            f"rules on output, window {window}",
            {"output": ["rules"], "rules": rules, "windowTokens": window},
        ),
        "output-guard": (
            f"guard model on output, window {window}",
            {"output": ["guard"], "guard": guard, "windowTokens": window},
        ),
    }


# A hook's request body -> its answer.
HookJudge = Callable[[dict[str, Any]], dict[str, Any]]


@contextmanager
def local_hook(judge: HookJudge) -> Iterator[str]:
    """A safety hook on loopback that answers each request with `judge(body)`; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = json.dumps(judge(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/check"
    finally:
        server.shutdown()
        thread.join()


def run_safety_bench(
    config: EngineConfig,
    *,
    ttft: BenchSettings,
    throughput: BenchSettings,
    concurrency: int,
    window: int,
    selected: tuple[str, ...] = POLICY_KEYS,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Runs the baseline and the `selected` policies, in POLICY_KEYS' order."""
    config = config.replace(enable_prefix_caching=False)
    report: dict[str, Any] = {"load_average": os.getloadavg()[0], "runs": []}
    not_flagged = local_hook(lambda body: {"flagged": False, "categories": {}})
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-safety-") as temp, not_flagged as hook_url:
        measured = policies(config.model, hook_url, window)
        for key in POLICY_KEYS:
            if key != "none" and key not in selected:
                continue
            name, policy = measured[key]
            args = ["--safety-config", json.dumps(policy)] if policy is not None else []
            server = ServeProcess(config, Path(temp), args)
            try:
                server.wait_ready()
                log(f"{name}: TTFT, one request at a time")
                alone = interactive_ttft(
                    replace(ttft, base_url=server.url, model=MODEL_NAME, max_concurrency=1)
                )
                log(f"{name}: throughput at concurrency {concurrency}")
                loaded = serve_throughput(
                    replace(throughput, base_url=server.url, model=MODEL_NAME), concurrency
                )
            finally:
                server.stop()
            report["runs"].append({"policy": name, "ttft": alone, "throughput": loaded})
    report["load_average_after"] = os.getloadavg()[0]
    return report


def format_report(report: dict[str, Any]) -> str:
    runs = report["runs"]
    base_ttft = runs[0]["ttft"]["median_ttft_ms"]
    base_throughput = runs[0]["throughput"]["output_throughput"]
    lines = [
        f"load average {report['load_average']:.2f} before, {report['load_average_after']:.2f} after",
        "",
        "| policy | TTFT p50 ms | added ms | output tokens/s | vs none | requests answered |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        p50 = run["ttft"]["median_ttft_ms"]
        tokens = run["throughput"]["output_throughput"]
        lines.append(
            f"| {run['policy']} | {p50:.1f} | {p50 - base_ttft:+.1f} | {tokens:.1f} | "
            f"{tokens / base_throughput:.0%} | {run['ttft']['completed'] + run['throughput']['completed']} |"
        )
    return "\n".join(lines)
