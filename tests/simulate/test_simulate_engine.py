"""The engine model's schedule against schedules worked out by hand from its step-time model."""

from __future__ import annotations

import math

import pytest

from kvfleet.simulate.engine import EngineModel, EngineProfile, Sequence

# A step costs 10 ms, plus 1 ms per prompt token and 2 ms per decoding sequence.
PROFILE = EngineProfile(
    step_fixed_s=0.010,
    prefill_token_s=0.001,
    decode_sequence_s=0.002,
    max_num_seqs=4,
    max_num_batched_tokens=8,
    kv_cache_tokens=1000,
)


def _sequence(prompt: int, output: int, arrival: float = 0.0, group: str = "", shared: int = 0) -> Sequence:
    return Sequence(prompt, output, group, shared, arrival)


def _run(engine: EngineModel, now: float) -> tuple[float, list[Sequence], list[Sequence]]:
    """Runs the next step (or run of steps); returns when it ends, and who got a first token and who ended."""
    length = engine.start_step(now)
    assert length is not None
    outcome = engine.finish_step(now + length)
    return now + length, outcome.first_tokens, outcome.finished


def test_a_prompt_longer_than_the_token_budget_is_chunked_and_the_next_joins_its_last_chunk() -> None:
    engine = EngineModel(PROFILE)
    long, short = _sequence(10, 2), _sequence(4, 1)
    engine.add(long)
    engine.add(short)
    # Step 1: 8 of the long prompt's 10 tokens fill the budget: 10 + 8 ms.
    end, first, finished = _run(engine, 0.0)
    assert end == pytest.approx(0.018) and first == [] and finished == []
    # Step 2: its last 2 tokens and the whole short prompt: 10 + 6 ms; both sample their first token, and the
    # short one, wanting one token, is done.
    end, first, finished = _run(engine, end)
    assert end == pytest.approx(0.034) and first == [long, short] and finished == [short]
    # Step 3: one decode: 10 + 2 ms.
    end, first, finished = _run(engine, end)
    assert end == pytest.approx(0.046) and finished == [long]
    assert engine.start_step(end) is None


def test_a_run_of_decode_steps_is_cut_at_the_step_in_progress_when_a_request_arrives() -> None:
    engine = EngineModel(PROFILE)
    decoding = _sequence(4, 5)
    engine.add(decoding)
    end, first, _ = _run(engine, 0.0)
    assert end == pytest.approx(0.014) and first == [decoding]
    # Four decode steps of 12 ms would end at 62 ms; a request arrives at 30 ms, during the second.
    assert engine.start_step(end) == pytest.approx(0.048)
    arriving = _sequence(4, 3, arrival=0.030)
    engine.add(arriving)
    cut = engine.interrupt(0.030)
    assert cut == pytest.approx(0.038)
    engine.finish_step(cut)
    assert decoding.generated == 3
    # The next step decodes one token and computes the new prompt: 10 + 4 + 2 ms.
    end, first, _ = _run(engine, cut)
    assert end == pytest.approx(0.054) and first == [arriving]
    assert arriving.first_token_s is not None
    assert arriving.first_token_s - arriving.arrival_s == pytest.approx(0.024)
    report = engine.report(end)
    assert report.ttft_seconds == pytest.approx((0.014 + 0.024) / 2)
    # Three decode tokens of the first sequence so far, over 12 + 12 + 16 ms.
    assert report.itl_seconds == pytest.approx((0.024 + 0.016) / 3)
    # As a replica's histograms hold them: 14 ms is at or below the 20 ms bound, 24 ms the 40 ms one; the
    # decode run's two tokens of 12 ms each at or below 25 ms, the third token's 16 ms too.
    assert report.ttft_buckets is not None and report.itl_buckets is not None
    assert dict(report.ttft_buckets)[0.01] == 0 and dict(report.ttft_buckets)[0.02] == 1
    assert dict(report.ttft_buckets)[0.04] == 2 and report.ttft_buckets[-1] == (math.inf, 2)
    assert dict(report.itl_buckets)[0.01] == 0 and dict(report.itl_buckets)[0.025] == 3
    # No token rates before a second report, as a scraper has none before its second scrape; then the
    # tokens since the first over the time between, as the sequences count them.
    assert report.prompt_tokens_per_s is None and report.generation_tokens_per_s is None
    generated = decoding.generated + arriving.generated
    next_end, _, _ = _run(engine, end)
    later = engine.report(next_end + 0.5)
    produced = decoding.generated + arriving.generated - generated
    assert produced > 0 and later.prompt_tokens_per_s == 0.0
    assert later.generation_tokens_per_s == pytest.approx(produced / (next_end + 0.5 - end))


def test_a_cached_prefix_group_starts_with_its_shared_tokens_computed() -> None:
    engine = EngineModel(PROFILE)
    engine.add(_sequence(8, 1, group="system", shared=6))
    end, _, _ = _run(engine, 0.0)
    assert end == pytest.approx(0.018)
    engine.add(_sequence(8, 1, group="system", shared=6))
    second_end, _, finished = _run(engine, end)
    # Only the 2 tokens past the shared 6 are computed.
    assert second_end - end == pytest.approx(0.012) and len(finished) == 1
    assert (engine.prefix_hits, engine.admitted) == (1, 2)


def test_a_full_kv_cache_preempts_the_latest_sequence_which_recomputes_and_still_finishes() -> None:
    engine = EngineModel(EngineProfile(max_num_seqs=4, max_num_batched_tokens=100, kv_cache_tokens=10))
    first, second = _sequence(4, 10), _sequence(4, 10)
    engine.add(first)
    engine.add(second)
    now, done = 0.0, []
    while len(done) < 2:
        now, _, finished = _run(engine, now)
        done += finished
    assert engine.preemptions >= 1
    assert first.generated == second.generated == 10
    assert done[0] is first
