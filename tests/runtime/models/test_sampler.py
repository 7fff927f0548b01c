"""The Sampler on hand-made logits: greedy, filters, penalties, min_tokens, seeds and logprobs (in vLLM's four
modes, against Transformers' logits processors)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from kvfleet.runtime.request import Request
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.structured_outputs.token_rules import TokenRules
from kvfleet.runtime.worker.sampler import Sampler
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

VOCAB = 16
EOS = 15


def _request(
    request_id: str = "r", prompt: list[int] | None = None, outputs: list[int] | None = None, **params: object
) -> Request:
    request = Request(request_id, prompt or [1, 2], SamplingParams(**params), eos_token_id=EOS)  # type: ignore[arg-type]
    if outputs:
        request.append_output_token_ids(outputs)
    return request


def _logits(*rows: list[float]) -> torch.Tensor:
    """Rows of (token, logit) pairs on top of a floor of -5 for every other token."""
    logits = torch.full((len(rows), VOCAB), -5.0)
    for i, row in enumerate(rows):
        for token, value in zip(row[::2], row[1::2], strict=True):
            logits[i, int(token)] = value
    return logits


def _frequencies(sampler: Sampler, logits_row: torch.Tensor, n: int, **params: object) -> Counter[int]:
    requests = [_request(f"r{i}", **params) for i in range(n)]
    result = sampler(logits_row.expand(n, -1).clone(), requests)
    return Counter(result.token_ids)


def test_greedy_takes_the_argmax() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    result = Sampler(torch.device("cpu"), seed=0)(
        logits.clone(), [_request(f"r{i}", temperature=0.0) for i in range(6)]
    )
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 6


def test_top_k_keeps_the_k_most_likely_in_proportion() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4))
    counts = _frequencies(Sampler(torch.device("cpu"), 1), probs.log(), 6000, top_k=2)
    assert set(counts) == {0, 1}
    assert counts[0] / 6000 == pytest.approx(0.4 / 0.7, abs=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)).log()
    counts = _frequencies(Sampler(torch.device("cpu"), 2), logits, 6000, top_p=0.75)
    assert set(counts) == {0, 1}
    assert counts[0] / 6000 == pytest.approx(0.5 / 0.8, abs=0.03)
    counts = _frequencies(Sampler(torch.device("cpu"), 3), logits, 6000, top_p=0.85)
    assert set(counts) == {0, 1, 2}


def test_top_k_and_top_p_together() -> None:
    logits = torch.tensor([0.3, 0.3, 0.2, 0.2] + [1e-9] * (VOCAB - 4)).log()
    counts = _frequencies(Sampler(torch.device("cpu"), 4), logits, 3000, top_k=3, top_p=0.5)
    assert set(counts) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)).log()
    counts = _frequencies(Sampler(torch.device("cpu"), 5), logits, 6000, min_p=0.2)
    assert set(counts) == {0, 1, 2}
    assert counts[2] / 6000 == pytest.approx(0.15 / 0.95, abs=0.03)


def test_temperature_flattens_the_distribution() -> None:
    logits = torch.tensor([0.0, math.log(3.0)] + [-1e9] * (VOCAB - 2))
    counts = _frequencies(Sampler(torch.device("cpu"), 6), logits, 8000, temperature=2.0)
    expected = math.sqrt(3) / (1 + math.sqrt(3))  # softmax([0, ln 3] / 2)[1]
    assert counts[1] / 8000 == pytest.approx(expected, abs=0.03)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    # Token 3 is in the prompt: 2.0 / 1.5 = 1.33 loses to 1.5; 2.0 / 1.2 = 1.67 wins.
    assert sampler(
        _logits([3, 2.0, 4, 1.5]), [_request(prompt=[3], temperature=0, repetition_penalty=1.5)]
    ).token_ids == [4]
    assert sampler(
        _logits([3, 2.0, 4, 1.5]), [_request(prompt=[3], temperature=0, repetition_penalty=1.2)]
    ).token_ids == [3]
    # Token 3 was generated: -1.0 * 1.5 = -1.5 loses to -1.4.
    logits = _logits([3, -1.0, 4, -1.4])
    assert sampler(logits, [_request(outputs=[3], temperature=0, repetition_penalty=1.5)]).token_ids == [4]


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    three_times = [3, 3, 3]
    # frequency: 2.0 - 0.1 * 3 = 1.7 > 1.5, 2.0 - 0.2 * 3 = 1.4 < 1.5.
    assert sampler(
        _logits([3, 2.0, 4, 1.5]), [_request(outputs=three_times, temperature=0, frequency_penalty=0.1)]
    ).token_ids == [3]
    assert sampler(
        _logits([3, 2.0, 4, 1.5]), [_request(outputs=three_times, temperature=0, frequency_penalty=0.2)]
    ).token_ids == [4]
    # presence: once, whatever the count: 2.0 - 0.4 = 1.6 > 1.5, 2.0 - 0.6 = 1.4 < 1.5.
    assert sampler(
        _logits([3, 2.0, 4, 1.5]), [_request(outputs=three_times, temperature=0, presence_penalty=0.4)]
    ).token_ids == [3]
    assert sampler(
        _logits([3, 2.0, 4, 1.5]), [_request(outputs=three_times, temperature=0, presence_penalty=0.6)]
    ).token_ids == [4]
    # A prompt token is not penalised by either.
    assert sampler(
        _logits([3, 2.0, 4, 1.5]), [_request(prompt=[3], temperature=0, frequency_penalty=2.0)]
    ).token_ids == [3]


def test_penalties_apply_only_to_their_own_row() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    rows = [
        _request("a", outputs=[3], temperature=0, presence_penalty=1.0),
        _request("b", outputs=[3], temperature=0),
    ]
    assert sampler(_logits([3, 2.0, 4, 1.5], [3, 2.0, 4, 1.5]), rows).token_ids == [4, 3]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    logits = _logits([EOS, 3.0, 7, 2.0, 2, 1.0])
    assert sampler(logits.clone(), [_request(temperature=0, min_tokens=2, outputs=[1])]).token_ids == [7]
    assert sampler(logits.clone(), [_request(temperature=0, min_tokens=2, outputs=[1, 1])]).token_ids == [EOS]
    stop_too = _request(temperature=0, min_tokens=1, stop_token_ids=[7])
    assert sampler(logits.clone(), [stop_too]).token_ids == [2]
    # With ignore_eos the eos token is an ordinary token.
    assert sampler(logits.clone(), [_request(temperature=0, min_tokens=2, ignore_eos=True)]).token_ids == [
        EOS
    ]


def test_seeded_request_samples_the_same_whatever_the_batch() -> None:
    gen = torch.Generator().manual_seed(9)
    steps = [torch.randn(VOCAB, generator=gen) for _ in range(5)]

    def run(batch_size: int, position: int, engine_seed: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), engine_seed)
        seeded = _request("seeded", seed=1234, temperature=0.9, top_p=0.95)
        tokens = []
        for step in steps:
            others = [_request(f"o{i}", temperature=1.0, top_k=5) for i in range(batch_size - 1)]
            others += [_request("other-seeded", seed=99)]
            batch = [*others[:position], seeded, *others[position:]]
            logits = torch.randn(len(batch), VOCAB, generator=gen)
            logits[position] = step
            token = sampler(logits, batch).token_ids[position]
            seeded.append_output_token_ids(token)
            tokens.append(token)
        return tokens

    alone = run(1, 0, engine_seed=0)
    assert run(7, 3, engine_seed=1) == alone
    assert run(30, 29, engine_seed=2) == alone
    assert len(set(alone)) > 1


def test_a_seeded_request_resumed_with_output_goes_on_with_its_random_stream() -> None:
    """A continuation: a request that reaches a fresh sampler with k output tokens (sampled elsewhere)
    samples the tokens the uninterrupted run sampled after them."""
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(1, VOCAB, generator=gen) for _ in range(8)]

    def sample(sampler: Sampler, request: Request, logits: list[torch.Tensor]) -> list[int]:
        tokens = []
        for step in logits:
            token = sampler(step.clone(), [request]).token_ids[0]
            request.append_output_token_ids(token)
            tokens.append(token)
        return tokens

    whole = sample(Sampler(torch.device("cpu"), 0), _request(seed=77, temperature=1.0), steps)
    assert len(set(whole)) > 1
    for k in (1, 4, 7):
        resumed = _request(seed=77, temperature=1.0, outputs=whole[:k])
        assert sample(Sampler(torch.device("cpu"), 1), resumed, steps[k:]) == whole[k:], k


def test_unseeded_sampling_follows_the_engine_seed() -> None:
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(4))
    requests = [_request(f"r{i}") for i in range(32)]
    first = Sampler(torch.device("cpu"), 5)(logits.clone(), requests).token_ids
    assert Sampler(torch.device("cpu"), 5)(logits.clone(), requests).token_ids == first
    assert Sampler(torch.device("cpu"), 6)(logits.clone(), requests).token_ids != first


def test_forget_drops_a_finished_request_generator() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.zeros(1, VOCAB)
    first = [sampler(logits.clone(), [_request("x", seed=3)]).token_ids[0] for _ in range(6)]
    sampler.forget(["x"])
    again = [sampler(logits.clone(), [_request("x", seed=3)]).token_ids[0] for _ in range(6)]
    assert again == first


def test_logprobs_are_of_the_raw_logits_with_top_n_and_the_sampled_token() -> None:
    sampler = Sampler(torch.device("cpu"), 0)
    logits = _logits([3, 2.0, 4, 1.5, 5, 1.0, 6, 0.5], [3, 2.0, 4, 1.5])
    raw = torch.log_softmax(logits, dim=-1)
    requests = [
        _request("top3", temperature=0, logprobs=3, outputs=[3], presence_penalty=2.0),
        _request("none", temperature=0),
    ]
    result = sampler(logits.clone(), requests)
    assert result.token_ids == [4, 3]
    entry = result.logprobs[0]
    assert entry is not None and set(entry) == {3, 4, 5}
    for token, value in entry.items():
        assert value == pytest.approx(raw[0, token].item(), abs=1e-6)  # before the penalty
    assert result.logprobs[1] is None
    only_sampled = sampler(logits[:1].clone(), [_request(temperature=0, logprobs=0)]).logprobs[0]
    assert only_sampled == {3: pytest.approx(raw[0, 3].item(), abs=1e-6)}
    # The sampled token is included even when it is outside the top-N.
    low = sampler(
        logits[:1].clone(), [_request(temperature=0, logprobs=1, outputs=[3], presence_penalty=2.0)]
    )
    assert set(low.logprobs[0] or {}) == {3, 4}


def test_top_p_wider_than_the_candidate_shortlist_is_exact() -> None:
    vocab = 1000
    logits = -torch.arange(vocab, dtype=torch.float32) / 300  # distinct, slowly falling probabilities
    probs = logits.softmax(-1)
    last_kept = int((probs.cumsum(-1) < 0.9).sum())  # the nucleus ends at this token (descending order)
    assert last_kept > 256
    requests = [_request(f"r{i}", top_p=0.9) for i in range(3000)]
    tokens = Sampler(torch.device("cpu"), 7)(logits.expand(3000, -1).clone(), requests).token_ids
    assert last_kept - 20 < max(tokens) <= last_kept  # the nucleus's tail is reached but never passed


# A sampled request and a greedy one, with every setting logprobs modes can see: a repetition penalty (over
# the prompt and the output), temperature, min_p, top_k and top_p.
SAMPLED = {"temperature": 0.7, "min_p": 0.02, "top_k": 6, "top_p": 0.8, "repetition_penalty": 1.3, "seed": 5}
GREEDY_PENALISED = {"temperature": 0.0, "repetition_penalty": 1.3}
TOP_N = 8


def _transformers_processed(logits: torch.Tensor, seen: list[int], params: dict[str, Any]) -> torch.Tensor:
    """One row's logits after its settings, by Transformers' logits processors in vLLM's order (penalty,
    temperature, min_p, top_k, top_p); a greedy row is only penalised."""
    input_ids = torch.tensor([seen])
    processors: list[Any] = [RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])]
    if params["temperature"] > 0:
        processors += [
            TemperatureLogitsWarper(params["temperature"]),
            MinPLogitsWarper(params["min_p"]),
            TopKLogitsWarper(params["top_k"]),
            TopPLogitsWarper(params["top_p"]),
        ]
    scores = logits.unsqueeze(0).clone()
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores[0]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_are_vllms_against_transformers_processors(mode: str) -> None:
    vocab = 64
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)) * 3
    prompt, outputs = [1, 2], [int(logits[0].argmax()), 9]
    requests = [
        _request("sampled", prompt=prompt, outputs=outputs, logprobs=TOP_N, **SAMPLED),
        _request("greedy", prompt=prompt, outputs=outputs, logprobs=TOP_N, **GREEDY_PENALISED),
    ]
    result = Sampler(torch.device("cpu"), 0, mode)(logits.clone(), requests)  # type: ignore[arg-type]
    for row, params in enumerate((SAMPLED, GREEDY_PENALISED)):
        expected = (
            logits[row]
            if mode.startswith("raw")
            else _transformers_processed(logits[row], prompt + outputs, params)
        )
        if mode.endswith("logprobs"):
            expected = torch.log_softmax(expected, dim=-1)
        entry = result.logprobs[row]
        assert entry is not None
        token = result.token_ids[row]
        assert math.isfinite(entry[token]) and entry[token] == pytest.approx(expected[token].item(), abs=1e-5)
        # The top N by the mode's scores; ties among the tokens filtered out (-inf) may be any of them.
        finite = {t: v for t, v in entry.items() if math.isfinite(v)}
        best = expected.topk(TOP_N)
        expected_finite = {
            t: v for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True) if math.isfinite(v)
        }
        assert finite == pytest.approx(expected_finite, abs=1e-5)
        assert len(entry) == TOP_N and all(v == -math.inf for v in entry.values() if not math.isfinite(v))
    if mode.startswith("processed"):
        # The settings left fewer than TOP_N tokens to the sampled row, the rest scoring -inf.
        assert sum(math.isfinite(v) for v in (result.logprobs[0] or {}).values()) < TOP_N


def test_logit_bias_comes_before_the_penalties_as_transformers_processors_in_vllms_order() -> None:
    """vLLM applies logit_bias as a logits processor before the penalties: a biased token already seen is
    penalised with its bias. Its processed logits are Transformers' SequenceBias then RepetitionPenalty."""
    logits = _logits([3, 1.0, 4, 1.2])
    params = SamplingParams(temperature=0.0, logit_bias={3: 1.0}, repetition_penalty=2.0, logprobs=2)
    request = Request("r", [3], params, eos_token_id=EOS, token_rules=TokenRules.of(params, VOCAB, list))
    result = Sampler(torch.device("cpu"), 0, "processed_logits")(logits.clone(), [request])
    scores = SequenceBiasLogitsProcessor({(3,): 1.0})(torch.tensor([[3]]), logits.clone())
    scores = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[3]]), scores)[0]
    assert scores[3].item() == pytest.approx(1.0) and result.token_ids == [4]  # (1 + 1) / 2 under 1.2
    assert result.logprobs[0] == pytest.approx({4: scores[4].item(), 3: scores[3].item()})
