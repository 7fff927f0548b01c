"""kvfleet's Triton attention backend: one paged attention kernel for mixed prefill/decode steps, with
split-KV for long-context decode, plus a Triton KV cache write."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from kvfleet.runtime.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from kvfleet.runtime.kernels.kv_cache_write import write_kv_cache
from kvfleet.runtime.kernels.paged_attention import (
    MAX_HEAD_DIM,
    AttentionTiling,
    build_tile_map,
    choose_num_splits,
    default_tiling,
    paged_attention,
)
from kvfleet.runtime.kernels.triton_utils import is_interpreting, torch_dtype_is_supported

# bfloat16 tensor-core products and cp.async pipelining both need Ampere or newer.
MIN_CUDA_CAPABILITY = (8, 0)


@dataclass
class TritonAttentionPlan:
    metadata: AttentionMetadata
    tiling: AttentionTiling
    tile_map: torch.Tensor


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        reason = self.unsupported_reason(spec)
        if reason is not None:
            raise ValueError(f"the triton attention backend cannot run this model: {reason}")
        self.queries_per_kv = spec.num_heads // spec.num_kv_heads
        on_cuda = spec.device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(spec.device).multi_processor_count if on_cuda else 0

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        if spec.device.type == "cuda":
            capability = torch.cuda.get_device_capability(spec.device)
            if capability < MIN_CUDA_CAPABILITY:
                major, minor = capability
                return f"needs CUDA compute capability 8.0 or newer, this device has {major}.{minor}"
        elif not is_interpreting():
            return (
                f"runs on CUDA devices only, not {spec.device.type} (the CPU only through TRITON_INTERPRET=1)"
            )
        if not torch_dtype_is_supported(spec.dtype):
            return f"supports float16, bfloat16 and float32, not {spec.dtype}"
        if spec.head_dim % 16 or spec.head_dim > MAX_HEAD_DIM:
            return f"needs a head size that is a multiple of 16 up to {MAX_HEAD_DIM}, not {spec.head_dim}"
        if spec.num_heads % spec.num_kv_heads:
            return (
                f"needs num_heads ({spec.num_heads}) to be a multiple of num_kv_heads ({spec.num_kv_heads})"
            )
        if spec.num_heads // spec.num_kv_heads > 128:
            return "supports at most 128 query heads per KV head"
        return None

    def prepare(self, metadata: AttentionMetadata) -> TritonAttentionPlan:
        spec = self.spec
        tiling = default_tiling(
            queries_per_kv=self.queries_per_kv,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            max_query_len=metadata.max_query_len,
        )
        tile_map = build_tile_map(
            metadata.query_start_loc_cpu, tiling.block_q(self.queries_per_kv), spec.device
        )
        # Split-KV only for pure decode steps: prefill tiles already give the device enough programs.
        if metadata.max_query_len == 1 and self.num_sms:
            num_programs = tile_map.shape[0] * spec.num_kv_heads
            splits = choose_num_splits(num_programs, metadata.max_seq_len, tiling.block_n, self.num_sms)
            tiling = dataclasses.replace(tiling, num_splits=splits)
        return TritonAttentionPlan(metadata, tiling, tile_map)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: TritonAttentionPlan,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        metadata = plan.metadata
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return paged_attention(
            query,
            kv_cache,
            block_tables=metadata.block_tables,
            seq_lens=metadata.seq_lens,
            query_start_loc=metadata.query_start_loc,
            tile_map=plan.tile_map,
            tiling=plan.tiling,
            scale=self.spec.scale,
            sliding_window=sliding_window,
        )
