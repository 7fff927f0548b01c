"""A prompt's multimodal items as the engine receives them: each one's preprocessed data, content hash and
the run of placeholder tokens its encoder output replaces; and what a model takes of each modality."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

# A prompt given as its input embeddings (vLLM's prompt_embeds): one item over the whole prompt, of
# placeholder tokens PROMPT_EMBEDS_TOKEN_ID, whose data are its embeddings [tokens, hidden size]; no encoder
# runs for it, so it costs no encoder budget.
PROMPT_EMBEDS = "prompt_embeds"
PROMPT_EMBEDS_TOKEN_ID = 0


class MediaInputError(ValueError):
    """An item the engine cannot take: undecodable, of another format, too large or too many."""


class MultiModalFeature(msgspec.Struct, array_like=True, frozen=True):
    """One item of a prompt. `offset` is the index of its first placeholder token, `length` how many there
    are; `identifier` (SHA-256 of the data, its shape and unpadded_length) keys the encoder cache and the
    prefix cache."""

    modality: str
    identifier: bytes
    offset: int
    length: int
    # The preprocessed input, float32 in C order, of this shape (an image: channels, height, width; an audio
    # clip: mel bins, frames).
    data: bytes
    shape: list[int]
    # How much of the data's last axis is the item's own; the encoder masks the rest, which is padding (an
    # audio clip's frames past its end). The whole axis for images.
    unpadded_length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def embeddings_given(self) -> bool:
        """Whether the data are the item's embeddings themselves (prompt embeddings), not an encoder's
        input."""
        return self.modality == PROMPT_EMBEDS

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.float32).reshape(self.shape)


@dataclass(frozen=True)
class ModalitySpec:
    """What a model takes of one modality, from its config.json."""

    placeholder_id: int
    # What is wrong with the shape of an item's preprocessed input, or None when the model takes it.
    shape_error: Callable[[Sequence[int]], str | None]
    # The placeholder tokens (encoder embeddings) of an item, from its shape and unpadded_length.
    num_tokens: Callable[[Sequence[int], int], int]
    # The most placeholder tokens one item can have.
    max_item_tokens: int
    # The (rows, columns) an item's placeholders form on M-RoPE's grid, from its shape, for a model whose
    # positions are three-dimensional and items laid out in two; None: its positions run on as text's do.
    mrope_grid: Callable[[Sequence[int]], tuple[int, int]] | None = None


def fixed_shape(item_shape: tuple[int, ...]) -> Callable[[Sequence[int]], str | None]:
    """ModalitySpec.shape_error for a model that takes items of one shape only."""

    def shape_error(shape: Sequence[int]) -> str | None:
        return None if tuple(shape) == item_shape else f"the model takes {list(item_shape)}"

    return shape_error


@dataclass(frozen=True)
class PreparedItem:
    """An item preprocessed by the front end, before its placeholders are placed."""

    data: np.ndarray
    unpadded_length: int
    num_tokens: int


def content_hash(array: np.ndarray, unpadded_length: int) -> bytes:
    hasher = hashlib.sha256(np.asarray([*array.shape, unpadded_length], dtype=np.int64).tobytes())
    hasher.update(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    return hasher.digest()


def expand_placeholders(
    prompt_token_ids: Sequence[int],
    items: Mapping[str, Sequence[PreparedItem]],
    specs: Mapping[str, ModalitySpec],
) -> tuple[list[int], list[MultiModalFeature]]:
    """The prompt with each placeholder token repeated as many times as its item has embeddings (the items of
    each modality in prompt order), and the items' features in prompt order. Raises ValueError when a
    modality's placeholders and items do not pair up."""
    modality_of = {specs[modality].placeholder_id: modality for modality in items}
    for modality, placeholder_id in ((m, specs[m].placeholder_id) for m in items):
        num_placeholders = sum(1 for token in prompt_token_ids if token == placeholder_id)
        if num_placeholders != len(items[modality]):
            raise ValueError(
                f"the prompt has {num_placeholders} {modality} placeholders for {len(items[modality])} "
                f"{modality} items"
            )
    used = dict.fromkeys(items, 0)
    expanded: list[int] = []
    features: list[MultiModalFeature] = []
    for token in prompt_token_ids:
        modality = modality_of.get(token)
        if modality is None:
            expanded.append(token)
            continue
        item = items[modality][used[modality]]
        used[modality] += 1
        features.append(
            MultiModalFeature(
                modality=modality,
                identifier=content_hash(item.data, item.unpadded_length),
                offset=len(expanded),
                length=item.num_tokens,
                data=np.ascontiguousarray(item.data, dtype=np.float32).tobytes(),
                shape=list(item.data.shape),
                unpadded_length=item.unpadded_length,
            )
        )
        expanded.extend([token] * item.num_tokens)
    return expanded, features


def prompt_embeds_item(embeddings: np.ndarray) -> tuple[list[int], MultiModalFeature]:
    """A prompt given as its embeddings [tokens, hidden size]: its placeholder tokens, and the item over
    them."""
    data = np.ascontiguousarray(embeddings, dtype=np.float32)
    feature = MultiModalFeature(
        modality=PROMPT_EMBEDS,
        identifier=content_hash(data, data.shape[-1]),
        offset=0,
        length=data.shape[0],
        data=data.tobytes(),
        shape=list(data.shape),
        unpadded_length=data.shape[-1],
    )
    return [PROMPT_EMBEDS_TOKEN_ID] * data.shape[0], feature


def check_features(
    prompt_token_ids: Sequence[int],
    features: Sequence[MultiModalFeature],
    specs: Mapping[str, ModalitySpec],
    *,
    max_item_tokens: int,
    prompt_embeds_size: int | None = None,
) -> None:
    """Raises ValueError unless every feature is of a modality the model takes, of its input shape, in
    prompt order, each over a run of exactly its placeholder tokens, and the prompt has no other
    placeholder token. Prompt embeddings are taken where `prompt_embeds_size` (the model's hidden size) is
    given, as the whole prompt."""
    if any(feature.embeddings_given for feature in features):
        _check_prompt_embeds(prompt_token_ids, features, prompt_embeds_size)
        return
    previous_end = 0
    for index, feature in enumerate(features):
        spec = specs.get(feature.modality)
        if spec is None:
            raise ValueError(modality_refusal(feature.modality, specs))
        name = f"{feature.modality} item {index}"
        shape = list(feature.shape)
        problem = spec.shape_error(shape)
        if problem is not None:
            raise ValueError(f"{name} has shape {shape}: {problem}")
        if len(feature.data) != 4 * int(np.prod(shape)):
            raise ValueError(f"{name} has {len(feature.data)} bytes of data for its shape {shape}")
        if not 0 < feature.unpadded_length <= shape[-1]:
            raise ValueError(f"{name} has unpadded length {feature.unpadded_length} of {shape[-1]}")
        expected = spec.num_tokens(shape, feature.unpadded_length)
        if feature.length != expected:
            raise ValueError(f"{name} has {feature.length} placeholders, the model gives {expected}")
        if feature.length > max_item_tokens:
            raise ValueError(
                f"{name} needs {feature.length} encoder tokens, more than a step's encoder budget "
                f"({max_item_tokens}, max_num_encoder_input_tokens)"
            )
        if feature.offset < previous_end or feature.end > len(prompt_token_ids):
            raise ValueError(f"{name} is out of order or past the prompt")
        if any(token != spec.placeholder_id for token in prompt_token_ids[feature.offset : feature.end]):
            raise ValueError(f"{name} does not lie on its placeholder tokens")
        previous_end = feature.end
    for modality, spec in specs.items():
        num_placeholders = sum(1 for token in prompt_token_ids if token == spec.placeholder_id)
        expected = sum(feature.length for feature in features if feature.modality == modality)
        if num_placeholders != expected:
            raise ValueError(f"the prompt has {modality} placeholder tokens without a {modality} item")


def _check_prompt_embeds(
    prompt_token_ids: Sequence[int], features: Sequence[MultiModalFeature], hidden_size: int | None
) -> None:
    if hidden_size is None:
        raise ValueError("prompt embeddings are taken by an engine started with enable_prompt_embeds")
    if len(features) != 1:
        raise ValueError("a prompt given as embeddings is that one item, without images or audio")
    (feature,) = features
    expected = [len(prompt_token_ids), hidden_size]
    if list(feature.shape) != expected or (feature.offset, feature.length) != (0, len(prompt_token_ids)):
        raise ValueError(f"prompt embeddings of shape {list(feature.shape)} for a prompt of shape {expected}")
    if len(feature.data) != 4 * int(np.prod(expected)):
        raise ValueError(f"prompt embeddings of {len(feature.data)} bytes for their shape {expected}")
    if any(token != PROMPT_EMBEDS_TOKEN_ID for token in prompt_token_ids):
        raise ValueError("prompt embeddings do not lie on their placeholder tokens")


def placeholder_token_id(config: Mapping[str, Any], modality: str) -> int:
    """The token id config.json gives a modality's placeholder: `image_token_index`, or `image_token_id` as
    some families name it."""
    token_id = config.get(f"{modality}_token_index", config.get(f"{modality}_token_id"))
    if token_id is None:
        raise ValueError(f"config.json names no {modality}_token_index")
    return int(token_id)


def modality_refusal(modality: str, specs: Mapping[str, ModalitySpec]) -> str:
    """What to tell a request that sends a model items of a modality it does not take."""
    taken = " and ".join(["text", *specs]) if specs else "text only"
    return f"this model takes {taken}, not {modality} input"
