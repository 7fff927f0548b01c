"""Beam search as vLLM runs it, over the engine's one-token requests: each step scores every live beam's
next token (its 2 x beam_width likeliest, as Transformers takes them), a beam extended with the end of
sequence is complete, and the beam_width likeliest other extensions go on. After max_tokens steps the
completed and live beams are ranked by their cumulative logprob over their length (prompt included, the end
token not) to the power length_penalty, and the best beam_width are the answer.

The search is a state machine (BeamSearch) that says what to score next and takes the scores; the engines'
drivers (the offline LLM's, and `beam_search_outputs` for an EngineClient) run the steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.request import FAILED_FINISH_REASONS
from kvfleet.runtime.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from kvfleet.runtime.engine.protocol import EngineClient


@dataclass
class BeamSearchSequence:
    """vLLM's: a beam, its tokens the prompt's and then its own, with each own token's scored candidates."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: a prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search: its live `beams` are what to score next, `advance` takes each one's scored
    candidates, until `done`; `best` ranks what it found."""

    def __init__(
        self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: int | None
    ) -> None:
        self.params = params
        self.prompt_length = len(prompt_token_ids)
        self._eos_token_id = eos_token_id
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def step_params(self) -> SamplingParams:
        """One token, greedy (the token drawn is not read), with the 2 x beam_width likeliest scored."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.params.beam_width)

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not self.beams

    def advance(self, scored: Sequence[dict[int, float]]) -> None:
        """`scored`: for each live beam, in order, its next token's candidates and their logprobs."""
        params = self.params
        extensions = []
        for order, (beam, candidates) in enumerate(zip(self.beams, scored, strict=True)):
            for token_id, logprob in candidates.items():
                extended = BeamSearchSequence(
                    [*beam.tokens, token_id], [*beam.logprobs, candidates], beam.cum_logprob + logprob
                )
                if token_id == self._eos_token_id and not params.ignore_eos:
                    if not params.include_stop_str_in_output:
                        extended.tokens.pop()
                    extended.finish_reason, extended.stop_reason = "stop", token_id
                    self.completed.append(extended)
                else:
                    extensions.append((-extended.cum_logprob, order, extended))
        # Ties go to the earlier beam, then to the candidate the engine listed first (the likelier).
        extensions.sort(key=lambda entry: entry[:2])
        self.beams = [extended for _, _, extended in extensions[: params.beam_width]]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best of the completed and live beams, best first (`finish_reason` length for a
        live one)."""
        ranked = sorted(self.completed + self.beams, key=self._score, reverse=True)
        best = ranked[: self.params.beam_width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
        return best

    def _score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens)
        if beam.tokens[-1] == self._eos_token_id:
            length -= 1
        return beam.cum_logprob / max(length, 1) ** self.params.length_penalty

    def answer(self, beam: BeamSearchSequence) -> tuple[list[int], list[int], list[dict[int, float]]]:
        """A best beam's own tokens, those its text shows (not an end token that completed it), and each
        token's candidates (none for an end token left out of its tokens)."""
        token_ids = beam.tokens[self.prompt_length :]
        ended = beam.finish_reason == "stop"
        shown = token_ids[:-1] if ended and token_ids[-1:] == [self._eos_token_id] else token_ids
        return token_ids, shown, beam.logprobs[: len(token_ids)]


async def beam_search_outputs(
    engine: EngineClient,
    request_id: str,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    *,
    with_logprobs: bool,
    **request_options: Any,
) -> AsyncIterator[RequestOutput]:
    """The search's answer as the engine's output of a request of beam_width sequences, whole, once it ends
    (a step that failed ends it, each sequence with the step's finish reason); `with_logprobs`: each token's
    candidates with it. `request_options`: what every step's engine requests share (priority, timeout from
    the search's arrival, LoRA, media, cache salt)."""
    search = BeamSearch(prompt_token_ids, params, engine.tokenizer.eos_token_id)
    step_params = search.step_params
    while not search.done:
        step_id = f"{request_id}-beam{search.steps}"
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(
                    _joined_output(engine, f"{step_id}-{order}", beam.tokens, step_params, request_options)
                )
                for order, beam in enumerate(search.beams)
            ]
        completions = [task.result().outputs[0] for task in tasks]
        failure = next(
            (c.finish_reason for c in completions if c.finish_reason in FAILED_FINISH_REASONS), None
        )
        if failure is not None:
            yield _answer(
                request_id,
                prompt_token_ids,
                [
                    CompletionOutput(index, "", [], None, None, finish_reason=failure)
                    for index in range(params.beam_width)
                ],
            )
            return
        search.advance([completion.logprobs[0] for completion in completions])
    completions = []
    for index, beam in enumerate(search.best()):
        token_ids, shown, logprobs = search.answer(beam)
        text = engine.tokenizer.decode(shown)
        completions.append(
            CompletionOutput(
                index,
                text,
                token_ids,
                beam.cum_logprob,
                logprobs if with_logprobs else None,
                beam.finish_reason,
                beam.stop_reason,
            )
        )
    yield _answer(request_id, prompt_token_ids, completions)


async def _joined_output(
    engine: EngineClient,
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    request_options: dict[str, Any],
) -> RequestOutput:
    """A request's delta outputs joined."""
    joined = None
    async for output in engine.generate(request_id, token_ids, params, **request_options):
        joined = output if joined is None else joined.followed_by(output)
    assert joined is not None and joined.finished, "a request's outputs end with its finished one"
    return joined


def _answer(
    request_id: str, prompt_token_ids: list[int], completions: list[CompletionOutput]
) -> RequestOutput:
    return RequestOutput(request_id, None, prompt_token_ids, completions, finished=True)
