"""A process that compiles grammars for the engine core, and the core's handle on it.

xgrammar cannot interrupt a compilation, and some take minutes: on a thread of the core, one past its time
limit would burn a core to its end after its request had failed. In a process of its own it is killed at its
limit. The compiled grammar comes back as xgrammar's JSON, without the vocabulary (which both sides hold);
reading it back takes about a millisecond.

The process compiles one grammar at a time, and exits with its parent, even in the middle of one.
"""

from __future__ import annotations

import logging
import os
import socket
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kvfleet.runtime.child_process import child_arguments, describe_exit, exit_with_parent, start_child
from kvfleet.runtime.structured_outputs.grammars import GrammarError, build_grammar

if TYPE_CHECKING:
    # Imported by the compile process alone: the engine core that starts it never needs xgrammar for that.
    import xgrammar

# What the process sends once its vocabulary is ready, before its first compilation.
_READY = "ready"


class CompileTimeoutError(Exception):
    """The compilation ran past its time limit; its process has been stopped."""


class CompilerExitedError(RuntimeError):
    """The compile process died (a crash, or killed from outside) before it answered."""


class CompileWorker:
    """A compile process started by the engine core, which alone stops it. One thread uses it at a time."""

    def __init__(self, tokenizer_info: str) -> None:
        """Starts the process and waits until its vocabulary is ready (a few seconds: it imports xgrammar).
        `tokenizer_info`: xgrammar's TokenizerInfo, serialized."""
        ours, theirs = socket.socketpair()
        log_level = logging.getLogger().getEffectiveLevel()
        with theirs:
            self.process = start_child(
                __name__,
                (tokenizer_info, os.getpid(), log_level, theirs.fileno()),
                pass_fds=(theirs.fileno(),),
            )
        self._connection = Connection(ours.detach())
        self._receive()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def compile(self, kind: str, text: str, timeout: float) -> str:
        """The `grammar_key`'s compiled grammar, serialized. Raises GrammarError for a grammar that is not
        valid, RuntimeError for one xgrammar failed on, CompileTimeoutError past `timeout` seconds."""
        try:
            self._connection.send((kind, text))
        except OSError:  # it died while idle
            raise self._exited() from None
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
        if self.alive:
            self.process.kill()

    def stop(self) -> None:
        self.kill()
        self.process.wait()
        self._connection.close()

    def _receive(self) -> Any:
        try:
            return self._connection.recv()
        except EOFError:
            raise self._exited() from None

    def _exited(self) -> CompilerExitedError:
        self.stop()
        return CompilerExitedError(f"the grammar compile process {describe_exit(self.process.returncode)}")


def run_compile_worker(tokenizer_info: str, parent_pid: int, log_level: int, fd: int) -> None:
    """The process's target: compiles what arrives on `fd` until the engine core closes it."""
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [grammar compiler]: %(message)s"
    )
    import xgrammar

    exit_with_parent(parent_pid)
    vocabulary = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info)
    compiler = xgrammar.GrammarCompiler(vocabulary, max_threads=1)
    connection = Connection(fd)
    connection.send(_READY)
    while True:
        try:
            kind, text = connection.recv()
        except EOFError:
            return
        connection.send(_compiled(compiler, kind, text))


def _compiled(compiler: xgrammar.GrammarCompiler, kind: str, text: str) -> tuple[str, str]:
    """(outcome, value): ("compiled", the serialized grammar), ("invalid", why) or ("failed", why)."""
    try:
        return "compiled", compiler.compile_grammar(build_grammar(kind, text)).serialize_json()
    except GrammarError as exc:
        return "invalid", str(exc)
    except Exception as exc:  # anything: the request fails, the process goes on
        return "failed", str(exc)


if __name__ == "__main__":
    run_compile_worker(*child_arguments())
