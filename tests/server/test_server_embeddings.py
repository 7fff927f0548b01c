"""POST /v1/embeddings through the official openai SDK against the shared server: each vector is the
model's last-token hidden state, L2-normalized (vLLM's pooling for a decoder model's embed task), as
Transformers computes it on the same folder; every input form and encoding gives the same vectors. vLLM's
/score and /rerank give the cosine similarities of those vectors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL = "tiny"
TEXTS = ["Once upon a time", "The weather in Paris is mild, with rain on most days of the year."]


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama)


def _transformers_embeddings(model_dir: Path, token_lists: list[list[int]]) -> list[np.ndarray]:
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    vectors = []
    with torch.inference_mode():
        for token_ids in token_lists:
            last = model(torch.tensor([token_ids])).last_hidden_state[0, -1]
            vectors.append(torch.nn.functional.normalize(last, dim=0).numpy())
    return vectors


def test_embeddings_are_transformers_last_token_pooling(
    client: openai.OpenAI, tokenizer: Any, tiny_llama: Path
) -> None:
    token_lists = [tokenizer(text).input_ids for text in TEXTS]
    expected = _transformers_embeddings(tiny_llama, token_lists)
    # The SDK asks for base64 unless told, and decodes it.
    as_base64 = client.embeddings.create(model=MODEL, input=TEXTS)
    as_floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    as_token_ids = client.embeddings.create(model=MODEL, input=token_lists)
    for answer in (as_base64, as_floats, as_token_ids):
        assert [item.index for item in answer.data] == [0, 1]
        for item, vector in zip(answer.data, expected, strict=True):
            assert len(item.embedding) == vector.size
            np.testing.assert_allclose(item.embedding, vector, atol=1e-4)
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, token_lists))
    one = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    one_by_ids = client.embeddings.create(model=MODEL, input=token_lists[1], encoding_format="float")
    assert one.data[0].embedding == one_by_ids.data[0].embedding
    np.testing.assert_allclose(one.data[0].embedding, expected[1], atol=1e-4)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"dimensions": 8}, "dimensions"),
        ({"input": []}, "input"),
        ({"model": "other"}, "model"),
        # Longer than the context: the input named.
        ({"input": [[1, 2], [1] * 4000]}, "input.1"),
    ],
)
def test_what_cannot_be_answered_is_refused_by_name(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(**{"model": MODEL, "input": TEXTS[0], **fields})
    assert caught.value.status_code in (400, 404)
    assert caught.value.body["param"] == param  # type: ignore[index]


CONVERSATIONS = [
    [{"role": "system", "content": "Represent the question."}, {"role": "user", "content": "Rain in Paris?"}],
    [{"role": "user", "content": "Stock markets fell today."}],
]


def test_conversations_are_embedded_as_the_chat_template_renders_them(
    api_server: ServerProcess, tokenizer: Any, tiny_llama: Path
) -> None:
    """vLLM's chat embeddings: `messages` (or an `input` of messages), one conversation or a batch of them,
    rendered by the tokenizer's template as Transformers renders it, without the generation prompt unless
    asked."""

    def rendered(conversation: list[dict[str, Any]], **options: Any) -> list[int]:
        return tokenizer.apply_chat_template(conversation, tokenize=True, **options)["input_ids"]

    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{api_server.url}/v1/embeddings",
            json={"model": MODEL, **body},
            headers=api_server.headers(),
            timeout=60,
        )

    token_lists = [rendered(conversation) for conversation in CONVERSATIONS]
    opened = rendered(CONVERSATIONS[1], add_generation_prompt=True)
    expected = _transformers_embeddings(tiny_llama, [*token_lists, opened])
    one = post({"messages": CONVERSATIONS[0]}).json()
    batched = post({"input": CONVERSATIONS, "encoding_format": "float"}).json()
    asked = post({"messages": CONVERSATIONS[1], "add_generation_prompt": True}).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], expected[0], atol=1e-4)
    assert [item["index"] for item in batched["data"]] == [0, 1]
    np.testing.assert_allclose([item["embedding"] for item in batched["data"]], expected[:2], atol=1e-4)
    np.testing.assert_allclose(asked["data"][0]["embedding"], expected[2], atol=1e-4)
    assert batched["usage"]["prompt_tokens"] == sum(map(len, token_lists))
    for body, param in [
        ({"input": TEXTS[0], "messages": CONVERSATIONS[0]}, "messages"),
        ({"messages": CONVERSATIONS[0], "add_special_tokens": True}, "add_special_tokens"),
        ({"messages": CONVERSATIONS[0], "add_generation_prompt": True, "continue_final_message": True}, None),
        ({"input": [CONVERSATIONS[0], [{"role": "user", "content": "x" * 20000}]]}, "messages"),
    ]:
        refused = post(body)
        assert refused.status_code == 400, refused.text
        assert param is None or refused.json()["error"]["param"] == param, refused.text


DOCUMENTS = ["A rainy day in Paris.", "Stock markets fell today.", "Once upon a time there was a king."]


def test_score_and_rerank_are_the_embeddings_cosine_similarities(
    api_server: ServerProcess, tokenizer: Any, tiny_llama: Path
) -> None:
    query = TEXTS[0]
    vectors = _transformers_embeddings(
        tiny_llama, [tokenizer(text).input_ids for text in [query, *DOCUMENTS]]
    )
    expected = [float(vectors[0] @ vector) for vector in vectors[1:]]

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = httpx.post(f"{api_server.url}{path}", json=body, headers=api_server.headers(), timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    for path in ("/score", "/v1/score"):
        scored = post(path, {"model": MODEL, "text_1": query, "text_2": DOCUMENTS})
        np.testing.assert_allclose([item["score"] for item in scored["data"]], expected, atol=1e-4)
    pairwise = post("/v1/score", {"model": MODEL, "text_1": [query, query], "text_2": DOCUMENTS[:2]})
    np.testing.assert_allclose([item["score"] for item in pairwise["data"]], expected[:2], atol=1e-4)
    order = sorted(range(len(DOCUMENTS)), key=lambda index: expected[index], reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = post(path, {"model": MODEL, "query": query, "documents": DOCUMENTS, "top_n": 2})
        assert [result["index"] for result in ranked["results"]] == order[:2]
        for result in ranked["results"]:
            assert result["document"]["text"] == DOCUMENTS[result["index"]]
            assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-4
    every = post("/v1/rerank", {"model": MODEL, "query": query, "documents": DOCUMENTS})
    assert [result["index"] for result in every["results"]] == order
    mismatched = httpx.post(
        f"{api_server.url}/v1/score",
        json={"model": MODEL, "text_1": DOCUMENTS[:2], "text_2": DOCUMENTS},
        headers=api_server.headers(),
        timeout=60,
    )
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_1"
    too_long = httpx.post(
        f"{api_server.url}/v1/rerank",
        json={"model": MODEL, "query": query, "documents": [DOCUMENTS[0], "word " * 4000]},
        headers=api_server.headers(),
        timeout=60,
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "documents.1"
