"""The one limit on how deeply JSON may nest, for every document read from outside: request bodies, batch
lines, JSON schemas, and the JSON a model writes (tool calls).

Python's json module recurses once per level: a document nested a thousand deep raises RecursionError, and
one nested a few hundred deep parses but breaks whatever walks it next (json.dumps, a chat template, a
grammar compiler). Real requests stay far below the limit: a tool's parameter schema inside a batch line is
some ten levels deep.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_JSON_DEPTH = 64
# A JSON string, escapes and all (possessive, so that a long string never backtracks).
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)
_BRACKET_STEPS = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in _BRACKET_STEPS)


class JSONTooDeepError(ValueError):
    def __init__(self) -> None:
        super().__init__(f"the JSON nests deeper than {MAX_JSON_DEPTH} levels")


def text_depth(text: str | bytes) -> int:
    """How deep arrays and objects nest in JSON text, found without parsing it (so without recursion):
    the deepest run of brackets outside strings."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_BRACKET_STEPS.__getitem__, brackets)), default=0)


def value_depth(value: Any) -> int:
    """How deep lists and dicts nest in a parsed value, found without recursion; it stops counting a little
    past the limit, so a very deep value costs no more than one at the limit."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                children = item.values() if isinstance(item, dict) else item
                stack.extend((child, depth + 1) for child in children)
    return deepest


def check_text(text: str | bytes) -> None:
    # Nesting needs a bracket per level. Keeping only the brackets is one fast pass, where text_depth first
    # copies the text without its strings, holding the interpreter lock for tens of milliseconds on a 10 MB
    # prompt: a stall of the server's event loop, probes included.
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if len(data.translate(None, _NOT_BRACKETS)) > MAX_JSON_DEPTH and text_depth(data) > MAX_JSON_DEPTH:
        raise JSONTooDeepError


def check_value(value: Any) -> None:
    if value_depth(value) > MAX_JSON_DEPTH:
        raise JSONTooDeepError


def loads(text: str | bytes) -> Any:
    """json.loads of a document within the limit; JSONTooDeepError for one beyond it."""
    check_text(text)
    return json.loads(text)
