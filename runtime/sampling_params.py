"""How to sample one request's output: vLLM's names and defaults, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

MAX_LOGPROBS = 20
# The key of SamplingParams.extra_args that carries a request's kv_transfer_params (vLLM's).
KV_TRANSFER_PARAMS = "kv_transfer_params"
# Temperatures below this sample greedily: dividing logits by less overflows them to inf, and the NaN
# probabilities that follow would pick the last token id every time (vLLM's threshold).
GREEDY_TEMPERATURE = 1e-5
# Seeds seed torch generators, which take 64-bit integers; vLLM accepts the signed range. A request with n
# sequences seeds them with seed, seed + 1, ..., seed + n - 1, all of which must be in it.
SEED_RANGE = (-(2**63), 2**63 - 1)
# vLLM's sequence poolings of a prompt's final hidden states (kvfleet.runtime.worker.prompt_pooling).
PromptPooling = Literal["LAST", "MEAN", "CLS"]


@dataclass
class StructuredOutputsParams:
    """Constrains the output to a language (vLLM's names); exactly one of the fields is set.

    json: a JSON schema (a dict, or its JSON text); regex: a regular expression the whole output matches;
    choice: the output is exactly one of these strings; grammar: an EBNF grammar (GBNF style, with a `root`
    rule); json_object: any JSON object; structural_tag: xgrammar's structural tag as JSON text, its
    `format` (tags, JSON schemas, text and their sequences), or vLLM's older `structures` and `triggers`
    (free text, and each trigger opens a tag whose content a JSON schema holds).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        _require(
            len(given) == 1,
            "structured_outputs",
            f"must set exactly one of {', '.join(_STRUCTURED_OUTPUT_KINDS)}, got {given or 'none'}",
        )
        if self.choice is not None:
            _require(
                bool(self.choice) and all(isinstance(item, str) and item for item in self.choice),
                "structured_outputs",
                "choice must be a non-empty list of non-empty strings",
            )
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _require(
                value is None or (isinstance(value, str) and value != ""),
                "structured_outputs",
                f"{name} must be a non-empty string",
            )
        _require(
            self.json_object in (None, True), "structured_outputs", "json_object must be true when given"
        )

    @property
    def kind(self) -> str:
        return next(name for name in _STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 and -1 both mean "no top-k"; stored as 0.
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # Accepts one string or a list; always stored as a list.
    stop: str | list[str] | None = None
    # Accepts None; always stored as a list.
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None = as many as the model's context allows.
    max_tokens: int | None = 16
    min_tokens: int = 0
    # Top-N log probabilities per sampled token; 0 = only the sampled token's.
    logprobs: int | None = None
    # vLLM's: the log probability of each prompt token after the first, with the top N in its place (0: the
    # token's own only) and its rank (RequestOutput.prompt_logprobs).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits of these token ids (OpenAI's logit_bias), each in [-100, 100].
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Never generated: a word's last token is banned wherever the output ends with the tokens before it.
    bad_words: list[str] | None = None
    # What a request asks of the engine beyond sampling (vLLM's): "kv_transfer_params", disaggregated prefill
    # and decode's.
    extra_args: dict[str, Any] | None = None
    # Return the prompt's final hidden states pooled into one vector (what an embedding is made of) with the
    # request's first tokens.
    prompt_pooling: PromptPooling | None = None
    # vLLM's: a stream hands out this request's new tokens once this many are waiting (its first and its
    # last at once), raised to the engine's --stream-interval if below it. None: the engine's.
    stream_interval: int | None = None
    # vLLM's: the most tokens a reasoning may take; once spent, the reasoning's end is written
    # (kvfleet.runtime.worker.thinking_budget). -1 or None: no limit.
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.thinking_token_budget is not None:
            _require_int("thinking_token_budget", self.thinking_token_budget)
            budget = self.thinking_token_budget
            _require(budget >= 0, "thinking_token_budget", f"must be -1 (no limit) or more, got {budget}")
        self._validate()
        if self.greedy:
            # As vLLM's: greedy sampling takes the likeliest token, which no filter would remove.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt token must run, prefix-cache hits or not: each token's logits or hidden
        state is wanted, which the cache (of KV only) does not hold."""
        return self.prompt_logprobs is not None or self.prompt_pooling in ("MEAN", "CLS")

    def _validate(self) -> None:
        _require_int("n", self.n)
        _require(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _require_number(name, getattr(self, name))
            _require(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _require_number("repetition_penalty", self.repetition_penalty)
        _require(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be positive, got {self.repetition_penalty}",
        )
        _require_number("temperature", self.temperature)
        _require(self.temperature >= 0, "temperature", f"must be non-negative, got {self.temperature}")
        _require_number("top_p", self.top_p)
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k)
        _require(self.top_k >= 0, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        _require_number("min_p", self.min_p)
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _require_int("seed", self.seed)
            low, high = SEED_RANGE
            _require(
                low <= self.seed and self.seed + self.n - 1 <= high,
                "seed",
                f"must be in [{low}, {high - self.n + 1}] for n={self.n} (each sequence i is seeded with "
                f"seed + i), got {self.seed}",
            )
        for stop in self.stop:
            _require(
                isinstance(stop, str) and stop != "", "stop", f"must hold non-empty strings, got {stop!r}"
            )
        for token_id in self.stop_token_ids:
            _require_token_id("stop_token_ids", token_id)
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            _require(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _require_int("min_tokens", self.min_tokens)
        _require(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                _require_token_id("logit_bias", token_id)
                _require_number("logit_bias", bias)
                _require(-100 <= bias <= 100, "logit_bias", f"values must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            _require(bool(self.allowed_token_ids), "allowed_token_ids", "must not be empty")
            for token_id in self.allowed_token_ids:
                _require_token_id("allowed_token_ids", token_id)
        _require(
            self.extra_args is None or isinstance(self.extra_args, dict),
            "extra_args",
            "must be a dict or None",
        )
        for word in self.bad_words or ():
            _require(
                isinstance(word, str) and word != "",
                "bad_words",
                f"must hold non-empty strings, got {word!r}",
            )
        if self.stream_interval is not None:
            _require_int("stream_interval", self.stream_interval)
            _require(
                self.stream_interval >= 1,
                "stream_interval",
                f"must be at least 1, got {self.stream_interval}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
                _require(0 <= value <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}], got {value}")


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: a beam search of `beam_width` beams over `max_tokens` steps
    (kvfleet.runtime.engine.beam_search). The beams are scored by the model's logprobs: `temperature` is
    vLLM's field, and sets nothing here."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _require_int("beam_width", self.beam_width)
        # Each step scores each beam's 2 x beam_width likeliest next tokens.
        most = MAX_LOGPROBS // 2
        _require(1 <= self.beam_width <= most, "beam_width", f"must be in [1, {most}], got {self.beam_width}")
        _require_int("max_tokens", self.max_tokens)
        _require(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _require_number("length_penalty", self.length_penalty)
        _require_number("temperature", self.temperature)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


def _require_int(name: str, value: object) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool), name, f"must be an int, got {value!r}")
    return value  # type: ignore[return-value]


def _require_token_id(name: str, value: object) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        name,
        f"must hold non-negative token ids, got {value!r}",
    )


def _require_number(name: str, value: object) -> float:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    _require(is_number and math.isfinite(value), name, f"must be a finite number, got {value!r}")  # type: ignore[arg-type]
    return value  # type: ignore[return-value]
