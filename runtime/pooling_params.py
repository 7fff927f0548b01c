"""How one prompt's embedding is made from its pooled hidden states: vLLM's PoolingParams, for LLM.embed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    # The size a Matryoshka model's embedding is cut to; None: the pooler config's (the whole vector unless it
    # sets dimensions).
    dimensions: int | None = None
    # L2-normalized (vLLM's activation for embeddings); None: as the pooler config says.
    use_activation: bool | None = None
