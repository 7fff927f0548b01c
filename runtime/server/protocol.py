"""Request bodies of the OpenAI API (plus vLLM's sampling extras), and their translation to SamplingParams.

Unknown fields are ignored, as OpenAI clients send fields (`store`, `metadata`, ...) that change nothing
here. Fields that would change the output but are not supported are refused, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.server.errors import BadRequestError
from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationRequest(_Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # kvfleet's: an SLA tier name or an integer (lower = served first), and a deadline in seconds.
    priority: int | str | None = None
    timeout: float | None = Field(default=None, gt=0)

    def _check_common(self) -> None:
        if self.logit_bias:
            raise BadRequestError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        given = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
        }
        # Absent fields keep SamplingParams' defaults (which are OpenAI's).
        kwargs = {name: value for name, value in given.items() if value is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, **kwargs)
        except ValueError as exc:
            message = str(exc)
            param = message.split(" ", 1)[0]
            raise BadRequestError(
                message, param=param if param in given or param == "max_tokens" else None
            ) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise BadRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequestError("best_of different from n is not supported", param="best_of")
        if self.echo and self.logprobs is not None:
            raise BadRequestError("echo together with logprobs is not supported", param="echo")
        return self._sampling_params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a batch of strings or of token lists is split, a token list kept whole."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise BadRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(item, int) for item in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_input(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self._text(index)}
        if self.name is not None:
            message["name"] = self.name
        return message

    def _text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part_index, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequestError(
                    f"only text content parts are supported, got type {part.get('type')!r}",
                    param=f"messages.{index}.content.{part_index}",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if not self.messages:
            raise BadRequestError("messages must not be empty", param="messages")
        if self.tools:
            raise BadRequestError("tool calling is not supported", param="tools")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise BadRequestError("only the text response_format is supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.as_template_input(index) for index, message in enumerate(self.messages)]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequestError("give exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
