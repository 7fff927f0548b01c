"""What the running CPU can execute: the instruction-set level the C++ operations are compiled for, and
whether oneDNN's half-precision weight packing may be used.

Both are decided here, from the CPU the process runs on, never from the one a build or an image was made
on. ATen's own switch caps them: ATEN_CPU_CAPABILITY=avx2 (or `default`) makes torch's kernels and
kvfleet's take the paths of an older CPU on any machine, which is how the tests run every path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CAPABILITY_ENV_VAR = "ATEN_CPU_CAPABILITY"

# The x86-64 micro-architecture levels that compilers take as -march values, newest first, each with the
# /proc/cpuinfo flags it adds to the one below (`abm` is how Linux names LZCNT).
_X86_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v4", frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})),
    ("x86-64-v3", frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})),
    ("x86-64-v2", frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})),
    ("x86-64", frozenset()),
)
ONEDNN_ISA_ENV_VAR = "ONEDNN_MAX_CPU_ISA"
# The ONEDNN_MAX_CPU_ISA values that keep oneDNN below AVX-512.
_ONEDNN_BELOW_AVX512 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"})
# The highest level each ATEN_CPU_CAPABILITY value lets through.
_CAPABILITY_LEVELS = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "default": "x86-64"}
# For each half-precision dtype: torch's check that oneDNN's packed GEMM runs on this CPU, and what it needs
# (any one of these).
_HALF_PRECISION_CHECKS = {
    torch.bfloat16: ("_is_mkldnn_bf16_supported", ("avx512bw and avx512vl and avx512dq", "avx_ne_convert")),
    torch.float16: ("_is_mkldnn_fp16_supported", ("avx512_fp16", "amx_fp16", "avx_ne_convert")),
}


@dataclass(frozen=True)
class CpuTarget:
    """The instruction set the CPU operations are built for: `level` is a -march value on x86-64, or
    `native` elsewhere; `capped_by` names the ATEN_CPU_CAPABILITY value that lowered it, if one did."""

    level: str
    capped_by: str | None = None
    # Off x86-64, `native` means whatever this CPU has: its flags then tell builds apart.
    flags_digest: str = ""

    @property
    def cache_tag(self) -> str:
        """The target as a name part (`x86_64_v3`): builds for different targets never share a cache entry."""
        return "_".join(filter(None, (self.level.replace("-", "_"), self.flags_digest)))


@functools.cache
def cpu_target() -> CpuTarget:
    """The highest level the running CPU supports, lowered to ATEN_CPU_CAPABILITY's when that is set."""
    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        digest = hashlib.sha256(f"{platform.machine()} {sorted(flags)}".encode()).hexdigest()[:12]
        return CpuTarget("native", flags_digest=digest)
    level = next(name for name, _ in _X86_LEVELS if _level_flags(name) <= flags)
    capability = os.environ.get(CAPABILITY_ENV_VAR, "").lower()
    cap = _CAPABILITY_LEVELS.get(capability)
    if cap is not None and _level_rank(cap) > _level_rank(level):
        logger.info(
            "CPU operations target %s (%s=%s), below this CPU's %s",
            cap,
            CAPABILITY_ENV_VAR,
            capability,
            level,
        )
        return CpuTarget(cap, capped_by=capability)
    target = CpuTarget(level)
    if level != _X86_LEVELS[0][0]:
        missing = sorted(_level_flags(_X86_LEVELS[0][0]) - flags)
        logger.info("CPU operations target %s: this CPU lacks %s", level, ", ".join(missing))
    return target


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's blocked weight layout can be used for `dtype` on this CPU. Float32 packs on any x86
    CPU; half precision needs the instructions torch checks for, and none that ATEN_CPU_CAPABILITY masks."""
    if dtype == torch.float32:
        return True
    if dtype not in _HALF_PRECISION_CHECKS:
        return False
    target = cpu_target()
    if target.capped_by is not None:
        _log_unpacked(dtype, f"{CAPABILITY_ENV_VAR}={target.capped_by} masks")
        return False
    if not getattr(torch.ops.mkldnn, _HALF_PRECISION_CHECKS[dtype][0])():
        _log_unpacked(dtype, "this CPU lacks")
        return False
    return True


def onednn_has_avx512() -> bool:
    """Whether oneDNN runs its AVX-512 kernels here: it picks them from the CPU's flags, below the cap
    ONEDNN_MAX_CPU_ISA sets, whatever ATEN_CPU_CAPABILITY says."""
    cap = os.environ.get(ONEDNN_ISA_ENV_VAR, "").upper()
    return cap not in _ONEDNN_BELOW_AVX512 and _level_flags(_X86_LEVELS[0][0]) <= _cpu_flags()


@functools.cache
def _log_unpacked(dtype: torch.dtype, reason: str) -> None:
    logger.warning(
        "%s projections run unpacked (slower): oneDNN's packed kernels for them need %s, which %s",
        str(dtype).removeprefix("torch."),
        " or ".join(_HALF_PRECISION_CHECKS[dtype][1]),
        reason,
    )


def _level_flags(level: str) -> frozenset[str]:
    """Every flag a level needs: its own and those of the levels below it."""
    names = [name for name, _ in _X86_LEVELS]
    return frozenset().union(*(added for _, added in _X86_LEVELS[names.index(level) :]))


def _level_rank(level: str) -> int:
    """0 for the newest level; larger is older."""
    return [name for name, _ in _X86_LEVELS].index(level)


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def prebuild_targets() -> tuple[CpuTarget, ...]:
    """What an image prebuilds the CPU operations for: on x86-64 every level, so that any node finds its own;
    elsewhere `native` targets this CPU alone."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return (cpu_target(),)
    return tuple(CpuTarget(level) for level, _ in _X86_LEVELS)
