"""The KV cache write kernel: every token lands in its slot, nothing else is touched."""

from __future__ import annotations

import pytest
import torch
from kvfleet.runtime.kernels import torch_reference
from kvfleet.runtime.kernels.kv_cache_write import write_kv_cache


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "dtype"),
    [
        (2, 64, 16, torch.float32),
        (1, 128, 8, torch.bfloat16),
        (8, 64, 32, torch.float16),
        (3, 96, 4, torch.float32),
    ],
)
def test_scatter_matches_reference_and_leaves_other_slots_alone(
    num_kv_heads, head_dim, block_size, dtype
) -> None:
    generator = torch.Generator().manual_seed(num_kv_heads * head_dim + block_size)
    num_blocks, num_tokens, num_heads = 6, 13, 2 * num_kv_heads
    # Key and value as the model produces them: views into one fused QKV projection output.
    qkv = torch.randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), generator=generator).to(dtype)
    _, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[2, 9]] = -1  # padding tokens
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    expected = kv_cache.clone()

    write_kv_cache(key, value, kv_cache, slots)
    torch_reference.write_kv_cache(key, value, expected, slots)

    assert torch.equal(kv_cache.isnan(), expected.isnan())
    assert torch.equal(kv_cache.nan_to_num(), expected.nan_to_num())
    untouched = kv_cache.isnan().all(dim=-1).all(dim=-1).sum().item()
    assert untouched == 2 * (num_blocks * block_size - (num_tokens - 2))


def test_shape_and_dtype_errors() -> None:
    key = torch.randn(4, 2, 64)
    kv_cache = torch.zeros(2, 3, 16, 2, 64)
    with pytest.raises(ValueError, match="same shape"):
        write_kv_cache(key, torch.randn(4, 2, 32), kv_cache, torch.arange(4))
    with pytest.raises(ValueError, match="must be"):
        write_kv_cache(key, key, torch.zeros(2, 3, 16, 4, 64), torch.arange(4))
    with pytest.raises(ValueError, match="one slot per token"):
        write_kv_cache(key, key, kv_cache, torch.arange(3))
    with pytest.raises(ValueError, match="dtype"):
        write_kv_cache(key.half(), key.half(), kv_cache, torch.arange(4))
