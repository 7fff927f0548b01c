"""Fixtures for the operator's tests: the repository's paths and an offline CRD validator.

The validator applies the subset of Kubernetes structural-schema semantics the kvfleet CRD uses
(defaults, types, enums, bounds, patterns, required and unknown fields) and evaluates its CEL rules with
a CEL interpreter, so schema mistakes show up without an API server. The end-to-end tests repeat the
important cases against a real one.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from e2e.cluster.binaries import ensure_binaries

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "kvfleet.dev_inferenceservices.yaml"

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


class CRDValidator:
    """Defaults and validates objects against one version of a CRD, as the API server would."""

    def __init__(self, crd: dict[str, Any], version: str) -> None:
        served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
        self.schema = served["schema"]["openAPIV3Schema"]
        self._cel = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def admit(
        self, obj: dict[str, Any], old: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], list[str]]:
        """The defaulted object and every validation error (empty when the server would accept it); with
        `old` (as stored), an update of it, whose transition rules (oldSelf) are checked where the value was
        there before."""
        defaulted = self._default(copy.deepcopy(obj), self.schema)
        errors: list[str] = []
        self._validate(defaulted, self.schema, "", errors, old)
        return defaulted, errors

    def default_errors(self) -> list[str]:
        """Errors of the schema's own defaults: the server checks each one, as written, against its schema."""
        errors: list[str] = []

        def walk(schema: dict[str, Any], path: str) -> None:
            if "default" in schema:
                self._validate(copy.deepcopy(schema["default"]), schema, f"{path}(default)", errors)
            for key, sub in schema.get("properties", {}).items():
                walk(sub, f"{path}.{key}")
            if "items" in schema:
                walk(schema["items"], f"{path}[]")

        walk(self.schema, "")
        return errors

    def _default(self, value: Any, schema: dict[str, Any]) -> Any:
        if isinstance(value, dict) and "properties" in schema:
            for key, sub in schema["properties"].items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
                if key in value:
                    value[key] = self._default(value[key], sub)
        elif isinstance(value, list) and "items" in schema:
            value = [self._default(item, schema["items"]) for item in value]
        return value

    def _validate(
        self, value: Any, schema: dict[str, Any], path: str, errors: list[str], old: Any = None
    ) -> None:
        where = path or "<root>"
        if not self._type_ok(value, schema):
            errors.append(f"{where}: wrong type {type(value).__name__}")
            return
        if "enum" in schema and value not in schema["enum"]:
            errors.append(f"{where}: unsupported value {value!r}")
        if isinstance(value, int | float) and not isinstance(value, bool):
            if "minimum" in schema and value < schema["minimum"]:
                errors.append(f"{where}: should be greater than or equal to {schema['minimum']}")
            if "maximum" in schema and value > schema["maximum"]:
                errors.append(f"{where}: should be less than or equal to {schema['maximum']}")
        if isinstance(value, str):
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                errors.append(f"{where}: too long")
            if "minLength" in schema and len(value) < schema["minLength"]:
                errors.append(f"{where}: too short")
            if "pattern" in schema and not re.search(schema["pattern"], value):
                errors.append(f"{where}: should match {schema['pattern']!r}")
        if isinstance(value, list):
            if "maxItems" in schema and len(value) > schema["maxItems"]:
                errors.append(f"{where}: too many items")
            for index, item in enumerate(value):
                self._validate(item, schema.get("items", {}), f"{path}[{index}]", errors)
        if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
            properties = schema.get("properties", {})
            for key in schema.get("required", []):
                if key not in value:
                    errors.append(f"{path}.{key}: Required value")
            for key, item in value.items():
                old_item = old.get(key) if isinstance(old, dict) else None
                if key in properties:
                    self._validate(item, properties[key], f"{path}.{key}", errors, old_item)
                elif "additionalProperties" in schema:
                    self._validate(item, schema["additionalProperties"], f"{path}.{key}", errors)
                elif path != ".metadata":
                    errors.append(f"{path}.{key}: unknown field")
        if not errors:
            for rule in schema.get("x-kubernetes-validations", []):
                transition = "oldSelf" in rule["rule"]
                if transition and old is None:
                    continue  # the server checks a transition rule only where the value was there before
                try:
                    passed = self._evaluate(rule["rule"], value, old if transition else None)
                except celpy.CELEvalError as error:
                    errors.append(f"{where}: Invalid value: {error.args[0]} evaluating rule: {rule['rule']}")
                    continue
                if not passed:
                    errors.append(f"{where}: Invalid value: {self._message(rule, value)}")

    @staticmethod
    def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
        if schema.get("x-kubernetes-int-or-string"):
            return isinstance(value, int | str) and not isinstance(value, bool)
        kind = schema.get("type")
        if kind is None:
            return True
        if kind in ("integer", "number") and isinstance(value, bool):
            return False
        return isinstance(value, _TYPES[kind])

    def _message(self, rule: dict[str, Any], value: Any) -> str:
        if "messageExpression" in rule:
            return str(self._run(rule["messageExpression"], value))
        return rule.get("message", rule["rule"])

    def _evaluate(self, rule: str, value: Any, old: Any = None) -> bool:
        return bool(self._run(rule, value, old))

    def _run(self, expression: str, value: Any, old: Any = None) -> Any:
        if expression not in self._programs:
            self._programs[expression] = self._cel.program(self._cel.compile(expression))
        activation = {"self": celpy.json_to_cel(value)}
        if old is not None:
            activation["oldSelf"] = celpy.json_to_cel(old)
        return self._programs[expression].evaluate(activation)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


# A fresh checkout's first test that needs helm builds it, or waits while the end-to-end suite builds it first
# (minutes on 2 busy cores), beyond the suite's per-test limit.
HELM_BUILD_TIMEOUT_S = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "helm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(HELM_BUILD_TIMEOUT_S))


@pytest.fixture(scope="session")
def helm() -> Path:
    """$KVFLEET_HELM, then helm on PATH, then the project's own pinned build (made on first use, or waited for
    while the end-to-end suite's build of the control plane holds the build cache)."""
    explicit = os.environ.get("KVFLEET_HELM")
    if explicit:
        return Path(explicit)
    on_path = shutil.which("helm")
    if on_path:
        return Path(on_path)
    return ensure_binaries(["helm"]) / "helm"


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def crd_validator(crd: dict[str, Any]) -> CRDValidator:
    return CRDValidator(crd, "v1alpha1")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Every InferenceService manifest under examples/ is a case for tests that take `example_path`.
    if "example_path" in metafunc.fixturenames:
        paths = [path for path in sorted((REPO / "examples").rglob("*.yaml")) if _holds_service(path)]
        metafunc.parametrize("example_path", paths, ids=[path.stem for path in paths])


def _holds_service(path: Path) -> bool:
    return any(doc and doc.get("kind") == "InferenceService" for doc in yaml.safe_load_all(path.read_text()))
