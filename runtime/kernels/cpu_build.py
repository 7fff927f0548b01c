"""Builds the project's C++ CPU operations for this host, on first use.

Each source registers its operations with torch (`torch.ops.<library>.*`). It is compiled with torch's C++
extension loader (g++ and ninja) for the instruction-set level of the CPU it runs on (`cpu_features`), about
ten seconds the first time, into torch's extension cache (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions), which later processes reuse. Each level has its own entry, so a cache shared by
hosts of different CPUs, or made where an image was built, only ever loads a build the running CPU can
execute. A host that cannot build it keeps the torch code the operations replace.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from kvfleet.runtime.kernels.cpu_features import cpu_target

logger = logging.getLogger(__name__)


def build_cpu_ops(name: str, source: Path, what: str) -> bool:
    """Whether `source`'s operations are loaded (built unless this host's build is cached); on failure logs,
    naming `what` the operations are, that they are not used."""
    from torch.utils import cpp_extension

    target = cpu_target()
    try:
        _put_pip_ninja_on_path()
        cpp_extension.load(
            name=f"{name}_{target.cache_tag}",
            sources=[str(source)],
            extra_cflags=["-O3", f"-march={target.level}", "-fopenmp"],
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
