"""The keys of `vllm bench serve`'s result file (vLLM 0.32, a generation backend), written here apart from
kvfleet's code so that the tests compare its result files with vLLM's layout. `vllm_keys_in_source` reads
the same sets from vLLM's own source, where an installed vLLM can be found, to keep these honest.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

# The run's setup, written before the results (vLLM adds its ramp-up's, which kvfleet has not).
SETUP_KEYS = frozenset(
    {
        "date",
        "endpoint_type",
        "backend",
        "label",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
    }
)
RAMP_UP_KEYS = frozenset({"ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps"})
# The results of a generation benchmark.
RESULT_KEYS = frozenset(
    {
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "latencies",
        "start_times",
        "queue_times",
        "generated_texts",
        "errors",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "rtfx",
    }
)
# Left out of the file without --save-detailed.
DETAILED_KEYS = frozenset(
    {"input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"}
)
# Each chosen metric's statistics: f"{prefix}{metric}_ms", the percentiles' prefix `p` followed by the word.
STATISTIC_PREFIXES = frozenset({"mean_", "median_", "std_", "p"})


def metric_keys(metrics: list[str], percentile_words: list[str]) -> set[str]:
    keys = {f"{stat}_{metric}_ms" for metric in metrics for stat in ("mean", "median", "std")}
    return keys | {f"p{word}_{metric}_ms" for metric in metrics for word in percentile_words}


def vllm_serve_source() -> Path | None:
    """vLLM's benchmarks/serve.py in the environment `make bench-vs-vllm` installs it in, if there is one."""
    cache = Path(os.environ.get("KVFLEET_CACHE", Path.home() / ".cache" / "kvfleet"))
    return next(
        iter(sorted(cache.glob("vllm-venv/lib/python3*/site-packages/vllm/benchmarks/serve.py"))), None
    )


def _function(tree: ast.Module, name: str) -> ast.AST:
    return next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    )


def vllm_keys_in_source(source: str) -> dict[str, set[str]]:
    """From vLLM's serve.py: the setup keys main_async writes, the keys of the generation results dict in
    benchmark, the fields it drops without --save-detailed, and the prefixes of its per-metric keys."""
    tree = ast.parse(source)
    main, bench = _function(tree, "main_async"), _function(tree, "benchmark")
    setup = {
        target.slice.value
        for node in ast.walk(main)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Subscript)
        and isinstance(target.value, ast.Name)
        and target.value.id == "result_json"
        and isinstance(target.slice, ast.Constant)
    }
    results = next(
        {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
        for node in ast.walk(bench)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value == "total_output_tokens" for k in node.value.keys)
    )
    detailed = next(
        {element.value for element in node.iter.elts if isinstance(element, ast.Constant)}
        for node in ast.walk(main)
        if isinstance(node, ast.For) and isinstance(node.iter, ast.List) and "ttfts" in ast.unparse(node.iter)
    )
    prefixes = {
        node.slice.values[0].value
        for node in ast.walk(bench)
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "result"
        and isinstance(node.slice, ast.JoinedStr)
        and isinstance(node.slice.values[0], ast.Constant)
    }
    return {"setup": setup, "results": results, "detailed": detailed, "prefixes": prefixes}
