"""The API server's side of the EngineCore: starting the core process, and the asyncio end of its socket.

The client learns of the core's death from a pidfd (readable once the process has exited), so it notices
a killed core at once, whether it started the core itself or another process did.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio
from kvfleet.runtime.child_process import describe_exit, start_child
from kvfleet.runtime.config import EngineConfig
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
    ToCore,
    UtilityDone,
    WakeUp,
    from_core_decoder,
)
from kvfleet.runtime.errors import EngineDeadError, error_of_kind

if TYPE_CHECKING:
    from kvfleet.runtime.engine.core import EngineCore

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0
_SOCKET_NAME = "engine-core.sock"
_SOCKET_DIR_PREFIX = "kvfleet-core-"


def _private_socket_dir() -> str:
    """A new directory only this user can enter, for the core's socket. A socket's path is limited to about
    a hundred bytes, and containers often point TMPDIR at a volume deep in the file system, so the temporary
    directory is used only where the path fits, else /dev/shm or /tmp."""
    # mkdtemp adds 8 characters to the prefix.
    suffix = len(f"/{_SOCKET_DIR_PREFIX}12345678/{_SOCKET_NAME}")
    for base in (tempfile.gettempdir(), "/dev/shm", "/tmp"):
        if len(base.encode()) + suffix <= zmq.IPC_PATH_MAX_LEN and os.access(base, os.W_OK | os.X_OK):
            return tempfile.mkdtemp(prefix=_SOCKET_DIR_PREFIX, dir=base)
    raise RuntimeError(
        f"no writable directory with a path short enough for the engine core's socket "
        f"(at most {zmq.IPC_PATH_MAX_LEN - suffix} bytes): set TMPDIR to one"
    )


@dataclass(frozen=True)
class EngineCoreAddress:
    """Where API servers reach a running core, and its process id."""

    address: str
    pid: int


class EngineCoreProcess:
    """An engine core process started by this process, which alone may stop it."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        core_class: type[EngineCore] | None = None,
        core_options: dict[str, Any] | None = None,
    ) -> None:
        self._socket_dir = _private_socket_dir()
        address = f"ipc://{self._socket_dir}/{_SOCKET_NAME}"
        log_level = logging.getLogger().getEffectiveLevel()
        self.process = start_child(
            "kvfleet.runtime.engine.core_proc",
            (config, address, os.getpid(), log_level, core_class, core_options),
        )
        self.address = EngineCoreAddress(address, self.process.pid)

    def describe_exit(self) -> str:
        return describe_exit(self.process.poll())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(_STOP_TIMEOUT_S)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


class EngineCoreClient:
    """One API server's connection to the core. Outputs go to `on_outputs`, in order, on the event loop;
    the core's death (or a failure to load) goes to `on_dead` once."""

    def __init__(
        self,
        address: EngineCoreAddress,
        client_index: int,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[EngineDeadError], None],
        owned: EngineCoreProcess | None = None,
    ) -> None:
        self.address = address
        self.client_index = client_index
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._owned = owned
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, client_index.to_bytes(4, "big"))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = from_core_decoder()
        self._pidfd: int | None = None
        self._receiver: asyncio.Task[None] | None = None
        # Set when the core's process has exited.
        self._exited: asyncio.Future[None] | None = None
        self.dead: EngineDeadError | None = None
        # Sleep and wake-up calls waiting for the core's answer, by call id.
        self._calls: dict[int, asyncio.Future[None]] = {}
        self._call_ids = itertools.count()

    async def connect(self) -> Ready:
        """Say hello and wait for the core to be ready; raises EngineDeadError if it fails or dies first."""
        loop = asyncio.get_running_loop()
        try:
            self._pidfd = os.pidfd_open(self.address.pid)
        except ProcessLookupError:
            raise self._died("is not running") from None
        self._exited = loop.create_future()
        loop.add_reader(self._pidfd, self._on_exit)
        self._socket.connect(self.address.address)
        self._send(Hello(self.client_index))
        receive = asyncio.ensure_future(self._socket.recv())
        await asyncio.wait({receive, self._exited}, return_when=asyncio.FIRST_COMPLETED)
        if not receive.done():
            receive.cancel()
            raise self.dead or self._died("has exited")
        reply = self._decoder.decode(receive.result())
        if isinstance(reply, Failed):
            raise self._died(f"failed to load the model: {reply.message}")
        assert isinstance(reply, Ready)
        self._receiver = asyncio.ensure_future(self._receive())
        return reply

    def _died(self, what: str) -> EngineDeadError:
        error = EngineDeadError(f"the engine core process (pid {self.address.pid}) {what}")
        if self.dead is None:
            self.dead = error
            for call in self._calls.values():
                if not call.done():
                    call.set_exception(error)
            self._on_dead(error)
        return self.dead

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        if self._pidfd is not None:
            loop.remove_reader(self._pidfd)
        how = self._owned.describe_exit() if self._owned is not None else "has exited"
        logger.error("the engine core process (pid %d) %s", self.address.pid, how)
        self._died(how)
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(None)

    async def _receive(self) -> None:
        try:
            while True:
                payload = await self._socket.recv(copy=False)
                message = self._decoder.decode(payload.buffer)
                if isinstance(message, EngineCoreOutputs):
                    self._on_outputs(message)
                elif isinstance(message, UtilityDone):
                    self._on_utility_done(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Outputs that cannot be read would leave every request waiting forever.
            logger.exception("reading the engine core's outputs failed")
            self._died(f"could not be read from: {type(exc).__name__}: {exc}")

    def add_requests(self, requests: list[AddRequest]) -> None:
        for request in requests:
            self._send(request)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(request_ids))

    def remove_lora(self, lora_int_id: int) -> None:
        self._send(RemoveLoRA(lora_int_id))

    def reset_prefix_cache(self) -> None:
        self._send(ResetPrefixCache())

    async def sleep(self, level: int, mode: str) -> None:
        await self._call(lambda call_id: Sleep(call_id, level, mode))

    async def wake_up(self, tags: list[str] | None) -> None:
        await self._call(lambda call_id: WakeUp(call_id, tags))

    async def _call(self, message: Callable[[int], Sleep | WakeUp]) -> None:
        """Send a call and wait for the core's answer; raises the EngineError the call failed with."""
        if self.dead is not None:
            raise self.dead
        call_id = next(self._call_ids)
        answer = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        try:
            self._send(message(call_id))
            await answer
        finally:
            del self._calls[call_id]

    def _on_utility_done(self, done: UtilityDone) -> None:
        answer = self._calls.get(done.call_id)
        if answer is None or answer.done():
            return
        if done.error_kind is None:
            answer.set_result(None)
        else:
            answer.set_exception(error_of_kind(done.error_kind, done.message))

    def _send(self, message: ToCore) -> None:
        # With no high-water mark a send never waits, so it completes here, in call order.
        if self.dead is None:
            self._socket.send(self._encoder.encode(message), copy=False)

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self._socket.close(linger=0)
        self._context.term()
