"""vLLM's hf_overrides: settings over a model folder's config.json, seen alike by every reader of it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from kvfleet.runtime.hf_config import read_hf_config, with_overrides
from kvfleet.runtime.models.folder import check_model_folder
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.multimodal.prompt_media import PromptMedia
from kvfleet.runtime.quantization.config import folder_weight_quantization


def test_a_key_is_replaced_and_a_nested_model_config_takes_the_keys_into_it() -> None:
    config = {
        "hidden_size": 64,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        "text_config": {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_scaling": {"factor": 2.0, "x": 1}},
    }
    overrides = {
        "hidden_size": 128,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "text_config": {"rms_norm_eps": 0.5, "rope_scaling": {"factor": 8.0}},
        "max_position_embeddings": 512,
    }
    assert with_overrides(config, overrides) == {
        "hidden_size": 128,
        # A plain dict is a value like any other: replaced whole, as vLLM sets it on the config.
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        # A nested model config keeps what the override does not name, in its own dicts too.
        "text_config": {"model_type": "llama", "rms_norm_eps": 0.5, "rope_scaling": {"factor": 8.0, "x": 1}},
        "max_position_embeddings": 512,
    }
    assert config["hidden_size"] == 64 and config["text_config"]["rms_norm_eps"] == 1e-5


def test_the_model_reads_the_overridden_config_and_an_error_names_the_overrides(tiny_llama: Path) -> None:
    overridden = ModelConfig.from_folder(tiny_llama, {"max_position_embeddings": 64})
    assert overridden.max_context == 64
    assert ModelConfig.from_folder(tiny_llama).max_context == 2048
    with pytest.raises(ValueError, match=r"config\.json with hf_overrides: hidden_act 'gelu' is not"):
        ModelConfig.from_folder(tiny_llama, {"hidden_act": "gelu"})


def test_the_folder_check_and_the_quantization_check_read_the_overrides(tiny_llama: Path) -> None:
    check_model_folder(str(tiny_llama))
    with pytest.raises(ValueError, match=r"with hf_overrides: model architecture 'GPT2LMHeadModel' is not"):
        check_model_folder(str(tiny_llama), {"architectures": ["GPT2LMHeadModel"]})
    assert folder_weight_quantization(tiny_llama, None) is None
    unknown = {"quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(ValueError, match=r"with hf_overrides: quantization_config\.quant_method 'bitsand"):
        folder_weight_quantization(tiny_llama, None, unknown)


def test_the_prompt_media_read_the_overrides(make_model: Callable[..., Path]) -> None:
    llava = make_model("llava", "tiny")
    written = json.loads((llava / "config.json").read_text())["image_token_index"]
    assert PromptMedia.for_model(llava, {"image": 1}, None).specs["image"].placeholder_id == written
    media = PromptMedia.for_model(llava, {"image": 1}, None, {"image_token_index": written + 1})
    assert media.specs["image"].placeholder_id == written + 1


def test_a_folder_without_a_json_object_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"a model folder needs a Hugging Face config\.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        read_hf_config(tmp_path)
