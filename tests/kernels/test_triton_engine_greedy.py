"""End to end: the engine on the Triton backend (interpreted) produces the torch backend's greedy tokens."""

from __future__ import annotations

import pytest
from kvfleet.runtime import LLM, SamplingParams

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
    options = {"block_size": 8, "max_num_batched_tokens": 24, "num_kv_blocks": 64, "max_model_len": 256}
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
