"""The project's C++ CPU operations: loaded prebuilt, or built for this host on first use.

Each source registers its operations with torch (`torch.ops.<library>.*`). A process takes, in this order:

1. the library prebuilt for the running CPU's instruction-set level (`cpu_features`) in the read-only folder
   KVFLEET_PREBUILT_KERNELS names, where the runtime image keeps one per level (`kvfleet build-kernels`);
2. torch's extension cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions), which a node may
   share between its pods through a volume;
3. a build into that cache with torch's C++ extension loader (g++ and ninja), about ten seconds.

Every entry is keyed by the level, so a cache shared by hosts of different CPUs, or made where an image was
built, only ever loads a build the running CPU can execute; a prebuilt library is also keyed by its source,
flags and torch version, so a folder left from another release is passed over. A host that can do none of
these keeps the torch code the operations replace.

torch marks a build in progress with a `lock` file that stays behind when its process dies (a pod killed
while it compiles, say), and every later load waits for it forever. Builds here hold a kernel lock beside it
instead (flock, released with the process that holds it, and shared by every process that sees the folder:
the pods of a node on one cache volume), so whoever holds that lock knows a torch `lock` file it finds is a
dead builder's, and removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvfleet.runtime.kernels.cpu_features import CpuTarget, cpu_target
from kvfleet.runtime.startup_phases import STARTUP_PHASES

logger = logging.getLogger(__name__)

PREBUILT_ENV_VAR = "KVFLEET_PREBUILT_KERNELS"
# libgomp resolves to the copy torch has loaded already: the operations run on its threads.
LINK_FLAGS = ("-fopenmp",)
_RUNTIME = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CpuLibrary:
    """One C++ source and the operations it registers; `what` names them in logs."""

    name: str
    source: Path
    what: str

    def build_name(self, target: CpuTarget) -> str:
        """The library's name in torch's extension cache: one entry per level."""
        return f"{self.name}_{target.cache_tag}"

    def prebuilt_name(self, target: CpuTarget) -> str:
        """Its file in a prebuilt folder: the level, and a digest of what the build depends on."""
        import torch

        key = "\0".join([self.source.read_text(), *compile_flags(target), *LINK_FLAGS, torch.__version__])
        return f"{self.build_name(target)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


CPU_ATTENTION = CpuLibrary(
    "kvfleet_cpu_attention",
    _RUNTIME / "attention" / "cpu_decode_attention.cpp",
    "the CPU decode attention kernel",
)
CPU_LAYERS = CpuLibrary(
    "kvfleet_cpu_layers", _RUNTIME / "kernels" / "cpu_layers.cpp", "the CPU layer operations"
)
CPU_QUANT = CpuLibrary("kvfleet_cpu_quant", _RUNTIME / "kernels" / "cpu_quant.cpp", "the fused int8 matmul")
CPU_DECODE = CpuLibrary(
    "kvfleet_cpu_decode", _RUNTIME / "kernels" / "cpu_decode_layers.cpp", "the CPU decoder layers"
)
CPU_LIBRARIES = (CPU_ATTENTION, CPU_LAYERS, CPU_QUANT, CPU_DECODE)


def build_cpu_ops(library: CpuLibrary) -> bool:
    """Whether the library's operations are loaded (prebuilt, cached, or built now); on failure logs that
    they are not used."""
    from torch.utils import cpp_extension

    target = cpu_target()
    try:
        with STARTUP_PHASES.phase("kernels"):
            if _load_prebuilt(library, target):
                return True
            _put_pip_ninja_on_path()
            build_directory = _build_directory(library, target)
            with _exclusive_build(build_directory):
                cpp_extension.load(
                    name=library.build_name(target),
                    sources=[_staged_source(library, build_directory)],
                    extra_cflags=compile_flags(target),
                    extra_ldflags=list(LINK_FLAGS),
                    build_directory=str(build_directory),
                    is_python_module=False,
                )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch code still works
        logger.warning("%s could not be built, the torch code runs instead: %s", library.what, exc)
        return False
    return True


def prebuild_cpu_ops(folder: Path, targets: Iterable[CpuTarget]) -> list[Path]:
    """Builds every library for each target, through torch's extension cache (where a build made before is
    reused), and copies each into `folder`; returns the files written.

    Nothing built is loaded: the levels register the same operations, and this CPU may not run the newer
    ones. torch's `load` always loads, so the build is its ninja step alone.
    """
    from torch.utils import cpp_extension

    _put_pip_ninja_on_path()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for target in targets:
        for library in CPU_LIBRARIES:
            name, build_directory = library.build_name(target), _build_directory(library, target)
            logger.info("building %s for %s", library.what, target.level)
            with _exclusive_build(build_directory):
                cpp_extension._write_ninja_file_and_build_library(
                    name=name,
                    sources=[_staged_source(library, build_directory)],
                    extra_cflags=compile_flags(target),
                    extra_cuda_cflags=[],
                    extra_sycl_cflags=[],
                    extra_ldflags=list(LINK_FLAGS),
                    extra_include_paths=[],
                    build_directory=str(build_directory),
                    verbose=False,
                    with_cuda=False,
                    with_sycl=False,
                )
            written.append(
                Path(shutil.copy2(build_directory / f"{name}.so", folder / library.prebuilt_name(target)))
            )
    return written


def _load_prebuilt(library: CpuLibrary, target: CpuTarget) -> bool:
    """Loads the library's build for this target from the prebuilt folder, if it holds one."""
    folder = os.environ.get(PREBUILT_ENV_VAR)
    if not folder:
        return False
    path = Path(folder) / library.prebuilt_name(target)
    if not path.is_file():
        logger.info("%s has no %s for %s: using the extension cache", folder, library.what, target.level)
        return False
    import torch

    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        logger.warning("%s could not be loaded, using the extension cache: %s", path, exc)
        return False
    return True


def compile_flags(target: CpuTarget) -> list[str]:
    """The compiler flags of a build for `target`."""
    return ["-O3", f"-march={target.level}", "-fopenmp"]


def _build_directory(library: CpuLibrary, target: CpuTarget) -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(library.build_name(target), verbose=False))


def _staged_source(library: CpuLibrary, build_directory: Path) -> str:
    """The source the build compiles: a copy in the build directory, written again only when it changed. The
    build's rules then hold no path of this installation, so that a checkout elsewhere on the same environment
    (a CI clone beside a developer's) finds the build current instead of compiling it again."""
    staged = build_directory / library.source.name
    source = library.source.read_bytes()
    if not staged.is_file() or staged.read_bytes() != source:
        staged.write_bytes(source)
    return str(staged)


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
