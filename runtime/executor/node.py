"""`kvfleet serve --node-rank R` with R > 0: a node that only runs its share of the ranks.

Node 0 runs the API server, the engine core and its own workers; the core listens for the other nodes' workers
on --master-port + 1. This process starts this node's workers, which join the group at --master-addr, and
serves GET /health on --host/--port: 200 once each of them has joined, loaded its shard and allocated its KV
cache, 503 before. When a worker exits (the group broke: another node died, the engine core stopped, a
collective timed out) the others are stopped and the process exits 1; SIGTERM or SIGINT stop them and exit 0.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType

from kvfleet.runtime.child_process import describe_exit
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.executor.executor import start_workers, stop_workers

logger = logging.getLogger(__name__)


class _Stop(Exception):
    pass


def run_node(config: EngineConfig, host: str, port: int) -> int:
    """Run this node's workers until the group breaks (1) or a signal stops them (0)."""
    local_ranks = config.world_size // config.nnodes
    pipes = [os.pipe() for _ in range(local_ranks)]
    core_address = f"tcp://{config.master_addr}:{config.master_port + 1}"
    workers = start_workers(config, range(local_ranks), core_address, ready_fds=[w for _, w in pipes])
    for _, write_end in pipes:
        os.close(write_end)
    ready = threading.Event()
    server = ThreadingHTTPServer((host, port), _health_handler(ready))
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    logger.info(
        "node %d of %d: ranks %d..%d started; GET /health on %s:%d",
        config.node_rank,
        config.nnodes,
        config.node_rank * local_ranks,
        (config.node_rank + 1) * local_ranks - 1,
        host,
        port,
    )

    def stop(sig: int, frame: FrameType | None) -> None:
        raise _Stop(signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    pidfds = {os.pidfd_open(worker.pid): worker for worker in workers}
    waiting = {read_end for read_end, _ in pipes}
    try:
        while True:
            readable, _, _ = select.select([*pidfds, *waiting], [], [])
            for fd in readable:
                if fd in pidfds:
                    worker = pidfds[fd]
                    worker.wait()
                    logger.error(
                        "worker %d %s: the group is broken", worker.pid, describe_exit(worker.returncode)
                    )
                    return 1
                os.read(fd, 1)
                waiting.discard(fd)
                os.close(fd)
                if not waiting:
                    logger.info("every rank of this node is ready")
                    ready.set()
    except _Stop as how:
        logger.info("%s: stopping this node's workers", how)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.shutdown()
        server.server_close()
        stop_workers(workers)
        for fd in [*pidfds, *waiting]:
            os.close(fd)


def _health_handler(ready: threading.Event) -> type[BaseHTTPRequestHandler]:
    class HealthHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/health":
                self.send_error(404)
                return
            self.send_response(200 if ready.is_set() else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every few seconds would fill the log

    return HealthHandler
