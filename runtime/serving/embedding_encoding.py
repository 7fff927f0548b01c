"""How an embeddings answer carries its vectors: OpenAI's floats or base64, or vLLM's raw bytes.

base64 and bytes hold each vector's values as the request's `embed_dtype` (float32 by default, what the openai
client decodes) in its `endianness` ("native": this server's, little on the machines it runs on). A bytes
answer is the vectors back to back, with each one's offsets and shape in a JSON `metadata` header (none for
`bytes_only`), as vLLM sends them: a client reads a large batch without parsing a number."""

from __future__ import annotations

import base64
import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from kvfleet.runtime.serving.narrow_floats import E4M3FN, E5M2, bfloat16_bits, float8_bits
from kvfleet.runtime.serving.protocol import EmbedDType, Endianness

# numpy's own; bfloat16 and fp8 it lacks (narrow_floats rounds to them).
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


@dataclass(frozen=True)
class EmbeddingBytes:
    """An embeddings answer as bytes: the vectors back to back, and what the `metadata` header says of them
    (None for `bytes_only`)."""

    content: bytes
    metadata: dict[str, Any] | None


def vector_bytes(vector: list[float], embed_dtype: EmbedDType, endianness: Endianness) -> bytes:
    """The vector's values as `embed_dtype`, in `endianness`, back to back."""
    if embed_dtype in _NUMPY_DTYPES:
        values = np.asarray(vector, dtype=np.float32).astype(_NUMPY_DTYPES[embed_dtype])
        bits = values.view(f"u{values.itemsize}")
    else:
        bits = _narrow_bits(vector, embed_dtype)
    if endianness not in ("native", sys.byteorder):
        bits = bits.byteswap()
    return bits.tobytes()


def _narrow_bits(vector: list[float], embed_dtype: EmbedDType) -> np.ndarray:
    """The bits of the vector's values as bfloat16 or fp8, as integers of their width."""
    values = np.asarray(vector, dtype=np.float32)
    if embed_dtype == "bfloat16":
        return bfloat16_bits(values)
    return float8_bits(values, E4M3FN if embed_dtype == "fp8_e4m3" else E5M2)


def encoded(
    vector: list[float],
    encoding_format: Literal["float", "base64"],
    embed_dtype: EmbedDType,
    endianness: Endianness,
) -> list[float] | str:
    """The vector as an item's `embedding`: its floats, or the base64 of its bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(vector_bytes(vector, embed_dtype, endianness)).decode("ascii")


def embedding_bytes(
    vectors: list[list[float]],
    embed_dtype: EmbedDType,
    endianness: Endianness,
    answer: dict[str, Any] | None,
) -> EmbeddingBytes:
    """The vectors as one body; `answer` (the JSON answer's fields but its data), where the metadata header
    goes, gets each vector's place in it."""
    parts = [vector_bytes(vector, embed_dtype, endianness) for vector in vectors]
    if answer is None:
        return EmbeddingBytes(b"".join(parts), None)
    data, start = [], 0
    for index, (vector, part) in enumerate(zip(vectors, parts, strict=True)):
        end = start + len(part)
        place = {"start": start, "end": end, "shape": [len(vector)]}
        data.append({"index": index, "embed_dtype": embed_dtype, "endianness": endianness, **place})
        start = end
    return EmbeddingBytes(b"".join(parts), {**answer, "data": data})
