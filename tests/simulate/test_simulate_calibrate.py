"""Calibration's fit: timings made by a known step-time model give that model back."""

from __future__ import annotations

import random

import pytest

from kvfleet.simulate.calibrate import StepTiming, decode_batches, fit_profile
from kvfleet.simulate.engine import EngineProfile


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
