"""Import kvfleet from this checkout whether or not it is installed.

The package maps folders to import names (`runtime/` is `kvfleet.runtime`), which an editable install
normally provides. On a machine where nothing can be installed, `use_this_checkout()` registers the same
mapping by hand: `kvfleet` from `kvfleet/`, and `kvfleet.runtime` as a package whose submodules are
found in `runtime/`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def use_this_checkout() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    kvfleet = importlib.import_module("kvfleet")
    runtime_dir = ROOT / "runtime"
    found = importlib.util.find_spec("kvfleet.runtime")
    if found is not None and found.origin is not None and Path(found.origin).parent == runtime_dir:
        return
    spec = importlib.util.spec_from_file_location(
        "kvfleet.runtime", runtime_dir / "__init__.py", submodule_search_locations=[str(runtime_dir)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load kvfleet.runtime from {runtime_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvfleet.runtime"] = module
    spec.loader.exec_module(module)
    kvfleet.runtime = module
