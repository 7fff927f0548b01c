"""vLLM's --runner pooling, --pooler-config and Matryoshka embeddings on a server of a sentence-transformers
folder (the tiny model with a mean Pooling module and no Normalize one), through the official openai SDK,
against sentence-transformers itself: the folder's mean pooling, normalized as --pooler-config says over the
folder, or not as a request says; cut to a Matryoshka size the config lists (before it is normalized);
prompts truncated as on completions; the generation routes 404, as on vLLM's pooling server, and the
embedding routes on a generation server. What cannot be served fails at start, naming it."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import httpx
import ml_dtypes
import numpy as np
import openai
import pytest
import torch
from click.testing import CliRunner
from kvfleet.contract.errors import NotFoundError
from kvfleet.runtime.serving.embeddings import OpenAIServingEmbedding
from kvfleet.runtime.serving.protocol import EmbeddingRequest
from kvfleet.runtime.serving.service import OpenAIService, ServiceSettings
from sentence_transformers import SentenceTransformer
from sentence_transformers_folders import sentence_transformers_folder
from server_checks import openai_error
from transformers import AutoModel, AutoTokenizer

from kvfleet.cli import cli

if TYPE_CHECKING:
    from servers import ServerProcess

TEXTS = ["Once upon a time", "The weather in Paris is mild, with rain on most days of the year."]
MATRYOSHKA = [16, 32]


@pytest.fixture(scope="module")
def folder(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a sentence-transformers folder whose Pooling module takes the mean of the tokens."""
    folder = tmp_path_factory.mktemp("sentence-transformers") / "tiny"
    return sentence_transformers_folder(tiny_llama, folder, "pooling_mode_mean_tokens", normalize=False)


@pytest.fixture(scope="module")
def server(start_server: Any, folder: Path) -> ServerProcess:
    return start_server(
        "--runner",
        "pooling",
        "--pooler-config",
        '{"use_activation": true}',
        "--hf-overrides",
        json.dumps({"matryoshka_dimensions": MATRYOSHKA}),
        "--served-model-name",
        "tiny",
        model=folder,
    )


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sentence_transformers(folder: Path) -> SentenceTransformer:
    return SentenceTransformer(str(folder), device="cpu")


def _embeddings(answer: Any) -> np.ndarray:
    assert [item.index for item in answer.data] == list(range(len(answer.data)))
    return np.array([item.embedding for item in answer.data])


def test_embeddings_are_the_folders_mean_pooling_normalized_as_the_flag_says(
    client: openai.OpenAI, sentence_transformers: SentenceTransformer
) -> None:
    # One text at a time: the tiny tokenizer pads nothing, and the mean of a padded batch is the mask's.
    normalized = np.stack([sentence_transformers.encode(text, normalize_embeddings=True) for text in TEXTS])
    raw = np.stack([sentence_transformers.encode(text) for text in TEXTS])
    np.testing.assert_allclose(
        _embeddings(client.embeddings.create(model="tiny", input=TEXTS)), normalized, atol=1e-4
    )
    unnormalized = client.embeddings.create(model="tiny", input=TEXTS, extra_body={"use_activation": False})
    np.testing.assert_allclose(_embeddings(unnormalized), raw, atol=1e-4)


def test_a_matryoshka_size_is_cut_before_normalizing(
    client: openai.OpenAI, folder: Path, server: ServerProcess
) -> None:
    cut = SentenceTransformer(str(folder), device="cpu", truncate_dim=MATRYOSHKA[0])
    expected = np.stack([cut.encode(text, normalize_embeddings=True) for text in TEXTS])
    answer = client.embeddings.create(model="tiny", input=TEXTS, dimensions=MATRYOSHKA[0])
    assert _embeddings(answer).shape == (len(TEXTS), MATRYOSHKA[0])
    np.testing.assert_allclose(_embeddings(answer), expected, atol=1e-4)
    refused = httpx.post(
        f"{server.url}/v1/embeddings", json={"input": TEXTS[0], "dimensions": 20}, timeout=60
    )
    error = openai_error(refused, 400)
    assert error["param"] == "dimensions" and "[16, 32]" in error["message"]


def _mean_pooled(folder: Path, token_ids: list[int]) -> np.ndarray:
    """The folder's pooling of these tokens, normalized, by Transformers."""
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        mean = model(torch.tensor([token_ids])).last_hidden_state[0].mean(dim=0)
    return torch.nn.functional.normalize(mean, dim=0).numpy()


def beyond_the_context(server: ServerProcess, folder: Path) -> str:
    """Words at random, more characters than the server's context could hold in its longest tokens: a text
    refused unread unless it is truncated."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    max_model_len = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    characters = 2 * max(len(token) for token in tokenizer.get_vocab()) * max_model_len
    rng = np.random.default_rng(0)
    words = ["rain", "Paris", "mild,", "weather", "days", "of", "the", "year.", "Once", "upon", "a", "time"]
    text = ""
    while len(text) <= characters:
        text += " ".join(rng.choice(words, size=1000)) + " "
    return text


@pytest.mark.parametrize(
    ("side", "long"),
    [("left", False), ("right", False), ("left", True), ("right", True), (None, False), (None, True)],
)
def test_prompts_are_truncated_as_on_completions(
    client: openai.OpenAI, server: ServerProcess, folder: Path, side: str | None, long: bool
) -> None:
    """Also a text longer than the context could hold, read only as far as the tokens kept. With no side
    named, a text to pool keeps its start and its special tokens, as Transformers' truncation on the right
    does (vLLM's for pooling)."""
    text = beyond_the_context(server, folder) if long else TEXTS[1]
    token_ids = AutoTokenizer.from_pretrained(folder)(text).input_ids
    if side is None:
        on_the_right = AutoTokenizer.from_pretrained(folder, truncation_side="right")
        kept = on_the_right(text, truncation=True, max_length=5).input_ids
    else:
        kept = token_ids[-5:] if side == "left" else token_ids[:5]
    expected = _mean_pooled(folder, kept)
    cut = {"truncate_prompt_tokens": 5} | ({} if side is None else {"truncation_side": side})
    answer = client.embeddings.create(model="tiny", input=text, extra_body=cut)
    assert answer.usage.prompt_tokens == len(kept)
    np.testing.assert_allclose(_embeddings(answer)[0], expected, atol=1e-4)
    if long:
        with pytest.raises(openai.BadRequestError, match="characters, more than that many tokens can hold"):
            client.embeddings.create(model="tiny", input=text)


DOCUMENTS = [TEXTS[1], "Markets fell sharply on Monday after the announcement."]


def _scored(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("sides", [("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                                   ("data_1", "data_2")])  # fmt: skip
def test_scores_are_the_cosines_of_the_embeddings_whichever_fields_hold_the_sides(
    server: ServerProcess, sentence_transformers: SentenceTransformer, sides: tuple[str, str]
) -> None:
    query, *documents = (
        sentence_transformers.encode(t, normalize_embeddings=True) for t in [TEXTS[0], *DOCUMENTS]
    )
    first, second = sides
    answer = _scored(server, "/score", {first: TEXTS[0], second: DOCUMENTS})
    np.testing.assert_allclose(
        [item["score"] for item in answer["data"]],
        [float(query @ document) for document in documents],
        atol=1e-4,
    )


def test_a_score_without_exactly_one_pair_of_sides_is_refused(server: ServerProcess) -> None:
    for body in ({"queries": TEXTS[0]}, {"text_1": TEXTS[0], "documents": DOCUMENTS},
                 {"queries": TEXTS[0], "documents": DOCUMENTS, "items": DOCUMENTS}):  # fmt: skip
        refused = httpx.post(f"{server.url}/score", json=body, timeout=60)
        assert "in one pair of fields: queries and documents" in openai_error(refused, 400)["message"]
    refused = httpx.post(
        f"{server.url}/score", json={"queries": TEXTS, "documents": DOCUMENTS * 2}, timeout=60
    )
    assert openai_error(refused, 400)["param"] == "queries"


def _first_tokens_of_text(tokenizer: Any, text: str, count: int) -> str:
    """The text as far as its first `count` tokens reach, cut at a character: vLLM's max_tokens_per_query."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text if len(offsets) <= count else text[: offsets[count - 1][1]]


def test_queries_and_documents_are_cut_to_their_own_token_limits(
    server: ServerProcess, folder: Path, sentence_transformers: SentenceTransformer
) -> None:
    """max_tokens_per_query and max_tokens_per_doc against sentence-transformers on the texts vLLM cuts them
    to; a score's truncate_prompt_tokens cuts each text as completions do; a document alone is one."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cut_query = _first_tokens_of_text(tokenizer, TEXTS[0], 2)
    cut_documents = [_first_tokens_of_text(tokenizer, text, 4) for text in DOCUMENTS]
    assert cut_query != TEXTS[0] and cut_documents != DOCUMENTS
    query, *documents = (
        sentence_transformers.encode(text, normalize_embeddings=True) for text in [cut_query, *cut_documents]
    )
    limits = {"max_tokens_per_query": 2, "max_tokens_per_doc": 4}
    scored = _scored(server, "/v1/score", {"queries": TEXTS[0], "documents": DOCUMENTS, **limits})
    expected = [float(query @ document) for document in documents]
    np.testing.assert_allclose([item["score"] for item in scored["data"]], expected, atol=1e-4)
    # The query embedded once for all the documents, and counted once, as in vLLM: each text its tokens and
    # its beginning-of-text token.
    assert scored["usage"]["prompt_tokens"] == (2 + 1) + len(DOCUMENTS) * (4 + 1)
    reranked = _scored(server, "/v1/rerank", {"query": TEXTS[0], "documents": DOCUMENTS, **limits})
    assert [result["document"]["text"] for result in reranked["results"]] == [
        DOCUMENTS[index] for index in np.argsort(expected)[::-1]
    ]
    alone = _scored(server, "/rerank", {"query": TEXTS[0], "documents": DOCUMENTS[0], **limits})
    assert alone["results"][0]["relevance_score"] == pytest.approx(expected[0], abs=1e-4)

    cut = [_mean_pooled(folder, tokenizer(text).input_ids[:3]) for text in [TEXTS[0], DOCUMENTS[1]]]
    truncated = _scored(
        server, "/score", {"text_1": TEXTS[0], "text_2": DOCUMENTS[1], "truncate_prompt_tokens": 3,
                           "truncation_side": "right"}
    )  # fmt: skip
    assert truncated["usage"]["prompt_tokens"] == 6
    assert truncated["data"][0]["score"] == pytest.approx(float(cut[0] @ cut[1]), abs=1e-4)


def test_token_limits_past_the_context_are_refused(server: ServerProcess) -> None:
    max_model_len = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        body = {"queries": TEXTS[0], "documents": DOCUMENTS, name: max_model_len}
        error = openai_error(httpx.post(f"{server.url}/score", json=body, timeout=60), 400)
        assert error["param"] == name and f"{name} ({max_model_len}) must be less" in error["message"]


# The dtypes vLLM writes embeddings in, as ml_dtypes (numpy's bfloat16 and fp8) represents them.
EMBED_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}


def _bits(values: np.ndarray, embed_dtype: str, endianness: str) -> bytes:
    """`values` rounded to `embed_dtype` by ml_dtypes, their bits in `endianness`."""
    rounded = values.astype(np.float32).astype(EMBED_DTYPES[embed_dtype])
    order = {"native": "=", "big": ">", "little": "<"}[endianness]
    return rounded.view(f"u{rounded.itemsize}").astype(f"{order}u{rounded.itemsize}").tobytes()


@pytest.mark.parametrize(
    ("embed_dtype", "endianness"),
    [
        ("float32", "native"),
        ("float16", "big"),
        ("bfloat16", "little"),
        ("bfloat16", "big"),
        ("fp8_e4m3", "native"),
        ("fp8_e5m2", "big"),
    ],
)
def test_base64_and_bytes_carry_the_floats_in_the_dtype_and_byte_order_asked(
    server: ServerProcess, embed_dtype: str, endianness: str
) -> None:
    """vLLM's encodings: base64 of each vector's values, or all of them as the body with their places in a
    metadata header (none for bytes_only), against the float answer rounded by ml_dtypes."""

    def post(encoding_format: str) -> httpx.Response:
        body = {"input": TEXTS, "encoding_format": encoding_format}
        answer = httpx.post(
            f"{server.url}/v1/embeddings",
            json={**body, "embed_dtype": embed_dtype, "endianness": endianness},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        return answer

    floats = [np.array(item["embedding"]) for item in post("float").json()["data"]]
    expected = [_bits(vector, embed_dtype, endianness) for vector in floats]
    as_base64 = post("base64").json()
    assert [base64.b64decode(item["embedding"]) for item in as_base64["data"]] == expected
    as_bytes = post("bytes")
    assert as_bytes.headers["content-type"] == "application/octet-stream"
    assert as_bytes.content == b"".join(expected)
    metadata = json.loads(as_bytes.headers["metadata"])
    assert metadata["usage"] == as_base64["usage"] and metadata["model"] == "tiny"
    places = [(item["index"], item["start"], item["end"], item["shape"]) for item in metadata["data"]]
    size = len(expected[0])
    assert places == [(0, 0, size, [len(floats[0])]), (1, size, 2 * size, [len(floats[1])])]
    assert {(item["embed_dtype"], item["endianness"]) for item in metadata["data"]} == {
        (embed_dtype, endianness)
    }
    bytes_only = post("bytes_only")
    assert bytes_only.content == b"".join(expected) and "metadata" not in bytes_only.headers


def test_an_unknown_encoding_is_refused(server: ServerProcess) -> None:
    for field, value in [("encoding_format", "npy"), ("embed_dtype", "int8"), ("endianness", "middle")]:
        refused = httpx.post(
            f"{server.url}/v1/embeddings", json={"input": TEXTS[0], field: value}, timeout=60
        )
        assert field in openai_error(refused, 400)["message"], refused.text


def test_pooling_answers_the_embeddings_in_vllms_pooling_shape(
    server: ServerProcess, sentence_transformers: SentenceTransformer
) -> None:
    """vLLM's /pooling on an embedding server: its embed task's vectors, for texts and conversations, in any
    encoding; another task, or dimensions, is refused naming the field."""
    expected = np.stack([sentence_transformers.encode(text, normalize_embeddings=True) for text in TEXTS])
    answer = httpx.post(f"{server.url}/pooling", json={"model": "tiny", "input": TEXTS}, timeout=60)
    assert answer.status_code == 200, answer.text
    pooled = answer.json()
    assert pooled["id"].startswith("pool-") and pooled["object"] == "list" and pooled["model"] == "tiny"
    assert [(item["index"], item["object"]) for item in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
    np.testing.assert_allclose([item["data"] for item in pooled["data"]], expected, atol=1e-4)
    conversation = [{"role": "user", "content": TEXTS[0]}]
    embedded = httpx.post(f"{server.url}/v1/embeddings", json={"messages": conversation}, timeout=60).json()
    as_chat = httpx.post(
        f"{server.url}/pooling", json={"messages": conversation, "task": "embed"}, timeout=60
    )
    assert as_chat.status_code == 200, as_chat.text
    np.testing.assert_allclose(as_chat.json()["data"][0]["data"], embedded["data"][0]["embedding"], atol=1e-6)
    as_bytes = httpx.post(
        f"{server.url}/pooling", json={"input": TEXTS, "encoding_format": "bytes"}, timeout=60
    )
    np.testing.assert_allclose(
        np.frombuffer(as_bytes.content, "<f4").reshape(expected.shape), expected, atol=1e-4
    )
    for field, value in [("task", "token_embed"), ("dimensions", 16)]:
        refused = httpx.post(f"{server.url}/pooling", json={"input": TEXTS[0], field: value}, timeout=60)
        assert openai_error(refused, 400)["param"] == field


def test_generation_is_not_served_by_a_pooling_server(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="embeddings only"):
        client.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="runner pooling"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input=TEXTS[0])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--runner", "pooling"], "2_Dense"),
        (["--runner", "draft"], "speculative_config"),
        (["--convert", "classify"], "classification head"),
        (["--pooler-config", '{"normalize": true}'], "use_activation"),
    ],
)
def test_what_cannot_be_served_fails_at_start_naming_it(
    folder: Path, tmp_path: Path, options: list[str], named: str
) -> None:
    """Before the engine starts; embeddings only of a folder whose Dense module kvfleet does not apply."""
    dense = tmp_path / "dense"
    shutil.copytree(folder, dense)
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    completed = CliRunner().invoke(cli, ["serve", str(dense), *options])
    assert completed.exit_code == 2 and named in completed.output, completed.output


def test_a_generation_server_answers_embeddings_404() -> None:
    engine = SimpleNamespace(config=SimpleNamespace(runner="generate", convert="auto"))
    embeddings = OpenAIServingEmbedding(OpenAIService(engine, ServiceSettings("tiny")))  # type: ignore[arg-type]
    body = EmbeddingRequest(input=TEXTS[0])
    with pytest.raises(NotFoundError, match=r"generation only .*embeddings, score and rerank are not served"):
        asyncio.run(embeddings.create_embedding(body, None))
