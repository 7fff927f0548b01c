"""vLLM's offline `LLM.embed()` against sentence-transformers on a sentence-transformers folder (the tiny
model pooled at its first token and normalized by a Normalize module): each prompt's PoolingParams cut a
Matryoshka embedding before it is normalized, or leave it unnormalized; a prompt the model fails on is named;
an engine's runner and convert decide which of generate() and embed() it serves; `LLM.score()` is the cosine
similarity of two embeddings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvfleet.runtime import LLM, PoolingParams, SamplingParams
from kvfleet.runtime.core.outputs import SchedulerOutput
from kvfleet.runtime.errors import RequestFailedError
from sentence_transformers import SentenceTransformer
from sentence_transformers_folders import sentence_transformers_folder

TEXTS = ["Once upon a time", "The weather in Paris is mild, with rain on most days of the year."]


@pytest.fixture(scope="module")
def folder(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sentence-transformers-cls") / "tiny"
    return sentence_transformers_folder(tiny_llama, folder, "pooling_mode_cls_token", normalize=True)


def test_embed_is_sentence_transformers_encode(folder: Path) -> None:
    llm = LLM(str(folder), dtype="float32", runner="pooling", hf_overrides={"is_matryoshka": True})
    model = SentenceTransformer(str(folder), device="cpu")
    outputs = llm.embed(TEXTS, use_tqdm=False)
    expected = np.stack([model.encode(text) for text in TEXTS])
    np.testing.assert_allclose([output.outputs.embedding for output in outputs], expected, atol=1e-4)
    assert all(output.finished and output.prompt_token_ids for output in outputs)

    cut = SentenceTransformer(str(folder), device="cpu", truncate_dim=8)
    # sentence-transformers cuts after its Normalize module: normalizing again gives vLLM's order.
    expected_cut = [cut.encode(text, normalize_embeddings=True) for text in TEXTS]
    raw = llm.embed(TEXTS, pooling_params=[PoolingParams(dimensions=8), PoolingParams(use_activation=False)])
    np.testing.assert_allclose(raw[0].outputs.embedding, expected_cut[0], atol=1e-4)
    # Unnormalized: the first token's hidden state, in the direction of the normalized one.
    assert np.linalg.norm(raw[1].outputs.embedding) != pytest.approx(1.0)
    np.testing.assert_allclose(
        raw[1].outputs.embedding / np.linalg.norm(raw[1].outputs.embedding), expected[1], atol=1e-4
    )
    with pytest.raises(ValueError, match=r"\[1, 64\] dimensions, not 65"):
        llm.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="generate\\(\\) is not served by an engine of runner pooling"):
        llm.generate(TEXTS[0], SamplingParams(max_tokens=1))


def test_a_prompt_the_model_fails_on_is_named_and_the_engine_goes_on(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(folder), dtype="float32", runner="pooling")
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS[0])
    poisoned = llm.get_tokenizer().encode(TEXTS[1])
    executor = llm.llm_engine.engine_core.executor
    execute: Callable[[SchedulerOutput], Any] = executor.execute_model

    def fail_on_the_poisoned_prompt(scheduler_output: SchedulerOutput) -> Any:
        if any(request.prompt_token_ids == poisoned for request in scheduler_output.requests):
            raise RuntimeError("poisoned input")
        return execute(scheduler_output)

    monkeypatch.setattr(executor, "execute_model", fail_on_the_poisoned_prompt)
    with pytest.raises(
        RequestFailedError, match=r"the engine failed on prompts \[1\] \(error\): no embedding"
    ):
        llm.embed(TEXTS, use_tqdm=False)
    (alone,) = llm.embed(TEXTS[:1], use_tqdm=False)
    np.testing.assert_allclose(alone.outputs.embedding, expected, atol=1e-4)


def test_score_is_the_cosine_similarity_sentence_transformers_gives(folder: Path) -> None:
    llm = LLM(str(folder), dtype="float32", runner="pooling")
    model = SentenceTransformer(str(folder), device="cpu")
    documents = [*TEXTS, "A third, unrelated sentence about markets."]
    embeddings = np.stack([model.encode(text) for text in [TEXTS[0], *documents]])
    expected = model.similarity(embeddings[:1], embeddings[1:])[0].tolist()
    one_to_many = llm.score(TEXTS[0], documents, use_tqdm=False)
    np.testing.assert_allclose([output.outputs.score for output in one_to_many], expected, atol=1e-4)
    pairwise = llm.score([TEXTS[0]] * 2, documents[:2], use_tqdm=False)
    np.testing.assert_allclose([output.outputs.score for output in pairwise], expected[:2], atol=1e-4)
    with pytest.raises(ValueError, match="2 against 3"):
        llm.score(TEXTS, documents, use_tqdm=False)


def test_a_generation_engine_does_not_embed(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", convert="none")
    with pytest.raises(
        ValueError, match="embed\\(\\) is not served by an engine of runner auto and convert none"
    ):
        llm.embed(TEXTS[0])
