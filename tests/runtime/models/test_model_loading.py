"""Config reading, the architecture registry, weight loading (single, sharded, tied), dtype and device choice,
and the ModelRunner's own checks."""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import SchedulerOutput
from kvfleet.runtime.kernels.fused_layers import CustomOp, Implementation
from kvfleet.runtime.models import registry as registry_module
from kvfleet.runtime.models.layers import rope_inverse_frequencies
from kvfleet.runtime.models.llama import LlamaForCausalLM
from kvfleet.runtime.models.loader import resolve_device, resolve_dtype
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.registry import ModelRegistry
from kvfleet.runtime.request import Request
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.model_runner import ModelRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.configuration_llama import LlamaConfig


def _copy(folder: Path, destination: Path) -> Path:
    shutil.copytree(folder, destination)
    return destination


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _greedy_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """Logits of the last prompt token, through one prefill step."""
    captured: list[torch.Tensor] = []
    model = runner.model
    assert model is not None
    compute = model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(compute(hidden))
        return captured[-1]

    model.compute_logits = capture  # type: ignore[method-assign]
    request = Request("probe", prompt, SamplingParams(temperature=0.0))
    num_blocks = -(-len(prompt) // runner.block_size)
    output = SchedulerOutput(
        [request], [len(prompt)], [0], [list(range(num_blocks))], len(prompt), set(), set()
    )
    runner.execute_model(output)
    return captured[0][0]


def _transformers_last_logits(folder: Path, prompt: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1]


PROMPT = [random.Random(0).randrange(8, 1000) for _ in range(21)]


def test_sharded_checkpoint_loads_like_the_single_file(
    tiny_model: Callable[[str], Path], runner_for, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy(tiny_model("qwen2"), tmp_path / "sharded")
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    capsys.readouterr()
    sharded = _greedy_logits(runner_for(folder), PROMPT)
    # The progress bar counts the shards as they are read, a line for each (tqdm repeats the last on closing).
    bar = [line for line in capsys.readouterr().err.splitlines() if "checkpoint shards" in line]
    counts = [re.fullmatch(r"Loading safetensors checkpoint shards: (\d+)/(\d+) .*", line) for line in bar]
    assert all(counts), bar
    assert list(dict.fromkeys(count.groups() for count in counts if count)) == [
        (str(done), str(len(shards))) for done in range(len(shards) + 1)
    ]
    single = _greedy_logits(runner_for(tiny_model("qwen2"), use_tqdm_on_load=False), PROMPT)
    assert "checkpoint shards" not in capsys.readouterr().err
    torch.testing.assert_close(sharded, single, atol=0, rtol=0)
    torch.testing.assert_close(sharded, _transformers_last_logits(folder, PROMPT), atol=2e-4, rtol=1e-4)


def test_tied_embeddings_match_transformers(
    tiny_model: Callable[[str], Path], runner_for, tmp_path: Path
) -> None:
    folder = _copy(tiny_model("qwen3"), tmp_path / "tied")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(folder, tie_word_embeddings=True)
    runner = runner_for(folder)
    assert runner.model is not None and runner.model.lm_head is None
    torch.testing.assert_close(
        _greedy_logits(runner, PROMPT), _transformers_last_logits(folder, PROMPT), atol=2e-4, rtol=1e-4
    )


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "truncate": False,
        },
    ],
    ids=["llama3", "yarn", "yarn-mscale-untruncated"],
)
def test_static_rope_scaling_matches_transformers(rope: dict) -> None:
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope)
    expected, expected_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))
    inv_freq, scale = rope_inverse_frequencies(64, rope)
    torch.testing.assert_close(inv_freq, expected)
    assert scale == pytest.approx(expected_scale)


def test_unsupported_rope_type_is_named_at_load(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("mistral"), folder)
    _edit_config(folder, rope_parameters={"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'proportional' is not supported; supported: default, "):
        LLM(str(folder), dtype="float32", num_gpu_blocks_override=16)


@pytest.mark.parametrize(
    ("rope", "max_context"),
    [
        ({"rope_type": "default"}, 512),
        ({"rope_type": "linear", "factor": 4.0}, 2048),
        ({"rope_type": "dynamic", "factor": 2.0}, 1024),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, 512),
        ({"rope_type": "yarn", "factor": 4.0}, 2048),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, 512),
    ],
)
def test_rope_scaling_sets_the_longest_context(rope: dict, max_context: int) -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_theta": 1e4, **rope},
    }
    assert ModelConfig.from_dict(raw).max_context == max_context


def test_old_style_rope_keys_are_read() -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "rope_theta": 1234.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "bfloat16",
    }
    config = ModelConfig.from_dict(raw)
    assert config.rope == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0}
    assert (config.num_key_value_heads, config.head_dim, config.dtype) == (4, 16, torch.bfloat16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": []}, "exactly one"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"dtype": "float8"}, "dtype"),
    ],
)
def test_bad_configs_are_rejected_with_the_reason(change: dict, message: str) -> None:
    raw = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**raw, **change})


def test_sliding_windows_per_layer_as_transformers_reads_them() -> None:
    base = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "max_position_embeddings": 8192,
    }
    mistral = ModelConfig.from_dict({**base, "sliding_window": 4096})
    assert (mistral.layer_windows, mistral.sliding_window, mistral.max_context) == ((4096,) * 3, 4096, 8192)
    assert ModelConfig.from_dict({**base, "sliding_window": None}).layer_windows == (None,) * 3
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 1024}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).layer_windows == (None,) * 3
    upper = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert (upper.layer_windows, upper.sliding_window) == ((None, 1024, 1024), None)
    named = {**qwen, "use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"] * 2}
    with pytest.raises(ValueError, match="names 4 layers, not 3"):
        ModelConfig.from_dict(named)
    named["layer_types"] = named["layer_types"][:3]
    assert ModelConfig.from_dict(named).layer_windows == (1024, None, 1024)


def test_registry_resolves_builtins_and_plugins_and_names_what_it_supports(monkeypatch) -> None:
    registry = ModelRegistry()
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert registry.resolve(name) is LlamaForCausalLM
    supported = "LlamaForCausalLM, LlavaForConditionalGeneration, MistralForCausalLM"
    with pytest.raises(ValueError, match=f"not supported; supported: {supported}"):
        registry.resolve("GPT2LMHeadModel")

    plugin = EntryPoint(name="MyForCausalLM", value="collections:OrderedDict", group="kvfleet.models")
    shadow = EntryPoint(name="LlamaForCausalLM", value="collections:Counter", group="kvfleet.models")
    broken = EntryPoint(
        name="BrokenForCausalLM", value="no_such_module_anywhere:Model", group="kvfleet.models"
    )
    monkeypatch.setattr(registry_module, "entry_points", lambda group: [plugin, shadow, broken])
    with_plugins = ModelRegistry()
    assert with_plugins.resolve("MyForCausalLM").__name__ == "OrderedDict"
    assert with_plugins.resolve("LlamaForCausalLM") is LlamaForCausalLM
    assert "MyForCausalLM" in with_plugins.supported_architectures
    with pytest.raises(ValueError, match="cannot load the class for 'BrokenForCausalLM'"):
        with_plugins.resolve("BrokenForCausalLM")
    # Classes can also be registered in code, under any name.
    with_plugins.register("BrokenForCausalLM", LlamaForCausalLM)
    assert with_plugins.resolve("BrokenForCausalLM") is LlamaForCausalLM


def test_weight_problems_are_reported_by_name(
    tiny_model: Callable[[str], Path], runner_for, tmp_path: Path
) -> None:
    folder = _copy(tiny_model("llama"), tmp_path / "broken")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensors, e\.g\. model\.layers\.1\.mlp\.up_proj\.weight"):
        runner_for(folder)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.weight' has shape"):
        runner_for(folder)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(176, 64)
    tensors["model.visual.proj.weight"] = torch.zeros(2)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.visual\.proj\.weight' has no place"):
        runner_for(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        runner_for(folder)


def test_dtype_and_device_resolution(tiny_model: Callable[[str], Path], runner_for) -> None:
    config = ModelConfig.from_folder(tiny_model("llama"))
    bf16 = ModelConfig.from_dict(
        {**json.loads((tiny_model("llama") / "config.json").read_text()), "dtype": "bfloat16"}
    )
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", config, cpu) == torch.float32
    assert resolve_dtype("auto", bf16, cpu) == torch.float32  # half precision is slower on a CPU
    assert resolve_dtype("bfloat16", config, cpu) == torch.bfloat16
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    runner = runner_for(tiny_model("llama"), dtype="bfloat16")
    assert runner.model is not None
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert runner.kv_caches[0].dtype == torch.bfloat16
    logits = _greedy_logits(runner, PROMPT)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("dtype", "implementation"), [("float32", Implementation.CPU), ("bfloat16", Implementation.NATIVE)]
)
def test_each_layer_runs_what_it_bound_for_the_models_dtype(
    tiny_model: Callable[[str], Path], runner_for, dtype: str, implementation: Implementation
) -> None:
    # The C++ operations take float32 only; on the CPU other dtypes keep the torch code.
    runner = runner_for(tiny_model("qwen3"), dtype=dtype, device="cpu")
    assert runner.model is not None
    bound = [module for module in runner.model.modules() if isinstance(module, CustomOp)]
    assert {type(module).__name__ for module in bound} == {"RMSNorm", "SiluAndMul", "RotaryEmbedding"}
    for module in bound:
        assert module.implementation is implementation
        assert module.forward == getattr(module, f"forward_{implementation.value}")
    logits = _greedy_logits(runner, PROMPT)
    assert torch.isfinite(logits).all()


def test_runner_cache_size_and_checks(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    folder = tiny_model("qwen3")  # head_dim 32, 2 KV heads, 2 layers
    runner = ModelRunner(
        EngineConfig(model=str(folder), dtype="float32", block_size=8, attention_backend="reference")
    )
    assert runner.max_model_len == 2048 and runner.vocab_size == 1024
    assert runner.kv_cache_bytes_per_block() == 2 * 8 * 2 * 32 * 4 * 2
    request = Request("a", [1, 2, 3], SamplingParams())
    step = SchedulerOutput([request], [3], [0], [[0]], 3, set(), set())
    with pytest.raises(RuntimeError, match="load_model"):
        runner.execute_model(step)
    runner.load_model()
    runner.initialize_kv_cache(10)
    assert [tuple(c.shape) for c in runner.kv_caches] == [(2, 10, 8, 2, 32)] * 2
    assert all(not c.any() for c in runner.kv_caches)
    with pytest.raises(ValueError, match="total_num_scheduled_tokens"):
        runner.execute_model(SchedulerOutput([request], [3], [0], [[0]], 4, set(), set()))
    with pytest.raises(ValueError, match="block table is too short"):
        runner.execute_model(
            SchedulerOutput(
                [Request("b", list(range(9)), SamplingParams())], [9], [0], [[0]], 9, set(), set()
            )
        )
    empty = runner.execute_model(SchedulerOutput([], [], [], [], 0, {"a"}, set()))
    assert empty.req_ids == [] and empty.sampled_token_ids == []
    # A prompt chunk that does not reach the end samples nothing.
    partial = runner.execute_model(SchedulerOutput([request], [2], [0], [[0]], 2, set(), set()))
    assert partial.sampled_token_ids == [[]] and partial.logprobs == [None]
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds"):
        ModelRunner(EngineConfig(model=str(folder), max_model_len=4096))
    with pytest.raises(ValueError, match="unknown attention backend"):
        ModelRunner(EngineConfig(model=str(folder), attention_backend="magic"))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelRunner(EngineConfig(model=str(tmp_path)))
