"""A prompt's multimodal items as the engine receives them: each one's preprocessed data, content hash and
the run of placeholder tokens its encoder output replaces."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np


class MultiModalFeature(msgspec.Struct, array_like=True, frozen=True):
    """One item of a prompt. `offset` is the index of its first placeholder token, `length` how many there
    are; `identifier` (SHA-256 of the data and its shape) keys the encoder cache and the prefix cache."""

    modality: str
    identifier: bytes
    offset: int
    length: int
    # The preprocessed input, float32 in C order, of this shape (an image: channels, height, width).
    data: bytes
    shape: list[int]

    @property
    def end(self) -> int:
        return self.offset + self.length

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.float32).reshape(self.shape)


def content_hash(array: np.ndarray) -> bytes:
    hasher = hashlib.sha256(np.asarray(array.shape, dtype=np.int64).tobytes())
    hasher.update(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    return hasher.digest()


def expand_placeholders(
    prompt_token_ids: Sequence[int],
    placeholder_id: int,
    tokens_per_item: int,
    items: Sequence[np.ndarray],
    modality: str,
) -> tuple[list[int], list[MultiModalFeature]]:
    """The prompt with each placeholder token repeated tokens_per_item times, and its items' features in
    prompt order. Raises ValueError when the prompt's placeholders and the items do not pair up."""
    num_placeholders = sum(1 for token in prompt_token_ids if token == placeholder_id)
    if num_placeholders != len(items):
        raise ValueError(
            f"the prompt has {num_placeholders} {modality} placeholders for {len(items)} {modality}s"
        )
    expanded: list[int] = []
    features: list[MultiModalFeature] = []
    for token in prompt_token_ids:
        if token == placeholder_id:
            array = items[len(features)]
            features.append(
                MultiModalFeature(
                    modality=modality,
                    identifier=content_hash(array),
                    offset=len(expanded),
                    length=tokens_per_item,
                    data=np.ascontiguousarray(array, dtype=np.float32).tobytes(),
                    shape=list(array.shape),
                )
            )
            expanded.extend([placeholder_id] * tokens_per_item)
        else:
            expanded.append(token)
    return expanded, features


def check_features(
    prompt_token_ids: Sequence[int],
    features: Sequence[MultiModalFeature],
    *,
    placeholder_id: int,
    tokens_per_item: int,
    item_shape: Sequence[int],
    max_item_tokens: int,
) -> None:
    """Raises ValueError unless the features are images of the model's input shape, in prompt order, each
    over a run of exactly its placeholder tokens, and the prompt has no other placeholder token."""
    previous_end = 0
    for index, feature in enumerate(features):
        if feature.modality != "image":
            raise ValueError(f"item {index} is {feature.modality!r}; this model takes images")
        if list(feature.shape) != list(item_shape) or len(feature.data) != 4 * int(np.prod(item_shape)):
            raise ValueError(f"image {index} has shape {feature.shape}, the model takes {list(item_shape)}")
        if feature.length != tokens_per_item:
            raise ValueError(
                f"image {index} has {feature.length} placeholders, the model gives {tokens_per_item}"
            )
        if feature.length > max_item_tokens:
            raise ValueError(
                f"image {index} needs {feature.length} encoder tokens, more than a step's encoder budget "
                f"({max_item_tokens}, max_num_encoder_input_tokens)"
            )
        if feature.offset < previous_end or feature.end > len(prompt_token_ids):
            raise ValueError(f"image {index} is out of order or past the prompt")
        if any(token != placeholder_id for token in prompt_token_ids[feature.offset : feature.end]):
            raise ValueError(f"image {index} does not lie on its placeholder tokens")
        previous_end = feature.end
    num_placeholders = sum(1 for token in prompt_token_ids if token == placeholder_id)
    if num_placeholders != tokens_per_item * len(features):
        raise ValueError("the prompt has image placeholder tokens without an image")
