"""vLLM's generation_config and override_generation_config offline, as `LLM(...)` takes them: the sampling
defaults of generate() and chat() where no SamplingParams are given (read against Transformers' reading of
the same generation_config.json), and the end tokens of a generation_config FOLDER other than the model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams
from transformers import GenerationConfig

ENGINE = {"dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 256}
PROMPT = "Once upon a time"
# Recommended sampling: each of the keys vLLM takes from generation_config.json but the penalties it has no
# default for here, max_new_tokens as max_tokens.
RECOMMENDED = {"temperature": 0.7, "top_p": 0.8, "top_k": 7, "repetition_penalty": 1.1, "max_new_tokens": 3}


def _with_generation_config(model: Path, destination: Path, settings: dict) -> Path:
    folder = Path(shutil.copytree(model, destination))
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return folder


def test_defaults_are_the_generation_configs_with_the_overrides_over_them(
    tiny_llama: Path, tmp_path: Path
) -> None:
    folder = _with_generation_config(tiny_llama, tmp_path / "model", RECOMMENDED)
    read = GenerationConfig.from_pretrained(folder)
    defaults = LLM(str(folder), **ENGINE).get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (
        read.temperature,
        read.top_p,
        read.top_k,
    )
    assert (defaults.repetition_penalty, defaults.max_tokens) == (
        read.repetition_penalty,
        read.max_new_tokens,
    )
    # Greedy (whose sampling no filter changes), so that a run with the defaults and one with the same values
    # given can be compared.
    llm = LLM(str(folder), override_generation_config={"temperature": 0.0}, **ENGINE)
    given = SamplingParams(temperature=0.0, repetition_penalty=1.1, max_tokens=3)
    assert llm.get_default_sampling_params() == given
    (unset,) = llm.generate(PROMPT, use_tqdm=False)
    (explicit,) = llm.generate(PROMPT, given, use_tqdm=False)
    assert unset.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert len(unset.outputs[0].token_ids) <= 3
    chat = [{"role": "user", "content": "Hi"}]
    assert llm.chat(chat, use_tqdm=False)[0].outputs[0].token_ids == (
        llm.chat(chat, given, use_tqdm=False)[0].outputs[0].token_ids
    )
    plain = LLM(str(folder), generation_config="vllm", **ENGINE).get_default_sampling_params()
    assert plain == SamplingParams()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"generation_config": "no-such-folder"}, "generation_config must be auto, vllm or a folder"),
        (
            {"override_generation_config": {"max_length": 5}},
            "override_generation_config: 'max_length' is not",
        ),
        ({"override_generation_config": {"top_p": 2.0}}, "override_generation_config: top_p must be in"),
    ],
)
def test_bad_generation_configs_are_refused_by_name(tiny_llama: Path, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), **options, **ENGINE)


def test_a_generation_config_folder_names_the_end_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    """As in vLLM: the end tokens of generation_config's folder end a sequence as stop tokens, those of the
    model's folder no longer."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    llm = LLM(str(tiny_llama), **ENGINE)
    (answer,) = llm.generate(PROMPT, greedy, use_tqdm=False)
    tokens = list(answer.outputs[0].token_ids)
    assert len(tokens) == 6, "the model's own end tokens do not end this answer"
    eos = llm.get_tokenizer().eos_token_id
    ending = tokens[2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, ending]}))
    (ended,) = LLM(str(tiny_llama), generation_config=str(tmp_path), **ENGINE).generate(
        PROMPT, greedy, use_tqdm=False
    )
    first = tokens.index(ending)
    assert list(ended.outputs[0].token_ids) == tokens[: first + 1]
    assert (ended.outputs[0].finish_reason, ended.outputs[0].stop_reason) == ("stop", ending)
