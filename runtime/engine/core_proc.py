"""The EngineCore process: the core's busy loop behind a ZeroMQ ROUTER socket.

Why a process: the Python parts of a step (scheduling, input preparation, sampling) then never wait for the
API server's interpreter lock, nor it for theirs (HTTP parsing, tokenization, detokenization, SSE).

The loop: with requests to run, take whatever messages have arrived without waiting, then step and send
each API server one message with its outputs; with nothing to run but KV blocks held for pulls (disaggregated
prefill and decode), wait a little for a message, then step to let go of the blocks whose pull ended or whose
hold expired; with nothing at all, sleep until a message arrives. The
process ends when its parent does, so a killed API server never leaves a core holding the accelerator.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from kvfleet.runtime.child_process import child_arguments
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import SchedulerStats
from kvfleet.runtime.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    Failed,
    Hello,
    Ready,
    RemoveLoRA,
    ResetPrefixCache,
    Sleep,
    UtilityDone,
    WakeUp,
    to_core_decoder,
)
from kvfleet.runtime.errors import EngineError, InvalidRequestError
from kvfleet.runtime.executor.executor import WorkerFailedError
from kvfleet.runtime.startup_phases import STARTUP_PHASES, process_age

if TYPE_CHECKING:
    from kvfleet.runtime.engine.core import EngineCore

logger = logging.getLogger(__name__)

# How long a failed core waits for its Failed message to leave before it exits.
_FAILED_LINGER_MS = 2000
# With only KV blocks held for pulls, how long the loop waits for a message between steps.
_HOLDS_POLL_MS = 50


def run_engine_core(
    config: EngineConfig,
    address: str,
    parent_pid: int,
    log_level: int,
    core_class: type[EngineCore] | None = None,
    core_options: dict[str, Any] | None = None,
) -> None:
    """The process's target. Binds `address` first, so API servers can connect while the model loads."""
    try:
        _serve(config, address, parent_pid, log_level, core_class, core_options)
    finally:
        _remove_socket(address)


def _remove_socket(address: str) -> None:
    """The socket and its private directory go with the process: an API server killed by SIGKILL cannot
    remove them, and ZeroMQ leaves the file behind. Only an empty directory is removed."""
    path = address.removeprefix("ipc://")
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


def _serve(
    config: EngineConfig,
    address: str,
    parent_pid: int,
    log_level: int,
    core_class: type[EngineCore] | None,
    core_options: dict[str, Any] | None,
) -> None:
    STARTUP_PHASES.add("engine_core_imports", process_age())
    with STARTUP_PHASES.phase("engine_core_imports"):
        from kvfleet.runtime.engine.core import EngineCore

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    parent = os.pidfd_open(parent_pid)
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.bind(address)
    try:
        with STARTUP_PHASES.phase("engine_core_setup"):
            core = (core_class or EngineCore)(config, **(core_options or {}))
    except Exception as exc:
        logger.exception("the engine core failed to load")
        _answer_hellos(socket, Failed(f"{type(exc).__name__}: {exc}"))
        socket.close(linger=_FAILED_LINGER_MS)
        raise SystemExit(1) from None
    logger.info("engine core started: %s", STARTUP_PHASES.describe())
    try:
        EngineCoreProc(core, socket, parent).run()
    except WorkerFailedError as exc:
        logger.error("stopping the engine core: %s", exc)
        raise SystemExit(1) from None
    finally:
        core.shutdown()
        socket.close(linger=0)
        context.term()


def _answer_hellos(socket: zmq.Socket, reply: Failed) -> None:
    decoder = to_core_decoder()
    encoder = msgspec.msgpack.Encoder()
    while socket.poll(0):
        identity, payload = socket.recv_multipart()
        if isinstance(decoder.decode(payload), Hello):
            socket.send_multipart((identity, encoder.encode(reply)))


class EngineCoreProc:
    def __init__(self, core: EngineCore, socket: zmq.Socket, parent_fd: int) -> None:
        self.core = core
        self.socket = socket
        self.parent_fd = parent_fd
        self.decoder = to_core_decoder()
        self.encoder = msgspec.msgpack.Encoder()
        # The API servers (DEALER identities) that said hello, and which one sent each sequence.
        self.clients: list[bytes] = []
        self.client_of: dict[str, bytes] = {}
        self._last_stats: SchedulerStats | None = None
        # Sleep calls (their client and call id) waiting for the requests in the engine to finish.
        self._sleep_calls: list[tuple[bytes, int]] = []

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.parent_fd, zmq.POLLIN)
        # Worker processes (tensor and pipeline parallelism): one lost, even while idle, ends the core.
        worker_watches = self.core.executor.worker_watches
        for watch in worker_watches:
            poller.register(watch, zmq.POLLIN)
        while True:
            busy = self.core.has_unfinished_requests()
            holding = not busy and self.core.has_pending_kv_transfers()
            events = dict(poller.poll(0 if busy else _HOLDS_POLL_MS if holding else None))
            if self.parent_fd in events:
                logger.info("the API server has exited; stopping the engine core")
                return
            if any(watch in events for watch in worker_watches):
                self.core.executor.check_workers()
            received = self.socket in events and self._receive()
            if self.core.has_unfinished_requests():
                self._send(self.core.step())
            elif holding:
                self._send_changes(self.core.step())
            elif received:
                # Nothing to step, but aborts changed the queues: the front ends' metrics should see it.
                self._send(EngineCoreOutputs(stats=self.core.stats))
            if self._sleep_calls and not self.core.falling_asleep:
                self._answer_sleep_calls(None)

    def _receive(self) -> bool:
        socket, core = self.socket, self.core
        while socket.poll(0):
            identity, payload = socket.recv_multipart(copy=False)
            message = self.decoder.decode(payload.buffer)
            if isinstance(message, AddRequest):
                self.client_of[message.request_id] = identity.bytes
                core.add_request(message)
            elif isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
                for request_id in message.request_ids:
                    self.client_of.pop(request_id, None)
            elif isinstance(message, RemoveLoRA):
                core.remove_lora(message.lora_int_id)
            elif isinstance(message, ResetPrefixCache):
                core.reset_prefix_cache()
            elif isinstance(message, Sleep):
                self._sleep(identity.bytes, message)
            elif isinstance(message, WakeUp):
                self._wake_up(identity.bytes, message)
            elif isinstance(message, Hello):
                self.clients.append(identity.bytes)
                ready = Ready(core.info, STARTUP_PHASES.seconds)
                socket.send_multipart((identity.bytes, self.encoder.encode(ready)))
        return True

    def _sleep(self, client: bytes, message: Sleep) -> None:
        try:
            self.core.sleep(message.level, message.mode)
        except WorkerFailedError:
            raise
        except Exception as error:
            self._answer(client, message.call_id, error)
        else:
            if self.core.falling_asleep:
                # Answered after the step that finishes the last request (run), or called off (_wake_up).
                self._sleep_calls.append((client, message.call_id))
            else:
                self._answer(client, message.call_id, None)

    def _wake_up(self, client: bytes, message: WakeUp) -> None:
        error: Exception | None = None
        try:
            self.core.wake_up(message.tags)
        except WorkerFailedError:
            raise
        except Exception as exc:  # the weights could not be read again, ...: the caller hears why
            logger.exception("waking the engine up failed")
            error = exc
        if self._sleep_calls and not self.core.falling_asleep:
            self._answer_sleep_calls(InvalidRequestError("the engine was woken up before it fell asleep"))
        self._answer(client, message.call_id, error)

    def _answer_sleep_calls(self, error: Exception | None) -> None:
        calls, self._sleep_calls = self._sleep_calls, []
        for client, call_id in calls:
            self._answer(client, call_id, error)

    def _answer(self, client: bytes, call_id: int, error: Exception | None) -> None:
        """Every API server first hears the engine's state (its stats: the sleep level), then the caller its
        answer, so that the caller's view is current when the call returns."""
        self._send(EngineCoreOutputs(stats=self.core.stats))
        if error is None:
            done = UtilityDone(call_id)
        elif isinstance(error, EngineError):
            done = UtilityDone(call_id, error.kind, str(error))
        else:
            done = UtilityDone(call_id, EngineError.kind, f"{type(error).__name__}: {error}")
        self.socket.send_multipart((client, self.encoder.encode(done)))

    def _send_changes(self, step: EngineCoreOutputs) -> None:
        """A step that ran no request is sent only when it changed what the front ends see (blocks held)."""
        if step.outputs or step.errors or step.stats != self._last_stats:
            self._send(step)

    def _send(self, step: EngineCoreOutputs) -> None:
        """One message per API server: its own outputs and errors, and everyone's stats."""
        per_client = {
            client: EngineCoreOutputs(stats=step.stats, step_time=step.step_time) for client in self.clients
        }
        client_of = self.client_of
        for output in step.outputs:
            client = client_of.get(output.request_id)
            if client is not None:
                per_client[client].outputs.append(output)
                if output.finish_reason is not None:
                    del client_of[output.request_id]
        for error in step.errors:
            client = client_of.pop(error.request_id, None)
            if client is not None:
                per_client[client].errors.append(error)
        for request_id in step.started:
            client = client_of.get(request_id)
            if client is not None:
                per_client[client].started.append(request_id)
        for client, message in per_client.items():
            self.socket.send_multipart((client, self.encoder.encode(message)), copy=False)
        self._last_stats = step.stats


if __name__ == "__main__":
    run_engine_core(*child_arguments())
