"""Engine options that are JSON objects (`--speculative-config`, `--kv-transfer-config`): given as a flag's
JSON text or as the dict of an `LLM(...)` keyword."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: str | dict[str, Any], name: str) -> dict[str, Any]:
    """The option's object; raises ValueError naming the option when the text is not JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object")
    return value
