"""Turns the scheduler's per-token results into RequestOutputs: text, stop strings, logprobs, n > 1."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime.core.outputs import EngineCoreOutput
from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from kvfleet.runtime.engine.outputs import (
    CompletionOutput,
    OutputKind,
    PromptTokenLogprobs,
    RequestMetrics,
    RequestOutput,
)
from kvfleet.runtime.engine.sequences import ResumedSequence
from kvfleet.runtime.errors import InvalidContinuationError
from kvfleet.runtime.request import FinishReason
from kvfleet.runtime.sampling_params import SamplingParams
from transformers import PreTrainedTokenizerBase


@dataclass
class _Sequence:
    """One of a request's n generated sequences (one scheduler request each)."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    sent_tokens: int = 0
    sent_text: int = 0
    # Its finish has been handed out (once: a finished sequence stays in its request until all are).
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind
    sequences: dict[str, _Sequence]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    prompt_hidden_state: list[float] | None = None
    # From the first of its sequences to score the prompt (each of n does), until handed out.
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
    prompt_scored: bool = False

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences.values())


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._parent_of: dict[str, str] = {}  # scheduler request id -> request id
        # Continuations' first outputs, until their engine takes them (take_resumed).
        self._resumed: dict[str, RequestOutput] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind,
        sequence_ids: list[str],
        arrival_time: float,
        resumed: dict[int, ResumedSequence] | None = None,
    ) -> None:
        """`resumed`, by sequence index: what a continuation's sequences already delivered; their output so
        far is rebuilt here as if it had been handed out from this processor (take_resumed). Raises
        InvalidContinuationError if an unfinished one would have hit a stop string."""
        # Text is built token by token only when someone reads it before the end (stop strings, streaming).
        incremental = bool(params.stop) or output_kind is OutputKind.DELTA
        sequences = {}
        for index, sequence_id in enumerate(sequence_ids):
            detokenizer = None
            if incremental:
                detokenizer = IncrementalDetokenizer(
                    self._tokenizer,
                    prompt_token_ids,
                    params.stop,
                    skip_special_tokens=params.skip_special_tokens,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            sequences[sequence_id] = _Sequence(
                index=index,
                detokenizer=detokenizer,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
        state = _RequestState(
            request_id, prompt, prompt_token_ids, params, output_kind, sequences, RequestMetrics(arrival_time)
        )
        if resumed:
            self._resumed[request_id] = self._replay(state, resumed)
        for sequence_id in sequence_ids:
            self._parent_of[sequence_id] = request_id
        self._requests[request_id] = state

    def _replay(self, state: _RequestState, resumed: dict[int, ResumedSequence]) -> RequestOutput:
        """Bring a continuation's sequences to where their deliveries stopped: their tokens detokenized (so
        that a stop string straddling the cut is found), and counted as handed out, with the text the
        previous replica sent of them (what a possible stop string held back is sent from here). A finished
        one is done, and never handed out again. Returns what they had delivered."""
        completions = []
        for sequence in state.sequences.values():
            already = resumed.get(sequence.index)
            if already is None:
                continue
            sequence.token_ids = list(already.token_ids)
            if sequence.logprobs is not None:
                # Not known here, and never handed out again: they only keep the lists aligned.
                sequence.logprobs = [{} for _ in sequence.token_ids]
            if already.finished:
                # How it finished was sent by the previous replica; here it only needs to count as finished.
                sequence.finish_reason, sequence.sent_finish = FinishReason.STOP.value, True
            elif sequence.detokenizer is not None:
                stop = sequence.detokenizer.update(sequence.token_ids)
                if stop is not None:
                    raise InvalidContinuationError(
                        f"choice {sequence.index} ends at the stop string {stop!r} within its resumed "
                        "tokens: a finished choice is resumed with finished true"
                    )
                sequence.text = sequence.detokenizer.text
            sequence.sent_tokens = len(sequence.token_ids)
            sequence.sent_text = max(0, len(sequence.text) - self._hold_back(state.params, sequence))
            completions.append(
                CompletionOutput(
                    index=sequence.index,
                    text=sequence.text[: sequence.sent_text],
                    token_ids=list(sequence.token_ids),
                    cumulative_logprob=None,
                    logprobs=None,
                    finish_reason=sequence.finish_reason,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            metrics=dataclasses.replace(state.metrics),
            resumed=True,
        )

    def take_resumed(self, request_id: str) -> RequestOutput | None:
        """A continuation's first output (see RequestOutput.resumed), once; None for other requests."""
        return self._resumed.pop(request_id, None)

    def request_of(self, sequence_id: str) -> str | None:
        return self._parent_of.get(sequence_id)

    def sequence_ids(self, request_id: str) -> list[str]:
        state = self._requests.get(request_id)
        return list(state.sequences) if state else []

    def mark_scheduled(self, sequence_id: str, now: float) -> None:
        state = self._requests.get(self._parent_of.get(sequence_id, ""))
        if state is not None and state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = now

    def remove(self, request_id: str) -> None:
        self._resumed.pop(request_id, None)
        state = self._requests.pop(request_id, None)
        if state is not None:
            for sequence_id in state.sequences:
                self._parent_of.pop(sequence_id, None)

    def process(
        self, core_outputs: list[EngineCoreOutput], now: float
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to hand out and the scheduler requests that hit a stop string."""
        touched: dict[str, _RequestState] = {}
        stopped: list[str] = []
        for core_output in core_outputs:
            request_id = self._parent_of.get(core_output.request_id)
            if request_id is None:
                continue  # aborted by the caller after the step was scheduled
            state = self._requests[request_id]
            sequence = state.sequences[core_output.request_id]
            if self._update_sequence(state, sequence, core_output, now):
                stopped.append(core_output.request_id)
            touched[request_id] = state

        outputs = []
        for request_id, state in touched.items():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
            output = self._make_output(state, finished)
            if output is not None:
                outputs.append(output)
            if finished:
                self.remove(request_id)
        return outputs, stopped

    def _update_sequence(
        self, state: _RequestState, sequence: _Sequence, core_output: EngineCoreOutput, now: float
    ) -> bool:
        new_ids = core_output.new_token_ids
        if new_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            sequence.token_ids.extend(new_ids)
        if core_output.num_cached_tokens > state.num_cached_tokens:
            state.num_cached_tokens = core_output.num_cached_tokens
        if core_output.kv_transfer_params is not None:
            state.kv_transfer_params = core_output.kv_transfer_params
        if core_output.prompt_hidden_state is not None:
            state.prompt_hidden_state = core_output.prompt_hidden_state
        if core_output.prompt_logprobs is not None and not state.prompt_scored:
            # Nothing before the first prompt token scores it.
            state.prompt_logprobs, state.prompt_scored = [None, *core_output.prompt_logprobs], True
        if sequence.logprobs is not None and core_output.new_logprobs:
            sequence.logprobs.extend(core_output.new_logprobs)
            for token_id, token_logprobs in zip(new_ids, core_output.new_logprobs, strict=False):
                sequence.cumulative_logprob += token_logprobs[token_id]

        stop = sequence.detokenizer.update(new_ids) if sequence.detokenizer is not None else None
        if stop is not None:
            # A stop string ends the sequence even where the same step ended it otherwise (its last token
            # under max_tokens, say), as vLLM's does; the core still runs it unless it finished.
            sequence.finish_reason, sequence.stop_reason = FinishReason.STOP.value, stop
        elif core_output.finish_reason is not None:
            sequence.finish_reason = core_output.finish_reason.value
            sequence.stop_reason = core_output.stop_reason
        hit_stop_string = stop is not None and core_output.finish_reason is None
        if sequence.finished:
            self._finalize_text(state.params, sequence)
        elif sequence.detokenizer is not None:
            sequence.text = sequence.detokenizer.text
        return hit_stop_string

    def _finalize_text(self, params: SamplingParams, sequence: _Sequence) -> None:
        if sequence.detokenizer is not None:
            sequence.detokenizer.finish()
            sequence.text = sequence.detokenizer.text
        else:
            sequence.text = self._tokenizer.decode(
                sequence.token_ids, skip_special_tokens=params.skip_special_tokens
            )

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput | None:
        """The output to hand out after a step; `finished`: whether the request's sequences all are."""
        if state.output_kind is OutputKind.FINAL_ONLY:
            if not finished:
                return None
            completions = [self._completion(seq, delta=False) for seq in state.sequences.values()]
        else:
            completions = [
                self._completion(seq, delta=True, hold_back=self._hold_back(state.params, seq))
                for seq in state.sequences.values()
                if seq.sent_tokens < len(seq.token_ids) or (seq.finished and not seq.sent_finish)
            ]
        # Once, with the first output made after the prompt is scored: a stream echoes the prompt with them.
        prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            # A snapshot: the state's own copy keeps changing, and outputs may be read on another thread.
            metrics=dataclasses.replace(state.metrics),
            kv_transfer_params=state.kv_transfer_params if finished else None,
            prompt_hidden_state=state.prompt_hidden_state if finished else None,
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _hold_back(params: SamplingParams, sequence: _Sequence) -> int:
        # While a stop string could still be completing, its first characters must not be streamed.
        if sequence.finished or not params.stop:
            return 0
        return max(len(s) for s in params.stop) - 1

    @staticmethod
    def _completion(sequence: _Sequence, *, delta: bool, hold_back: int = 0) -> CompletionOutput:
        if not delta:
            return CompletionOutput(
                index=sequence.index,
                text=sequence.text,
                token_ids=list(sequence.token_ids),
                cumulative_logprob=sequence.cumulative_logprob,
                logprobs=sequence.logprobs,
                finish_reason=sequence.finish_reason,
                stop_reason=sequence.stop_reason,
            )
        text_end = max(sequence.sent_text, len(sequence.text) - hold_back)
        completion = CompletionOutput(
            index=sequence.index,
            text=sequence.text[sequence.sent_text : text_end],
            token_ids=sequence.token_ids[sequence.sent_tokens :],
            cumulative_logprob=sequence.cumulative_logprob,
            logprobs=sequence.logprobs[sequence.sent_tokens :] if sequence.logprobs is not None else None,
            finish_reason=sequence.finish_reason,
            stop_reason=sequence.stop_reason,
        )
        sequence.sent_tokens = len(sequence.token_ids)
        sequence.sent_text = text_end
        sequence.sent_finish = sequence.finished
        return completion
