"""Child processes of the runtime: a fresh interpreter that runs one module, handed its arguments on stdin.

Not multiprocessing: its spawn start method re-imports the parent's main module and adds a resource-tracker
process, and the process tree should be exactly what `kvfleet serve` says it is.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def start_child(
    module: str, arguments: tuple[Any, ...], *, pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    # -P: the working directory (a checkout, with its operator/ folder) must not shadow the standard library.
    process = subprocess.Popen([sys.executable, "-P", "-m", module], stdin=subprocess.PIPE, pass_fds=pass_fds)
    assert process.stdin is not None
    with process.stdin:
        pickle.dump(arguments, process.stdin)
    return process


def child_arguments() -> tuple[Any, ...]:
    """In the child: the arguments its parent passed to start_child."""
    return pickle.load(sys.stdin.buffer)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is running"
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"
