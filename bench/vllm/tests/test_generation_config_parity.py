"""The offline LLM's generation config options against vLLM's own (`vllm.LLM`, its CPU build) on the same
folder: the default sampling parameters a generation_config folder and override_generation_config give, and
the answers of generate() called without SamplingParams, which end at the folder's own end tokens."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams
from transformers import AutoTokenizer

PROGRAM = Path(__file__).resolve().parents[1] / "generation_defaults.py"
TEXTS = ["Once upon a time", "The quick brown fox", "Hello"]


def test_defaults_and_end_tokens_of_a_generation_config_folder_are_vllms(
    make_small_model: Callable[..., Path], tmp_path: Path
) -> None:
    python = os.environ.get("VLLM_PYTHON")
    if not python or not Path(python).is_file():
        pytest.fail("set VLLM_PYTHON to the python of vLLM's environment (make test-vllm-runtime does)")
    model = make_small_model("small-generation-config")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer(text).input_ids for text in TEXTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = LLM(str(model), dtype="float32").generate([{"prompt_token_ids": prompts[0]}], greedy)
    # The folder's end tokens: the tokenizer's, and one the first prompt's greedy answer reaches.
    ending = first[0].outputs[0].token_ids[2]
    folder = tmp_path / "generation"
    folder.mkdir()
    recommended = {"temperature": 0.9, "top_k": 5, "max_new_tokens": 6}
    config = {**recommended, "eos_token_id": [tokenizer.eos_token_id, ending]}
    (folder / "generation_config.json").write_text(json.dumps(config))
    options = {"generation_config": str(folder), "override_generation_config": {"temperature": 0.0}}
    (tmp_path / "options.json").write_text(json.dumps(options))
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    result = tmp_path / "vllm.json"
    command = [python, "-P", str(PROGRAM), "--model", str(model), "--options", str(tmp_path / "options.json")]
    command += ["--prompts", str(tmp_path / "prompts.json"), "--result-json", str(result)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    expected = json.loads(result.read_text())

    llm = LLM(str(model), dtype="float32", **options)
    defaults = llm.get_default_sampling_params()
    # The fields the program reads of vLLM's defaults: those a generation_config.json can set.
    assert {name: getattr(defaults, name) for name in expected["defaults"]} == expected["defaults"]
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": ids} for ids in prompts])]
    ours = [[list(o.token_ids), o.finish_reason, o.stop_reason] for o in outputs]
    assert ours == expected["outputs"]
    assert ["stop", ending] in [[finish, stop] for _, finish, stop in ours], (
        "the folder's end token ended one"
    )
