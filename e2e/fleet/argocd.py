"""The chart's Argo CD health check (files/argocd-health.lua), evaluated by Lua as Argo CD does: the live
object is the global `obj`, and the script returns a table with `status` and `message`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lupa

from e2e.fleet.chart import CHART_DIR

HEALTH_SCRIPT = CHART_DIR / "files" / "argocd-health.lua"


@dataclass(frozen=True)
class Health:
    status: str
    message: str


class ArgoHealthCheck:
    def __init__(self, script: Path = HEALTH_SCRIPT) -> None:
        self._source = script.read_text()

    def evaluate(self, obj: dict[str, Any]) -> Health:
        # A fresh runtime per object, so nothing one evaluation sets leaks into the next.
        lua = lupa.LuaRuntime(unpack_returned_tuples=True)
        lua.globals().obj = lua.table_from(obj, recursive=True)
        result = lua.execute(self._source)
        if result is None:
            raise AssertionError("the health script returned nothing")
        return Health(status=str(result["status"]), message=str(result["message"] or ""))
