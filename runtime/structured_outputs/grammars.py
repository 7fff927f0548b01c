"""From StructuredOutputsParams to an xgrammar Grammar, refusing what xgrammar would not enforce.

The API server runs `check_constraint` to answer a bad JSON schema with a 400 before the request is queued:
the checks that need neither xgrammar nor the torch it imports, which API servers never load. The engine core
runs `build_grammar` to compile the constraint, and answers what only that finds (regex and grammar syntax)
with an `invalid` error, a 400 too.
"""

from __future__ import annotations

import functools
import json
import re
import urllib.parse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jsonschema
from kvfleet.runtime import json_depth
from kvfleet.runtime.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# JSON Schema keywords that xgrammar accepts but does not enforce: a schema using them would get a looser
# grammar than it asks for, so it is refused instead.
UNENFORCED_KEYWORDS = frozenset(
    {
        "not",
        "allOf",
        "oneOf",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "maxProperties",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
# Keywords whose values are schemas, lists of schemas, or maps of names to schemas.
_SCHEMA_KEYWORDS = frozenset(
    {"items", "additionalProperties", "additionalItems", "not", "if", "then", "else"}
)
_SCHEMA_LIST_KEYWORDS = frozenset({"anyOf", "allOf", "oneOf", "prefixItems"})
_SCHEMA_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
# The schema of json_object: any JSON object (compiled without strict mode, which would allow only `{}`).
_JSON_OBJECT_SCHEMA = '{"type":"object"}'
# The kinds whose output is JSON.
JSON_KINDS = frozenset({"json", "json_object"})
# xgrammar prefixes its messages with a timestamp and a C++ source location.
_XGRAMMAR_MESSAGE_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ")


class GrammarError(ValueError):
    """The constraint is not valid, or asks for something that cannot be enforced."""


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, canonical text): equal for constraints that compile to the same grammar."""
    kind = params.kind
    if kind == "json":
        return kind, _canonical_json(params.json)
    if kind == "json_object":
        return kind, _JSON_OBJECT_SCHEMA
    if kind == "choice":
        return kind, json.dumps(params.choice)
    if kind == "structural_tag":
        return kind, _canonical_json(params.structural_tag, "structural_tag")
    value = params.regex if kind == "regex" else params.grammar
    assert value is not None
    return kind, value


def check_constraint(params: StructuredOutputsParams) -> None:
    """Raises GrammarError for a constraint whose JSON text does not parse, or whose schema is invalid,
    cannot be enforced or refers to what it does not hold."""
    kind, text = grammar_key(params)
    if kind in JSON_KINDS:
        _check_json_schema_text(text)
    elif kind == "structural_tag":
        for schema in _structural_tag_schemas(json.loads(text)):
            check_json_schema(schema)


def _structural_tag_schemas(tag: Any) -> Iterator[Any]:
    """The JSON schemas of a structural tag, which must be vLLM's older form (`structures`, each a `begin`,
    a `schema` and an `end`, and the `triggers` that open them) or xgrammar's (`format`, whose json_schema
    nodes hold them; xgrammar checks the rest of it when compiling)."""
    if not isinstance(tag, dict) or ("structures" in tag) == ("format" in tag):
        raise GrammarError("invalid structural_tag: an object with either format or structures and triggers")
    if "format" in tag:
        yield from _format_schemas(tag["format"])
        return
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise GrammarError("invalid structural_tag: triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise GrammarError("invalid structural_tag: structures must be a non-empty list")
    for index, structure in enumerate(structures):
        if not (
            isinstance(structure, dict)
            and isinstance(structure.get("begin"), str)
            and isinstance(structure.get("end"), str)
            and "schema" in structure
        ):
            raise GrammarError(
                f"invalid structural_tag: structures[{index}] needs a begin, a schema and an end"
            )
        if not any(structure["begin"].startswith(trigger) for trigger in triggers):
            raise GrammarError(
                f"invalid structural_tag: structures[{index}]'s begin {structure['begin']!r} starts with "
                "none of the triggers"
            )
        yield structure["schema"]


def _format_schemas(node: Any) -> Iterator[Any]:
    """The schemas of a structural tag's format: those of its json_schema nodes, however deep. xgrammar's
    any_order and excludes would loosen a schema (its required keys, its strings' lengths): refused, as
    keywords it would not enforce are."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            for option in ("any_order", "excludes"):
                if node.get(option):
                    raise GrammarError(
                        f"unsupported structural_tag: a json_schema's {option} loosens its schema"
                    )
            yield node["json_schema"]
        for key, value in node.items():
            if key != "json_schema":
                yield from _format_schemas(value)
    elif isinstance(node, list):
        for item in node:
            yield from _format_schemas(item)


# Many requests share a schema, and checking one takes milliseconds; only schemas that pass are cached.
@functools.lru_cache(maxsize=512)
def _check_json_schema_text(text: str) -> None:
    check_json_schema(json.loads(text))


def build_grammar(kind: str, text: str) -> xgrammar.Grammar:
    """The grammar of a `grammar_key`, or GrammarError saying what is wrong with it."""
    import xgrammar  # here: it imports torch, which the API servers (which only check) never load

    try:
        if kind in JSON_KINDS:
            schema = json.loads(text)
            check_json_schema(schema)
            # No whitespace, as vLLM's disable_any_whitespace writes JSON: with any whitespace allowed, a
            # model could pad its output forever. Strict mode allows no properties or items beyond those a
            # schema names (OpenAI's strict outputs).
            return xgrammar.Grammar.from_json_schema(
                text, any_whitespace=False, separators=(",", ":"), strict_mode=kind == "json"
            )
        if kind == "regex":
            return xgrammar.Grammar.from_regex(text)
        if kind == "choice":
            return xgrammar.Grammar.from_ebnf(
                "root ::= " + " | ".join(_ebnf_literal(c) for c in json.loads(text))
            )
        if kind == "structural_tag":
            return _structural_tag_grammar(text)
        return xgrammar.Grammar.from_ebnf(text)
    except RuntimeError as exc:
        message = _XGRAMMAR_MESSAGE_PREFIX.sub("", str(exc).strip())
        raise GrammarError(f"invalid {kind}: {message}") from None


def _structural_tag_grammar(text: str) -> xgrammar.Grammar:
    import xgrammar

    tag = json.loads(text)
    for schema in _structural_tag_schemas(tag):
        check_json_schema(schema)
    if "format" in tag:
        return xgrammar.Grammar.from_structural_tag(text)
    items = [
        xgrammar.StructuralTagItem(begin=item["begin"], schema=json.dumps(item["schema"]), end=item["end"])
        for item in tag["structures"]
    ]
    return xgrammar.Grammar.from_structural_tag(items, tag["triggers"])


def check_json_schema(schema: Any) -> None:
    """Raises GrammarError unless `schema` is a valid JSON Schema whose every keyword can be enforced."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"invalid json: a JSON schema is an object, got {type(schema).__name__}")
    if json_depth.value_depth(schema) > json_depth.MAX_JSON_DEPTH:
        # Checking and compiling recurse.
        raise GrammarError(
            f"unsupported json: the schema nests deeper than {json_depth.MAX_JSON_DEPTH} levels"
        )
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path)
        raise GrammarError(f"invalid json: schema at '/{where}': {exc.message}") from None
    for path, keyword, value in _keywords(schema, ""):
        if keyword in UNENFORCED_KEYWORDS:
            raise GrammarError(
                f"unsupported json: the keyword {keyword!r} (at '{path or '/'}') is not supported"
            )
        if keyword == "$ref":
            _check_reference(schema, value, path)


def _check_reference(schema: dict[str, Any], reference: str, path: str) -> None:
    """Only references into the schema itself (JSON pointers) can be followed, and they must lead
    somewhere."""
    where = path or "/"
    if not reference.startswith("#"):
        raise GrammarError(f"unsupported json: $ref {reference!r} (at '{where}') is not within the schema")
    target: Any = schema
    pointer = urllib.parse.unquote(reference[1:])
    for part in pointer.split("/")[1:] if pointer else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        elif isinstance(target, dict) and part in target:
            target = target[part]
        else:
            raise GrammarError(f"invalid json: $ref {reference!r} (at '{where}') leads nowhere in the schema")


def _keywords(schema: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """(path, keyword, value) of every keyword of a schema and of its subschemas."""
    if not isinstance(schema, dict):
        return
    for keyword, value in schema.items():
        yield path, keyword, value
        where = f"{path}/{keyword}"
        if keyword in _SCHEMA_KEYWORDS:
            yield from _keywords(value, where)
        elif keyword in _SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            for index, item in enumerate(value):
                yield from _keywords(item, f"{where}/{index}")
        elif keyword in _SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            for name, item in value.items():
                yield from _keywords(item, f"{where}/{name}")


def _canonical_json(schema: str | dict[str, Any] | None, kind: str = "json") -> str:
    try:
        if isinstance(schema, str):
            schema = json_depth.loads(schema)
        else:
            json_depth.check_value(schema)
    except json_depth.JSONTooDeepError as exc:
        raise GrammarError(f"unsupported {kind}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise GrammarError(
            f"invalid {kind}: the {'schema' if kind == 'json' else kind} is not JSON: {exc}"
        ) from None
    return json.dumps(schema, separators=(",", ":"))


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: quotes and backslashes escaped, other characters as \\u escapes
    where they are not printable."""
    escaped = []
    for character in text:
        if character in '"\\':
            escaped.append("\\" + character)
        elif character.isprintable():
            escaped.append(character)
        else:
            escaped.append(
                f"\\u{ord(character):04x}" if ord(character) <= 0xFFFF else f"\\U{ord(character):08x}"
            )
    return '"' + "".join(escaped) + '"'
