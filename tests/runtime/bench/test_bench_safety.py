"""`kvfleet bench safety`: the baseline and the heaviest policy (the guard model on output windows) measured
end to end on the tiny model (the guard forced to "safe"); every other policy's configuration is checked
against the server's own parser, which is where a server of its own would refuse it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner
from kvfleet.runtime.bench.safety import POLICY_KEYS, policies
from kvfleet.runtime.safety.config import parse_safety_config

from kvfleet.cli import cli


def test_bench_safety_measures_the_baseline_and_the_chosen_policy(tiny_llama: Path) -> None:
    args = ["bench", "safety", "--model", str(tiny_llama), "--num-prompts", "3", "--throughput-prompts", "4"]
    args += ["--concurrency", "4", "--input-len", "8", "--output-len", "8", "--window-tokens", "4"]
    args += ["--num-gpu-blocks-override", "256", "--dtype", "float32", "--policy", "output-guard"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = re.findall(
        r"^\| ([^|]+) \| [\d.]+ \| [+-][\d.]+ \| [\d.]+ \| \d+% \| (\d+) \|$", result.stdout, re.MULTILINE
    )
    assert rows == [("none", "7"), ("guard model on output, window 4", "7")]


def test_every_policy_is_a_configuration_the_server_accepts(tiny_llama: Path) -> None:
    measured = policies(str(tiny_llama), "http://127.0.0.1:9/check", window=4)
    assert tuple(measured) == POLICY_KEYS
    stages = {}
    for key, (_, config) in measured.items():
        if config is None:
            continue
        parsed = parse_safety_config(json.dumps(config))
        stages[key] = (parsed.input, parsed.output, parsed.window_tokens if parsed.output else None)
    assert stages == {
        "input-rules": (("rules",), (), None),
        "input-guard": (("guard",), (), None),
        "input-hook": (("hook",), (), None),
        "output-rules": ((), ("rules",), 4),
        "output-guard": ((), ("guard",), 4),
    }
