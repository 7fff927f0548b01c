"""vLLM's --chat-template-content-format: which templates take a message's content as OpenAI's parts (those
that loop over it), and the content each format gives them. The expected formats are read off the templates
by hand, as vLLM's rule has it: a loop over a message's content, however the template reaches it."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfleet.runtime.chat_content_format import (
    detect_content_format,
    formatted_messages,
    resolve_content_format,
)
from kvfleet.runtime.models.make_model.tokenizer import CHATML_TEMPLATE, LLAMA3_TEMPLATE

PARTS_LOOP = "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"

TEMPLATES = [
    pytest.param(LLAMA3_TEMPLATE, "string", id="llama3: the content printed whole"),
    pytest.param(CHATML_TEMPLATE, "string", id="chatml: loops over tool calls, not content"),
    pytest.param("{% for message in messages %}" + PARTS_LOOP + "{% endfor %}", "openai", id="a loop"),
    pytest.param(
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
        "openai",
        id="a loop beside a string branch, by attribute",
    ),
    pytest.param(
        "{% set loop_messages = messages[1:] %}{% for message in loop_messages|reverse %}"
        "{% set content = message['content'] %}{% for p in content|list %}{{ p.text }}{% endfor %}"
        "{% endfor %}",
        "openai",
        id="through a slice, a filter and a variable",
    ),
    pytest.param(
        "{% macro render(x) %}{% for p in x %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render(m['content']) }}{% endfor %}",
        "openai",
        id="through a macro's parameter",
    ),
    pytest.param(
        "{% macro render(prefix, body) %}{% for p in body %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render('>', body=m.content) }}{% endfor %}",
        "openai",
        id="through a macro's keyword",
    ),
    pytest.param(
        "{% for m in messages %}{% generation %}" + PARTS_LOOP.replace("message", "m") + "{% endgeneration %}"
        "{% endfor %}",
        "openai",
        id="inside Transformers' generation block",
    ),
    pytest.param(
        "{% set content = 'abc' %}{% for c in content %}{{ c }}{% endfor %}"
        "{% for m in messages %}{% for c in m['role'] %}{{ c }}{% endfor %}{{ m['content'] }}{% endfor %}",
        "string",
        id="loops over other strings, one named content",
    ),
    pytest.param("{% for message in messages %}" + PARTS_LOOP, "string", id="a template that does not parse"),
]


@pytest.mark.parametrize(("template", "expected"), TEMPLATES)
def test_a_template_takes_parts_where_it_loops_over_a_messages_content(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_named_templates_are_read_as_transformers_picks_them() -> None:
    parts = "{% for message in messages %}" + PARTS_LOOP + "{% endfor %}"
    named = {"default": LLAMA3_TEMPLATE, "tool_use": parts}
    assert resolve_content_format("auto", named, tools=False) == "string"
    assert resolve_content_format("auto", named, tools=True) == "openai"
    assert resolve_content_format("string", parts, tools=False) == "string"


TEXT_PARTS = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
WITH_IMAGE = [{"type": "image"}, {"type": "text", "text": "What is it?"}]


def test_each_format_gives_the_content_as_vllm_does() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": TEXT_PARTS},
        {"role": "user", "content": WITH_IMAGE},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
        {"role": "tool", "content": TEXT_PARTS, "tool_call_id": "c"},
    ]
    as_strings = [message["content"] for message in formatted_messages(messages, "string")]
    assert as_strings == ["Be brief.", "Hello\nworld", WITH_IMAGE, "", "Hello\nworld"]
    as_parts = [message["content"] for message in formatted_messages(messages, "openai")]
    assert as_parts == [[{"type": "text", "text": "Be brief."}], TEXT_PARTS, WITH_IMAGE, [], "Hello\nworld"]
    # Everything else a message holds goes through unchanged, and the messages given are left as they were.
    assert formatted_messages(messages, "openai")[3]["tool_calls"] == [{"id": "c"}]
    assert messages[1]["content"] is TEXT_PARTS


def test_llm_chat_gives_a_template_that_loops_over_parts_the_parts(tiny_llama: Path) -> None:
    """Offline, as vLLM's LLM.chat: `auto` gives a template that loops over a message's content OpenAI's
    parts, even for a string; `string` gives it a string. Transformers renders the oracle."""
    from kvfleet.runtime import LLM
    from transformers import AutoTokenizer

    template = "{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}{% else %}" + (
        "P:{% for part in m['content'] %}{{ part['text'] }}|{% endfor %}{% endif %}{% endfor %}"
    )
    llm = LLM(str(tiny_llama), chat_template=template, num_gpu_blocks_override=16, max_model_len=128)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    conversation = [{"role": "user", "content": "Hello"}]
    for content_format, content in (("auto", [{"type": "text", "text": "Hello"}]), ("string", "Hello")):
        expected = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], chat_template=template, tokenize=True
        )["input_ids"]
        rendered = llm.apply_chat_template(
            conversation, add_generation_prompt=False, chat_template_content_format=content_format
        )
        assert rendered == expected, content_format
