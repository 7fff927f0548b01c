"""M-RoPE positions (Qwen2-VL's family, Qwen2.5-Omni's thinker): three per token, time, row and column.

A text token's three are equal and one more than the largest position before it. An item laid out on a grid
(an image) starts where the next text token would, and each of its embeddings adds its row and column to
that start (its time stays at the start); the token after it continues from the largest position it reached,
plus one. Other items (audio clips) run on like text. Positions past the prompt are therefore the token's
index plus a per-request delta (the prompt's largest position + 1 - its length, zero or negative)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from kvfleet.runtime.multimodal.inputs import ModalitySpec, MultiModalFeature


class MRopePositions:
    """A request's positions: its prompt's computed once when the prompt is known, every later token's from
    its index and the delta."""

    def __init__(self, prompt: np.ndarray, delta: int) -> None:
        self.prompt = prompt  # [3, prompt tokens], int64
        self.delta = delta

    @classmethod
    def of(
        cls,
        num_prompt_tokens: int,
        features: Sequence[MultiModalFeature],
        specs: Mapping[str, ModalitySpec],
    ) -> MRopePositions:
        prompt = np.empty((3, num_prompt_tokens), dtype=np.int64)
        next_position = 0
        cursor = 0  # the first prompt token not yet placed
        for feature in features:
            spec = specs.get(feature.modality)  # none for prompt embeddings
            grid = None if spec is None else spec.mrope_grid
            if grid is None:
                continue  # its placeholders run on as text
            start = next_position + feature.offset - cursor
            prompt[:, cursor : feature.offset] = np.arange(next_position, start)
            rows, cols = grid(feature.shape)
            prompt[0, feature.offset : feature.end] = start
            prompt[1, feature.offset : feature.end] = start + np.repeat(np.arange(rows), cols)
            prompt[2, feature.offset : feature.end] = start + np.tile(np.arange(cols), rows)
            next_position = start + max(rows, cols)
            cursor = feature.end
        prompt[:, cursor:] = np.arange(next_position, next_position + num_prompt_tokens - cursor)
        return cls(prompt, next_position + num_prompt_tokens - cursor - num_prompt_tokens)

    def rows(self, start: int, end: int) -> np.ndarray:
        """The positions [3, end - start] of the request's tokens start to end (past the prompt too)."""
        num_prompt_tokens = self.prompt.shape[1]
        if end <= num_prompt_tokens:
            return self.prompt[:, start:end]
        later = np.arange(max(start, num_prompt_tokens), end) + self.delta
        if start >= num_prompt_tokens:
            return np.broadcast_to(later, (3, end - start))
        return np.concatenate([self.prompt[:, start:], np.broadcast_to(later, (3, len(later)))], axis=1)
