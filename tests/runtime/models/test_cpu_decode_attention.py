"""The CPU decode attention kernel inside the SDPA backend, against the reference backend and against the
backend's own gather-and-SDPA path, on decode steps over random paged caches (blocks shuffled across the
pool, garbage in every block no request owns)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kvfleet.runtime.attention.backend import AttentionMetadata, AttentionSpec
from kvfleet.runtime.attention.reference import ReferenceAttentionBackend
from kvfleet.runtime.attention.sdpa import SdpaAttentionBackend

BLOCK_SIZE = 16
NUM_HEADS = 8
# Contexts of one token, on both sides of tile (8 or 16 positions) and block boundaries, and of several
# hundred tokens.
CONTEXTS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 255, 256, 257, 380, 517]


def _decode_step(
    spec: AttentionSpec, seq_lens: list[int], seed: int
) -> tuple[AttentionMetadata, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A step of one decode per context length: its metadata, a random cache and the new query, key, value."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-seq_len // BLOCK_SIZE) for seq_len in seq_lens]
    free = list(range(sum(blocks) + 16))
    random.Random(seed).shuffle(free)
    tables = torch.zeros(len(seq_lens), max(blocks) + 3, dtype=torch.int32)  # padding past every table's end
    slots = []
    for i, (seq_len, num_blocks) in enumerate(zip(seq_lens, blocks, strict=True)):
        tables[i, :num_blocks] = torch.tensor([free.pop() for _ in range(num_blocks)], dtype=torch.int32)
        slots.append(int(tables[i, (seq_len - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (seq_len - 1) % BLOCK_SIZE)
    num = len(seq_lens)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(num + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(num + 1)),
        seq_lens_cpu=seq_lens,
    )
    shape = (2, sum(blocks) + 16, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    cache = torch.randn(shape, generator=gen).to(spec.dtype)
    new = [
        torch.randn(num, heads, spec.head_dim, generator=gen).to(spec.dtype)
        for heads in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
    ]
    return metadata, cache, (new[0], new[1], new[2])


def _attend(
    backend: ReferenceAttentionBackend | SdpaAttentionBackend,
    metadata: AttentionMetadata,
    cache: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    window: int | None = None,
) -> torch.Tensor:
    return backend.forward(*qkv, cache.clone(), backend.prepare(metadata), sliding_window=window)


def _kernel_backend(spec: AttentionSpec) -> SdpaAttentionBackend:
    backend = SdpaAttentionBackend(spec)
    assert backend.decode_kernel is not None, "the CPU decode kernel did not build (its warning says why)"
    return backend


def _gather_backend(spec: AttentionSpec) -> SdpaAttentionBackend:
    backend = SdpaAttentionBackend(spec)
    backend.decode_kernel = None
    return backend


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("head_dim", [64, 80, 128])  # 80: no path of its own, the general loop
@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])  # grouped-query ratios 1, 2, 4, 8
def test_kernel_matches_the_reference_and_the_gather_path(
    num_kv_heads: int, head_dim: int, window: int | None
) -> None:
    spec = AttentionSpec(NUM_HEADS, num_kv_heads, head_dim, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    rng = random.Random(num_kv_heads * head_dim)
    seq_lens = CONTEXTS + [rng.randint(1, 400) for _ in range(20)]
    metadata, cache, qkv = _decode_step(spec, seq_lens, seed=num_kv_heads + head_dim)
    backend = _kernel_backend(spec)
    plan = backend.prepare(metadata)
    assert plan.kernel_decodes is not None and not plan.decode_groups
    output = _attend(backend, metadata, cache, qkv, window)
    reference = _attend(ReferenceAttentionBackend(spec), metadata, cache, qkv, window)
    torch.testing.assert_close(output, reference, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(output, _attend(_gather_backend(spec), metadata, cache, qkv, window))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches_accumulate_in_float32(dtype: torch.dtype) -> None:
    spec = AttentionSpec(NUM_HEADS, 2, 64, BLOCK_SIZE, dtype, torch.device("cpu"))
    metadata, cache, qkv = _decode_step(spec, CONTEXTS, seed=5)
    output = _attend(_kernel_backend(spec), metadata, cache, qkv)
    assert output.dtype == dtype
    # The reference computes in float32 from the same half-precision inputs: only the output rounding differs.
    reference = _attend(ReferenceAttentionBackend(spec), metadata, cache, qkv)
    torch.testing.assert_close(output.float(), reference.float(), atol=1e-2, rtol=1e-2)


def test_head_sizes_without_a_specialised_kernel() -> None:
    spec = AttentionSpec(NUM_HEADS, 4, 80, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    metadata, cache, qkv = _decode_step(spec, CONTEXTS, seed=9)
    reference = _attend(ReferenceAttentionBackend(spec), metadata, cache, qkv, 33)
    torch.testing.assert_close(_attend(_kernel_backend(spec), metadata, cache, qkv, 33), reference)
    # Head sizes that are no multiple of 16 keep the gather path.
    spec = AttentionSpec(NUM_HEADS, 4, 72, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    assert SdpaAttentionBackend(spec).decode_kernel is None


def test_blocks_before_the_window_are_never_read() -> None:
    spec = AttentionSpec(NUM_HEADS, 2, 64, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    metadata, cache, qkv = _decode_step(spec, [300, 47, 20], seed=3)
    reference = _attend(ReferenceAttentionBackend(spec), metadata, cache, qkv, 32)
    # Blocks wholly before a decode's window may have been freed and hold anything.
    for request, seq_len in enumerate(metadata.seq_lens_cpu):
        for block in metadata.block_tables[request, : max(0, seq_len - 32) // BLOCK_SIZE]:
            cache[:, block] = float("nan")
    torch.testing.assert_close(_attend(_kernel_backend(spec), metadata, cache, qkv, 32), reference)


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    spec = AttentionSpec(NUM_HEADS, 2, 64, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    metadata, cache, qkv = _decode_step(spec, CONTEXTS * 3, seed=11)
    backend = _kernel_backend(spec)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 3):
            torch.set_num_threads(count)
            outputs.append(_attend(backend, metadata, cache, qkv))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])


def test_a_host_that_cannot_build_the_kernel_falls_back_to_the_gather_path(tmp_path: Path) -> None:
    # No compiler, and a build cache of its own: the backend warns once and decodes as before.
    script = textwrap.dedent(
        """
        import logging, torch
        from kvfleet.runtime.attention.backend import AttentionSpec
        from kvfleet.runtime.attention.sdpa import SdpaAttentionBackend
        logging.basicConfig(level=logging.WARNING)
        spec = AttentionSpec(8, 2, 64, 16, torch.float32, torch.device("cpu"))
        backends = [SdpaAttentionBackend(spec) for _ in range(2)]
        print([backend.decode_kernel for backend in backends])
        """
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[None, None]"
    assert result.stderr.count("the CPU decode attention kernel could not be built") == 1
