"""How embeddings are pooled, read as vLLM reads it: a sentence-transformers folder's modules (its Pooling
module's mode, normalized only with a Normalize module), `pooler_config`'s fields over them, a Matryoshka
config's sizes; what kvfleet cannot pool refused with the reason; the runner and convert combinations.
(Served embeddings are checked against sentence-transformers in tests/server/test_server_pooling.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvfleet.runtime.pooler_config import EMBED, GENERATE, PoolerConfig, pooler_config, served_tasks

TRANSFORMER = {"path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}


def _folder(
    tmp_path: Path, modules: list[dict[str, Any]] | None, pooling: dict[str, Any] | None = None
) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    if modules is not None:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(tmp_path)


def test_a_folder_without_sentence_transformers_modules_is_pooled_at_its_last_token_normalized(
    tmp_path: Path,
) -> None:
    assert pooler_config(_folder(tmp_path, None), None) == PoolerConfig("LAST", True)


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "MEAN"),
        ({"pooling_mode_cls_token": True, "include_prompt": True}, "CLS"),
        ({"pooling_mode_lasttoken": True}, "LAST"),
        ({"pooling_mode": "mean"}, "MEAN"),
        ({"pooling_mode": "lasttoken"}, "LAST"),
    ],
)
def test_the_pooling_modules_mode_is_the_pooling(
    tmp_path: Path, pooling: dict[str, Any], expected: str
) -> None:
    config = pooler_config(_folder(tmp_path, [TRANSFORMER, POOLING], pooling), None)
    # As vLLM reads a sentence-transformers folder: normalized only by a Normalize module.
    assert (config.pooling_type, config.use_activation, config.refusal) == (expected, False, None)


def test_a_normalize_module_normalizes_and_the_option_overrides_the_folder(tmp_path: Path) -> None:
    folder = _folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode_cls_token": True})
    assert pooler_config(folder, None) == PoolerConfig("CLS", True)
    overridden = pooler_config(folder, {"pooling_type": "MEAN", "use_activation": False})
    assert overridden == PoolerConfig("MEAN", False)
    assert pooler_config(folder, {"seq_pooling_type": "LAST"}).pooling_type == "LAST"


@pytest.mark.parametrize(
    ("modules", "pooling", "named"),
    [
        ([TRANSFORMER, POOLING, DENSE, NORMALIZE], {"pooling_mode_mean_tokens": True}, "2_Dense"),
        ([TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
        ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "cls"),
        ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True, "include_prompt": False}, "without"),
        ([TRANSFORMER, POOLING], {"pooling_mode": "weightedmean"}, "weightedmean"),
    ],
)
def test_what_kvfleet_cannot_pool_is_a_refusal_naming_it(
    tmp_path: Path, modules: list[dict[str, Any]], pooling: dict[str, Any], named: str
) -> None:
    refusal = pooler_config(_folder(tmp_path, modules, pooling), None).refusal
    assert refusal is not None and named in refusal


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"normalize": True}, "use_activation"),
        ({"pooling_type": "ALL"}, "'ALL'"),
        ({"pooling_type": "MEAN", "seq_pooling_type": "CLS"}, "not both"),
        ({"task": "classify"}, "'classify'"),
        ({"step_tag_id": 3}, "step_tag_id"),
        ({"use_activation": "yes"}, "use_activation"),
        ({"dimensions": 0}, "positive"),
        ({"dimensions": 4}, "is_matryoshka"),
    ],
)
def test_bad_options_are_refused_by_field(tmp_path: Path, option: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match="pooler_config") as caught:
        pooler_config(_folder(tmp_path, None), option)
    assert named in str(caught.value)


def test_matryoshka_sizes_come_from_the_config(tmp_path: Path) -> None:
    folder = _folder(tmp_path, None)
    listed = pooler_config(folder, {"dimensions": 4}, {"matryoshka_dimensions": [4, 2]})
    assert (listed.dimensions, listed.matryoshka_dimensions) == (4, (2, 4))
    with pytest.raises(ValueError, match=r"\[2, 4\] dimensions, not 3"):
        listed.check_dimensions(3)
    # is_matryoshka: any size up to the hidden size.
    anything = pooler_config(folder, None, {"is_matryoshka": True})
    anything.check_dimensions(8)
    with pytest.raises(ValueError, match=r"\[1, 8\] dimensions, not 9"):
        anything.check_dimensions(9)


@pytest.mark.parametrize(
    ("runner", "convert", "tasks"),
    [
        ("auto", "auto", {GENERATE, EMBED}),
        ("auto", "none", {GENERATE}),
        ("auto", "embed", {EMBED}),
        ("generate", "auto", {GENERATE}),
        ("pooling", "auto", {EMBED}),
        ("pooling", "embed", {EMBED}),
    ],
)
def test_what_a_runner_and_convert_serve(runner: str, convert: str, tasks: set[str]) -> None:
    assert served_tasks(runner, convert) == tasks


@pytest.mark.parametrize(
    ("runner", "convert", "named"),
    [
        ("draft", "auto", "speculative_config"),
        ("auto", "classify", "classification"),
        ("generate", "embed", "runner pooling"),
        ("pooling", "none", "convert embed"),
    ],
)
def test_combinations_kvfleet_does_not_serve_are_refused(runner: str, convert: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        served_tasks(runner, convert)
