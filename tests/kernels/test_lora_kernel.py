"""The batched LoRA kernels (interpreted) against the dense torch path of the LoRA layer and against a float64
computation from each adapter's own unpadded matrices: several adapters of different ranks in one batch,
base-model tokens untouched, fused q/k/v and gate/up slices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvfleet.runtime.kernels.lora import add_lora_, choose_split_k, plan_lora_tokens
from kvfleet.runtime.lora.layers import LoRABatch, LoRALinear
from kvfleet.runtime.models.layers import Linear

IN_FEATURES = 96
MAX_RANK = 16
# Out features of each slice: a q/k/v-like projection (k and v narrower than q), gate/up-like, and one slice.
SLICES = {"qkv": [128, 32, 32], "gate_up": [80, 80], "single": [96]}
# Each slot's adapter rank: all below or at the maximum, padded to it in the layer's slots.
RANKS = [4, 16, 8]


def _layers(slice_sizes: list[int], dtype: torch.dtype, seed: int) -> tuple[LoRALinear, LoRALinear, list]:
    """A dense and a Triton layer over the same base projection, with the same random adapters in their slots;
    also each slot's unpadded (A per slice, B per slice) in float64."""
    generator = torch.Generator().manual_seed(seed)
    base = Linear(IN_FEATURES, sum(slice_sizes), bias=False).to(dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=generator) / IN_FEATURES**0.5)
    batch = LoRABatch()
    options = {"max_loras": len(RANKS), "max_rank": MAX_RANK, "dtype": dtype, "device": torch.device("cpu")}
    dense = LoRALinear(base, slice_sizes, batch, use_triton=False, **options)
    triton = LoRALinear(base, slice_sizes, batch, use_triton=True, **options)
    adapters = []
    for slot, rank in enumerate(RANKS):
        a_parts = [torch.randn(rank, IN_FEATURES, generator=generator) / 4 for _ in slice_sizes]
        b_parts = [torch.randn(size, rank, generator=generator) / 4 for size in slice_sizes]
        padded_a = torch.zeros(len(slice_sizes) * MAX_RANK, IN_FEATURES)
        padded_b = torch.zeros(sum(slice_sizes), MAX_RANK)
        row = 0
        for index, (a, b) in enumerate(zip(a_parts, b_parts, strict=True)):
            padded_a[index * MAX_RANK : index * MAX_RANK + rank] = a
            padded_b[row : row + b.shape[0], :rank] = b
            row += b.shape[0]
        for layer in (dense, triton):
            layer.set_slot(slot, padded_a.to(dtype), padded_b.to(dtype))
        # The oracle sees what the layers hold: the weights rounded to the layers' dtype.
        adapters.append(
            (
                [a.to(dtype).double() for a in a_parts],
                [b.to(dtype).double() for b in b_parts],
            )
        )
    return dense, triton, adapters


def _expected(
    base_out: torch.Tensor, x: torch.Tensor, token_slots: np.ndarray, adapters: list
) -> torch.Tensor:
    expected = base_out.double().clone()
    for token, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        a_parts, b_parts = adapters[slot]
        row = 0
        for a, b in zip(a_parts, b_parts, strict=True):
            expected[token, row : row + b.shape[0]] += b @ (a @ x[token].double())
            row += b.shape[0]
    return expected


def _prepare(batch: LoRABatch, token_slots: np.ndarray) -> None:
    """The step's layout for both paths (the manager builds only the one its layers use)."""
    slots = torch.from_numpy(token_slots)[:, None]
    slot_of_column = torch.arange(len(RANKS) * MAX_RANK) // MAX_RANK
    batch.other_columns = slot_of_column != slots
    batch.plan = plan_lora_tokens(token_slots, torch.device("cpu"))


@pytest.mark.parametrize("shape", list(SLICES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_dense_path_and_each_adapter_alone(assert_close, shape, dtype) -> None:
    slice_sizes = SLICES[shape]
    dense, triton, adapters = _layers(slice_sizes, dtype, seed=len(slice_sizes))
    rng = np.random.default_rng(7)
    # A prefill-sized run of one adapter (more tokens than a tile holds), then decodes of every slot mixed
    # with base-model tokens in no order.
    token_slots = np.concatenate([np.full(70, 1), rng.integers(-1, len(RANKS), size=21)])
    x = torch.randn(len(token_slots), IN_FEATURES, generator=torch.Generator().manual_seed(3)).to(dtype)
    _prepare(dense.batch, token_slots)
    base_out = dense.base(x)

    kernel_out = triton(x)
    dense_out = dense(x)

    is_base = torch.from_numpy(token_slots < 0)
    assert torch.equal(kernel_out[is_base], base_out[is_base]), "base-model tokens must be left as they were"
    assert not torch.equal(kernel_out[~is_base], base_out[~is_base])
    assert_close(kernel_out, _expected(base_out, x, token_slots, adapters))
    assert_close(kernel_out, dense_out.double())


@pytest.mark.parametrize("split_k", [1, 3])
def test_split_input_ranges_add_up_to_the_whole(assert_close, split_k) -> None:
    """Decode-like steps cut the shrink's input dimension across programs; the parts sum to the whole."""
    slice_sizes = SLICES["qkv"]
    _, triton, adapters = _layers(slice_sizes, torch.float32, seed=11)
    token_slots = np.array([2, -1, 0, 0, 1, -1, 2])
    x = torch.randn(len(token_slots), IN_FEATURES, generator=torch.Generator().manual_seed(5))
    plan = plan_lora_tokens(token_slots, torch.device("cpu"))
    assert plan is not None
    base_out = triton.base(x)
    output = base_out.clone()
    add_lora_(
        output,
        x,
        triton.lora_a,
        triton.lora_b,
        plan,
        slice_sizes,
        triton.slice_starts,
        rank=MAX_RANK,
        split_k=split_k,
    )
    assert_close(output, _expected(base_out, x, token_slots, adapters))


def test_plan_groups_tokens_by_slot_in_tiles() -> None:
    token_slots = np.array([1, -1, 0] + [1] * 20 + [-1, 0])
    plan = plan_lora_tokens(token_slots, torch.device("cpu"))
    assert plan is not None and plan.block_m == 64  # 21 tokens of slot 1: more than a small tile
    sorted_tokens = plan.sorted_tokens.tolist()
    assert sorted_tokens == [2, 24, 0, *range(3, 23)]
    assert plan.tile_map.tolist() == [[0, 0, 2], [1, 2, 21]]
    decode = plan_lora_tokens(np.array([2, 2, -1, 0, 2]), torch.device("cpu"))
    assert decode is not None and decode.block_m == 16
    assert decode.tile_map.tolist() == [[0, 0, 1], [2, 1, 3]]
    many = plan_lora_tokens(np.full(150, 3), torch.device("cpu"))
    assert many is not None and many.tile_map.tolist() == [[3, 0, 64], [3, 64, 64], [3, 128, 22]]
    assert plan_lora_tokens(np.full(5, -1), torch.device("cpu")) is None


def test_split_k_fills_the_device_only_when_tiles_are_few() -> None:
    assert choose_split_k(num_programs=12, in_features=4096, num_sms=132) == 8
    assert choose_split_k(num_programs=12, in_features=1024, num_sms=132) == 2
    assert choose_split_k(num_programs=400, in_features=4096, num_sms=132) == 1
    assert choose_split_k(num_programs=3, in_features=4096, num_sms=0) == 1


def test_bad_shapes_are_refused() -> None:
    _, triton, _ = _layers(SLICES["gate_up"], torch.float32, seed=1)
    plan = plan_lora_tokens(np.array([0, 1]), torch.device("cpu"))
    assert plan is not None
    x = torch.randn(2, IN_FEATURES)
    with pytest.raises(ValueError, match="output"):
        add_lora_(
            torch.zeros(2, 100), x, triton.lora_a, triton.lora_b, plan, [80, 80], triton.slice_starts, rank=16
        )
    with pytest.raises(ValueError, match="rank-16 slots"):
        add_lora_(
            torch.zeros(2, 160),
            x,
            triton.lora_a[:16],
            triton.lora_b,
            plan,
            [80, 80],
            triton.slice_starts,
            rank=16,
        )
    with pytest.raises(ValueError, match="one dtype"):
        add_lora_(
            torch.zeros(2, 160),
            x.double(),
            triton.lora_a,
            triton.lora_b,
            plan,
            [80, 80],
            triton.slice_starts,
            rank=16,
        )
