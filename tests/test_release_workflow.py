"""The release workflow: valid for GitHub Actions (actionlint, built from its Go module when Go is at hand),
publishing with the commands a person runs (`make images`, `make push`), under the names the chart pulls."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from images.build import TARGETS, VERSION, pushed_name

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yaml"
ACTIONLINT_MODULE = "github.com/rhysd/actionlint/cmd/actionlint"
ACTIONLINT_VERSION = "v1.7.12"


@pytest.fixture(scope="module")
def actionlint() -> Path:
    """actionlint from the project's build cache, built there through the Go module proxy the first time."""
    cache = Path(os.environ.get("KVFLEET_CACHE", Path.home() / ".cache" / "kvfleet"))
    folder = cache / "tools" / f"actionlint-{ACTIONLINT_VERSION}"
    binary = folder / "actionlint"
    if binary.exists():
        return binary
    go = shutil.which("go")
    if go is None:
        pytest.skip("no actionlint in the build cache and no Go toolchain to build it")
    build = subprocess.run(
        [go, "install", f"{ACTIONLINT_MODULE}@{ACTIONLINT_VERSION}"],
        env={**os.environ, "GOBIN": str(folder), "GOFLAGS": "-buildvcs=false"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if build.returncode != 0:
        pytest.skip(f"actionlint could not be built: {build.stderr.strip()[-400:]}")
    return binary


def test_actionlint_passes(actionlint: Path) -> None:
    result = subprocess.run(
        [str(actionlint), "-no-color", str(WORKFLOW)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _make_targets(run: str) -> list[str]:
    return re.findall(r"\bmake ((?:[a-z-]+ ?)+)", run)


def test_a_tag_publishes_with_the_make_targets() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    # YAML 1.1 reads the key `on` as True.
    trigger = workflow.get("on", workflow.get(True))
    assert trigger == {"push": {"tags": ["v*"]}}
    (job,) = workflow["jobs"].values()
    targets = [target.strip() for step in job["steps"] for target in _make_targets(step.get("run", ""))]
    assert targets == ["images", "push"], "the images and the chart are built and pushed as `make` does"
    makefile = (ROOT / "Makefile").read_text()
    for target in ("images", "push", "push-chart", "chart"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"no `make {target}`"


def test_pushed_images_are_the_ones_the_chart_pulls() -> None:
    values = yaml.safe_load((ROOT / "charts" / "kvfleet" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "kvfleet" / "Chart.yaml").read_text())
    registry = "registry.example.com/platform"
    pulled = {
        "operator": f"{registry}/{values['image']['repository']}:{chart['appVersion']}",
        "runtime": f"{registry}/{values['runtime']['image']}",
    }
    assert {target: pushed_name(registry + "/", target) for target in TARGETS} == pulled
    assert chart["version"] == chart["appVersion"] == VERSION
