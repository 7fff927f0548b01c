"""How a chat template takes a message's content (vLLM's --chat-template-content-format): as a string, the
text parts joined by newlines, or as OpenAI's list of parts, which a multimodal model's template walks to
place its image and audio tokens.

`auto` reads the template: one that loops over a message's content (directly, through a variable set from
it, or through a macro it is passed to) takes parts; any other takes a string. Both are vLLM's rules, so a
conversation renders to the same prompt on kvfleet and on vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser

ContentFormat = Literal["string", "openai"]
ContentFormatOption = Literal["auto", "string", "openai"]
CONTENT_FORMAT_OPTIONS: tuple[str, ...] = get_args(ContentFormatOption)


class GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which Transformers' templates may use to mark the assistant's
    tokens for training masks: rendered as its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def resolve_content_format(option: str, template: str | dict[str, str] | None, tools: bool) -> ContentFormat:
    """The format `option` names, or for auto the one the template in use (of named ones, the tool_use
    template when there are tools, as Transformers picks it) takes."""
    if option != "auto":
        return option  # type: ignore[return-value]
    if isinstance(template, dict):
        template = template["tool_use"] if tools and "tool_use" in template else template.get("default")
    return detect_content_format(template) if template else "string"


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """openai where the template loops over a message's content; string otherwise, or where it does not
    parse (it then fails when rendered, with its own message)."""
    environment = jinja2.Environment(extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    try:
        tree = environment.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    return "openai" if any(True for _ in _loops_over_content(tree)) else "string"


def _loops_over_content(tree: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    messages = _names_bound_to(tree, {"messages"})
    message_names = {
        loop.target.name
        for loop in tree.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and _name_of(loop.iter) in messages
    }

    def is_content(node: jinja2.nodes.Node) -> bool:
        node = _underlying(node)
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
            return node.arg.value == "content" and _name_of(node.node) in message_names
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == "content" and _name_of(node.node) in message_names
        return False

    contents = _names_bound_to(tree, set(), is_content)
    contents |= _macro_parameters_given(tree, lambda node: is_content(node) or _name_of(node) in contents)
    for loop in tree.find_all(jinja2.nodes.For):
        if is_content(loop.iter) or _name_of(loop.iter) in contents:
            yield loop


def _underlying(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """The value under filters, tests and slices: `messages[1:]|reverse` is a view of `messages`."""
    while True:
        if (isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        ):
            node = node.node
        else:
            return node


def _name_of(node: jinja2.nodes.Node) -> str | None:
    node = _underlying(node)
    return node.name if isinstance(node, jinja2.nodes.Name) else None


def _names_bound_to(
    tree: jinja2.nodes.Template,
    names: set[str],
    matches: Callable[[jinja2.nodes.Node], bool] = lambda node: False,
) -> set[str]:
    """`names`, and every variable set (`{% set x = ... %}`) from one of them or from a value `matches`
    accepts, and from those in turn."""
    bound = set(names)
    assignments = [
        (node.target.name, node.node)
        for node in tree.find_all(jinja2.nodes.Assign)
        if isinstance(node.target, jinja2.nodes.Name)
    ]
    grew = True
    while grew:
        grew = False
        for target, value in assignments:
            if target not in bound and (_name_of(value) in bound or matches(value)):
                bound.add(target)
                grew = True
    return bound


def _macro_parameters_given(
    tree: jinja2.nodes.Template, is_content: Callable[[jinja2.nodes.Node], bool]
) -> set[str]:
    """The parameters of the template's macros that some call passes a message's content to."""
    parameters = set()
    for macro in tree.find_all(jinja2.nodes.Macro):
        names = [argument.name for argument in macro.args]
        for call in tree.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            passed = list(zip(names, call.args, strict=False))
            passed += [(keyword.key, keyword.value) for keyword in call.kwargs if keyword.key in names]
            parameters |= {name for name, value in passed if is_content(value)}
    return parameters


def formatted_messages(messages: list[dict[str, Any]], content_format: ContentFormat) -> list[dict[str, Any]]:
    """The messages with their content as the template takes it. As vLLM has it: under string, text parts
    joined by newlines (parts with media are kept, for a multimodal template); under openai, a string made
    one text part; a tool's text-only answer a string under either."""
    return [_formatted(message, content_format) for message in messages]


def _formatted(message: dict[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    content = message.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    text_only = all(isinstance(part, dict) and part.get("type") == "text" for part in parts)
    if text_only and (content_format == "string" or message.get("role") == "tool"):
        return {**message, "content": "\n".join(part["text"] for part in parts)}
    if content_format == "openai":
        return {**message, "content": parts}
    return message
