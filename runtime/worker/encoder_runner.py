"""The encoder side of a multimodal step: which placeholder tokens of the step an item covers, its encoder
output (run batched, once per item, kept in a cache keyed by the item's content hash), and the step's input
embeddings with those outputs in place of the placeholders' token embeddings. Prompt embeddings are an item
whose output is its data: no encoder runs, nothing is cached."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.worker.step_inputs import StepInputs
from torch import nn

# Encoder outputs kept, in embeddings (placeholder tokens), least recently used dropped first: enough for a
# prompt's items to survive while it prefills in chunks, and for the same item in requests close in time.
ENCODER_CACHE_TOKENS = 16384


@dataclass(frozen=True)
class _Span:
    feature: MultiModalFeature
    row: int  # the step's input row of the first placeholder this step feeds
    start: int  # which of the item's embeddings the step feeds: [start, end)
    end: int


class EncoderRunner:
    def __init__(
        self, model: nn.Module, device: torch.device, cache_tokens: int = ENCODER_CACHE_TOKENS
    ) -> None:
        self.model = model
        self.device = device
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._cached_tokens = 0
        # Cumulative: items encoded, and item lookups the cache answered (a later chunk of an image's
        # placeholders counts as one).
        self.num_encoder_runs = 0
        self.num_cache_hits = 0

    def input_embeddings(
        self, input_ids: torch.Tensor, step: StepInputs, query_start_loc: list[int]
    ) -> torch.Tensor | None:
        """The step's input embeddings, or None when no scheduled token is a placeholder."""
        spans = []
        for i, features in enumerate(step.mm_features):
            if not features:
                continue
            first = step.num_computed_tokens[i]
            end = first + len(step.token_ids[i])
            for feature in features:
                if feature.offset < end and feature.end > first:
                    lo, hi = max(first, feature.offset), min(end, feature.end)
                    spans.append(
                        _Span(
                            feature, query_start_loc[i] + lo - first, lo - feature.offset, hi - feature.offset
                        )
                    )
        if not spans:
            return None
        outputs = self._encode({span.feature.identifier: span.feature for span in spans})
        embeddings = self.model.embed_input_ids(input_ids)
        for span in spans:
            rows = span.end - span.start
            embeddings[span.row : span.row + rows] = outputs[span.feature.identifier][span.start : span.end]
        return embeddings

    def _encode(self, features: dict[bytes, MultiModalFeature]) -> dict[bytes, torch.Tensor]:
        outputs: dict[bytes, torch.Tensor] = {}
        missing: dict[tuple[str, tuple[int, ...]], list[MultiModalFeature]] = {}
        for identifier, feature in features.items():
            if feature.embeddings_given:
                outputs[identifier] = torch.from_numpy(feature.array().copy()).to(self.device)
                continue
            cached = self._cache.get(identifier)
            if cached is None:
                missing.setdefault((feature.modality, tuple(feature.shape)), []).append(feature)
            else:
                self._cache.move_to_end(identifier)
                outputs[identifier] = cached
                self.num_cache_hits += 1
        for (modality, _), batch in missing.items():  # one encoder run per modality and input shape
            # Copies: the arrays are views of the messages' read-only bytes.
            data = torch.stack([torch.tensor(feature.array()) for feature in batch]).to(self.device)
            unpadded_lengths = torch.tensor(
                [feature.unpadded_length for feature in batch], device=self.device
            )
            encoded = self.model.embed_multimodal(modality, data, unpadded_lengths)
            for feature, output in zip(batch, encoded, strict=True):
                if output.shape[0] != feature.length:
                    raise ValueError(
                        f"the encoder gave {output.shape[0]} embeddings for an item of {feature.length} "
                        "placeholder tokens"
                    )
                outputs[feature.identifier] = output
                self._remember(feature.identifier, output)
            self.num_encoder_runs += len(batch)
        return outputs

    def _remember(self, identifier: bytes, output: torch.Tensor) -> None:
        self._cache[identifier] = output
        self._cached_tokens += output.shape[0]
        while self._cached_tokens > self.cache_tokens and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cached_tokens -= dropped.shape[0]
