"""Builds the project's C++ CPU operations for this host, on first use.

Each source registers its operations with torch (`torch.ops.<library>.*`). It is compiled with torch's C++
extension loader (g++ and ninja) for the instruction-set level of the CPU it runs on (`cpu_features`), about
ten seconds the first time, into torch's extension cache (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions), which later processes reuse. Each level has its own entry, so a cache shared by
hosts of different CPUs, or made where an image was built, only ever loads a build the running CPU can
execute. A host that cannot build it keeps the torch code the operations replace.

torch marks a build in progress with a `lock` file that stays behind when its process dies (a pod killed
while it compiles, say), and every later load waits for it forever. Builds here hold a kernel lock beside it
instead (flock, released with the process that holds it), so whoever holds that lock knows a torch `lock`
file it finds is a dead builder's, and removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from kvfleet.runtime.kernels.cpu_features import cpu_target
from kvfleet.runtime.startup_phases import STARTUP_PHASES

logger = logging.getLogger(__name__)


def build_cpu_ops(name: str, source: Path, what: str) -> bool:
    """Whether `source`'s operations are loaded (built unless this host's build is cached); on failure logs,
    naming `what` the operations are, that they are not used."""
    from torch.utils import cpp_extension

    target = cpu_target()
    build_name = f"{name}_{target.cache_tag}"
    try:
        _put_pip_ninja_on_path()
        build_directory = Path(cpp_extension._get_build_directory(build_name, verbose=False))
        with STARTUP_PHASES.phase("kernels"), _exclusive_build(build_directory):
            cpp_extension.load(
                name=build_name,
                sources=[str(source)],
                extra_cflags=["-O3", f"-march={target.level}", "-fopenmp"],
                # libgomp resolves to the copy torch has loaded already: the operations run on its threads.
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_directory),
                is_python_module=False,
            )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch code still works
        logger.warning("%s could not be built, the torch code runs instead: %s", what, exc)
        return False
    return True


@contextlib.contextmanager
def _exclusive_build(build_directory: Path) -> Iterator[None]:
    """Holds the build directory's kernel lock, waiting for a live builder to finish; clears a torch `lock`
    file that a dead one left."""
    build_directory.mkdir(parents=True, exist_ok=True)
    with open(build_directory / "kvfleet.flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            stale = build_directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _put_pip_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pinned ninja package's binary lies beside the interpreter's scripts,
    which are on PATH only in an activated environment."""
    if shutil.which("ninja") is not None:
        return
    import ninja

    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
