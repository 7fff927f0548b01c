"""The CPU operations follow the CPU they run on: the instruction-set level comes from the running CPU's
flags, ATEN_CPU_CAPABILITY lowers it, the C++ operations are built and cached per level (or prebuilt, as an
image holds them), and a level below this machine's is built, chosen and checked like the machine's own."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvfleet.runtime.kernels import cpu_build, cpu_features, fused_layers
from kvfleet.runtime.models.layers import Linear

V2 = "sse sse2 ssse3 sse4_1 sse4_2 popcnt cx16 lahf_lm"
# A 2-core AMD EPYC Zen 3, as Linux lists its flags: AVX2 and FMA, no AVX-512.
ZEN3 = f"{V2} avx avx2 bmi1 bmi2 f16c fma abm movbe xsave aes sha_ni vaes"
SAPPHIRE_RAPIDS = f"{ZEN3} avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 avx512_fp16 amx_tile"
REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/kernels/test_fused_layers_hook.py",
    "tests/runtime/models/test_cpu_decode_attention.py",
    "tests/runtime/quantization/test_int8_matmul.py",
]


def _target(monkeypatch: pytest.MonkeyPatch, flags: str, capability: str | None) -> cpu_features.CpuTarget:
    monkeypatch.setattr(cpu_features, "_cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
    if capability is None:
        monkeypatch.delenv(cpu_features.CAPABILITY_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(cpu_features.CAPABILITY_ENV_VAR, capability)
    return cpu_features.cpu_target.__wrapped__()


@pytest.mark.parametrize(
    ("flags", "capability", "level", "capped_by"),
    [
        (SAPPHIRE_RAPIDS, None, "x86-64-v4", None),
        (ZEN3, None, "x86-64-v3", None),
        (V2, None, "x86-64-v2", None),
        ("sse sse2", None, "x86-64", None),
        (SAPPHIRE_RAPIDS, "avx2", "x86-64-v3", "avx2"),
        (SAPPHIRE_RAPIDS, "AVX2", "x86-64-v3", "avx2"),
        (SAPPHIRE_RAPIDS, "default", "x86-64", "default"),
        # A cap above what the CPU has changes nothing: the CPU decides.
        (ZEN3, "avx512", "x86-64-v3", None),
        (ZEN3, "avx2", "x86-64-v3", None),
    ],
)
def test_the_level_is_the_running_cpus_lowered_by_aten_capability(
    monkeypatch: pytest.MonkeyPatch, flags: str, capability: str | None, level: str, capped_by: str | None
) -> None:
    target = _target(monkeypatch, flags, capability)
    assert (target.level, target.capped_by) == (level, capped_by)
    assert target.cache_tag == level.replace("-", "_")


def test_a_level_is_not_granted_for_part_of_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # AVX-512F alone (as on Xeon Phi) is not x86-64-v4: -march=x86-64-v4 would emit AVX-512BW/VL.
    assert _target(monkeypatch, f"{ZEN3} avx512f", None).level == "x86-64-v3"


@pytest.mark.parametrize(
    ("flags", "aten_capability", "onednn_isa", "avx512"),
    [
        (SAPPHIRE_RAPIDS, None, None, True),
        # oneDNN chooses its kernels from the CPU, not from ATen's cap ...
        (SAPPHIRE_RAPIDS, "avx2", None, True),
        # ... but from its own.
        (SAPPHIRE_RAPIDS, None, "AVX2", False),
        (SAPPHIRE_RAPIDS, None, "avx512_core", True),
        (ZEN3, None, None, False),
        (ZEN3, None, "ALL", False),
    ],
)
def test_onednn_runs_avx512_where_the_cpu_has_it_below_its_own_cap(
    monkeypatch: pytest.MonkeyPatch,
    flags: str,
    aten_capability: str | None,
    onednn_isa: str | None,
    avx512: bool,
) -> None:
    _target(monkeypatch, flags, aten_capability)
    if onednn_isa is None:
        monkeypatch.delenv(cpu_features.ONEDNN_ISA_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(cpu_features.ONEDNN_ISA_ENV_VAR, onednn_isa)
    assert cpu_features.onednn_has_avx512() == avx512


@pytest.mark.parametrize("pad_rows", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_packed_projections_equal_torchs_with_and_without_padding(pad_rows: bool, rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=True)
    x = torch.randn(rows, 96)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.pack_for_cpu(pad_rows)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_half_precision_packing_is_off_when_the_capability_masks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_features, "cpu_target", lambda: cpu_features.CpuTarget("x86-64-v3", "avx2"))
    assert cpu_features.onednn_packs(torch.float32)
    assert not cpu_features.onednn_packs(torch.bfloat16)
    assert not cpu_features.onednn_packs(torch.float16)


def test_half_precision_packing_follows_torchs_check_of_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # What an AVX2-only CPU answers: torch's own check fails, so the weights stay unpacked instead of
    # reaching mkldnn_reorder_linear_weight, which raises on such a CPU.
    monkeypatch.setattr(cpu_features, "cpu_target", lambda: cpu_features.CpuTarget("x86-64-v3"))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False, raising=False)
    assert not cpu_features.onednn_packs(torch.bfloat16)
    assert not cpu_features.onednn_packs(torch.float16)
    assert cpu_features.onednn_packs(torch.float32)


PROBE = """
import json, torch
from torch.utils import cpp_extension
from kvfleet.runtime.attention.cpu_decode import load_paged_decode_attention
from kvfleet.runtime.kernels.cpu_features import cpu_target
from kvfleet.runtime.kernels.fused_layers import Implementation
from kvfleet.runtime.models.layers import RMSNorm
norm = RMSNorm(64, 1e-6)
assert load_paged_decode_attention() is not None
print(json.dumps({
    "tag": cpu_target().cache_tag,
    "fused": norm.implementation is Implementation.CPU,
    "loaded": sorted({line.split()[-1] for line in open("/proc/self/maps") if "kvfleet_cpu" in line}),
}))
"""


@pytest.mark.parametrize(
    ("capability", "level", "wide_registers"), [("avx2", "x86-64-v3", "zmm"), ("default", "x86-64", "[yz]mm")]
)
def test_operations_for_a_masked_level_are_built_for_it_and_chosen(
    capability: str, level: str, wide_registers: str
) -> None:
    tag = level.replace("-", "_")
    env = {**os.environ, cpu_features.CAPABILITY_ENV_VAR: capability}
    result = subprocess.run(
        [sys.executable, "-P", "-c", PROBE], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    probe = json.loads(result.stdout)
    assert probe["tag"] == tag and probe["fused"]
    loaded = [Path(path) for path in probe["loaded"]]
    # The cache key is the level: one build per library, each in a folder named for the level chosen.
    assert sorted(path.parent.name for path in loaded) == [
        f"kvfleet_cpu_attention_{tag}",
        f"kvfleet_cpu_layers_{tag}",
    ]
    for library in loaded:
        ninja = (library.parent / "build.ninja").read_text()
        assert f"-march={level} " in ninja
        assert "-march=native" not in ninja
        # The source is compiled from the build's own copy: another checkout finds the build current.
        assert str(REPO) not in ninja and f"compile {library.parent}/" in ninja
        # Nothing in it needs registers the masked CPU lacks: it runs on such a CPU.
        disassembly = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True, check=True
        ).stdout
        assert not re.search(rf"%{wide_registers}\d", disassembly), f"{library.name} uses {wide_registers}"


def test_the_kernel_tests_pass_on_the_operations_built_for_avx2() -> None:
    # The checks of every C++ operation against its torch code, run again on the AVX2 build (and ATen's
    # AVX2 kernels), so that the path an AVX2-only CPU takes is tested on any machine.
    env = {**os.environ, cpu_features.CAPABILITY_ENV_VAR: "avx2"}
    result = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", result.stdout) and " failed" not in result.stdout


def test_a_build_lock_left_by_a_dead_builder_does_not_stall_later_loads(tmp_path: Path) -> None:
    # torch's `lock` file outlives a builder killed mid-build, and torch's own loader then waits for it
    # forever: a load must clear it and go on. The cache holds a copy of this machine's build, as a builder
    # that died while rebuilding a library would leave it.
    assert fused_layers._cpu_ops_available()
    built = cpu_build._build_directory(cpu_build.CPU_LAYERS, cpu_features.cpu_target())
    build_dir = Path(shutil.copytree(built, tmp_path / built.name))
    (build_dir / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    build = "from kvfleet.runtime.kernels import fused_layers; print(fused_layers._cpu_ops_available())"
    again = subprocess.run(
        [sys.executable, "-P", "-c", build], env=env, capture_output=True, text=True, timeout=120
    )
    assert again.stdout.strip() == "True", again.stderr[-2000:]
    assert "left by a build that did not finish" in again.stderr
    assert not (build_dir / "lock").exists()


LOADED = """
import json
from kvfleet.runtime.attention.cpu_decode import load_paged_decode_attention
from kvfleet.runtime.kernels.fused_layers import _cpu_ops_available
from kvfleet.runtime.kernels.cpu_build import CPU_DECODE, build_cpu_ops
from kvfleet.runtime.quantization.linear import int8_ops_available
assert load_paged_decode_attention() is not None and _cpu_ops_available() and int8_ops_available()
assert build_cpu_ops(CPU_DECODE)
print(json.dumps(sorted({line.split()[-1] for line in open("/proc/self/maps") if "kvfleet_cpu" in line})))
"""


def test_prebuilt_operations_for_the_running_level_load_without_a_build(tmp_path: Path) -> None:
    # The image's build step for this machine's level, through the extension cache the kernel tests filled
    # (ninja finds those builds current), then a process with that folder and an empty cache of its own: it
    # loads every library from the folder and builds nothing.
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    # Another level beside it, as an image holds them: the key is the running CPU's level, not any build.
    other = cpu_features.CpuTarget("x86-64-v2")
    (prebuilt / cpu_build.CPU_LAYERS.prebuilt_name(other)).parent.mkdir(parents=True)
    (prebuilt / cpu_build.CPU_LAYERS.prebuilt_name(other)).write_bytes(b"not a library")
    written = cpu_build.prebuild_cpu_ops(prebuilt, [cpu_features.cpu_target()])
    assert len(written) == len(cpu_build.CPU_LIBRARIES)
    env = {**os.environ, cpu_build.PREBUILT_ENV_VAR: str(prebuilt), "TORCH_EXTENSIONS_DIR": str(cache)}
    result = subprocess.run(
        [sys.executable, "-P", "-c", LOADED], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == sorted(str(path) for path in written)
    assert not cache.exists() or not any(cache.iterdir())
