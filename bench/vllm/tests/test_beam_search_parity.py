"""kvfleet's beam search against vLLM's own (`vllm.LLM.beam_search`, its CPU build) on the same folder: the
same beams, best first, with the same cumulative logprobs, for widths 3 to 8 and length penalties 0.5 to 2.

So that beams complete, the folder is the small model trained a few steps on its tokenizer's corpus, with "."
as its end-of-sequence token: most answers reach a full stop within the steps. `ignore_eos` is left out: with
it vLLM's offline search ranks a live beam ending in the end token as if the token were not there (its
server's search, kvfleet's and Transformers' rank it by its logprob; tests/runtime/engine/test_beam_search.py
checks kvfleet's with Transformers').
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from kvfleet.runtime import LLM
from kvfleet.runtime.sampling_params import BeamSearchParams
from transformers import AutoTokenizer

PROGRAM = Path(__file__).resolve().parents[1] / "beam_search.py"
TEXTS = [
    "Once upon a time",
    "The quick brown fox",
    "In the beginning",
    "She said that",
    "Hello",
    "The weather",
]
CASES = {
    "width 3": {"width": 3, "steps": 12, "length_penalty": 1.0},
    "width 8": {"width": 8, "steps": 16, "length_penalty": 1.0},
    "short beams favoured": {"width": 5, "steps": 12, "length_penalty": 0.5},
    "long beams favoured": {"width": 5, "steps": 12, "length_penalty": 2.0},
}


@pytest.fixture(scope="module")
def model_dir(make_small_model: Callable[..., Path]) -> Path:
    path = make_small_model("small-full-stop", "--train-steps", "40")
    tokenizer_config = path / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**config, "eos_token": "."}))
    return path


def test_kvfleets_beams_are_vllms(model_dir: Path, tmp_path: Path) -> None:
    python = os.environ.get("VLLM_PYTHON")
    if not python or not Path(python).is_file():
        pytest.fail("set VLLM_PYTHON to the python of vLLM's environment (make test-vllm-runtime does)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(text).input_ids for text in TEXTS]
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({name: {**case, "prompts": prompts} for name, case in CASES.items()}))
    result = tmp_path / "vllm.json"
    command = [python, "-P", str(PROGRAM), "--model", str(model_dir), "--cases", str(cases)]
    subprocess.run([*command, "--result-json", str(result)], check=True, capture_output=True, text=True)
    expected = json.loads(result.read_text())
    llm = LLM(str(model_dir), dtype="float32")
    end = tokenizer.eos_token_id
    completed = 0
    for name, case in CASES.items():
        params = BeamSearchParams(
            beam_width=case["width"], max_tokens=case["steps"], length_penalty=case["length_penalty"]
        )
        found = llm.beam_search([{"prompt_token_ids": ids} for ids in prompts], params)
        for text, output, theirs in zip(TEXTS, found, expected[name], strict=True):
            # vLLM's offline beams keep the end token they completed with; kvfleet's, as vLLM's server's,
            # leave it out unless include_stop_str_in_output.
            their_tokens = [tokens[:-1] if tokens[-1] == end else tokens for tokens, _ in theirs]
            assert [beam.tokens for beam in output.sequences] == their_tokens, (name, text)
            ours = [beam.cum_logprob for beam in output.sequences]
            assert ours == pytest.approx([logprob for _, logprob in theirs], abs=1e-3), (name, text)
            completed += sum(beam.finish_reason == "stop" for beam in output.sequences)
    # The rules for completed beams were exercised, not only live ones.
    assert completed >= 20
