"""Fixtures shared by every test folder: model folders made by `kvfleet make-model`, once per session.

Tests start the command as `python -P -m kvfleet`: -P keeps the checkout off `sys.path`, where its
operator/ folder would shadow the standard library's `operator` module in an environment without the
editable install."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def make_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Returns a function (arch, preset, seed, *make-model options) -> model folder, built through the real
    CLI and cached."""
    made: dict[tuple[str, ...], Path] = {}
    root = tmp_path_factory.mktemp("models")

    def build(arch: str = "llama", preset: str = "tiny", seed: int = 0, *options: str) -> Path:
        key = (arch, preset, str(seed), *options)
        if key not in made:
            out = root / f"{arch}-{preset}-{seed}-{len(made)}"
            command = [
                "make-model",
                "--arch",
                arch,
                "--preset",
                preset,
                "--seed",
                str(seed),
                *options,
                str(out),
            ]
            subprocess.run(
                [sys.executable, "-P", "-m", "kvfleet", *command], check=True, capture_output=True, text=True
            )
            made[key] = out
        return made[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(make_model: Callable[..., Path]) -> Path:
    return make_model("llama", "tiny")
