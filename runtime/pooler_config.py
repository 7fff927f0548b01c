"""How a model's embeddings are made, and what a server serves, as vLLM's runner, convert and pooler_config
(`--runner`, `--convert`, `--pooler-config`) set them.

kvfleet pools a decoder model's final hidden states (vLLM's `--convert embed` of a causal LM): by default the
last token's, L2-normalized. A sentence-transformers folder says otherwise in its own files (modules.json and
its Pooling module's config.json), which vLLM reads, and pooler_config overrides them field by field. What
kvfleet cannot pool as the folder says (a Dense projection, max pooling) makes its embeddings refused with the
reason rather than served wrong.

Torch-free: the server's options are checked before the engine loads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

from kvfleet.runtime.hf_config import read_hf_config
from kvfleet.runtime.sampling_params import PromptPooling

T = TypeVar("T")
Runner = Literal["auto", "generate", "pooling", "draft"]
Convert = Literal["auto", "none", "embed", "classify"]
# What a server answers: generation (completions, chat completions, responses) and embeddings (embeddings,
# score, rerank).
GENERATE = "generate"
EMBED = "embed"

_POOLING_TYPES: tuple[str, ...] = get_args(PromptPooling)
# vLLM's pooler-config fields kvfleet takes; the others it names in its refusal.
_TAKEN_FIELDS = ("task", "pooling_type", "seq_pooling_type", "use_activation", "dimensions")
_ST_MODULES = "modules.json"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# A sentence-transformers Pooling config's modes, by vLLM's pooling names (the others kvfleet does not pool).
_ST_POOLING_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}
_ST_POOLING_NAMES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: PromptPooling = "LAST"
    # vLLM's use_activation for embeddings: L2-normalized.
    use_activation: bool = True
    # Matryoshka: the size embeddings are cut to unless a request asks for another; None: the whole vector.
    dimensions: int | None = None
    # The sizes a request's `dimensions` may take: None for a model not trained to be cut (refused), all of
    # [1, hidden size] unless the config lists some (matryoshka_dimensions).
    matryoshka_dimensions: tuple[int, ...] | None = None
    # Why the folder's embeddings are not served (what its sentence-transformers modules do that kvfleet
    # does not); None: they are.
    refusal: str | None = None

    def embedding(
        self, pooled: list[float], dimensions: int | None, use_activation: bool | None
    ) -> list[float]:
        """A pooled prompt as its embedding, in the order of vLLM's embedding head: cut to `dimensions`, then
        L2-normalized where `use_activation` says (each None: as this config says)."""
        vector = pooled[: dimensions or self.dimensions]
        normalizes = self.use_activation if use_activation is None else use_activation
        return normalized(vector) if normalizes else vector

    def check_dimensions(self, dimensions: int) -> None:
        """Raises ValueError where `dimensions` is not a size this model's embeddings may be cut to."""
        if self.matryoshka_dimensions is None:
            raise ValueError(
                "this model's embeddings have one size (it was not trained to be cut: no is_matryoshka or "
                "matryoshka_dimensions in its config)"
            )
        if dimensions not in self.matryoshka_dimensions:
            sizes = self.matryoshka_dimensions
            listed = f"[1, {sizes[-1]}]" if sizes == tuple(range(1, len(sizes) + 1)) else str(list(sizes))
            raise ValueError(f"this model's embeddings may be cut to {listed} dimensions, not {dimensions}")


def normalized(vector: list[float]) -> list[float]:
    """`vector` L2-normalized (a zero vector as it is)."""
    norm = math.sqrt(math.fsum(value * value for value in vector))
    return [value / norm for value in vector] if norm > 0 else vector


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two embeddings: a score, as vLLM scores with an embedding model."""
    return math.fsum(x * y for x, y in zip(normalized(a), normalized(b), strict=True))


def score_pairs(first: list[T], second: list[T]) -> tuple[list[T], list[T]]:
    """What is scored against what, as vLLM pairs them: one of the first against each of the second, or the
    two pair by pair; ValueError for lists of other lengths (naming `first`'s count first)."""
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"{len(first)} against {len(second)}: give one, or as many as there are to score")
    return first, second


def served_tasks(runner: str, convert: str) -> frozenset[str]:
    """What a server of this runner and convert answers; raises ValueError for the combinations
    kvfleet does not serve. By default (auto, auto) both: kvfleet embeds with the generating model, where
    vLLM serves one or the other."""
    if runner == "draft":
        raise ValueError("runner draft: a draft model runs inside a server, by speculative_config")
    if convert == "classify":
        raise ValueError(
            "convert classify: kvfleet serves no classification head; it pools a decoder's hidden states "
            "into embeddings (convert embed)"
        )
    if runner == "generate":
        if convert == "embed":
            raise ValueError("convert embed serves embeddings: it needs runner pooling or auto")
        return frozenset({GENERATE})
    if runner == "pooling":
        if convert == "none":
            raise ValueError(
                "a decoder model is pooled once converted: convert embed (or auto) with runner pooling"
            )
        return frozenset({EMBED})
    return {"auto": frozenset({GENERATE, EMBED}), "none": frozenset({GENERATE}), "embed": frozenset({EMBED})}[
        convert
    ]


def pooler_config(
    model_dir: str, option: dict[str, Any] | None, hf_overrides: dict[str, Any] | None = None
) -> PoolerConfig:
    """The folder's pooling (its sentence-transformers files, else vLLM's default for a causal LM) with
    `pooler_config`'s fields over it; raises ValueError naming a field it cannot take."""
    given = _parsed_option(option or {})
    from_folder = _sentence_transformers_pooling(Path(model_dir))
    config = read_hf_config(model_dir, hf_overrides)
    text_config = config.get("text_config") or config
    hidden_size = int(text_config.get("hidden_size", 0))
    matryoshka = config.get("matryoshka_dimensions")
    sizes: tuple[int, ...] | None = None
    if matryoshka:
        sizes = tuple(sorted(int(size) for size in matryoshka))
    elif config.get("is_matryoshka"):
        sizes = tuple(range(1, hidden_size + 1))
    merged = {**from_folder, **given}
    pooler = PoolerConfig(
        pooling_type=merged.get("pooling_type", "LAST"),
        use_activation=merged.get("use_activation", True),
        dimensions=given.get("dimensions"),
        matryoshka_dimensions=sizes,
        refusal=merged.get("refusal"),
    )
    if pooler.dimensions is not None:
        try:
            pooler.check_dimensions(pooler.dimensions)
        except ValueError as error:
            raise ValueError(f"pooler_config dimensions: {error}") from None
    return pooler


def _parsed_option(option: dict[str, Any]) -> dict[str, Any]:
    """pooler_config's fields, as the names above; raises ValueError for what kvfleet does not take."""
    if "normalize" in option:
        raise ValueError("pooler_config: normalize was removed from vLLM's pooler config; use use_activation")
    unknown = sorted(set(option) - set(_TAKEN_FIELDS))
    if unknown:
        raise ValueError(
            f"pooler_config: {unknown[0]} is not taken by kvfleet, which pools sequences into embeddings "
            f"({', '.join(_TAKEN_FIELDS)})"
        )
    if option.get("task", "embed") != "embed":
        raise ValueError(f"pooler_config task: kvfleet serves the embed task, not {option['task']!r}")
    if "pooling_type" in option and "seq_pooling_type" in option:
        raise ValueError("pooler_config: set pooling_type or seq_pooling_type, not both")
    parsed: dict[str, Any] = {}
    pooling_type = option.get("seq_pooling_type", option.get("pooling_type"))
    if pooling_type is not None:
        if pooling_type not in _POOLING_TYPES:
            raise ValueError(
                f"pooler_config pooling_type must be one of {', '.join(_POOLING_TYPES)} (kvfleet pools "
                f"sequences), not {pooling_type!r}"
            )
        parsed["pooling_type"] = pooling_type
    if "use_activation" in option:
        if not isinstance(option["use_activation"], bool):
            raise ValueError("pooler_config use_activation must be true or false")
        parsed["use_activation"] = option["use_activation"]
    dimensions = option.get("dimensions")
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
            raise ValueError("pooler_config dimensions must be a positive integer")
        parsed["dimensions"] = dimensions
    return parsed


def _sentence_transformers_pooling(folder: Path) -> dict[str, Any]:
    """What a sentence-transformers folder's modules say (as vLLM reads them: normalized only with a
    Normalize module), or nothing for another folder."""
    try:
        modules = json.loads((folder / _ST_MODULES).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ValueError(f"{_ST_MODULES} cannot be read: {error}") from None
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise ValueError(f"{_ST_MODULES} must be a list of modules (objects)")
    found: dict[str, Any] = {"use_activation": any(m.get("type") == _ST_NORMALIZE for m in modules)}
    for module in modules:
        kind = module.get("type")
        if kind == _ST_POOLING:
            found.update(_st_pooling_mode(folder / str(module.get("path", "")) / "config.json"))
        elif kind not in (_ST_TRANSFORMER, _ST_NORMALIZE):
            found["refusal"] = (
                f"the model's sentence-transformers module {module.get('path')!r} ({kind}) is not applied by "
                "kvfleet, so its embeddings would not be the model's"
            )
    return found


def _st_pooling_mode(path: Path) -> dict[str, Any]:
    try:
        pooling = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"the sentence-transformers pooling config {path.name} cannot be read: {error}"
        ) from None
    if isinstance(pooling.get("pooling_mode"), str):
        modes = [pooling["pooling_mode"]]
        poolings = [_ST_POOLING_NAMES.get(pooling["pooling_mode"])]
    else:
        modes = [key for key in _ST_POOLING_MODES if pooling.get(key) is True]
        poolings = [_ST_POOLING_MODES[key] for key in modes]
    without_prompt = pooling.get("include_prompt", True) is not True
    if len(modes) != 1 or poolings[0] is None or without_prompt:
        named = ", ".join(modes) or "none"
        return {
            "refusal": f"the model's sentence-transformers pooling ({named}"
            f"{', without the prompt' if without_prompt else ''}) is not one kvfleet pools (the last token, "
            "the first, or the mean)"
        }
    return {"pooling_type": poolings[0]}
