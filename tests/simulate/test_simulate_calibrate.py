"""Calibration's fit: timings made by a known step-time model give that model back."""

from __future__ import annotations

import random

import pytest

from kvfleet.simulate.calibrate import StepTiming, decode_batches, fit_profile
from kvfleet.simulate.engine import EngineProfile

# Decode steps of one and two sequences of the small model on one thread, as timed through its server.
SMALL_MODEL_DECODE_STEPS = (StepTiming(0, 1, 64, 0.00882), StepTiming(0, 2, 128, 0.00891))


def test_the_fit_recovers_the_profile_that_timed_the_steps() -> None:
    truth = EngineProfile(
        step_fixed_s=0.0062, prefill_token_s=0.00011, decode_sequence_s=0.00047, first_token_overhead_s=0.004
    )
    rng = random.Random(1)
    shapes = [(0, 1), (0, 4), (0, 16), (128, 0), (512, 0), (1024, 0)]

    def seconds(prefill: int, decode: int) -> float:
        # A first token (a prefill timing) also waits for its way in and out; a decode step's time does not.
        overhead = truth.first_token_overhead_s if decode == 0 else 0.0
        return truth.step_seconds(prefill, decode, 0) + overhead

    # Timings a little noisy, as measured ones are: within 1% of the model.
    timings = [
        StepTiming(prefill, decode, 0, seconds(prefill, decode) * rng.uniform(0.99, 1.01))
        for prefill, decode in shapes
    ]
    limits = EngineProfile(max_num_seqs=7, kv_cache_tokens=1234)
    fitted = fit_profile(timings, limits)
    assert fitted.step_fixed_s == pytest.approx(truth.step_fixed_s, rel=0.1)
    assert fitted.prefill_token_s == pytest.approx(truth.prefill_token_s, rel=0.05)
    assert fitted.decode_sequence_s == pytest.approx(truth.decode_sequence_s, rel=0.1)
    assert fitted.first_token_overhead_s == pytest.approx(truth.first_token_overhead_s, rel=0.1)
    assert (fitted.max_num_seqs, fitted.kv_cache_tokens) == (7, 1234)


def test_the_fit_recovers_the_overhead_beside_a_batch_and_the_wake_curve() -> None:
    truth = EngineProfile(
        step_fixed_s=0.002,
        prefill_token_s=0.00003,
        decode_sequence_s=0.0004,
        first_token_overhead_s=0.01,
        first_token_overhead_per_sequence_s=0.003,
        wake_s=0.03,
        wake_after_s=0.4,
    )
    rng = random.Random(2)
    steps = [StepTiming(0, b, 0, truth.step_seconds(0, b, 0)) for b in (1, 4, 16)] + [
        StepTiming(p, 0, 0, truth.step_seconds(p, 0, 0) + truth.first_token_overhead_s)
        for p in (128, 512, 1024)
    ]
    # Beside B decoding sequences a first token waits, on average, half the step in progress, then shares a
    # step with them; each timing is off by up to a quarter of the step in progress, as a real one lands.
    beside = [
        StepTiming(
            128,
            b,
            0,
            truth.step_seconds(0, b, 0) * rng.uniform(0.25, 0.75)
            + truth.step_seconds(128, b, 0)
            + truth.first_token_overhead(b),
        )
        for b in (1, 4)
        for _ in range(3)
    ]
    woken = [
        StepTiming(
            128,
            0,
            0,
            truth.step_seconds(128, 0, 0)
            + truth.first_token_overhead_s
            + truth.wake_seconds(pause) * rng.uniform(0.95, 1.05),
            idle_s=pause,
        )
        for pause in (0.1, 0.3, 1.0, 3.0)
        for _ in range(3)
    ]
    fitted = fit_profile(steps + beside + woken, EngineProfile())
    assert fitted.first_token_overhead_per_sequence_s == pytest.approx(0.003, rel=0.15)
    # The time constants tried are 12% apart.
    assert fitted.wake_after_s == pytest.approx(0.4, rel=0.12)
    assert fitted.wake_s == pytest.approx(0.03, rel=0.1)


def test_a_replica_that_never_slows_after_a_pause_is_fitted_no_wake() -> None:
    steps = [StepTiming(0, 1, 0, 0.003), StepTiming(0, 4, 0, 0.004)] + [
        StepTiming(p, 0, 0, 0.003 + 0.00001 * p + 0.002) for p in (128, 512, 1024)
    ]
    # What a first token after a pause takes is noise about the lone one's time, as often under as over.
    woken = [
        StepTiming(128, 0, 0, 0.00628 + noise, idle_s=pause)
        for pause in (0.1, 0.3, 1.0, 3.0)
        for noise in (-0.0005, 0.0, 0.0004)
    ]
    fitted = fit_profile(steps + woken, EngineProfile())
    assert fitted.wake_s < 0.0002


def test_a_cost_that_would_come_out_negative_is_fitted_at_zero_and_the_others_refitted() -> None:
    # Two sequences decoded faster than one, by chance: 2.0 ms against 1.4 ms. The plain fit says -0.6 ms a
    # sequence and a fixed cost above both timings; with no cost a sequence, the fixed cost is the one with
    # the least relative error over the two, 1/2.0 + 1/1.4 over 1/2.0**2 + 1/1.4**2 ms. The first tokens
    # are that fixed cost + 20 us a prompt token + 5 ms exactly.
    fixed = (1 / 0.002 + 1 / 0.0014) / (1 / 0.002**2 + 1 / 0.0014**2)
    timings = [StepTiming(0, 1, 0, 0.002), StepTiming(0, 2, 0, 0.0014)] + [
        StepTiming(prompt, 0, 0, fixed + 0.00002 * prompt + 0.005) for prompt in (128, 512, 1024)
    ]
    fitted = fit_profile(timings, EngineProfile(max_num_seqs=2))
    assert fitted.decode_sequence_s == 0.0
    assert fitted.step_fixed_s == pytest.approx(fixed)
    assert fitted.prefill_token_s == pytest.approx(0.00002)
    assert fitted.first_token_overhead_s == pytest.approx(0.005)


def test_the_long_prefills_do_not_set_the_decode_steps_cost() -> None:
    # Timed on the small model with one thread, its two places: a decode step of one or two sequences takes
    # 8.8 or 8.9 ms, and a prompt's first token 0.6 ms a token, a little more on the longer prompts (their
    # attention). An absolute fit let the 0.68 s prefill set the fixed cost to zero, and gave 5.3 ms a
    # decoding sequence: a decode step of one sequence 40% short.
    timings = [
        *SMALL_MODEL_DECODE_STEPS,
        StepTiming(128, 0, 0, 0.0778),
        StepTiming(512, 0, 0, 0.3139),
        StepTiming(1024, 0, 0, 0.6806),
    ]
    fitted = fit_profile(timings, EngineProfile(max_num_seqs=2))
    for timing in timings:
        modelled = fitted.step_seconds(timing.prefill_tokens, timing.decode_sequences, 0)
        if timing.prefill_tokens:
            modelled += fitted.first_token_overhead_s
        assert modelled == pytest.approx(timing.seconds, rel=0.1 if timing.prefill_tokens else 0.03), timing


def test_a_timing_of_no_time_is_refused() -> None:
    timings = [StepTiming(0, 1, 0, 0.002), StepTiming(0, 2, 0, 0.0)] + [
        StepTiming(prompt, 0, 0, 0.001 * prompt) for prompt in (128, 512)
    ]
    with pytest.raises(ValueError, match="no time"):
        fit_profile(timings, EngineProfile(max_num_seqs=2))


def test_timings_of_one_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="do not tell"):
        fit_profile([StepTiming(0, 4, 0, 0.01)] * 3, EngineProfile())


@pytest.mark.parametrize(
    ("max_num_seqs", "batches"),
    [(256, (1, 4, 16, 256)), (16, (1, 4, 16)), (4, (1, 4)), (3, (1, 3)), (1, (1,))],
)
def test_decode_batches_stop_at_what_the_replica_runs_at_once(
    max_num_seqs: int, batches: tuple[int, ...]
) -> None:
    # A batch past max_num_seqs would queue some of its requests, and their waits would be timed as steps.
    assert decode_batches(max_num_seqs) == batches


def test_a_replica_of_one_sequence_at_a_time_puts_its_decode_step_in_the_fixed_cost() -> None:
    # Its only decode batch is one sequence: the fixed and per-sequence costs cannot be told apart, and the
    # simulator never runs more than one sequence a step on it anyway.
    timings = [StepTiming(0, 1, 0, 0.006)] + [
        StepTiming(prompt, 0, 0, 0.004 + 0.005 + 0.0001 * prompt) for prompt in (128, 512, 1024)
    ]
    fitted = fit_profile(timings, EngineProfile(max_num_seqs=1))
    assert fitted.decode_sequence_s == 0.0
    assert fitted.step_fixed_s == pytest.approx(0.006)
    assert fitted.prefill_token_s == pytest.approx(0.0001)
    assert fitted.first_token_overhead_s == pytest.approx(0.003)


def test_the_wake_is_what_a_pause_adds_to_the_same_prompt_not_to_the_fitted_line() -> None:
    # The small model's timings: its prefill grows faster than its prompt, so the fitted line misses the
    # 128-token prompt's first token by several ms, more than the wake itself at short pauses. The first
    # tokens after a pause took what a wake of 12 ms (time constant 0.8 s) adds to the same prompt without
    # one.
    lone_s = 0.0745
    timings = [
        *SMALL_MODEL_DECODE_STEPS,
        StepTiming(16, 0, 0, 0.0197),
        StepTiming(512, 0, 0, 0.3059),
        StepTiming(1024, 0, 0, 0.649),
    ] + [StepTiming(128, 0, 0, lone_s + noise) for noise in (-0.0005, 0.0, 0.0005)]
    truth = EngineProfile(wake_s=0.012, wake_after_s=0.8)
    woken = [
        StepTiming(128, 0, 0, lone_s + truth.wake_seconds(pause), idle_s=pause)
        for pause in (0.1, 0.3, 1.0, 3.0)
        for _ in range(3)
    ]
    fitted = fit_profile(timings + woken, EngineProfile(max_num_seqs=2))
    for pause in (0.3, 3.0):
        assert fitted.wake_seconds(pause) == pytest.approx(truth.wake_seconds(pause), rel=0.1)


def test_a_wake_with_no_unpaused_first_token_of_its_prompt_is_refused() -> None:
    timings = [StepTiming(0, 1, 0, 0.002), StepTiming(0, 2, 0, 0.003)] + [
        StepTiming(prompt, 0, 0, 0.001 * prompt) for prompt in (16, 512)
    ]
    woken = [StepTiming(128, 0, 0, 0.2, idle_s=1.0)]
    with pytest.raises(ValueError, match="without a pause"):
        fit_profile(timings + woken, EngineProfile(max_num_seqs=2))


def test_a_first_token_held_up_by_something_else_does_not_pull_the_line() -> None:
    # Each prompt timed three times; one of the 128-token prompt's first tokens waited 60 ms for something
    # else (a scrape, a neighbour). The fit follows each shape's median, as if that one were not there.
    def timings(held_up_s: float) -> list[StepTiming]:
        steps = [StepTiming(0, 1, 0, 0.009), StepTiming(0, 2, 0, 0.0093)]
        for prompt in (16, 128, 512, 1024):
            seconds = 0.009 + 0.004 + 0.0006 * prompt
            steps += [StepTiming(prompt, 0, 0, seconds * factor) for factor in (0.99, 1.0, 1.01)]
        steps[-7] = StepTiming(128, 0, 0, steps[-7].seconds + held_up_s)
        return steps

    clean = fit_profile(timings(0.0), EngineProfile(max_num_seqs=2))
    held_up = fit_profile(timings(0.06), EngineProfile(max_num_seqs=2))
    assert held_up == clean
