"""What makes a prompt servable: one rule, applied by the engine core and, earlier, by the API server."""

from __future__ import annotations

from kvfleet.runtime.engine.errors import InvalidRequestError
from kvfleet.runtime.sampling_params import SamplingParams


def check_prompt_token_ids(
    prompt_token_ids: list[int], stop_token_ids: list[int], *, vocab_size: int, max_model_len: int
) -> None:
    """Raises InvalidRequestError for token ids the engine cannot serve."""
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    bad_stop = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise InvalidRequestError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_token_ids)} tokens, but the model's context is {max_model_len} "
            "tokens, leaving no room for output"
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
