"""`kvfleet serve --speculative-config`: the real server speculates, answers as it would without, counts its
drafts in /metrics, serves structured outputs beside, and refuses bad configurations at the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest
from kvfleet.runtime import LLM, SamplingParams

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
PROMPTS = ["the cat sat on the mat, the cat sat on the", "Once upon a time", "1 2 3 4 1 2 3 4 1 2"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def speculating_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    # The target as its own draft: every greedy draft token is accepted, which the metrics show.
    config = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    return start_server("--speculative-config", json.dumps(config))


@pytest.fixture(scope="module")
def client(speculating_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{speculating_server.url}/v1", api_key="unused") as client:
        yield client


def test_greedy_text_is_what_the_engine_writes_without_speculation(
    client: openai.OpenAI, speculating_server: ServerProcess, tiny_llama: Path
) -> None:
    before = speculating_server.metrics()
    texts = []
    for prompt in PROMPTS:
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    after = speculating_server.metrics()

    reference = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=64, max_model_len=256).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert texts == [output.outputs[0].text for output in reference]
    drafted = after["vllm:spec_decode_num_draft_tokens_total"] - before.get(
        "vllm:spec_decode_num_draft_tokens_total", 0.0
    )
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0.0
    )
    assert drafted > 0 and accepted == drafted
    assert after["kvfleet:spec_decode_draft_acceptance_rate"] == 1.0


def test_structured_outputs_are_served_beside_speculation(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="code:",
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": "spec-[0-9]{3}"}},
    )
    assert re.fullmatch("spec-[0-9]{3}", completion.choices[0].text)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        (
            '{"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min (4) exceeds prompt_lookup_max (2)",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "does not take model"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "must name the draft model's folder"),
    ],
)
def test_bad_configurations_are_usage_errors(tiny_llama: Path, config: str, message: str) -> None:
    completed = _serve(tiny_llama, config)
    assert completed.returncode == 2, completed.stderr
    assert message in completed.stderr


def test_a_draft_model_with_another_tokenizer_is_refused(
    tiny_llama: Path, make_model: Callable[..., Path]
) -> None:
    config = {"method": "draft_model", "model": str(make_model("qwen2", "tiny")), "num_speculative_tokens": 2}
    completed = _serve(tiny_llama, json.dumps(config))
    assert completed.returncode == 2, completed.stderr
    assert "the draft model's tokenizer differs from the target's" in completed.stderr


def _serve(model: Path, speculative_config: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-P", "-m", "kvfleet", "serve", "--model", str(model)]
    command += ["--port", "0", "--speculative-config", speculative_config]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
