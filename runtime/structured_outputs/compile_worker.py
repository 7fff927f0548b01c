"""Processes that compile grammars for the engine core, and the core's handles on them.

xgrammar cannot interrupt a compilation, and some take minutes: on a thread of the core, one past its time
limit would burn a core to its end after its request had failed. In a process of its own it is killed at its
limit. Importing xgrammar takes seconds and hundreds of megabytes (it imports torch), so a compile server
imports it and reads the vocabulary once, then forks each compile process from itself: a process killed at
its limit is replaced in milliseconds, and the processes share the server's pages. The server forks nothing
else and starts no threads of its own but the one that watches the core, which fork leaves behind.

Each compile process gets one end of a socket pair, the core holds the other, and the server keeps a copy of
the process's end: when the process exits, the server reaps it and writes how it ended on that copy, so the
core reads why a compilation failed where it reads its answers. The core gets each process's pidfd too, so
that it never signals a reused pid. A compiled grammar comes back as xgrammar's JSON, without the vocabulary
(which both sides hold); reading it back takes about a millisecond.

A compile process compiles one grammar at a time. The server and its processes end with the engine core,
even in the middle of a compilation.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import struct
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kvfleet.runtime.child_process import child_arguments, describe_exit, exit_with_parent, start_child
from kvfleet.runtime.structured_outputs.grammars import GrammarError, build_grammar

if TYPE_CHECKING:
    # Imported by the compile server alone: the engine core that starts it never needs xgrammar for that.
    import xgrammar

# What the server sends once its vocabulary is ready, before it forks anything.
_READY = b"ready"
# The core's request for a compile process, sent with that process's end of its socket pair.
_FORK = b"fork"
# The server's answer: the process's pid, sent with its pidfd.
_PID = struct.Struct("=i")


class CompileTimeoutError(Exception):
    """The compilation ran past its time limit; its process has been stopped."""


class CompilerExitedError(RuntimeError):
    """A compile process (or the server) died (a crash, or killed from outside) before it answered."""


class CompileServer:
    """The compile server started by the engine core, which alone stops it. Threads may ask it for compile
    processes at once."""

    def __init__(self, tokenizer_info: str) -> None:
        """Starts the server and waits until its vocabulary is ready (a few seconds: it imports xgrammar).
        `tokenizer_info`: xgrammar's TokenizerInfo, serialized."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_level = logging.getLogger().getEffectiveLevel()
        with theirs:
            self.process = start_child(
                __name__,
                (tokenizer_info, os.getpid(), log_level, theirs.fileno()),
                pass_fds=(theirs.fileno(),),
            )
        self._control = ours
        self._lock = threading.Lock()
        if self._control.recv(len(_READY)) != _READY:
            raise self._exited()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self) -> CompileWorker:
        """A new compile process, ready for a grammar."""
        ours, theirs = socket.socketpair()
        with self._lock, theirs:
            try:
                socket.send_fds(self._control, [_FORK], [theirs.fileno()])
                message, fds, _, _ = socket.recv_fds(self._control, _PID.size, 1)
            except OSError:
                message, fds = b"", []
        if len(message) != _PID.size or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            ours.close()
            raise self._exited()
        (pid,) = _PID.unpack(message)
        return CompileWorker(pid, fds[0], Connection(ours.detach()))

    def kill(self) -> None:
        """Kills the server; its compile processes end with the core, or when the core kills them."""
        if self.alive:
            self.process.kill()
        self.process.wait()
        self._control.close()

    def _exited(self) -> CompilerExitedError:
        self.kill()
        return CompilerExitedError(f"the grammar compile server {describe_exit(self.process.returncode)}")


class CompileWorker:
    """A compile process forked by the server. One thread compiles with it at a time; another may kill it
    (the engine shutting down)."""

    def __init__(self, pid: int, pidfd: int, connection: Connection) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._connection = connection
        # Guards the pidfd, which stop() closes, against a kill from another thread.
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def alive(self) -> bool:
        with self._lock:
            return not self._stopped and not _has_exited(self._pidfd)

    def compile(self, kind: str, text: str, timeout: float) -> str:
        """The `grammar_key`'s compiled grammar, serialized. Raises GrammarError for a grammar that is not
        valid, RuntimeError for one xgrammar failed on, CompileTimeoutError past `timeout` seconds."""
        try:
            self._connection.send((kind, text))
        except OSError:  # it died while idle, and the server wrote nothing yet
            raise self._exited(None) from None
        if not self._connection.poll(timeout):
            self.stop()
            raise CompileTimeoutError
        outcome, value = self._receive()
        if outcome == "invalid":
            raise GrammarError(value)
        if outcome == "failed":
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        """Kills the process at once (a compilation cannot be interrupted otherwise); a thread waiting on it
        hears that it exited."""
        with self._lock:
            if not self._stopped and not _has_exited(self._pidfd):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def stop(self) -> None:
        """Kills the process, waits until it has exited and closes the handles on it."""
        self.kill()
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            _has_exited(self._pidfd, wait=True)
            self._connection.close()
            os.close(self._pidfd)

    def _receive(self) -> Any:
        try:
            message = self._connection.recv()
        except (EOFError, ConnectionResetError):  # the server is gone too, and wrote nothing
            raise self._exited(None) from None
        if message[0] == "exited":
            raise self._exited(message[1])
        return message

    def _exited(self, returncode: int | None) -> CompilerExitedError:
        self.stop()
        how = "exited" if returncode is None else describe_exit(returncode)
        return CompilerExitedError(f"the grammar compile process {self.pid} {how}")


def _has_exited(pidfd: int, wait: bool = False) -> bool:
    """Whether the pidfd's process has exited (its pidfd turns readable), or, with `wait`, once it has. poll,
    not select: an engine core's descriptors may number past select's limit."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if wait else 0))


def run_compile_server(tokenizer_info: str, parent_pid: int, log_level: int, fd: int) -> None:
    """The server process's target: forks a compile process for each request on `fd` and reports how each
    ended, until the engine core closes `fd`."""
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [grammar compiler]: %(message)s"
    )
    import xgrammar

    exit_with_parent(parent_pid)
    # The compile processes' exit statuses are read with waitpid, which a SIG_IGN inherited from the core
    # would take away.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    vocabulary = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info)
    control = socket.socket(fileno=fd)
    control.send(_READY)
    # pidfd -> (pid, the server's copy of the process's end of its socket pair)
    processes: dict[int, tuple[int, socket.socket]] = {}
    while True:
        readable, _, _ = select.select([control, *processes], [], [])
        for pidfd in (ready for ready in readable if ready is not control):
            pid, copy = processes.pop(pidfd)
            _report_exit(pid, copy)
            os.close(pidfd)
        if control in readable:
            message, fds, _, _ = socket.recv_fds(control, len(_FORK), 1)
            if not message:
                return
            end = socket.socket(fileno=fds[0])
            pid = os.fork()
            if pid == 0:
                # What the server holds is not the compile process's to keep open.
                control.close()
                for other_pidfd, (_, other) in processes.items():
                    other.close()
                    os.close(other_pidfd)
                os._exit(_compile_forever(vocabulary, end, parent_pid))
            pidfd = os.pidfd_open(pid)
            socket.send_fds(control, [_PID.pack(pid)], [pidfd])
            processes[pidfd] = pid, end


def _report_exit(pid: int, copy: socket.socket) -> None:
    """Reaps an exited compile process and writes how it ended on its socket, for the core."""
    _, status = os.waitpid(pid, 0)
    connection = Connection(copy.detach())
    try:
        connection.send(("exited", os.waitstatus_to_exitcode(status)))
    except OSError:  # the core has closed its end: it stopped the process itself
        pass
    finally:
        connection.close()


def _compile_forever(vocabulary: xgrammar.TokenizerInfo, end: socket.socket, core_pid: int) -> int:
    """A forked compile process: compiles what arrives on `end` until the core closes it. Its exit code:
    whatever happens, the process must not go back to the server's loop it was forked from."""
    try:
        import xgrammar

        exit_with_parent(core_pid)
        compiler = xgrammar.GrammarCompiler(vocabulary, max_threads=1)
        connection = Connection(end.detach())
        while True:
            try:
                kind, text = connection.recv()
            except EOFError:
                return 0
            connection.send(_compiled(compiler, kind, text))
    except BaseException:
        logging.getLogger(__name__).exception("the grammar compile process failed")
        return 1


def _compiled(compiler: xgrammar.GrammarCompiler, kind: str, text: str) -> tuple[str, str]:
    """(outcome, value): ("compiled", the serialized grammar), ("invalid", why) or ("failed", why)."""
    try:
        return "compiled", compiler.compile_grammar(build_grammar(kind, text)).serialize_json()
    except GrammarError as exc:
        return "invalid", str(exc)
    except Exception as exc:  # anything: the request fails, the process goes on
        return "failed", str(exc)


if __name__ == "__main__":
    run_compile_server(*child_arguments())
