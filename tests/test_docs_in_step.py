"""Pages of docs/ that list what the code has, kept in step with it: every condition reason and event the
operator reports (troubleshooting.md) and every architecture the runtime serves (supported-models.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvfleet.runtime.models.registry import REFUSED_ARCHITECTURES, ModelRegistry

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / "operator"
DOCS = ROOT / "docs"
# Where a reason stands in the calls that set or post one: Condition(type, status, REASON, message), the
# status module's condition(ok, REASON, message), SpecError(REASON, message), _warn(REASON, message) and
# events(type, REASON, message).
_REASON_ARGUMENT = {"Condition": 2, "condition": 1, "SpecError": 0, "_warn": 0, "events": 1}


def _strings(node: ast.AST, constants: dict[str, str]) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in constants:
        return [constants[node.id]]
    if isinstance(node, ast.IfExp):
        return _strings(node.body, constants) + _strings(node.orelse, constants)
    return []


def operator_reasons() -> set[str]:
    """Every reason the operator's code sets on a condition or posts as an event, read from its source."""
    trees = [ast.parse(path.read_text()) for path in sorted(OPERATOR.glob("*.py"))]
    constants = {
        target.id: node.value.value
        for tree in trees
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                function = node.func
                name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
                index = _REASON_ARGUMENT.get(name)
                if index is not None and len(node.args) > index:
                    found.update(_strings(node.args[index], constants))
                # events.append((type, REASON, message))
                appended = node.args[0] if name == "append" and node.args else None
                if isinstance(appended, ast.Tuple) and len(appended.elts) == 3:
                    found.update(_strings(appended.elts[1], constants))
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                # blocking = (REASON, message); reason = ...; FAILURE_REASONS = {...}; X_REASON = "..."
                if name == "blocking" and isinstance(node.value, ast.Tuple):
                    found.update(_strings(node.value.elts[0], constants))
                elif name == "reason" or name.endswith(("_REASON", "_REASONS")):
                    for part in ast.walk(node.value):
                        found.update(_strings(part, constants) if isinstance(part, ast.Constant) else [])
    return {reason for reason in found if re.fullmatch(r"[A-Z][A-Za-z]+", reason)}


def test_troubleshooting_explains_every_reason_and_event() -> None:
    reasons = operator_reasons()
    # The reader that finds none would pass any page.
    assert {"InvalidSpec", "InsufficientGPU", "ScaledToZero", "ChildNotOwned", "ScaledUp"} <= reasons
    page = (DOCS / "troubleshooting.md").read_text()
    explained = set(re.findall(r"`([A-Z][A-Za-z]+)`", page))
    assert sorted(reasons - explained) == [], "reasons docs/troubleshooting.md does not explain"


def test_supported_models_lists_every_architecture() -> None:
    page = (DOCS / "supported-models.md").read_text()
    served, refused = page.split("Refused with the reason")
    listed = set(re.findall(r"^\| `(\w+)` \|", served, re.MULTILINE))
    assert listed == set(ModelRegistry(load_plugins=False).supported_architectures)
    assert set(re.findall(r"^\| `(\w+)` \|", refused, re.MULTILINE)) == set(REFUSED_ARCHITECTURES)
