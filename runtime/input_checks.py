"""What makes a prompt servable, each rule written once: the engine core, the scheduler and, earlier, the
OpenAI service apply them."""

from __future__ import annotations

from kvfleet.runtime.errors import InvalidRequestError
from kvfleet.runtime.sampling_params import SamplingParams


class ContextLengthError(InvalidRequestError):
    """A prompt and the tokens it asks for do not fit the model's context."""

    def __init__(self, num_prompt_tokens: int, num_output_tokens: int, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        self.max_model_len = max_model_len
        # Whether the prompt alone leaves room for what every request may ask: one token of output.
        self.output_too_long = num_prompt_tokens + min(num_output_tokens, 1) <= max_model_len
        if self.output_too_long:
            reason = f"and {num_output_tokens} are asked for, more than"
        elif num_output_tokens:
            reason = "leaving no room for output in"
        else:
            reason = "more than"
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens, {reason} the model's context (max_model_len) of "
            f"{max_model_len} tokens"
        )


MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(cache_salt: object) -> None:
    """vLLM's cache_salt, when given, is a non-empty string; bounded, as it is hashed into every block."""
    if not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"
        )


def check_context_length(num_prompt_tokens: int, max_model_len: int, num_output_tokens: int = 1) -> None:
    """The prompt-length rule: a prompt and the `num_output_tokens` it must be able to generate fit the
    model's context. A request is served only if it leaves room for at least one token of output (a
    prompt as long as the context has none); the scheduler, which samples one token from any prompt it
    holds, asks only that the prompt fit (`num_output_tokens` 0)."""
    if num_prompt_tokens + num_output_tokens > max_model_len:
        raise ContextLengthError(num_prompt_tokens, num_output_tokens, max_model_len)


def check_prompt_token_ids(
    prompt_token_ids: list[int],
    stop_token_ids: list[int],
    *,
    vocab_size: int,
    max_model_len: int,
    max_tokens: int | None = None,
) -> None:
    """Raises InvalidRequestError for token ids the engine cannot serve, ContextLengthError for a prompt
    that leaves no room for its output: one token, or `max_tokens` where the caller holds a request to it."""
    check_context_length(len(prompt_token_ids), max_model_len, 1 if max_tokens is None else max_tokens)
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    bad_stop = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise InvalidRequestError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab_size})")


def check_resumed_token_ids(token_ids: list[int], *, vocab_size: int, max_tokens: int | None) -> None:
    """A continuation's resumed output (the tokens a sequence already delivered): ids of the vocabulary, and
    no more of them than the request may generate."""
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"resumed token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    if max_tokens is not None and len(token_ids) > max_tokens:
        raise InvalidRequestError(
            f"{len(token_ids)} resumed tokens are more than the request's max_tokens ({max_tokens})"
        )


def check_sampling_token_ids(params: SamplingParams, *, vocab_size: int) -> None:
    """Raises InvalidRequestError for logit_bias or allowed_token_ids outside the vocabulary."""
    for name, token_ids in (
        ("logit_bias", params.logit_bias),
        ("allowed_token_ids", params.allowed_token_ids),
    ):
        bad = [t for t in token_ids or () if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
