"""`kvfleet bench multi-turn` on the tiny model: the prefill it reports is the one block arithmetic predicts
when the blocks of generated answers are cached like prompt blocks, and the report's figures hold together."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from kvfleet.cli import cli

BLOCK = 16
SYSTEM, MESSAGE, ANSWER = 40, 24, 20
USERS, TURNS = 3, 4


def _expected_prefill_with_caching() -> int:
    """Per user, turn 1 computes its whole prompt but the system prompt's full blocks once another user has
    cached them; turn t computes what follows the full blocks of turn t-1's computed tokens: its prompt and
    all of its answer but the last token, whose KV is only computed as part of the next turn."""
    system_blocks = SYSTEM // BLOCK * BLOCK
    total = 0
    prompt = SYSTEM + MESSAGE
    for user in range(USERS):
        total += prompt - (system_blocks if user else 0)
    for _ in range(1, TURNS):
        computed_before = prompt + ANSWER - 1
        prompt += ANSWER + MESSAGE
        total += USERS * (prompt - computed_before // BLOCK * BLOCK)
    return total


def test_multi_turn_reuses_every_earlier_turn_including_answers(tiny_llama: Path) -> None:
    args = ["bench", "multi-turn", "--model", str(tiny_llama), "--num-users", str(USERS)]
    args += ["--num-turns", str(TURNS), "--system-prompt-len", str(SYSTEM)]
    args += ["--user-message-len", str(MESSAGE)]
    args += ["--answer-len", str(ANSWER), "--num-gpu-blocks-override", "256", "--block-size", str(BLOCK)]
    args += ["--dtype", "float32", "--max-num-seqs", "1"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    output = result.stdout
    rows = dict(re.findall(r"^\| (on|off) \| [\d.]+ \| \d+ \| (\d+) \| \d+ \| 0 \|$", output, re.MULTILINE))
    prompts = [SYSTEM + MESSAGE + turn * (ANSWER + MESSAGE) for turn in range(TURNS)]
    assert int(rows["off"]) == USERS * sum(prompts)
    assert int(rows["on"]) == _expected_prefill_with_caching()
    saved = 1 - int(rows["on"]) / int(rows["off"])
    assert f"prefill tokens saved by prefix caching: {saved:.1%}" in output
    turns = re.findall(r"^\| (\d+) \| \d+ \| \d+ \|$", output, re.MULTILINE)
    assert turns == [str(t) for t in range(1, TURNS + 1)]
