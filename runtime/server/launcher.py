"""The processes of `kvfleet serve`.

The EngineCore process is started first, as soon as the engine's options are checked: it imports torch and
loads the model while the command's process builds the server's settings, imports the HTTP stack and binds
the port. With one API server (the default) the command's own process then serves HTTP: two processes. With
`--api-server-count N`, the command's process supervises: it binds the port, then starts N API server
processes that accept on the same socket and share the core. SIGTERM drains them all; if the core or an API
server dies, the rest are stopped and the command exits non-zero.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfleet.contract.tiers import BACKGROUND_TIER, TIERS
from kvfleet.runtime.child_process import child_arguments, describe_exit, start_child
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.server.tokenizer_imports import import_tokenizer_classes
from kvfleet.runtime.startup_phases import STARTUP_PHASES

if TYPE_CHECKING:
    # The server's modules: imported while the engine core starts, not before it.
    from kvfleet.runtime.engine.core import EngineCore
    from kvfleet.runtime.engine.core_client import EngineCoreAddress, EngineCoreProcess
    from kvfleet.runtime.server.state import ServerSettings
    from kvfleet.runtime.server.tls import TlsFiles
    from kvfleet.runtime.serving.lora_adapters import LoRAAdapters

logger = logging.getLogger(__name__)

# How often the supervisor looks at its children.
_SUPERVISE_POLL_S = 0.2
# Connections the listening socket of several API servers queues before they accept them.
_BACKLOG = 2048


@dataclass(frozen=True)
class ServeOptions:
    """Everything `kvfleet serve` was asked for beyond the engine's own options."""

    settings: ServerSettings
    host: str = "0.0.0.0"
    port: int = 8000
    # A Unix domain socket served instead of host and port.
    uds: str | None = None
    access_log: bool = False
    # Paths whose requests the access log leaves out.
    access_log_excluded_paths: frozenset[str] = frozenset()
    # The HTTP server's own log level (uvicorn's names); None: the process's.
    uvicorn_log_level: str | None = None
    startup_request_timeout: float | None = None
    api_server_count: int = 1
    lora_adapters: LoRAAdapters | None = None
    # HTTPS instead of HTTP.
    tls: TlsFiles | None = None


def start_engine_core(
    config: EngineConfig,
    *,
    api_server_count: int,
    max_waiting_requests: int | None,
    core_class: type[EngineCore] | None = None,
) -> EngineCoreProcess:
    """The EngineCore process the server will run on. `core_class`: the EngineCore class to run (the
    static-batching baseline of the benchmarks brings its own)."""
    from kvfleet.runtime.engine.core_client import EngineCoreProcess

    core_options = {
        "max_waiting_requests": max_waiting_requests,
        # Each API server process needs a CPU while the core steps (HTTP, detokenization, SSE).
        "reserved_cpus": api_server_count,
        # The batch tier (and the Batch API, which runs at it) takes only the capacity others leave.
        "background_priority": TIERS[BACKGROUND_TIER],
    }
    return EngineCoreProcess(config, core_class=core_class, core_options=core_options)


def run_server(config: EngineConfig, options: ServeOptions, core: EngineCoreProcess) -> int:
    """Serve on `core` (from start_engine_core) until drained (0) or failed (1), then stop it; returns the
    exit status."""
    try:
        if options.api_server_count > 1:
            return _supervise(config, options, core)
        return run_api_server(config, options, client_index=0, core_process=core)
    finally:
        core.stop()


def run_api_server(
    config: EngineConfig,
    options: ServeOptions,
    *,
    client_index: int,
    core_address: EngineCoreAddress | None = None,
    core_process: EngineCoreProcess | None = None,
    listen_socket: socket.socket | None = None,
) -> int:
    """One API server process, on the core at `core_address` or the one `core_process` runs."""
    with STARTUP_PHASES.phase("api_server_imports"):
        import prometheus_client
        import uvicorn
        from kvfleet.contract.tiers import tier_of
        from kvfleet.runtime.engine.async_llm import AsyncLLM
        from kvfleet.runtime.metrics import ServerMetrics
        from kvfleet.runtime.server.access_log import ACCESS_LOGGER, ExcludedPaths
        from kvfleet.runtime.server.app import build_app
        from kvfleet.runtime.server.http_protocol import TimedH11Protocol
        from kvfleet.runtime.server.runner import GRACEFUL_SHUTDOWN_TIMEOUT_S, DrainingServer
        from kvfleet.runtime.server.state import ServerState

    settings = options.settings
    # One `_created` series per counter and histogram doubles what Prometheus stores, for nothing it uses.
    prometheus_client.disable_created_metrics()
    metrics = ServerMetrics(settings.served_model_name)
    tracing = None
    if settings.otlp_traces_endpoint is not None:
        from kvfleet.runtime.tracing import RequestTracing

        tracing = RequestTracing(settings.otlp_traces_endpoint, settings.served_model_name)
    engine = AsyncLLM(
        config,
        core_address=core_address,
        core_process=core_process,
        client_index=client_index,
        api_server_count=options.api_server_count,
        metrics=metrics,
        tracing=tracing,
        tier_of=tier_of,
        startup_request_timeout=options.startup_request_timeout,
    )
    state = ServerState(
        settings=settings, engine=engine, metrics=metrics, lora_adapters=options.lora_adapters
    )
    if settings.safety is not None:
        from kvfleet.runtime.serving.safety import ServerGuardrails

        state.guardrails = ServerGuardrails(settings.safety, metrics, engine)
    if options.lora_adapters is not None:
        adapters = options.lora_adapters
        metrics.set_lora_adapters_source(
            lambda: {served.lora.lora_name: served.lora.lora_int_id for served in adapters.loaded}
        )
    with STARTUP_PHASES.phase("api_server_app"):
        app = build_app(state)
    if options.access_log and options.access_log_excluded_paths:
        logging.getLogger(ACCESS_LOGGER).addFilter(ExcludedPaths(options.access_log_excluded_paths))
    uvicorn_config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        uds=options.uds,
        log_level=options.uvicorn_log_level or logging.getLogger().getEffectiveLevel(),
        log_config=None,
        access_log=options.access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        h11_max_incomplete_event_size=settings.h11_max_incomplete_event_size,
        http=TimedH11Protocol.with_timeouts(
            header_read_timeout=settings.header_read_timeout, send_timeout=settings.send_timeout
        ),
        **(options.tls.uvicorn_options() if options.tls is not None else {}),
    )
    refreshed = options.tls if options.tls is not None and options.tls.refresh else None
    server = DrainingServer(uvicorn_config, state, refreshed_tls=refreshed)
    server.run(sockets=[listen_socket] if listen_socket is not None else None)
    if tracing is not None:
        # The spans of the drained requests still on their way.
        tracing.shutdown()
    return 1 if server.failed or not server.started else 0


def _api_server_main(
    config: EngineConfig,
    options: ServeOptions,
    client_index: int,
    core_address: EngineCoreAddress,
    listen_fd: int,
    log_level: int,
) -> None:
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [api {client_index}]: %(message)s"
    )
    listen_socket = socket.socket(fileno=listen_fd)
    import_tokenizer_classes()
    raise SystemExit(
        run_api_server(
            config, options, client_index=client_index, core_address=core_address, listen_socket=listen_socket
        )
    )


def _supervise(config: EngineConfig, options: ServeOptions, core: EngineCoreProcess) -> int:
    from kvfleet.runtime.metrics import MULTIPROCESS_DIR

    listen_socket = _listen_socket(options)
    metrics_dir = tempfile.mkdtemp(prefix="kvfleet-metrics-")
    # Every API server records its request metrics there, and each one's /metrics adds them all up.
    os.environ[MULTIPROCESS_DIR] = metrics_dir
    log_level = logging.getLogger().getEffectiveLevel()
    listen_fd = listen_socket.fileno()
    stop_signals = (signal.SIGTERM, signal.SIGINT)
    # The signal that asked to stop: the handler only notes it, and the loop below passes it on, so that a
    # signal that comes while an API server is being started reaches that one too, and each gets it once.
    asked_to_stop: list[int] = []

    def note_stop(sig: int, _frame: object) -> None:
        asked_to_stop.append(sig)

    previous = {sig: signal.signal(sig, note_stop) for sig in stop_signals}
    api_servers: list[subprocess.Popen[bytes]] = []
    # An API server told to stop before it installed its drain handler dies of the signal: it had nothing
    # to drain, so that is a clean stop too.
    stopped_early = tuple(-sig for sig in stop_signals)
    passed_on = 0
    status = 0
    try:
        with listen_socket:
            for index in range(options.api_server_count):
                if asked_to_stop:
                    break
                arguments = (config, options, index, core.address, listen_fd, log_level)
                api_servers.append(
                    start_child("kvfleet.runtime.server.launcher", arguments, pass_fds=(listen_fd,))
                )
        while any(process.poll() is None for process in api_servers):
            # They drain on SIGTERM (a second signal makes them exit at once); the core is stopped after them.
            for sig in asked_to_stop[passed_on:]:
                for process in api_servers:
                    if process.poll() is None:
                        process.send_signal(sig)
            passed_on = len(asked_to_stop)
            time.sleep(_SUPERVISE_POLL_S)
            clean = (None, 0, *stopped_early) if asked_to_stop else (None, 0)
            failed = [process for process in api_servers if process.poll() not in clean]
            if core.process.poll() is not None or failed:
                # A dead core is noticed by the API servers themselves, which fail their requests and exit.
                status = 1
                if failed and not asked_to_stop:
                    logger.error("an API server %s; stopping the others", describe_exit(failed[0].returncode))
                    asked_to_stop.append(signal.SIGTERM)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for process in api_servers:
            if process.poll() is None:
                process.kill()
            process.wait()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _listen_socket(options: ServeOptions) -> socket.socket:
    """The socket every API server accepts on: the Unix domain socket asked for (a stale one replaced, as
    one server would), else host and port."""
    if options.uds is None:
        return socket.create_server((options.host, options.port), backlog=_BACKLOG)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(options.uds).st_mode):
            os.unlink(options.uds)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(options.uds)
    listening.listen(_BACKLOG)
    return listening


if __name__ == "__main__":
    _api_server_main(*child_arguments())
