"""The Dockerfile against what the chart, the rendered pods and the package expect of the images.

`make test` builds no image (`make images` and `make test-images` do: docs/images.md); these checks keep
the file in step with the rest of the project: sources, requirements, user, ports, commands and base.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
import yaml
from kvfleet.operator.api import HTTP_PORT
from kvfleet.operator.render_pod import RUNTIME_USER
from test_packaging import PACKAGE_SOURCES

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvfleet"


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions as (KEYWORD, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, arguments = line.partition(" ")
        if keyword.upper() == "FROM":
            match = re.fullmatch(r"\S+ AS (\S+)", arguments, re.IGNORECASE)
            assert match, f"every stage is named: {line}"
            current = stages.setdefault(match.group(1), [])
        current.append((keyword.upper(), arguments))
    return stages


def _arguments(stage: str, keyword: str) -> list[str]:
    return [arguments for found, arguments in _stages()[stage] if found == keyword]


def _copied_sources(stage: str) -> list[str]:
    sources = []
    for arguments in _arguments(stage, "COPY"):
        if not arguments.startswith("--from"):
            sources += arguments.split()[:-1]
    return sources


@pytest.mark.parametrize("target", ["runtime", "operator"])
def test_each_image_runs_the_kvfleet_command_as_the_user_the_pods_ask_for(target: str) -> None:
    assert _arguments(target, "ENTRYPOINT") == ['["kvfleet"]']
    assert _arguments(target, "USER") == [f"{RUNTIME_USER}:{RUNTIME_USER}"]
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {RUNTIME_USER}" in deployment, "the chart runs the operator as the image's user"


def test_the_wheel_is_built_from_the_package_sources() -> None:
    assert sorted(_copied_sources("wheel")) == sorted(PACKAGE_SOURCES)


def test_the_runtime_image_installs_the_runtime_pins_and_the_operator_image_never_does() -> None:
    shared = ["requirements/core.txt", "requirements/tracing.txt"]
    assert _copied_sources("runtime") == [*shared, "requirements/runtime.txt"]
    # The operator's image also runs the fleet gateway.
    assert _copied_sources("operator") == [*shared, "requirements/operator.txt", "requirements/gateway.txt"]
    for target, parts in (("runtime", ["runtime"]), ("operator", ["operator", "gateway"])):
        runs = " ".join(_arguments(target, "RUN"))
        for part in parts:
            assert f"--requirement /tmp/requirements/{part}.txt" in runs
        assert "--no-deps /tmp/wheels/*.whl" in runs, "the package itself adds no unpinned dependency"
    for part, shares in (("runtime", shared), ("operator", shared[:1]), ("gateway", shared)):
        included = re.findall(
            r"^-r (\S+)$", (ROOT / "requirements" / f"{part}.txt").read_text(), re.MULTILINE
        )
        expected = [Path(path).name for path in shares]
        assert included == expected, "a requirements file includes only what the image copies beside it"


def test_the_images_expose_the_ports_the_pods_use() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert _arguments("runtime", "EXPOSE") == [str(HTTP_PORT)]
    assert _arguments("operator", "EXPOSE") == [f"{values['metrics']['port']} {values['health']['port']}"]


def test_the_build_context_admits_every_copied_source() -> None:
    text = (ROOT / ".dockerignore").read_text()
    patterns = [line for line in text.splitlines() if line and not line.startswith("#")]

    def admitted(path: str) -> bool:
        # As Docker reads it: the last matching pattern decides; a pattern naming a folder covers its files.
        parts = path.split("/")
        prefixes = ["/".join(parts[:count]) for count in range(1, len(parts) + 1)]
        verdict = True
        for pattern in patterns:
            bare = pattern.removeprefix("!").rstrip("/")
            if any(fnmatch.fnmatchcase(prefix, bare) for prefix in prefixes):
                verdict = pattern.startswith("!")
        return verdict

    sources = {*_copied_sources("wheel"), *_copied_sources("runtime"), *_copied_sources("operator")}
    for source in sorted(sources):
        assert (ROOT / source).exists(), source
        assert admitted(source), f".dockerignore leaves {source} out of the build context"
    assert not admitted("tests/test_images.py") and not admitted("runtime/__pycache__/x.pyc")


def test_every_stage_starts_from_the_base_image_argument() -> None:
    """`docker build` uses the public Python image; `make images` passes a base made from Debian packages."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE) == ["python:3.11-slim-bookworm"]
    parents = re.findall(r"^FROM (\S+) AS", text, re.MULTILINE)
    assert set(parents) - set(_stages()) == {"${BASE_IMAGE}"}, "a stage starts from the base or another stage"
