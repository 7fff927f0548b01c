"""One step as the model sees it: the tokens to feed and where their KV goes, without the scheduler's request
objects. The in-process runner builds it from the SchedulerOutput; with worker processes the engine core sends
it to every rank (it is small and picklable), and each builds its input tensors from it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from kvfleet.runtime.core.host_kv_tier import TierCopies
from kvfleet.runtime.core.outputs import SchedulerOutput
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.worker.prompt_pooling import PooledPromptRows


@dataclass
class PromptLogprobRows:
    """One request's rows whose logits score its prompt's next tokens this step."""

    # The first of them in the flattened batch, and the position of the token fed there.
    first_row: int
    first_position: int
    # The prompt tokens they score, one a row (each the token after the row's own).
    next_token_ids: list[int]
    # How many of the likeliest tokens each row returns besides its prompt token.
    num_logprobs: int


@dataclass
class StepInputs:
    request_ids: list[str]
    # The tokens each request feeds this step (its draft tokens included).
    token_ids: list[list[int]]
    num_computed_tokens: list[int]
    num_prompt_tokens: list[int]
    block_ids: list[list[int]]
    # Requests that sample this step (their prompt, or recomputed prefix, is complete).
    sample_rows: list[int]
    # Rows of the flattened batch whose logits are needed: each sampling request's last token, or with
    # drafts its last real token and each draft token.
    logit_rows: list[int]
    lora_requests: list[LoRARequest | None]
    # Each request's images (or other items), in prompt order; empty for text.
    mm_features: list[list[MultiModalFeature]]
    tier_copies: TierCopies = field(default_factory=TierCopies)
    # On a model with M-RoPE, each request's positions [3, its scheduled tokens]; None on others.
    mrope_positions: list[np.ndarray] | None = None
    # See SchedulerOutput.removed_lora_ids.
    removed_lora_ids: list[int] = field(default_factory=list)
    # Requests that return their pooled prompt this step: request index -> its last token's row among the
    # logit rows.
    prompt_hidden_state_rows: dict[int, int] = field(default_factory=dict)
    # Requests whose prompt's first or mean pooling keeps this step's prompt tokens: request index -> their
    # rows.
    pooled_prompt_rows: dict[int, PooledPromptRows] = field(default_factory=dict)
    # Requests whose prompt's logprobs are computed this step: request index -> their rows.
    prompt_logprob_rows: dict[int, PromptLogprobRows] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_scheduled_tokens(self) -> list[int]:
        return [len(tokens) for tokens in self.token_ids]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.token_ids)

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput) -> StepInputs:
        num_tokens = sum(scheduler_output.num_scheduled_tokens)
        if num_tokens != scheduler_output.total_num_scheduled_tokens:
            raise ValueError(
                f"total_num_scheduled_tokens is {scheduler_output.total_num_scheduled_tokens}, "
                f"but the requests add up to {num_tokens}"
            )
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        requests = scheduler_output.requests
        mrope_positions = (
            [
                request.mrope_positions.rows(start, start + count)
                for request, start, count in zip(
                    requests,
                    scheduler_output.num_computed_tokens,
                    scheduler_output.num_scheduled_tokens,
                    strict=True,
                )
            ]
            if requests and requests[0].mrope_positions is not None
            else None
        )
        token_ids, sample_rows, logit_rows = [], [], []
        prompt_hidden_state_rows = {}
        pooled_prompt_rows = {}
        prompt_logprob_rows = {}
        end_row = 0
        for i, request in enumerate(scheduler_output.requests):
            start = scheduler_output.num_computed_tokens[i]
            end = start + scheduler_output.num_scheduled_tokens[i]
            drafts = spec_decode_tokens.get(request.request_id, ())
            tokens = request.all_token_ids[start:end]
            if drafts:  # the request's tokens continue with its drafts
                tokens += drafts[max(start - request.num_tokens, 0) : end - request.num_tokens]
            token_ids.append(tokens)
            if request.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                scored = request.prompt_token_ids[start + 1 : min(end, request.num_prompt_tokens - 1) + 1]
                num_logprobs = request.sampling_params.prompt_logprobs or 0
                prompt_logprob_rows[i] = PromptLogprobRows(end_row, start, scored, num_logprobs)
            if (
                request.sampling_params.prompt_pooling in ("MEAN", "CLS")
                and start < request.num_prompt_tokens
            ):
                count = min(end, request.num_prompt_tokens) - start
                pooled_prompt_rows[i] = PooledPromptRows(end_row, start, count)
            end_row += len(tokens)
            if end == request.num_tokens + len(drafts):
                sample_rows.append(i)
                if request.sampling_params.prompt_pooling is not None and not request.output_token_ids:
                    prompt_hidden_state_rows[i] = len(logit_rows)
                logit_rows.extend(range(end_row - len(drafts) - 1, end_row))
        return cls(
            request_ids=[request.request_id for request in scheduler_output.requests],
            token_ids=token_ids,
            num_computed_tokens=list(scheduler_output.num_computed_tokens),
            num_prompt_tokens=[request.num_prompt_tokens for request in scheduler_output.requests],
            block_ids=scheduler_output.block_ids,
            sample_rows=sample_rows,
            logit_rows=logit_rows,
            lora_requests=[request.lora_request for request in scheduler_output.requests],
            mm_features=[list(request.mm_features) for request in scheduler_output.requests],
            tier_copies=scheduler_output.tier_copies,
            mrope_positions=mrope_positions,
            removed_lora_ids=scheduler_output.removed_lora_ids,
            prompt_hidden_state_rows=prompt_hidden_state_rows,
            pooled_prompt_rows=pooled_prompt_rows,
            prompt_logprob_rows=prompt_logprob_rows,
        )

    def split(self, parts: int) -> list[StepInputs]:
        """The step as up to `parts` micro-batches of consecutive requests (about equal in tokens), whose
        logit rows, concatenated, are this step's in order. Tier copies go with the first."""
        if parts <= 1 or self.num_reqs <= 1:
            return [self]
        total = self.total_num_scheduled_tokens
        bounds, fed = [0], 0
        for i, tokens in enumerate(self.token_ids[:-1]):
            fed += len(tokens)
            if len(bounds) < parts and fed * parts >= total * len(bounds):
                bounds.append(i + 1)
        bounds.append(self.num_reqs)
        return [self._slice(first, last, copies=first == 0) for first, last in itertools.pairwise(bounds)]

    def _slice(self, first: int, last: int, *, copies: bool) -> StepInputs:
        offset = sum(len(tokens) for tokens in self.token_ids[:first])
        end = offset + sum(len(tokens) for tokens in self.token_ids[first:last])
        return StepInputs(
            request_ids=self.request_ids[first:last],
            token_ids=self.token_ids[first:last],
            num_computed_tokens=self.num_computed_tokens[first:last],
            num_prompt_tokens=self.num_prompt_tokens[first:last],
            block_ids=self.block_ids[first:last],
            sample_rows=[i - first for i in self.sample_rows if first <= i < last],
            logit_rows=[row - offset for row in self.logit_rows if offset <= row < end],
            lora_requests=self.lora_requests[first:last],
            mm_features=self.mm_features[first:last],
            tier_copies=self.tier_copies if copies else TierCopies(),
            mrope_positions=None if self.mrope_positions is None else self.mrope_positions[first:last],
            removed_lora_ids=self.removed_lora_ids,
        )
