"""The Triton attention backend through the AttentionBackend contract, interpreted on the CPU."""

from __future__ import annotations

import pytest
import torch
from kvfleet.runtime.attention.backend import AttentionSpec
from kvfleet.runtime.attention.sdpa import SdpaAttentionBackend
from kvfleet.runtime.attention.triton_backend import TritonAttentionBackend


def spec_for(batch, block_size: int, **changes) -> AttentionSpec:
    fields = {
        "num_heads": batch.query.shape[1],
        "num_kv_heads": batch.kv_cache.shape[3],
        "head_dim": batch.query.shape[2],
        "block_size": block_size,
        "dtype": batch.query.dtype,
        "device": torch.device("cpu"),
    }
    return AttentionSpec(**(fields | changes))


@pytest.mark.parametrize(
    ("requests", "block_size", "dtype"),
    [
        ([(0, 20), (0, 7)], 16, torch.float32),  # first chunks of two prompts
        ([(20, 13), (7, 1), (40, 1)], 8, torch.float32),  # a later chunk beside decodes
        ([(33, 1), (8, 1), (41, 1)], 16, torch.bfloat16),  # decodes only
    ],
)
def test_forward_writes_the_new_tokens_and_attends_like_the_reference(
    make_paged_batch, assert_close, requests, block_size, dtype
) -> None:
    batch = make_paged_batch(
        requests, num_kv_heads=2, queries_per_kv=4, head_dim=64, block_size=block_size, dtype=dtype, seed=11
    )
    backend = TritonAttentionBackend(spec_for(batch, block_size))
    expected_cache = batch.kv_cache.clone()
    plan = backend.prepare(batch.metadata)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, plan)

    batch_written = batch.kv_cache
    batch.kv_cache = expected_cache
    batch.write_new_tokens()
    assert torch.equal(batch_written.nan_to_num(), expected_cache.nan_to_num())
    assert_close(out, batch.reference_attention(64**-0.5))


def test_agrees_with_the_sdpa_backend(make_paged_batch) -> None:
    batch = make_paged_batch(
        [(24, 9), (5, 1), (0, 12), (60, 1)],
        num_kv_heads=1,
        queries_per_kv=8,
        head_dim=128,
        block_size=16,
        dtype=torch.float32,
        seed=4,
    )
    # SDPA reads masked slots through its additive mask, so the cache may hold garbage but not NaN.
    batch.kv_cache = batch.kv_cache.nan_to_num(nan=0.0)
    spec = spec_for(batch, 16)
    outputs = []
    for backend in (TritonAttentionBackend(spec), SdpaAttentionBackend(spec)):
        kv_cache = batch.kv_cache.clone()
        plan = backend.prepare(batch.metadata)
        outputs.append(backend.forward(batch.query, batch.key, batch.value, kv_cache, plan))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_long_decode_steps_on_a_large_device_are_split(make_paged_batch, assert_close) -> None:
    batch = make_paged_batch(
        [(300, 1), (200, 1)],
        num_kv_heads=1,
        queries_per_kv=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    backend = TritonAttentionBackend(spec_for(batch, 16))
    backend.num_sms = 132  # as on an H100/H200: two programs cannot fill it
    plan = backend.prepare(batch.metadata)
    assert plan.tiling.num_splits > 1
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, plan)
    batch.write_new_tokens()
    assert_close(out, batch.reference_attention(64**-0.5))


def test_unsupported_models_are_refused_with_a_reason(monkeypatch) -> None:
    cpu = torch.device("cpu")
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=cpu
    )
    assert TritonAttentionBackend.unsupported_reason(spec) is None
    wrong_head = AttentionSpec(8, 2, 72, 16, torch.float32, cpu)
    assert "head size" in TritonAttentionBackend.unsupported_reason(wrong_head)
    assert "float64" in TritonAttentionBackend.unsupported_reason(
        AttentionSpec(8, 2, 64, 16, torch.float64, cpu)
    )
    assert "multiple" in TritonAttentionBackend.unsupported_reason(
        AttentionSpec(6, 4, 64, 16, torch.float32, cpu)
    )
    with pytest.raises(ValueError, match="head size"):
        TritonAttentionBackend(wrong_head)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "CUDA" in TritonAttentionBackend.unsupported_reason(spec)
