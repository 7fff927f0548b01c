"""Rejection sampling keeps the target's distribution: many verifications of the same drafts on a small
vocabulary, each emitted position tested with a chi-square test against the distribution computed here
independently (penalties, temperature, top-k and top-p applied by hand in numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kvfleet.runtime.request import Request
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.sampler import Sampler, SpeculativeBatch

BASE_LOGITS = np.array([2.0, 1.6, 1.1, 0.7, 0.2, -0.4, -1.0, -1.7])
PROMPT = [1, 2]
OUTPUT = [3]
PARAMS = {
    "temperature": 0.8,
    "top_k": 6,
    "top_p": 0.92,
    "repetition_penalty": 1.3,
    "frequency_penalty": 0.4,
    "presence_penalty": 0.2,
}
NUM_SAMPLES = 30000


def _target_distribution(output_token_ids: list[int]) -> np.ndarray:
    """The distribution the target samples from after output_token_ids, computed from the definitions."""
    logits = BASE_LOGITS.copy()
    counts = np.bincount(output_token_ids, minlength=len(logits)).astype(float)
    for token in set(PROMPT) | set(output_token_ids):
        penalty = PARAMS["repetition_penalty"]
        logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
    logits -= PARAMS["frequency_penalty"] * counts
    logits -= PARAMS["presence_penalty"] * (counts > 0)
    logits /= PARAMS["temperature"]
    logits[np.argsort(-logits)[PARAMS["top_k"] :]] = -np.inf
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    # The smallest set of most likely tokens whose mass reaches top_p.
    keep = order[: int(np.searchsorted(np.cumsum(probs[order]), PARAMS["top_p"])) + 1]
    kept = np.zeros_like(probs)
    kept[keep] = probs[keep]
    return kept / kept.sum()


def _chi_square_p_value(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """P-value of Pearson's test; tokens the target never samples must never be observed."""
    impossible = expected_probs == 0
    assert observed[impossible].sum() == 0, f"tokens outside the target's support: {observed}"
    expected = expected_probs[~impossible] * observed.sum()
    statistic = float(((observed[~impossible] - expected) ** 2 / expected).sum())
    dof = int((~impossible).sum()) - 1
    # The chi-square survival function is the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


@pytest.mark.parametrize(
    "drafts", [[0, 1], [4, 0], [2, 7]], ids=["likely", "unlikely-first", "filtered-second"]
)
def test_every_position_follows_the_target(drafts: list[int]) -> None:
    requests = []
    for i in range(NUM_SAMPLES):
        request = Request(f"r{i}", PROMPT, SamplingParams(**PARAMS))  # type: ignore[arg-type]
        request.append_output_token_ids(OUTPUT)
        requests.append(request)
    batch = SpeculativeBatch.of(requests, [drafts] * NUM_SAMPLES)
    # The model's logits are the same at every position: only the sampler's processing tells them apart.
    logits = torch.tensor(BASE_LOGITS, dtype=torch.float32).repeat(len(batch.rows), 1)
    emitted = Sampler(torch.device("cpu"), seed=7).verify(logits, batch).token_ids

    vocab = len(BASE_LOGITS)
    for position in range(len(drafts) + 1):
        # The token at this position, among the runs whose earlier tokens were all accepted drafts.
        reached = [
            tokens for tokens in emitted if len(tokens) > position and tokens[:position] == drafts[:position]
        ]
        expected = _target_distribution(OUTPUT + drafts[:position])
        if position and _target_distribution(OUTPUT + drafts[: position - 1])[drafts[position - 1]] == 0:
            assert not reached  # a draft the target cannot sample is never accepted
            continue
        assert len(reached) > 500
        observed = np.bincount([tokens[position] for tokens in reached], minlength=vocab)
        assert _chi_square_p_value(observed, expected) > 1e-3, (position, observed, expected)
    for tokens in emitted:
        # Accepted drafts, then exactly one token of the target's own.
        accepted = len(tokens) - 1
        assert tokens[:accepted] == drafts[:accepted]


def test_greedy_accepts_the_longest_matching_prefix_and_adds_the_argmax() -> None:
    # Row j's argmax is token j + 1: drafts [1, 2, 9] match twice, then the target says 3.
    logits = torch.full((4, 16), -1.0)
    for row in range(4):
        logits[row, row + 1] = 5.0
    request = Request("r", PROMPT, SamplingParams(temperature=0.0))
    verified = Sampler(torch.device("cpu"), seed=0).verify(
        logits, SpeculativeBatch.of([request], [[1, 2, 9]])
    )
    assert verified.token_ids == [[1, 2, 3]]


def test_a_seeded_request_verifies_the_same_way_whatever_else_is_in_the_batch() -> None:
    def run(others: int) -> list[int]:
        requests = [Request(f"o{i}", PROMPT, SamplingParams(temperature=1.0)) for i in range(others)]
        requests.append(Request("seeded", PROMPT, SamplingParams(temperature=1.0, seed=11)))
        batch = SpeculativeBatch.of(requests, [[0, 1]] * len(requests))
        logits = torch.tensor(BASE_LOGITS, dtype=torch.float32).repeat(len(batch.rows), 1)
        return Sampler(torch.device("cpu"), seed=others).verify(logits, batch).token_ids[-1]

    assert run(0) == run(5)


def test_processed_logprobs_of_verified_tokens_are_the_targets_distribution() -> None:
    """vLLM's processed_logprobs while verifying: each emitted token's logprobs are those of the distribution
    it was drawn from at its position (after the drafts before it); a raw run's, the model's logits'."""
    drafts = [0, 1]
    requests = []
    for i in range(200):
        request = Request(f"r{i}", PROMPT, SamplingParams(**PARAMS, logprobs=len(BASE_LOGITS)))  # type: ignore[arg-type]
        request.append_output_token_ids(OUTPUT)
        requests.append(request)
    batch = SpeculativeBatch.of(requests, [drafts] * len(requests))
    logits = torch.tensor(BASE_LOGITS, dtype=torch.float32).repeat(len(batch.rows), 1)
    processed = Sampler(torch.device("cpu"), 7, "processed_logprobs").verify(logits.clone(), batch)
    raw = Sampler(torch.device("cpu"), 7).verify(logits.clone(), batch)
    assert processed.token_ids == raw.token_ids  # the mode changes what is reported, not what is drawn
    positions = [len(tokens) for tokens in processed.token_ids]
    assert {1, 2, 3} <= set(positions)  # rejections at every position, and runs with all drafts accepted
    raw_expected = np.log(np.exp(BASE_LOGITS) / np.exp(BASE_LOGITS).sum())
    for tokens, processed_entries, raw_entries in zip(
        processed.token_ids, processed.logprobs, raw.logprobs, strict=True
    ):
        assert processed_entries is not None and raw_entries is not None
        for position, (entry, raw_entry) in enumerate(zip(processed_entries, raw_entries, strict=True)):
            with np.errstate(divide="ignore"):
                expected = np.log(_target_distribution(OUTPUT + drafts[:position]))
            assert set(entry) == set(range(len(BASE_LOGITS))) and math.isfinite(entry[tokens[position]])
            np.testing.assert_allclose([entry[t] for t in range(len(BASE_LOGITS))], expected, atol=1e-5)
            np.testing.assert_allclose(
                [raw_entry[t] for t in range(len(BASE_LOGITS))], raw_expected, atol=1e-5
            )
