"""vLLM's prompt embeddings: a prompt given as its input embeddings, [tokens, hidden size] (or [1, tokens,
hidden size]). Offline a torch tensor; over the API base64 of what torch.save writes, loaded as weights only,
so that no pickled code runs."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np
import torch

# How much of torch's reason for refusing the bytes is repeated back: it is made of the caller's bytes.
_MAX_REASON_CHARACTERS = 200


def prompt_embeds_array(tensor: Any) -> np.ndarray:
    """The float32 array [tokens, hidden size] of a prompt's embeddings; ValueError for a tensor of another
    shape, sparse, or not of floating point."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt embeddings must be a torch tensor, not {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError("prompt embeddings must be a dense tensor")
    if not tensor.is_floating_point():
        raise ValueError(f"prompt embeddings must be of floating point, not {tensor.dtype}")
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] == 0:
        raise ValueError(f"prompt embeddings must be [tokens, hidden size], not {list(tensor.shape)}")
    array = tensor.detach().to("cpu", torch.float32).numpy()
    if not np.isfinite(array).all():
        raise ValueError("prompt embeddings must be finite")
    return array


def decoded_prompt_embeds(encoded: str) -> np.ndarray:
    """A request's prompt embeddings from their base64 text; ValueError saying what is wrong."""
    try:
        payload = base64.b64decode(encoded, validate=True)
    except binascii.Error as error:
        raise ValueError(f"prompt embeddings must be base64: {error}") from None
    try:
        tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except (MemoryError, torch.OutOfMemoryError):
        raise  # the server's condition, not the request's
    except Exception as error:  # torch has no one error for bytes that are not a saved tensor
        reason = str(error).strip() or type(error).__name__
        raise ValueError(
            f"prompt embeddings could not be read as a saved torch tensor: {reason[:_MAX_REASON_CHARACTERS]}"
        ) from None
    return prompt_embeds_array(tensor)
