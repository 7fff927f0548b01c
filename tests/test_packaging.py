"""What each part imports is what the package declares for it, and every declared dependency is pinned.

`pip install kvfleet[operator]` must give a working operator without torch, and `kvfleet[runtime]` a working
engine: a direct import that only arrives through another package's dependencies breaks when that one
changes.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# folder -> the extras that install what it needs, beyond the core dependencies
# The project's own top-level names (conftest: tests/server imports its own conftest module).
LOCAL = {"kvfleet", "e2e", "tests", "conftest"}
PARTS = {
    "kvfleet": (),
    "operator": ("operator",),
    "runtime": ("runtime",),
    "tests": ("runtime", "operator", "test"),
    "e2e": ("runtime", "operator", "test"),
}


def _declared(*extras: str) -> set[str]:
    requirements = list(PYPROJECT["dependencies"])
    for extra in extras:
        requirements += PYPROJECT["optional-dependencies"][extra]
    return {canonicalize_name(Requirement(line).name) for line in requirements}


def _imported_distributions(folder: str) -> dict[str, set[str]]:
    """Third-party distributions the folder's modules import directly -> the modules naming them."""
    distributions = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in LOCAL:
                    continue
                for distribution in distributions.get(top, [top]):
                    found.setdefault(canonicalize_name(distribution), set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("folder", sorted(PARTS))
def test_every_direct_import_is_declared_for_its_part(folder: str) -> None:
    declared = _declared(*PARTS[folder])
    missing = {name: sorted(files) for name, files in _imported_distributions(folder).items()}
    missing = {name: files for name, files in missing.items() if name not in declared}
    assert not missing, f"imported by {folder}/ but not declared in pyproject.toml: {missing}"


def test_every_declared_dependency_is_pinned_in_the_requirements() -> None:
    pins: dict[str, str] = {}
    for path in sorted((ROOT / "requirements").glob("*.txt")):
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                requirement = Requirement(line)
                assert str(requirement.specifier).startswith("=="), f"{path.name}: {line} is not pinned"
                pins[canonicalize_name(requirement.name)] = str(requirement.specifier)
    declared = _declared(*PYPROJECT["optional-dependencies"])
    unpinned = sorted(declared - set(pins))
    assert not unpinned, f"declared in pyproject.toml but not pinned under requirements/: {unpinned}"
