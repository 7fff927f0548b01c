"""Builds the project's C++ CPU operations for this host, on first use.

Each source registers its operations with torch (`torch.ops.<library>.*`). It is compiled with torch's C++
extension loader (g++ and ninja) for this host's instruction set, about ten seconds the first time, into
torch's extension cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions), which later processes
reuse. A host that cannot build it keeps the torch code the operations replace.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)


def build_cpu_ops(name: str, source: Path, what: str) -> bool:
    """Whether `source`'s operations are loaded (built unless this host's build is cached); on failure logs,
    naming `what` the operations are, that they are not used."""
    from torch.utils import cpp_extension

    try:
        _put_pip_ninja_on_path()
        cpp_extension.load(
            # One build per instruction set: a cache shared by different hosts never runs another's code.
            name=f"{name}_{_instruction_set_key()}",
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            # libgomp resolves to the copy torch has loaded already: the operations run on torch's threads.
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch code still works
        logger.warning("%s could not be built, the torch code runs instead: %s", what, exc)
        return False
    return True


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
