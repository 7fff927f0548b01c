"""The CPU's paged decode attention kernel (cpu_decode_attention.cpp), compiled on first use.

The kernel attends each decode's one query token over its context straight from the paged KV cache, where
the portable path gathers the blocks into a padded copy first. It is built with torch's C++ extension
loader (g++ and ninja) for this host's instruction set, about ten seconds the first time, into torch's
extension cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions), which later processes reuse.
A host that cannot build it logs why once and keeps the portable path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")

# (out, query, key_cache, value_cache, block_tables, seq_lens, decode_rows, decode_requests, scale, window)
PagedDecodeAttention = Callable[..., None]


def cpu_kernel_supports_head_size(head_dim: int) -> bool:
    """The kernel works on vectors of 16 floats: head sizes 16, 32, ... 256."""
    return head_dim % 16 == 0 and head_dim <= 256


@functools.cache
def load_paged_decode_attention() -> PagedDecodeAttention | None:
    """The kernel as a torch op, built unless this host's build is cached; None if it cannot be built."""
    from torch.utils import cpp_extension

    try:
        _put_pip_ninja_on_path()
        cpp_extension.load(
            # One build per instruction set: a cache shared by different hosts never runs another's code.
            name=f"kvfleet_cpu_attention_{_instruction_set_key()}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            # libgomp resolves to the copy torch has loaded already: the kernel runs on torch's thread pool.
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the portable path still works
        logger.warning(
            "the CPU decode attention kernel could not be built, decodes gather their blocks instead: %s", exc
        )
        return None
    return torch.ops.kvfleet_cpu.paged_decode_attention


def _put_pip_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pinned ninja package's binary lies beside the interpreter's scripts,
    which are on PATH only in an activated environment."""
    if shutil.which("ninja") is not None:
        return
    import ninja

    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _instruction_set_key() -> str:
    """A short digest of the CPU's feature flags, which -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(f"{os.uname().machine} {flags}".encode()).hexdigest()[:12]
