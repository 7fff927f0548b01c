"""`kvfleet bench serve` without a server: the seeded workload (vLLM's length ranges and arrivals), the
ShareGPT dataset, the statistics and goodput, checked against independent computations; and the result keys
it follows checked against vLLM's own source where that is installed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click
import pytest
from kvfleet.runtime.bench.serve import (
    OVERLOAD_MIX,
    RESULT_FILE_OPTIONS,
    BenchSettings,
    bench_serve,
    parse_extra_body,
    parse_goodput,
    parse_tier_mix,
    settings_from_options,
)
from kvfleet.runtime.bench.serve_client import arrival_times, build_workload
from kvfleet.runtime.bench.serve_datasets import parse_range_ratio, sharegpt_prompts
from kvfleet.runtime.bench.serve_report import MetricSelection, RequestResult, summarize
from transformers import AutoTokenizer
from vllm_bench_keys import (
    DETAILED_KEYS,
    RAMP_UP_KEYS,
    RESULT_KEYS,
    SETUP_KEYS,
    STATISTIC_PREFIXES,
    vllm_keys_in_source,
    vllm_serve_source,
)


def test_workload_is_seeded_and_follows_the_settings() -> None:
    settings = BenchSettings(
        base_url="-",
        num_prompts=400,
        request_rate=20.0,
        random_input_len=40,
        random_output_len=10,
        random_range_ratio=(0.5, 0.5),
        random_prefix_len=5,
        seed=3,
        tier_mix=parse_tier_mix("critical=1,batch=3"),
    )
    workload = build_workload(settings, vocab_size=100)
    assert workload == build_workload(settings, vocab_size=100)
    assert workload != build_workload(BenchSettings(**{**settings.__dict__, "seed": 4}), vocab_size=100)
    # vLLM's ranges: [floor(len * (1 - r)), ceil(len * (1 + r))], after the shared prefix.
    assert all(5 + 20 <= len(r.prompt_token_ids) <= 5 + 60 and 5 <= r.output_len <= 15 for r in workload)
    assert len({tuple(r.prompt_token_ids[:5]) for r in workload}) == 1
    assert all(16 <= t < 100 for r in workload for t in r.prompt_token_ids)
    # The last of 400 requests at 20/s leaves at 20 s, in order.
    assert workload[-1].send_at == pytest.approx(20.0)
    assert sorted(r.send_at for r in workload) == [r.send_at for r in workload]
    critical_share = sum(r.tier == "critical" for r in workload) / len(workload)
    assert 0.18 < critical_share < 0.32
    # The workload of `make bench-vs-vllm`: prompts 16-256 tokens, outputs 16-128, each bound reached.
    ratios = parse_range_ratio('{"input": 0.88, "output": 0.77}')
    wide = BenchSettings(
        base_url="-", num_prompts=2000, random_input_len=136, random_output_len=72, random_range_ratio=ratios
    )
    prompt_lens = [len(r.prompt_token_ids) for r in build_workload(wide, vocab_size=100)]
    output_lens = [r.output_len for r in build_workload(wide, vocab_size=100)]
    assert (min(prompt_lens), max(prompt_lens), min(output_lens), max(output_lens)) == (16, 256, 16, 128)
    burst = build_workload(BenchSettings(base_url="-", num_prompts=5), vocab_size=100)
    assert {r.send_at for r in burst} == {0.0} and {r.tier for r in burst} == {None}
    assert {len(r.prompt_token_ids) for r in burst} == {1024} and {r.output_len for r in burst} == {128}


def test_burstiness_changes_the_spread_of_arrivals_not_their_rate() -> None:
    """Gaps between arrivals are gamma distributed with shape = burstiness: the squared coefficient of
    variation is 1 / burstiness (1 for Poisson arrivals), the mean 1 / rate whatever the shape."""
    rate, count = 10.0, 4000
    squared_cv = {}
    for burstiness in (0.25, 1.0, 4.0):
        times = arrival_times(count, rate, burstiness, seed=7)
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        assert statistics.fmean(gaps) == pytest.approx(1 / rate)
        squared_cv[burstiness] = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
        assert squared_cv[burstiness] == pytest.approx(1 / burstiness, rel=0.25)
    assert squared_cv[0.25] > 2 * squared_cv[1.0] > 4 * squared_cv[4.0]
    assert arrival_times(count, rate, 1.0, seed=7) != arrival_times(count, rate, 1.0, seed=8)
    even = arrival_times(10, rate, float("inf"), seed=7)
    assert even == pytest.approx([(i + 1) / rate for i in range(10)])


def test_option_parsing() -> None:
    assert parse_tier_mix("overload") == parse_tier_mix(OVERLOAD_MIX)
    assert parse_tier_mix("a=1,b=3") == {"a": 0.25, "b": 0.75}
    assert parse_tier_mix(None) == {}
    assert parse_range_ratio("0.3") == (0.3, 0.3)
    assert parse_range_ratio('{"input": 0.1, "output": 0.6}') == (0.1, 0.6)
    assert parse_goodput(("ttft:500", "e2el:2000")) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_extra_body('{"stream_interval": 4}') == {"stream_interval": 4}
    assert parse_extra_body(None) == {}
    bad = [
        (parse_tier_mix, ("a", "a=x", "a=0", "a=-1,b=2")),
        (parse_range_ratio, ("1", "-0.1", "x", '{"input": 0.1}')),
        (parse_goodput, (("ttft",), ("itl:5",), ("tpot:-1",))),
        (parse_extra_body, ("{", "[1]", '"stream_interval"')),
    ]
    for parse, values in bad:
        for value in values:
            with pytest.raises(click.BadParameter):
                parse(value)  # type: ignore[operator]


def _results() -> list[RequestResult]:
    return [
        # TTFT 100 ms, TPOT 10 ms, E2EL 140 ms.
        RequestResult("batch", 10, output_tokens=5, ttft=0.1, itl=[0.01] * 4, latency=0.14),
        # TTFT 300 ms, TPOT 10 ms, E2EL 340 ms.
        RequestResult("batch", 12, output_tokens=5, ttft=0.3, itl=[0.01] * 4, latency=0.34),
        # TTFT 100 ms, TPOT 50 ms, E2EL 300 ms.
        RequestResult("critical", 8, output_tokens=5, ttft=0.1, itl=[0.05] * 4, latency=0.3),
        # One output token: TPOT 0 for goodput, and no TPOT in its statistics.
        RequestResult("critical", 6, output_tokens=1, ttft=0.15, latency=0.15),
        RequestResult("critical", 20, error="shed"),
    ]


def test_summary_statistics() -> None:
    results = _results()
    selection = MetricSelection(("ttft", "tpot", "itl", "e2el"), (50.0, 90.0, 99.9))
    summary = summarize(results, duration=2.0, selection=selection)
    assert (summary["completed"], summary["failed"]) == (4, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (36, 16)
    assert summary["output_throughput"] == 8.0 and summary["request_throughput"] == 2.0
    assert summary["request_goodput"] is None
    ttfts = [100.0, 300.0, 100.0, 150.0]
    tpots = [10.0, 10.0, 50.0]
    for metric, values in {"ttft": ttfts, "tpot": tpots, "e2el": [140.0, 340.0, 300.0, 150.0]}.items():
        assert summary[f"mean_{metric}_ms"] == pytest.approx(statistics.fmean(values))
        assert summary[f"median_{metric}_ms"] == pytest.approx(statistics.median(values))
        assert summary[f"std_{metric}_ms"] == pytest.approx(statistics.pstdev(values))
        # Linear interpolation between ranks: the inclusive method of statistics.quantiles.
        cuts = statistics.quantiles(values, n=1000, method="inclusive")
        assert summary[f"p50_{metric}_ms"] == pytest.approx(cuts[499])
        assert summary[f"p90_{metric}_ms"] == pytest.approx(cuts[899])
        assert summary[f"p99.9_{metric}_ms"] == pytest.approx(cuts[998])
    assert summary["mean_itl_ms"] == pytest.approx(statistics.fmean([10.0] * 8 + [50.0] * 4))
    assert (
        summary["per_tier"]["critical"]["completed"] == 2 and summary["per_tier"]["critical"]["failed"] == 1
    )
    assert summary["per_tier"]["batch"]["median_ttft_ms"] == pytest.approx(200.0)
    nothing = summarize([RequestResult("-", 5, error="shed")], duration=1.0)
    assert nothing["mean_ttft_ms"] == 0.0 and nothing["p99_tpot_ms"] == 0.0 and "per_tier" not in nothing


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 200}, 3),  # all but the 300 ms first token
        ({"tpot": 20}, 3),  # all but the 50 ms per token; one token counts 0
        ({"e2el": 200}, 2),
        ({"ttft": 200, "tpot": 20}, 2),
        ({"ttft": 200, "tpot": 20, "e2el": 145}, 1),
        ({"ttft": 200, "tpot": 20, "e2el": 140}, 1),  # within means at most
        ({"ttft": 200, "tpot": 20, "e2el": 139}, 0),
        ({"ttft": 99}, 0),
    ],
)
def test_goodput_counts_successful_requests_within_every_slo(slos: dict[str, float], good: int) -> None:
    summary = summarize(_results(), duration=4.0, selection=MetricSelection(goodput=slos))
    assert summary["request_goodput"] == good / 4.0


def test_sharegpt_prompts_are_read_pruned_and_oversampled(tiny_llama: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    turns = [
        (
            "Tell me about the weather in the mountains today.",
            "It is cold and windy, with snow on the peaks.",
        ),
        ("What is the capital city of the country?", "The capital is the largest city by far."),
        ("Summarize the story of the old sailor and the sea.", "An old man fights a great fish for days."),
        ("Hi", "Hello there, how can I help you today?"),  # a prompt too short to keep
        ("Write one long answer about the history of ships.", "Ok"),  # an answer too short to keep
    ]
    entries = [
        {"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for i, (q, a) in enumerate(turns)
    ]
    entries.append(
        {"id": "lone", "conversations": [{"from": "human", "value": "A question with no answer at all."}]}
    )
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    kept = {q: a for q, a in turns[:3]}

    prompts = sharegpt_prompts(path, 3, tokenizer, None, seed=0)
    assert {p.text for p in prompts} == set(kept)
    for prompt in prompts:
        assert prompt.prompt_token_ids == tokenizer(prompt.text).input_ids
        assert prompt.output_len == len(tokenizer(kept[prompt.text]).input_ids)
    # The order is the seed's shuffle.
    orders = {
        tuple(p.text for p in sharegpt_prompts(path, 3, tokenizer, None, seed=seed)) for seed in range(4)
    }
    assert len(orders) > 1
    # More prompts than conversations: the kept ones repeated; a given output length keeps short answers.
    many = sharegpt_prompts(path, 10, tokenizer, 7, seed=0)
    assert len(many) == 10 and {p.output_len for p in many} == {7}
    assert {p.text for p in many} == set(kept) | {turns[4][0]}


def test_result_keys_are_vllms() -> None:
    """The key sets the tests compare kvfleet's result files with are the ones vLLM's source writes."""
    source = vllm_serve_source()
    if source is None:
        pytest.skip("no vLLM installed beside kvfleet (`make bench-vs-vllm` installs one)")
    keys = vllm_keys_in_source(source.read_text())
    assert keys["setup"] - RAMP_UP_KEYS == SETUP_KEYS
    assert keys["results"] == RESULT_KEYS
    assert keys["detailed"] == DETAILED_KEYS
    assert keys["prefixes"] == STATISTIC_PREFIXES


def _settings(*args: str) -> BenchSettings:
    params = bench_serve.make_context("serve", list(args)).params
    return settings_from_options({k: v for k, v in params.items() if k not in RESULT_FILE_OPTIONS})


def test_command_line_as_vllm_reads_it() -> None:
    """vLLM's list forms, its general length flags, and where the server is; the client queue's metrics only
    where a concurrency cap makes requests wait on the client."""
    settings = _settings(
        "--backend", "openai-chat", "--port", "8011", "--input-len", "50", "--output-len", "20",
        "--goodput", "ttft:300", "e2el:900", "--percentile-metrics", "ttft,e2el,client_queue_time",
    )  # fmt: skip
    assert (settings.base_url, settings.endpoint) == ("http://127.0.0.1:8011", "/v1/chat/completions")
    assert settings.random_input_len == 50
    assert settings.random_output_len == settings.sharegpt_output_len == 20
    assert settings.selection == MetricSelection(("ttft", "e2el"), (99.0,), {"ttft": 300.0, "e2el": 900.0})
    capped = _settings(
        "--base-url", "http://gateway:80/", "--max-concurrency", "4", "--metric-percentiles", "50,99.9",
        "--percentile-metrics", "client_queue_time,e2el_including_client_queue", "--header", "a=1", "b=2",
    )  # fmt: skip
    assert (capped.base_url, capped.endpoint) == ("http://gateway:80", "/v1/completions")
    assert capped.headers == {"a": "1", "b": "2"}
    assert capped.selection.metrics == ("client_queue_time",) and capped.selection.percentiles == (50.0, 99.9)
    at_a_rate = _settings(
        "--max-concurrency", "4", "--request-rate", "2", "--percentile-metrics", "e2el_including_client_queue"
    )
    assert at_a_rate.selection.metrics == ("e2el_including_client_queue",)
    assert _settings().random_range_ratio == (0.0, 0.0) and _settings().num_prompts == 1000
    for bad in (["--backend", "tgi"], ["--dataset-name", "sharegpt"], ["--percentile-metrics", "ttft,x"]):
        with pytest.raises(click.BadParameter):
            _settings(*bad)
