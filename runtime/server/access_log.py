"""vLLM's --disable-access-log-for-endpoints: the access log without the lines of some paths, such as the
probes a kubelet or a load balancer sends every few seconds, which would drown the requests in it."""

from __future__ import annotations

import logging

# The HTTP server's access log, one record per response: (client, method, path with query, HTTP version,
# status).
ACCESS_LOGGER = "uvicorn.access"


class ExcludedPaths(logging.Filter):
    """Drops the access log's records of requests to these paths (whatever their query string)."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3:
            return True
        return str(args[2]).split("?", 1)[0] not in self.paths


def parse_paths(value: str | None) -> frozenset[str]:
    """The flag's comma-separated paths; each must start with '/'."""
    paths = frozenset(path.strip() for path in (value or "").split(",") if path.strip())
    for path in paths:
        if not path.startswith("/"):
            raise ValueError(f"{path!r} is not a path: each starts with '/', as /health,/metrics")
    return paths
