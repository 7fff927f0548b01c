"""Polling helpers for tests against the local cluster."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.1) -> T:
    """Calls probe until it returns something truthy, and returns that; fails with what it last saw."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {result!r})")
        time.sleep(interval)


def condition(obj: dict, kind: str) -> dict | None:
    """The status condition of that type, or None."""
    for entry in obj.get("status", {}).get("conditions", []):
        if entry["type"] == kind:
            return entry
    return None
