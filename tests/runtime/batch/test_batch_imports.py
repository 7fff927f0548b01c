"""run-batch and the Batch API's worker reach the OpenAI service directly: the batch package loads no web
framework."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import kvfleet.runtime.batch

WEB_FRAMEWORKS = ("starlette", "fastapi", "uvicorn")


def test_the_batch_modules_import_no_web_framework() -> None:
    modules = [
        info.name for info in pkgutil.iter_modules(kvfleet.runtime.batch.__path__, "kvfleet.runtime.batch.")
    ]
    assert "kvfleet.runtime.batch.offline" in modules
    # A fresh interpreter: this one may have loaded the frameworks for other tests.
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True).stdout
    )
    assert [name for name in loaded if name.split(".")[0] in WEB_FRAMEWORKS] == []
