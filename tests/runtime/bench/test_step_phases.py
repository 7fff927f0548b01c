"""`kvfleet bench step-phases` on the tiny models: every phase of a decode step is reported, none negative,
and the step is set against the bytes it must read, counted from the checkpoint itself (of a
mixture-of-experts model's experts, those its tokens are routed to)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner
from kvfleet.runtime.bench.step_phases import PHASES
from safetensors import safe_open

from kvfleet.cli import cli


def test_step_phases_reports_every_phase(tiny_llama: Path) -> None:
    args = ["bench", "step-phases", "--model", str(tiny_llama), "--batch-sizes", "1,3"]
    args += ["--steps", "6", "--rounds", "2", "--num-gpu-blocks-override", "256"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = dict(re.findall(r"^\| ([^|]+?) \| (.+) \|$", result.stdout, re.MULTILINE))
    assert rows["phase (ms per step)"] == "batch 1 | batch 3"
    for phase in PHASES:
        values = [float(v) for v in rows[phase].split(" | ")]
        assert len(values) == 2 and all(v >= 0 for v in values), phase
    untimed = [float(v.strip("*")) for v in rows["**whole step, untimed**"].split(" | ")]
    timed = [float(v) for v in rows["whole step, timed"].split(" | ")]
    assert all(v > 0 for v in untimed + timed)
    assert float(rows["projections"].split(" | ")[0]) > 0, "the projections were timed"

    # The weights a step reads are the checkpoint's tensors but the embedding table (read row by row)
    # unless the LM head is tied to it; the KV is every layer's keys and values of each context, which the
    # measured steps grow from 36 to 48 tokens (a prompt of 32, four steps before them, six untimed and six
    # timed).
    config = json.loads((tiny_llama / "config.json").read_text())
    checkpoint_bytes = 0
    for path in tiny_llama.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names = [n for n in list(f.keys()) if config["tie_word_embeddings"] or "embed_tokens" not in n]
            checkpoint_bytes += sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in names)
    weights_shown = [float(v) for v in rows["weights read (MB)"].split(" | ")]
    assert weights_shown == [round(checkpoint_bytes / 1e6, 2)] * 2
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    expected_kv = [round(kv_per_token * (32 + 4 + 6) * batch / 1e6, 2) for batch in (1, 3)]
    assert [float(v) for v in rows["KV read (MB)"].split(" | ")] == expected_kv
    bandwidth = [float(v) for v in rows["read bandwidth (GB/s)"].split(" | ")]
    bound = [float(v) for v in rows["bound: bytes / bandwidth (ms)"].split(" | ")]
    for gigabytes_per_second, ms, kv_megabytes in zip(bandwidth, bound, expected_kv, strict=True):
        megabytes = checkpoint_bytes / 1e6 + kv_megabytes
        assert abs(ms - megabytes / gigabytes_per_second) <= 0.002 + 0.06 * ms  # bandwidth shown rounded


def test_a_mixture_of_experts_step_reads_only_its_routed_experts(make_model: Callable[..., Path]) -> None:
    """At batch 1 a step routes its one token to num_experts_per_tok experts in each layer: the weights it
    reads are the checkpoint's but the other experts' (and the embedding table), counted from the checkpoint;
    the experts are timed apart from the other projections."""
    folder = make_model("mixtral", "tiny", 0, "--quantize", "w8a16")
    args = ["bench", "step-phases", "--model", str(folder), "--batch-sizes", "1,3"]
    args += ["--steps", "6", "--rounds", "1", "--num-gpu-blocks-override", "256"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = dict(re.findall(r"^\| ([^|]+?) \| (.+) \|$", result.stdout, re.MULTILINE))
    assert all(float(v) > 0 for v in rows["experts"].split(" | "))
    config = json.loads((folder / "config.json").read_text())
    expert = re.compile(r".*\.experts\.(\d+)\..*")
    dense_bytes, expert_bytes = 0, 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
            if "embed_tokens" in name or name.endswith(".weight_shape"):
                continue  # the table is read row by row; a packed weight's shape is not held
            # Four int8 values to an int32 word: the words' bytes are the int8 weight's.
            tensor = f.get_tensor(name)
            size = tensor.numel() * tensor.element_size()
            if expert.fullmatch(name):
                expert_bytes += size
            else:
                dense_bytes += size
    per_expert = expert_bytes / (config["num_hidden_layers"] * config["num_local_experts"])
    routed = config["num_hidden_layers"] * config["num_experts_per_tok"]
    weights_shown = [float(v) for v in rows["weights read (MB)"].split(" | ")]
    assert weights_shown[0] == round((dense_bytes + routed * per_expert) / 1e6, 2)
    # Three tokens route to between num_experts_per_tok and three times as many experts in each layer.
    assert weights_shown[0] <= weights_shown[1] <= round((dense_bytes + 3 * routed * per_expert) / 1e6, 2)
