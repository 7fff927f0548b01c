"""`--structured-outputs-config`: vLLM's JSON object, parsed and checked once, unknown keys refused by name.

kvfleet compiles every constraint with xgrammar, and its JSON is always compact (a model free to pad its
output with whitespace could pad it forever): vLLM's `xgrammar` backend with `disable_any_whitespace`. A
setting only vLLM's other backends or plugins have is refused with the reason, as vLLM refuses the
combinations it does not take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet.runtime.json_options import json_object

_NAME = "structured_outputs_config"
# vLLM's backends, and the ones kvfleet's (xgrammar) stands for.
_VLLM_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
_BACKENDS = ("auto", "xgrammar")
_SWITCHES = (
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "enable_in_reasoning",
)
_KEYS = {"backend", "reasoning_parser", "reasoning_parser_plugin", *_SWITCHES}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    # The parser that splits a chat answer's reasoning from its content, as --reasoning-parser names it;
    # None: none named here.
    reasoning_parser: str | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> StructuredOutputsConfig:
        """From the JSON text of the flag or the dict of `LLM(structured_outputs_config=...)`; raises
        ValueError naming what is wrong."""
        value = json_object(value, _NAME)
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(
                f"{_NAME} does not take {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})"
            )
        backend = value.get("backend", "auto")
        if backend not in _VLLM_BACKENDS:
            raise ValueError(f"{_NAME}.backend must be one of {', '.join(_VLLM_BACKENDS)}, got {backend!r}")
        if backend not in _BACKENDS:
            raise ValueError(
                f"{_NAME}.backend {backend!r} is not supported: kvfleet compiles structured outputs with "
                "xgrammar (auto or xgrammar)"
            )
        switches = {name: value.get(name, False) for name in _SWITCHES}
        for name, switch in switches.items():
            if not isinstance(switch, bool):
                raise ValueError(f"{_NAME}.{name} must be true or false, got {switch!r}")
        if switches["disable_any_whitespace"] and backend != "xgrammar":
            # vLLM's rule: a backend that may change under auto might not honour it.
            raise ValueError(f"{_NAME}.disable_any_whitespace needs the xgrammar backend")
        if switches["disable_additional_properties"]:
            raise ValueError(f"{_NAME}.disable_additional_properties is vLLM's guidance backend's alone")
        if switches["enable_in_reasoning"]:
            raise ValueError(
                f"{_NAME}.enable_in_reasoning is not supported: a model that reasons first is constrained "
                "from the end of its reasoning"
            )
        if value.get("reasoning_parser_plugin"):
            raise ValueError(f"{_NAME}.reasoning_parser_plugin is not supported: kvfleet loads no plugins")
        parser = value.get("reasoning_parser", "")
        if not isinstance(parser, str):
            raise ValueError(f"{_NAME}.reasoning_parser must be a parser's name, got {parser!r}")
        return cls(reasoning_parser=parser or None)
