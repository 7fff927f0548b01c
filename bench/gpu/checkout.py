"""Import kvfleet from this checkout whether or not it is installed.

The package maps folders to import names (`runtime/` is `kvfleet.runtime`, `contract/` is
`kvfleet.contract`), which an editable install normally provides. On a machine where nothing can be
installed, `use_this_checkout()` registers the same mapping by hand, read from `pyproject.toml`'s
`package-dir`, so that the two never disagree.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _package_dirs() -> dict[str, Path]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        mapping = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def _load(name: str, folder: Path) -> None:
    found = importlib.util.find_spec(name)
    if found is not None and found.origin is not None and Path(found.origin).parent == folder:
        return
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name} from {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)


def use_this_checkout() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    importlib.import_module("kvfleet")
    for name, folder in _package_dirs().items():
        if name != "kvfleet":
            _load(name, folder)
