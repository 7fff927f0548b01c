"""What each part imports is what the package declares for it, and every declared dependency is pinned.

`pip install kvfleet[operator]` must give a working operator without torch, and `kvfleet[runtime]` a working
engine: a direct import that only arrives through another package's dependencies breaks when that one
changes.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# folder -> the extras that install what it needs, beyond the core dependencies
# The project's own top-level names: its packages, and the test modules that tests import by name (conftest,
# server_checks, ports, ...).
LOCAL = {"kvfleet", "e2e", "images", "tests"} | {path.stem for path in (ROOT / "tests").rglob("*.py")}
PARTS = {
    # The fleet simulator runs the operator's and the gateway's own code.
    "kvfleet": ("operator", "gateway", "simulate"),
    "operator": ("operator",),
    "gateway": ("gateway",),
    "contract": (),
    "runtime": ("runtime",),
    "tests": ("runtime", "operator", "gateway", "simulate", "test"),
    "e2e": ("runtime", "operator", "gateway", "simulate", "test"),
    "images": ("runtime", "operator", "gateway", "simulate", "test"),
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
                # `from package import module` imports the module, which a namespace package's
                # distributions each install their own of.
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in LOCAL:
                    continue
                for distribution in _installers(name, distributions.get(top, [top])):
                    found.setdefault(canonicalize_name(distribution), set()).add(str(path.relative_to(ROOT)))
    return found


def _installers(name: str, candidates: list[str]) -> list[str]:
    """Of the distributions that install the top-level package of `name`, those that install the module
    itself: several share a namespace package (OpenTelemetry's), and each installs modules of its own in it.
    `name` may end with a name that is not a module (`from package import function`): its module counts."""
    if len(set(candidates)) == 1:
        return candidates
    module = name
    while module.count("."):
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.origin is not None:
            origin = Path(spec.origin).resolve()
            owners = [candidate for candidate in candidates if origin in _installed_files(candidate)]
            return owners or candidates
        module = module.rsplit(".", 1)[0]
    return candidates


@functools.cache
def _installed_files(distribution_name: str) -> frozenset[Path]:
    distribution = importlib.metadata.distribution(distribution_name)
    return frozenset(Path(str(distribution.locate_file(file))).resolve() for file in distribution.files or ())


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
            if line and not line.startswith("-r "):  # an included file is read on its own
                requirement = Requirement(line)
                assert str(requirement.specifier).startswith("=="), f"{path.name}: {line} is not pinned"
                pins[canonicalize_name(requirement.name)] = str(requirement.specifier)
    declared = _declared(*PYPROJECT["optional-dependencies"])
    unpinned = sorted(declared - set(pins))
    assert not unpinned, f"declared in pyproject.toml but not pinned under requirements/: {unpinned}"


# Runs `kvfleet operator --help` and `kvfleet gateway --help` and imports the kopf handlers and the gateway
# with the runtime's and the simulator's dependencies unimportable.
_OPERATOR_ONLY = """
import importlib.abc, sys

# The gateway tokenizes prompts with `tokenizers` and prepares their images with numpy: the image has them.
RUNTIME_ONLY = {"torch", "triton", "transformers", "safetensors", "fastapi", "uvicorn", "soundfile", "httpx"}
# The fleet simulator's own: the image leaves them out.
SIMULATE_ONLY = {"numba", "llvmlite", "matplotlib"}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in RUNTIME_ONLY | SIMULATE_ONLY:
            raise ImportError(f"{name} is not installed in the operator's image")
        return None

sys.meta_path.insert(0, Refuse())
import kvfleet.operator.handlers
import kvfleet.gateway.cli, kvfleet.gateway.kube
from kvfleet.cli import cli
cli.main(["operator", "--help"], standalone_mode=False)
cli.main(["gateway", "--help"], standalone_mode=False)
"""


def test_the_operator_and_gateway_run_without_the_runtime_dependencies() -> None:
    result = subprocess.run(
        [sys.executable, "-P", "-c", _OPERATOR_ONLY], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert result.returncode == 0, result.stderr
    assert "Run the kvfleet operator" in result.stdout
    assert "Run the kvfleet fleet gateway" in result.stdout


# What a wheel (or an image) is built from; building a copy leaves no build/ in the checkout.
PACKAGE_SOURCES = (
    "pyproject.toml",
    "setup.py",
    "README.md",
    "kvfleet",
    "runtime",
    "operator",
    "gateway",
    "contract",
)


def test_the_wheel_holds_every_part_and_the_command(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in PACKAGE_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    pip_wheel = [sys.executable, "-P", "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip_wheel, "-w", tmp_path, source], check=True, timeout=300, cwd=tmp_path)
    (wheel,) = tmp_path.glob("kvfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, package in (
        ("kvfleet", "kvfleet"),
        ("runtime", "kvfleet/runtime"),
        ("operator", "kvfleet/operator"),
        ("gateway", "kvfleet/gateway"),
        ("contract", "kvfleet/contract"),
    ):
        for module in (ROOT / folder).rglob("*.py"):
            assert f"{package}/{module.relative_to(ROOT / folder).as_posix()}" in names
    assert "kvfleet/runtime/models/data/corpus.txt" in names, "the tokenizer corpus of make-model"
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "kvfleet = kvfleet.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert not any(name.startswith(("tests/", "e2e/", "bench/")) for name in names)
