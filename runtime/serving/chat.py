"""POST /v1/chat/completions: the model folder's chat template turns the messages into one prompt; the
answer is a message, with the calls the model made when it may call tools. With a reasoning parser, what the
model reasons before it answers is the message's `reasoning_content` (and `reasoning`, vLLM's newer name),
streamed before the content, and calls are read from the content alone."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from kvfleet.runtime.engine.outputs import CompletionOutput
from kvfleet.runtime.pooler_config import GENERATE
from kvfleet.runtime.reasoning import ReasoningParser, ReasoningStream
from kvfleet.runtime.request import PromptTokenLogprobs
from kvfleet.runtime.safety.guardrails import Decision, redact_pieces
from kvfleet.runtime.sampling_params import StructuredOutputsParams
from kvfleet.runtime.serving.media import load_chat_media
from kvfleet.runtime.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    message_text,
    template_messages,
    usage,
)
from kvfleet.runtime.serving.request import PreparedRequest, Prompt
from kvfleet.runtime.serving.responses import (
    Choice,
    ChoiceBuilder,
    answered_logprob,
    prompt_logprobs_body,
    token_id_name,
    top_logprobs,
)
from kvfleet.runtime.serving.safety import RequestSafety
from kvfleet.runtime.serving.token_names import TokenNames
from kvfleet.runtime.serving.tool_calls import OutputReading, ParsedCall, ToolCalling, new_call_id

if TYPE_CHECKING:
    from kvfleet.runtime.serving.service import OpenAIService, ServiceSettings


class ChatRoute:
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    keeps_request_id = False
    task = GENERATE
    reports_cached_tokens = False

    def __init__(self, body: ChatCompletionRequest, settings: ServiceSettings) -> None:
        self.body = body
        self.settings = settings
        self.template_kwargs = settings.chat_rendering.chat_template_kwargs(body)
        self.tokens_as_ids = body.tokens_as_ids(settings.return_tokens_as_token_ids)
        # The prompt as the model reads it, when the input is checked.
        self.rendered: str | None = None
        # The server's reasoning parser, and whether this answer begins with reasoning (known with the
        # prompt).
        self.reasoning: ReasoningParser | None = None
        self.opens_in_reasoning = False
        # vLLM's echo: the text an answer in the last message's role begins with, that message's (known with
        # the prompt, as the model reads it).
        self.echo = ""

    @property
    def role(self) -> str:
        """As vLLM's: the server's response role for an answer the generation prompt opens; otherwise the
        answer goes on with the last message, in its role (read once the prompt has checked the messages)."""
        if self.body.add_generation_prompt:
            return self.settings.response_role
        return self.body.messages[-1].role

    @cached_property
    def tool_calling(self) -> ToolCalling | None:
        return ToolCalling.of(
            self.body, self.settings.tool_call_parser, self.settings.enable_auto_tool_choice
        )

    @property
    def tool_constraint(self) -> StructuredOutputsParams | None:
        return self.tool_calling.constraint() if self.tool_calling else None

    async def prompt(self, service: OpenAIService, safety: RequestSafety | None) -> Prompt:
        """The conversation rendered by the chat template, its media placed."""
        messages = self.body.messages
        if safety is not None:
            safety.prompt = _last_user_text(messages)
            if safety.redacts_input:
                messages = await _redacted(safety, messages)
        if self.body.echo and messages[-1].role == self.role:
            self.echo = message_text(messages[-1].as_template_input(len(messages) - 1))
        media = await load_chat_media(service.engine.config, messages)
        token_ids = await self.render(service, messages)
        self.reasoning = service.reasoning
        if self.reasoning is not None:
            self.opens_in_reasoning = self.reasoning.opens_in_reasoning(self.template_kwargs)
        # Checked as the model reads it: the tools, the calls and all else the template puts in.
        self.rendered = await service.prompt_text(token_ids) if safety is not None else None
        mm_features = []
        if media is not None:
            token_ids, mm_features = await media.expand(token_ids)
        return Prompt([token_ids], ["messages"], [mm_features])

    async def render(self, service: OpenAIService, messages: list[ChatMessage]) -> list[int]:
        """`messages` rendered by the chat template with the request's tools and variables, tokenized."""
        body = self.body
        return await service.chat_prompt(
            messages,
            body.add_generation_prompt,
            self.settings.chat_rendering.tools(body),
            self.template_kwargs,
            body.continue_final_message,
            body.chat_template,
        )

    def input_text(self, service: OpenAIService, safety: RequestSafety | None) -> str | None:
        return self.rendered

    def response(
        self,
        request: PreparedRequest,
        choices: list[list[Choice]],
        tokenizer: Any,
        cached_tokens: int | None,
    ) -> dict[str, Any]:
        entries = []
        for index, choice in enumerate(choices[0]):
            message: dict[str, Any] = {"role": self.role, "content": choice.text}
            if self.reasoning is not None:
                split = self.reasoning.extract_reasoning(choice.text, choice.token_ids, self.template_kwargs)
                reasoning = split.reasoning if self.body.include_reasoning else None
                message.update(_reasoning_fields(reasoning), content=split.content)
            finish_reason = choice.finish_reason
            calls = _calls(self.tool_calling, message["content"] or "", finish_reason)
            if calls is not None:
                message["content"], parsed = calls
                message["tool_calls"] = [call.as_openai() for call in parsed]
                finish_reason = "tool_calls"
            if self.echo:
                message["content"] = self.echo + (message["content"] or "")
            entry = {
                "index": index,
                "message": message,
                "logprobs": self._logprobs(TokenNames(tokenizer), choice.token_ids, choice.logprobs),
                "finish_reason": finish_reason,
                "stop_reason": choice.stop_reason,
            }
            if self.body.return_token_ids:
                entry["token_ids"] = choice.token_ids
            entries.append(entry)
        response = {
            "id": request.request_id,
            "object": "chat.completion",
            "created": request.created,
            "model": request.model,
            "choices": entries,
            "usage": usage(
                len(request.prompt_token_ids[0]),
                sum(len(choice.token_ids) for choice in choices[0]),
                cached_tokens,
            ),
            **self.first_chunk_fields(request),
        }
        prompt_logprobs = choices[0][0].prompt_logprobs
        if self.body.prompt_logprobs is not None and prompt_logprobs is not None:
            # vLLM's: the rendered conversation's tokens, once for all choices.
            response["prompt_logprobs"] = prompt_logprobs_body(
                tokenizer, request.prompt_token_ids[0], prompt_logprobs
            )
        return response

    def _logprobs(
        self, names: TokenNames, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> dict[str, Any] | None:
        """`names`: the choice's, which name its tokens in order."""
        if logprobs is None:
            return None
        limit = self.body.top_logprobs or 0
        as_ids = self.tokens_as_ids
        content = []
        for token_id, entry in zip(token_ids, logprobs, strict=False):
            named = names.next(token_id, entry)
            text = named[token_id]
            # As vLLM's: a token named by its id still has its text's bytes, while an alternative has its
            # name's.
            content.append(
                {
                    "token": token_id_name(token_id) if as_ids else text,
                    "logprob": answered_logprob(entry[token_id]),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": name, "logprob": logprob, "bytes": list(name.encode())}
                        for name, logprob in top_logprobs(named, entry, limit, as_ids)
                    ],
                }
            )
        return {"content": content}

    def preamble(self, request: PreparedRequest) -> list[dict[str, Any]]:
        """Every choice's role, first; then the echo of each, where there is one."""
        deltas = [{"role": self.role, "content": ""}] + ([{"content": self.echo}] if self.echo else [])
        return [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            for delta in deltas
            for index in range(request.params.n)
        ]

    def first_chunk_fields(self, request: PreparedRequest) -> dict[str, Any]:
        """The prompt's token ids, when asked for (in the response, or the stream's first chunk)."""
        return {"prompt_token_ids": request.prompt_token_ids[0]} if self.body.return_token_ids else {}

    def choice_builder(
        self,
        request: PreparedRequest,
        tokenizer: Any,
        prompt_logprobs: Mapping[int, list[PromptTokenLogprobs | None]],
    ) -> ChoiceBuilder:
        """A chat stream sends no prompt logprobs, as in vLLM."""
        builder = self._content_builder(request, tokenizer)
        if self.reasoning is not None:
            streams = [self.reasoning.stream(self.template_kwargs) for _ in range(request.params.n)]
            builder = _reasoning_first(streams, builder, self.body.include_reasoning)
        return _carrying_token_ids(builder) if self.body.return_token_ids else builder

    def _content_builder(self, request: PreparedRequest, tokenizer: Any) -> ChoiceBuilder:
        if self.tool_calling is not None:
            return _ToolCallStream(self.tool_calling, request.params.n)

        names = [TokenNames(tokenizer) for _ in range(request.params.n)]
        # As vLLM's: a chunk's content is there when empty too, unless reasoning may come in its place.
        empty_content = self.reasoning is None

        def choice_of(_: int, completion: CompletionOutput, finished: bool) -> list[dict[str, Any]]:
            if not (completion.text or finished or completion.logprobs):
                return []
            logprobs = self._logprobs(names[completion.index], completion.token_ids, completion.logprobs)
            return [
                {
                    "index": completion.index,
                    "delta": {"content": completion.text} if completion.text or empty_content else {},
                    "logprobs": logprobs,
                }
            ]

        return choice_of


def _reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """vLLM's two names for the reasoning: reasoning_content, and reasoning (its newer one)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def _reasoning_first(streams: list[ReasoningStream], builder: ChoiceBuilder, include: bool) -> ChoiceBuilder:
    """Each choice's reasoning as reasoning deltas (unless not to `include` it), and its content through
    `builder`: the reasoning of a delta joins the first choice the builder makes of its content, or goes in a
    choice of its own."""

    def choice_of(prompt_index: int, completion: CompletionOutput, finished: bool) -> list[dict[str, Any]]:
        reasoning, content = streams[completion.index].feed(
            completion.text, completion.token_ids, finished=finished
        )
        choices = builder(prompt_index, replace(completion, text=content), finished)
        if not reasoning or not include:
            return choices
        first = choices[0] if choices else {"index": completion.index, "delta": {}, "logprobs": None}
        first = {**first, "delta": {**_reasoning_fields(reasoning), **first["delta"]}}
        return [first, *choices[1:]]

    return choice_of


def _carrying_token_ids(builder: ChoiceBuilder) -> ChoiceBuilder:
    """The builder's choices, the last of each delta carrying the delta's token ids: in a choice of its own
    when the builder sends nothing yet (text held back), so that the stream's ids add up to the answer's."""

    def choice_of(prompt_index: int, completion: CompletionOutput, finished: bool) -> list[dict[str, Any]]:
        choices = builder(prompt_index, completion, finished)
        if not completion.token_ids:
            return choices
        if not choices:
            choices = [{"index": completion.index, "delta": {}, "logprobs": None}]
        return [*choices[:-1], {**choices[-1], "token_ids": completion.token_ids}]

    return choice_of


def _last_user_text(messages: list[ChatMessage]) -> str | None:
    conversation = template_messages(messages)
    return next(
        (message_text(message) for message in reversed(conversation) if message["role"] == "user"), None
    )


async def _redacted(safety: RequestSafety, messages: list[ChatMessage]) -> list[ChatMessage]:
    """The messages with what the input checkers found redacted, each checked on its own."""
    texts = [message_text(message) for message in template_messages(messages)]
    decisions = await asyncio.gather(*(safety.checked_input(text) for text in texts))
    return [
        message if decision.text == text else _with_redactions(message, decision)
        for message, text, decision in zip(messages, texts, decisions, strict=True)
    ]


def _with_redactions(message: ChatMessage, decision: Decision) -> ChatMessage:
    """The message with its text redacted; with images or audio, each text part on its own, so that every
    part stays where the client put it."""
    if not isinstance(message.content, list):
        return message.model_copy(update={"content": decision.text})
    texts = [part.text for part in message.content if part.is_text]
    redacted = iter(redact_pieces(texts, decision.findings))
    content = [
        part.model_copy(update={"text": next(redacted)}) if part.is_text else part for part in message.content
    ]
    return message.model_copy(update={"content": content})


def _calls(
    tool_calling: ToolCalling | None, text: str, finish_reason: str | None
) -> tuple[str | None, list[ParsedCall]] | None:
    """(content, calls) of a finished answer that made calls, else None: its text is all content."""
    if tool_calling is None or finish_reason != "stop":
        return None
    content, calls = tool_calling.extract(text)
    return (content, calls) if calls else None


class _ToolCallStream:
    """Streams an answer that may hold calls. Text that cannot be part of a call goes out as content as it
    comes. A call is announced (index, id, type, name, arguments "") once its name is written, then its
    arguments follow as the model writes them. What a parser cannot yet place is held back: with `hermes`,
    text from `<tool_call>` (or a tail that may begin one) until the call's name is read; with `llama3_json`,
    an output that begins with `{` until the name is read; content after a call waits for the end.

    A call announced cannot be taken back: if the output then strays from the format, the text not yet sent
    as content follows as content, and the answer finishes as a plain one. A call cut short (max_tokens)
    keeps the arguments sent, as OpenAI's streams do. Log probabilities are not streamed."""

    def __init__(self, tool_calling: ToolCalling, n: int) -> None:
        self.tool_calling = tool_calling
        self.readers = [tool_calling.reader() for _ in range(n)]
        self.sent_content = [0] * n
        # Per choice, the calls announced: how much of each one's arguments has been sent.
        self.sent_arguments: list[list[int]] = [[] for _ in range(n)]

    def __call__(self, _: int, completion: CompletionOutput, finished: bool) -> list[dict[str, Any]]:
        index = completion.index
        reader = self.readers[index]
        reading = reader.read(completion.text)
        text = reader.text
        if reading.malformed:
            return self._finishing(index, self._content(index, text), None, text, finished)
        if not finished:
            return self._choices(index, self._content(index, text, reading.content_end), reading, text)
        calls = _calls(self.tool_calling, text, completion.finish_reason)
        if calls is not None:
            content, _ = calls
            choices = self._finishing(index, self._content(index, content or ""), reading, text, True)
            return [*choices[:-1], {**choices[-1], "finish_reason": "tool_calls"}]
        if completion.finish_reason != "stop" and self.sent_arguments[index]:
            return self._finishing(index, self._content(index, reading.content(text)), reading, text, True)
        return self._finishing(index, self._content(index, text), None, text, True)

    def _finishing(
        self, index: int, content: str, reading: OutputReading | None, text: str, finished: bool
    ) -> list[dict[str, Any]]:
        """The choices to send, with an empty one to carry the finish reason when there is nothing else."""
        choices = self._choices(index, content, reading, text)
        return choices or ([{"index": index, "delta": {}, "logprobs": None}] if finished else [])

    def _content(self, index: int, content: str, end: int | None = None) -> str:
        """What of `content[:end]` (the answer's content so far) has not been sent."""
        end = len(content) if end is None else end
        unsent = content[self.sent_content[index] : end]
        self.sent_content[index] = max(self.sent_content[index], end)
        return unsent

    def _choices(
        self, index: int, content: str, reading: OutputReading | None, text: str
    ) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        sent = self.sent_arguments[index]
        calls = reading.calls if reading is not None else []
        # The calls before the last one announced have been sent whole.
        for number in range(max(len(sent) - 1, 0), len(calls)):
            call = calls[number]
            if call.name is None:
                break  # calls are announced in order
            if number == len(sent):
                announced = {"name": call.name, "arguments": ""}
                deltas.append(
                    {
                        "tool_calls": [
                            {"index": number, "id": new_call_id(), "type": "function", "function": announced}
                        ]
                    }
                )
                sent.append(0)
            arguments = call.arguments(text, sent[number])
            if arguments:
                deltas.append({"tool_calls": [{"index": number, "function": {"arguments": arguments}}]})
                sent[number] += len(arguments)
        return [{"index": index, "delta": delta, "logprobs": None} for delta in deltas]
