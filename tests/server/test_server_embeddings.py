"""POST /v1/embeddings through the official openai SDK against the shared server: each vector is the
model's last-token hidden state, L2-normalized (vLLM's pooling for a decoder model's embed task), as
Transformers computes it on the same folder; every input form and encoding gives the same vectors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    [({"dimensions": 8}, "dimensions"), ({"input": []}, "input"), ({"model": "other"}, "model")],
)
def test_what_cannot_be_answered_is_refused_by_name(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(**{"model": MODEL, "input": TEXTS[0], **fields})
    assert caught.value.status_code in (400, 404)
    assert caught.value.body["param"] == param  # type: ignore[index]
