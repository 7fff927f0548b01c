"""A `with` block during which a thread keeps a view of the cluster fresh."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Self

from e2e.cluster import ApiError


class BackgroundPoller:
    """Calls `poll` on entry (its errors propagate), then every `interval` seconds on a thread until exit.

    A failed poll on the thread keeps the previous view, as a controller's cache does while the API is away.
    """

    def __init__(self, name: str, interval: float) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def poll(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.poll()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except (ApiError, OSError):
                continue
