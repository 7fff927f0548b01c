"""A prompt's hidden states pooled into one vector (what an embedding is made of), as vLLM's sequence
poolers pool them: the last token's final hidden state (LAST), the first's (CLS), or their mean (MEAN).

A long prompt is computed in chunks over several steps, so the first and mean poolings keep what each chunk
gave until the prompt's last chunk; a prompt computed again from an earlier position (after preemption)
replaces what it had from there on. Those requests compute their whole prompt: the prefix cache holds KV,
not hidden states (see SamplingParams.computes_whole_prompt)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvfleet.runtime.sampling_params import PromptPooling


@dataclass
class PooledPromptRows:
    """One request's prompt tokens fed this step, which a first or mean pooling keeps."""

    # The first of them in the flattened batch, the prompt position of the token fed there, and how many.
    first_row: int
    first_position: int
    count: int


@dataclass
class _Chunk:
    first_position: int
    end_position: int
    # CLS: the first token's hidden state; MEAN: the sum of the chunk's, in float32.
    pooled: torch.Tensor


class PromptPooler:
    """The chunks each first- or mean-pooling request has computed of its prompt, until it is pooled."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[_Chunk]] = {}

    def keep(
        self, request_id: str, pooling: PromptPooling, rows: PooledPromptRows, hidden: torch.Tensor
    ) -> None:
        """The step's rows of the request's prompt (`hidden`: the step's final hidden states)."""
        chunks = [
            chunk for chunk in self._chunks.get(request_id, []) if chunk.end_position <= rows.first_position
        ]
        computed = chunks[-1].end_position if chunks else 0
        if computed != rows.first_position:
            raise RuntimeError(
                f"request {request_id}: its prompt's hidden states reach position {computed}, but the step "
                f"feeds position {rows.first_position} on"
            )
        states = hidden[rows.first_row : rows.first_row + rows.count].float()
        if pooling == "MEAN":
            pooled = states.sum(dim=0)
        elif rows.first_position == 0:
            pooled = states[0]
        else:
            pooled = states.new_empty(0)  # CLS keeps the first chunk's first row only
        end_position = rows.first_position + rows.count
        self._chunks[request_id] = [*chunks, _Chunk(rows.first_position, end_position, pooled)]

    def pooled(self, request_id: str, pooling: PromptPooling, last: torch.Tensor) -> list[float]:
        """The request's pooled prompt, once its last chunk is kept (`last`: its last token's hidden
        state); what was kept of it is let go."""
        if pooling == "LAST":
            return last.float().tolist()
        chunks = self._chunks.pop(request_id)
        if pooling == "CLS":
            return chunks[0].pooled.tolist()
        total = torch.stack([chunk.pooled for chunk in chunks]).sum(dim=0)
        return (total / chunks[-1].end_position).tolist()

    def forget(self, request_ids: list[str] | set[str]) -> None:
        """Requests that finished (or were aborted) before their prompt was pooled."""
        for request_id in request_ids:
            self._chunks.pop(request_id, None)
