"""`--speculative-config`: vLLM's JSON object, parsed and checked once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvfleet.runtime.json_options import json_object

SpeculativeMethod = Literal["ngram", "draft_model"]
_METHODS: tuple[str, ...] = ("ngram", "draft_model")
_KEYS = {
    "ngram": {
        "method",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "disable_by_batch_size",
    },
    "draft_model": {"method", "model", "num_speculative_tokens", "disable_by_batch_size"},
}
# vLLM's default n-gram window when neither bound is given.
_DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix of the context looked up earlier in it.
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    # draft_model: the draft model's folder.
    model: str | None = None
    # Steps whose running batch has at least this many requests do not speculate (it costs compute that a
    # large batch no longer has spare). None: always speculate.
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the JSON text of the flag or the dict of `LLM(speculative_config=...)`; raises ValueError
        naming what is wrong."""
        value = json_object(value, "speculative_config")
        method = value.get("method")
        if method not in _METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(_METHODS)}, got {method!r}"
            )
        unknown = sorted(set(value) - _KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config for method {method!r} does not take {', '.join(unknown)}")
        num_tokens = _positive_int(value, "num_speculative_tokens", required=True)
        disable_by_batch_size = _positive_int(value, "disable_by_batch_size", required=False)
        if method == "ngram":
            lookup_min = _positive_int(value, "prompt_lookup_min", required=False)
            lookup_max = _positive_int(value, "prompt_lookup_max", required=False)
            # As in vLLM: a missing bound takes the other's value.
            lookup_min = lookup_min or lookup_max or _DEFAULT_PROMPT_LOOKUP
            lookup_max = lookup_max or lookup_min
            if lookup_min > lookup_max:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min ({lookup_min}) exceeds "
                    f"prompt_lookup_max ({lookup_max})"
                )
            return cls(method, num_tokens, lookup_min, lookup_max, None, disable_by_batch_size)
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model must name the draft model's folder")
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"speculative_config.model: {model!r} is not a model folder (no config.json)")
        return cls(method, num_tokens, model=model, disable_by_batch_size=disable_by_batch_size)

    def check_draft_tokenizer(self, target_tokenizer: str) -> None:
        """Raises ValueError unless the draft model's tokenizer maps every token as the target's does."""
        from transformers import AutoTokenizer  # only when a draft model is configured: a heavy import

        assert self.model is not None
        try:
            draft = AutoTokenizer.from_pretrained(self.model)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"speculative_config.model: cannot load the draft model's tokenizer: {error}"
            ) from None
        try:
            target = AutoTokenizer.from_pretrained(target_tokenizer)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"cannot load the tokenizer to compare the draft model's with: {error}"
            ) from None
        if draft.get_vocab() != target.get_vocab():
            raise ValueError(
                "speculative_config.model: the draft model's tokenizer differs from the target's "
                f"({len(draft.get_vocab())} tokens against {len(target.get_vocab())}, or as many mapped "
                "otherwise); draft and target must share one tokenizer"
            )


def _positive_int(value: dict[str, Any], key: str, *, required: bool) -> int | None:
    number = value.get(key)
    if number is None:
        if required:
            raise ValueError(f"speculative_config.{key} is required")
        return None
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ValueError(f"speculative_config.{key} must be a positive integer, got {number!r}")
    return number
