"""A prompt's logprobs (vLLM's prompt_logprobs): each prompt token scored by the logits of the row before it,
as the model computed them (before any sampling setting), with the likeliest tokens in its place and its
rank. The score is the log-softmax of those logits, or the logits themselves in the *_logits logprobs
modes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from kvfleet.runtime.request import PromptTokenLogprobs
from kvfleet.runtime.worker.step_inputs import PromptLogprobRows

# Rows scored at once: a row's logits are a vocabulary's floats, and a prompt's chunk may be thousands of
# rows.
ROWS_AT_ONCE = 256


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: PromptLogprobRows,
    as_logits: bool,
) -> list[PromptTokenLogprobs]:
    """The scores of the prompt tokens `rows` names, from the step's final hidden states (one per token
    fed)."""
    scores = []
    for offset in range(0, len(rows.next_token_ids), ROWS_AT_ONCE):
        next_token_ids = rows.next_token_ids[offset : offset + ROWS_AT_ONCE]
        first = rows.first_row + offset
        logits = compute_logits(hidden[first : first + len(next_token_ids)])
        scored = logits if as_logits else torch.log_softmax(logits, dim=-1)
        scores += _scored(scored, next_token_ids, rows.num_logprobs)
    return scores


def _scored(scores: torch.Tensor, token_ids: list[int], top: int) -> list[PromptTokenLogprobs]:
    targets = torch.tensor(token_ids, device=scores.device).unsqueeze(1)
    chosen = scores.gather(1, targets)
    # Ties share the best rank among them, as every token scored higher counts once.
    ranks = ((scores > chosen).sum(dim=1) + 1).tolist()
    chosen_values = chosen.squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in token_ids]
    top_values: list[list[float]] = [[] for _ in token_ids]
    if top:
        values, ids = scores.topk(top, dim=1)
        top_ids, top_values = ids.tolist(), values.tolist()
    return [
        PromptTokenLogprobs({**dict(zip(ids, values, strict=True)), token_id: value}, rank)
        for token_id, value, rank, ids, values in zip(
            token_ids, chosen_values, ranks, top_ids, top_values, strict=True
        )
    ]
