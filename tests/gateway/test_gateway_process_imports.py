"""The gateway's process loads neither torch nor the engine: it runs in the operator's image, which has
neither, and it starts and stays as small as a proxy should.

A fresh interpreter imports what `kvfleet gateway` imports (the command's module, and the modules it imports
once it runs), then reports every module it holds.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvfleet.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_CLI = ROOT / "gateway" / "cli.py"
SCHEDULER = "kvfleet.runtime.core.scheduler"

_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def _imported_when_run(path: Path) -> list[str]:
    """The modules a command's module imports inside its functions: those it loads once it runs."""
    names = []
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.append(node.module)
                elif isinstance(node, ast.Import):
                    names += [alias.name for alias in node.names]
    return names


def _with_dependencies(names: set[str]) -> set[str]:
    """The distributions and, as installed, everything they require (markers for extras not taken)."""
    found: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requirements:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(canonicalize_name(requirement.name))
    return found


def _runtime_only_modules() -> set[str]:
    """Top-level import names of the distributions only the runtime's extra installs: neither the gateway's
    nor the operator's (the gateway runs in the operator's image) requires them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements: list[str]) -> set[str]:
        return {canonicalize_name(Requirement(line).name) for line in requirements}

    others = _with_dependencies(
        names(project["dependencies"]) | names(extras["gateway"]) | names(extras["operator"])
    )
    runtime_only = names(extras["runtime"]) - others
    return {
        module
        for module, distributions in importlib.metadata.packages_distributions().items()
        if any(canonicalize_name(distribution) in runtime_only for distribution in distributions)
    }


def _modules_of_the_gateway_process() -> set[str]:
    command_module = COMMANDS["gateway"].split(":")[0]
    modules = ["kvfleet.cli", command_module, *_imported_when_run(GATEWAY_CLI)]
    result = subprocess.run(
        [sys.executable, "-P", "-c", _PROBE, *modules], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout))


def test_the_gateway_process_loads_neither_torch_nor_the_scheduler() -> None:
    loaded = _modules_of_the_gateway_process()
    assert {"kvfleet.gateway.proxy", "kvfleet.gateway.kube"} <= loaded, "the probe loaded the gateway"
    assert "torch" not in loaded
    assert SCHEDULER not in loaded
    runtime_only = sorted(_runtime_only_modules() & {name.split(".")[0] for name in loaded})
    assert not runtime_only, f"the gateway loads what only the runtime's image installs: {runtime_only}"


def test_the_probe_sees_what_a_runtime_module_loads() -> None:
    """The same probe on the engine's scheduler finds it and torch: an empty answer would prove nothing."""
    result = subprocess.run(
        [sys.executable, "-P", "-c", _PROBE, SCHEDULER], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert result.returncode == 0, result.stderr
    assert SCHEDULER in json.loads(result.stdout)
