"""Child processes of the runtime: a fresh interpreter that runs one module, handed its arguments on stdin.

Not multiprocessing: its spawn start method re-imports the parent's main module and adds a resource-tracker
process, and the process tree should be exactly what `kvfleet serve` says it is.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


def start_child(
    module: str, arguments: tuple[Any, ...], *, pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    # -P: the working directory (a checkout, with its operator/ folder) must not shadow the standard library.
    # A process group of its own: a terminal's Ctrl-C, or a supervisor that signals every process of the
    # parent's group (a container's), must not stop the child before its parent has drained its requests. The
    # parent decides when the child stops, and the child ends with its parent.
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", module], stdin=subprocess.PIPE, pass_fds=pass_fds, process_group=0
    )
    assert process.stdin is not None
    with process.stdin:
        pickle.dump(arguments, process.stdin)
    return process


def child_arguments() -> tuple[Any, ...]:
    """In the child: the arguments its parent passed to start_child."""
    return pickle.load(sys.stdin.buffer)


def exit_with_parent(parent_pid: int) -> None:
    """In the child: a thread that ends the process when its parent exits, even while the main thread is in
    native code (a collective, a grammar compilation)."""
    parent = os.pidfd_open(parent_pid)

    def watch() -> None:
        select.select([parent], [], [])
        logger.error("the parent process %d has exited; stopping", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is running"
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"
