"""logit_bias (OpenAI's), allowed_token_ids and bad_words (vLLM's) through the openai SDK."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0, timeout=60
    )


def test_logit_bias_and_allowed_token_ids(client: openai.OpenAI, tiny_llama: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    pulled = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=6,
        temperature=0.0,
        logit_bias={"300": 100},
        extra_body={"ignore_eos": True},
    )
    assert pulled.choices[0].text == tokenizer.decode([300] * 6)
    allowed = [300, 301]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=12,
        seed=1,
        logprobs=True,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    tokens = {entry.token for entry in chat.choices[0].logprobs.content}
    assert tokens <= {tokenizer.decode([token_id]) for token_id in allowed}


def test_bad_words_are_not_said(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.0}
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    words = [word for word in plain.split() if word.isalpha()][:3]
    assert words
    banned = (
        client.completions.create(**kwargs, extra_body={"ignore_eos": True, "bad_words": words})
        .choices[0]
        .text
    )
    assert not set(banned.split()) & set(words)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [99999999]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_bad_token_rules_get_a_400(api_server: ServerProcess, body: dict[str, Any], param: str) -> None:
    response = httpx.post(
        f"{api_server.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **body},
        headers=api_server.headers(),
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
