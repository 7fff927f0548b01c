"""docs/quickstart.md as a platform engineer follows it: the blocks it marks `<!-- quickstart: run -->` run
as written, in order, with bash, on the local cluster; only the variables its "What to set" block exports
differ (no registry: the pod runner runs the images' commands; the test's tiny model on the node instead of
a download). The release it installs is the session's, upgraded in place with the values it was installed
with."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from e2e.cluster import LocalCluster
from e2e.fleet.chart import REPO_ROOT, OperatorRelease, local_cluster_values
from e2e.fleet.observe import wait_ready
from e2e.fleet.traffic import ReadyEndpoints, chat

QUICKSTART = REPO_ROOT / "docs" / "quickstart.md"
MARKER = "<!-- quickstart: run -->"


def marked_blocks(text: str) -> list[str]:
    return re.findall(rf"^{re.escape(MARKER)}\n```sh\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def documented_variables(text: str) -> set[str]:
    return set(re.findall(r"^export (\w+)=", text, re.MULTILINE))


def release_values(cluster: LocalCluster, release: OperatorRelease) -> dict:
    """The values the release was last installed or upgraded with (helm's user-supplied ones)."""
    shown = cluster.helm("get", "values", release.release, "--namespace", release.namespace, "--output=json")
    return json.loads(shown.stdout)


def value_at(values: dict, dotted: str) -> object:
    """The value at a `--set` path."""
    for key in dotted.split("."):
        values = values[key]
    return values


def test_the_quickstart_runs_as_written(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    namespace: str,
    tiny_model_dir: Path,
    measurements: Callable[[str], None],
) -> None:
    text = QUICKSTART.read_text()
    blocks = marked_blocks(text)
    assert len(blocks) == 2 and "helm upgrade --install" in blocks[0] and "kubectl wait" in blocks[1]
    variables = {
        "IMAGE_REGISTRY": "",
        "RELEASE": kvfleet_release.release,
        "RELEASE_NAMESPACE": kvfleet_release.namespace,
        # The values the session's release was installed with: the upgrade changes nothing of it.
        "HELM_FLAGS": " ".join(f"--set {key}={value}" for key, value in local_cluster_values().items()),
        "NAMESPACE": namespace,
        "MODEL_URI": f"file://{tiny_model_dir}",
        "MODEL_ON_NODE": "true",
    }
    assert set(variables) == documented_variables(text), "the page's variables are the ones set here"
    for number, block in enumerate(blocks, 1):
        started = time.monotonic()
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            env={**local_cluster.env(), **variables},
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"{block}\n{result.stdout}{result.stderr}"
        measurements(f"quickstart block {number} ran in {time.monotonic() - started:.1f}s")
    assert "small" in result.stdout, "kubectl get kvis lists the service"
    # `--set` strings as helm reads them: "null" is a null.
    upgraded = release_values(local_cluster, kvfleet_release)
    kept = {key: value_at(upgraded, key) for key in local_cluster_values()}
    assert kept == {key: yaml.safe_load(value) for key, value in local_cluster_values().items()}
    wait_ready(local_cluster.api, namespace, "small", timeout=10)
    with ReadyEndpoints(local_cluster.api, namespace, "small") as endpoints:
        (endpoint,) = endpoints.current()
    assert chat(endpoint, "Say hello.", max_tokens=8, model="small").strip()
