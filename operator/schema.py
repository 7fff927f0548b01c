"""The InferenceService's OpenAPI v3 schema, declared on the spec model and rendered from it.

A field of a spec dataclass is part of the resource when it is declared with `prop()`, which carries the
field's description and the schema's bounds; its key is the field's name in camelCase. Its type gives the
schema's type: `int`, `bool`, `str`, a `Literal` (an enum), `X | None` (optional), `tuple[X, ...]` (an
array), `Mapping[str, str]` (a map) or another spec dataclass (an object). A field declared without `prop()`
is derived by the operator and has no key of its own. Parts of the resource without a dataclass of their own
(the status, the safety policy) are written with the small builders below.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any

# A Kubernetes quantity (4, 500m, 16Gi), as the API server's own types declare it.
QUANTITY: Mapping[str, Any] = {
    "x-kubernetes-int-or-string": True,
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": (
        r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
        r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
    ),
}
_SCALARS: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


@dataclass(frozen=True)
class Rule:
    """A CEL rule the API server checks (`x-kubernetes-validations`), with the message it answers."""

    rule: str
    message: str

    def render(self) -> dict[str, str]:
        return {"rule": self.rule, "message": self.message}


def prop(
    description: str,
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    required: bool = False,
    server_default: Any = MISSING,
    schema: Mapping[str, Any] | None = None,
    items: Mapping[str, Any] | None = None,
    rules: Sequence[Rule] = (),
    **keywords: Any,
) -> Any:
    """A dataclass field that is a property of the resource.

    The schema's default is the field's when that is a plain value; `server_default` sets another (None:
    none). `schema` replaces the schema the type gives (a function returning it, for a part whose module
    imports the dataclass's); `items` adds keywords to an array's items, and `keywords` (minimum,
    maxLength, enum, ...) to the property's own schema.
    """
    if not description.strip():
        raise ValueError("a property of the resource needs a description (`kubectl explain` shows it)")
    metadata = {
        "description": description,
        "required": required,
        "server_default": server_default,
        "schema": schema,
        "items": items,
        "rules": tuple(rules),
        "keywords": keywords,
    }
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def derived(default: Any = MISSING, *, default_factory: Any = MISSING) -> Any:
    """A dataclass field the operator derives from the resource's properties: not a key of its own."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"derived": True})


def _camel_case(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def dataclass_schema(cls: type, description: str, rules: Sequence[Rule] = ()) -> dict[str, Any]:
    """The object schema of a spec dataclass: one property for each of its `prop()` fields."""
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    required = []
    for spec_field in dataclasses.fields(cls):
        if spec_field.metadata.get("derived"):
            continue
        if "description" not in spec_field.metadata:
            raise TypeError(
                f"{cls.__name__}.{spec_field.name} is declared with neither prop() (a property, described) "
                "nor derived()"
            )
        key = _camel_case(spec_field.name)
        properties[key] = _field_schema(spec_field, hints[spec_field.name])
        if spec_field.metadata["required"]:
            required.append(key)
    return obj(description, properties, required=required, rules=rules)


def _field_schema(spec_field: dataclasses.Field[Any], hint: Any) -> dict[str, Any]:
    metadata = spec_field.metadata
    if metadata["schema"] is not None:
        given = metadata["schema"]
        schema = {**(given() if callable(given) else given), "description": metadata["description"]}
    else:
        schema = _type_schema(hint, metadata["description"])
        if metadata["items"]:
            schema["items"] = {**schema["items"], **metadata["items"]}
    default = metadata["server_default"]
    if default is MISSING and isinstance(spec_field.default, bool | int | str):
        default = spec_field.default
    schema.update(metadata["keywords"])
    if default is not MISSING and default is not None:
        schema["default"] = default
    if metadata["rules"]:
        schema["x-kubernetes-validations"] = [rule.render() for rule in metadata["rules"]]
    return _ordered(schema)


def _type_schema(hint: Any, description: str) -> dict[str, Any]:
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        (present,) = [argument for argument in arguments if argument is not type(None)]
        return _type_schema(present, description)
    if origin is typing.Literal:
        return _described({"type": _SCALARS[type(arguments[0])], "enum": list(arguments)}, description, {})
    if origin is tuple:
        return array(description, _type_schema(arguments[0], ""))
    if origin is Mapping or origin is dict:
        return obj(description, additionalProperties=_type_schema(arguments[1], ""))
    if dataclasses.is_dataclass(hint):
        return dataclass_schema(hint, description)
    return _described({"type": _SCALARS[hint]}, description, {})


# The order of a property's keywords in the rendered schema: what it is first, then what it holds.
_ORDER = ("type", "x-kubernetes-int-or-string", "anyOf", "format", "enum", "default", "description")


def _ordered(schema: Mapping[str, Any]) -> dict[str, Any]:
    first = {key: schema[key] for key in _ORDER if key in schema}
    rest = {key: value for key, value in schema.items() if key not in first}
    return {**first, **rest}


def _described(schema: dict[str, Any], description: str, keywords: Mapping[str, Any]) -> dict[str, Any]:
    if description:
        schema["description"] = description
    schema.update(keywords)
    return _ordered(schema)


def string(description: str, **keywords: Any) -> dict[str, Any]:
    return _described({"type": "string"}, description, keywords)


def integer(description: str, **keywords: Any) -> dict[str, Any]:
    return _described({"type": "integer"}, description, keywords)


def number(description: str, **keywords: Any) -> dict[str, Any]:
    return _described({"type": "number"}, description, keywords)


def boolean(description: str, **keywords: Any) -> dict[str, Any]:
    return _described({"type": "boolean"}, description, keywords)


def array(description: str, items: Mapping[str, Any], **keywords: Any) -> dict[str, Any]:
    return _described({"type": "array", "items": dict(items)}, description, keywords)


def obj(
    description: str,
    properties: Mapping[str, Any] | None = None,
    *,
    required: Sequence[str] = (),
    rules: Sequence[Rule] = (),
    **keywords: Any,
) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    if required:
        schema["required"] = list(required)
    if rules:
        schema["x-kubernetes-validations"] = [rule.render() for rule in rules]
    if properties is not None:
        schema["properties"] = dict(properties)
    return _described(schema, description, keywords)
