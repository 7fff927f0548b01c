"""Beam search (kvfleet.runtime.engine.beam_search): its rules on scores worked out by hand, a failed step,
and LLM.beam_search against Transformers' beam search on the same folder."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from beam_reference import transformers_beams
from kvfleet.runtime import LLM
from kvfleet.runtime.engine.beam_search import BeamSearch, beam_search_outputs
from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.sampling_params import BeamSearchParams, SamplingParams
from transformers import AutoTokenizer

END = 9
PROMPT = [5]
# The next token's candidates after each beam (by its own tokens), as probabilities.
SCORES = {
    (): {1: 0.5, END: 0.3, 2: 0.2},
    (1,): {3: 0.9, END: 0.1},
    (2,): {4: 0.6, END: 0.4},
    (END,): {6: 0.7, 7: 0.3},
}


def _searched(**params: Any) -> BeamSearch:
    """Two steps of a search of width 2 over SCORES."""
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=2, **params), END)
    while not search.done:
        search.advance(
            [
                {token: math.log(p) for token, p in SCORES[tuple(beam.tokens[1:])].items()}
                for beam in search.beams
            ]
        )
    return search


def _best(search: BeamSearch) -> list[tuple[list[int], float, str]]:
    return [(beam.tokens, round(math.exp(beam.cum_logprob), 6), beam.finish_reason) for beam in search.best()]


def test_an_end_token_completes_a_beam_and_the_length_penalty_ranks_the_answer() -> None:
    # After the first step: [5] completed (0.3), beams [5, 1] (0.5) and [5, 2] (0.2). After the second:
    # [5, 1] (0.05) and [5, 2] (0.08) completed, beams [5, 1, 3] (0.45) and [5, 2, 4] (0.12). Over their
    # lengths (the end token not counted): log 0.45 / 3 = -0.27, log 0.12 / 3 = -0.71, log 0.3 / 1 = -1.20,
    # log 0.08 / 2 = -1.26, log 0.05 / 2 = -1.50.
    assert _best(_searched()) == [([5, 1, 3], 0.45, "length"), ([5, 2, 4], 0.12, "length")]
    # Without the length: 0.45, then the beam completed at once (0.3), before 0.12.
    assert _best(_searched(length_penalty=0.0)) == [([5, 1, 3], 0.45, "length"), ([5], 0.3, "stop")]
    # The end token kept in the tokens is still not counted in the length: log 0.3 / 1, not / 2 (-0.60, which
    # would rank second).
    assert _best(_searched(include_stop_str_in_output=True)) == _best(_searched())
    kept = _searched(length_penalty=0.0, include_stop_str_in_output=True)
    assert _best(kept) == [([5, 1, 3], 0.45, "length"), ([5, END], 0.3, "stop")]
    tokens, shown, logprobs = kept.answer(kept.best()[1])
    assert (tokens, shown, len(logprobs)) == ([END], [], 1)


def test_ignore_eos_keeps_the_end_token_as_any_other() -> None:
    # [5, 1] (0.5) and [5, END] (0.3) go on: [5, 1, 3] (0.45), [5, END, 6] (0.21).
    assert _best(_searched(ignore_eos=True)) == [([5, 1, 3], 0.45, "length"), ([5, END, 6], 0.21, "length")]


class _FailingEngine:
    """An engine whose requests of the second step end with `reason`."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.tokenizer = SimpleNamespace(eos_token_id=END, decode=lambda ids: " ".join(map(str, ids)))
        self.request_ids: list[str] = []

    async def generate(
        self, request_id: str, token_ids: list[int], params: SamplingParams, **options: Any
    ) -> AsyncIterator[RequestOutput]:
        self.request_ids.append(request_id)
        failed = len(token_ids) > len(PROMPT)
        scores = {token: math.log(p) for token, p in SCORES[tuple(token_ids[1:])].items()}
        completion = CompletionOutput(0, "", [1], None, [scores], self.reason if failed else "length")
        yield RequestOutput(request_id, None, token_ids, [completion], finished=True)


def test_a_failed_step_ends_the_search_with_its_reason() -> None:
    engine = _FailingEngine("timeout")

    async def run() -> list[RequestOutput]:
        params = BeamSearchParams(beam_width=2, max_tokens=4)
        outputs = beam_search_outputs(engine, "req", PROMPT, params, with_logprobs=True)  # type: ignore[arg-type]
        return [output async for output in outputs]

    (output,) = asyncio.run(run())
    assert [completion.finish_reason for completion in output.outputs] == ["timeout", "timeout"]
    assert output.request_id == "req" and output.finished
    # One request for the first step, one per beam for the second, and no third step.
    assert engine.request_ids == ["req-beam0-0", "req-beam1-0", "req-beam1-1"]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


def test_llm_beam_search_finds_transformers_beams(llm: LLM, tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = ["Once upon a time", "The quick brown fox"]
    width, steps = 3, 6
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        expected = transformers_beams(tiny_llama, prompt_ids, width, steps)
        assert [beam.tokens for beam in output.sequences] == [prompt_ids + tokens for tokens, _ in expected]
        for beam, (_, logprob) in zip(output.sequences, expected, strict=True):
            assert beam.cum_logprob == pytest.approx(logprob, abs=1e-4)
            assert beam.text == tokenizer.decode(beam.tokens)
            assert beam.finish_reason == "length" and len(beam.logprobs) == steps
    # The same searches one prompt at a time: side by side, they keep to their own beams.
    alone = llm.beam_search(prompts[1], BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    assert [beam.tokens for beam in alone[0].sequences] == [beam.tokens for beam in outputs[1].sequences]
