"""How a server renders a chat request into its prompt beyond what the request says: its default chat
template variables (vLLM's --default-chat-template-kwargs), whether a tool_choice of "none" leaves the tools
out (--exclude-tools-when-tool-choice-none), and how OpenAI's content parts reach the template
(--chat-template-content-format). A router must render alike to hash the prompt as the engine does: a
replica serves these with its tokenizer files (kvfleet.contract.tokenizer_files)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from kvfleet.runtime.chat_content_format import ContentFormatOption
from kvfleet.runtime.serving.protocol import ChatCompletionRequest


@dataclass(frozen=True)
class ChatRendering:
    """A server's settings of how chat prompts are rendered, and the rules they set."""

    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    exclude_tools_when_tool_choice_none: bool = False
    chat_template_content_format: ContentFormatOption = "auto"

    def template_kwargs(
        self, requested: Mapping[str, Any] | None, effort: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The template's variables: the server's defaults, under the request's chat_template_kwargs, under
        what its reasoning_effort sets."""
        return {**self.default_chat_template_kwargs, **(requested or {}), **(effort or {})}

    def chat_template_kwargs(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """A chat request's template variables."""
        return self.template_kwargs(body.chat_template_kwargs, body.effort_variables())

    def tools(self, body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
        """The tools the template is told of: not those the model may not call, where the server says so."""
        if not body.tools or (body.tool_choice == "none" and self.exclude_tools_when_tool_choice_none):
            return None
        return [tool.model_dump(exclude_none=True) for tool in body.tools]

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> ChatRendering:
        """What `as_json` wrote; ValueError for anything else."""
        if not isinstance(value, dict) or set(value) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError("its chat rendering is not an object of the contract's fields")
        rendering = cls(**value)
        if not isinstance(rendering.default_chat_template_kwargs, dict):
            raise ValueError("its default_chat_template_kwargs is not an object")
        if not isinstance(rendering.exclude_tools_when_tool_choice_none, bool):
            raise ValueError("its exclude_tools_when_tool_choice_none is not a boolean")
        if rendering.chat_template_content_format not in get_args(ContentFormatOption):
            raise ValueError(
                f"its chat_template_content_format {rendering.chat_template_content_format!r} is unknown"
            )
        return rendering


# A server started without the settings; a replica of an older kvfleet, which does not say how it renders.
DEFAULT_RENDERING = ChatRendering()
