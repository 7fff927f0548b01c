"""`kvfleet bench long-context` on short contexts: each length runs with a KV pool of its own size, the
prompt crosses the torch backend's long-context threshold, and the parity check runs against Transformers."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from kvfleet.cli import cli


def test_long_context_bench_reports_each_length_and_parity(make_model) -> None:
    model_dir: Path = make_model("llama", "tiny", 0, "--max-position-embeddings", "9000")
    args = ["bench", "long-context", "--model", str(model_dir), "--context-lens", "2048,9000"]
    args += [
        "--parity-len",
        "9000",
        "--output-len",
        "8",
        "--max-num-batched-tokens",
        "512",
        "--dtype",
        "float32",
    ]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| [\d.]+ \| [\d.]+ \| (\d+) \|", result.output, re.M)
    assert [(int(c), int(p), int(o)) for c, p, o, _ in rows] == [(2048, 2040, 8), (9000, 8992, 8)]
    # The tiny model's KV: 2 layers x K and V x 2 heads x 16 dims x 4 bytes = 512 bytes per token, in whole
    # 16-token blocks.
    assert [int(kv) for *_, kv in rows] == [1, 4]
    assert "prefill in chunks of 512 tokens" in result.output
    assert "context 9000: matches Transformers" in result.output
