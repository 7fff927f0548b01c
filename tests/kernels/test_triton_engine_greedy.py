"""End to end: the engine on the Triton backend (interpreted) produces the torch backend's greedy tokens."""

from __future__ import annotations

import pytest
from kvfleet.runtime import LLM, LoRARequest, SamplingParams
from kvfleet.runtime.lora.make_adapter import make_adapter

SHARED_PREFIX = "It was the best of times, it was the worst of times, it was the age of wisdom, "
PROMPTS = [
    SHARED_PREFIX + "it was the age of foolishness",
    SHARED_PREFIX + "it was the epoch of belief",
    "The quick brown fox",
    "Once upon a time there was",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_options",
    [("llama",), ("mistral", "--sliding-window", "12")],
    ids=["llama", "mistral-sliding-window"],
)
def test_triton_backend_generates_the_sdpa_backends_greedy_tokens(make_model, model_options) -> None:
    arch, *options = model_options
    model = str(make_model(arch, "tiny", 0, *options))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # A 24-token step budget splits the long prompts into chunks that share steps with decodes, and the
    # second long prompt reuses the first one's cached prefix blocks.
    options = {
        "block_size": 8,
        "max_num_batched_tokens": 24,
        "num_gpu_blocks_override": 64,
        "max_model_len": 256,
    }
    tokens = {}
    for backend in ("sdpa", "triton"):
        llm = LLM(model, attention_backend=backend, **options)
        assert llm.llm_engine.runner.attention_backend.name == backend
        outputs = llm.generate(PROMPTS, params)
        tokens[backend] = [output.outputs[0].token_ids for output in outputs]
        stats = llm.llm_engine.stats
        assert stats.prefix_cache_hits > 0
    assert all(len(ids) == 10 for ids in tokens["triton"])
    assert tokens["triton"] == tokens["sdpa"]


@pytest.mark.slow
def test_lora_kernels_generate_the_dense_paths_greedy_tokens(make_model, tmp_path) -> None:
    """Two adapters of different ranks and the base model in one batch: the Triton LoRA kernels, bound with
    the Triton backend, give the tokens of the dense torch path bound with the sdpa backend."""
    model = make_model("llama", "tiny")
    loras = [
        LoRARequest(
            f"r{rank}", index + 1, str(make_adapter(model, tmp_path / f"r{rank}", rank=rank, seed=index))
        )
        for index, rank in enumerate((4, 8))
    ]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    options = {
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 8,
        "num_gpu_blocks_override": 64,
        "max_model_len": 128,
    }
    tokens = {}
    for backend in ("sdpa", "triton"):
        llm = LLM(str(model), attention_backend=backend, **options)
        lora_manager = llm.llm_engine.runner.lora_manager
        assert lora_manager is not None and lora_manager.use_triton == (backend == "triton")
        outputs = llm.generate(prompts, params, lora_request=[loras[0], loras[1], None])
        tokens[backend] = [output.outputs[0].token_ids for output in outputs]
    base_alone = llm.generate(prompts[:2], params)
    assert [output.outputs[0].token_ids for output in base_alone] != tokens["triton"][:2], (
        "adapters did nothing"
    )
    assert tokens["triton"] == tokens["sdpa"]
