"""Fixtures for the end-to-end tests: one real local cluster per test session, a namespace per test.

The cluster's binaries are built (with progress shown) before the first test that needs them, outside any
test's timeout; a cold build takes about ten minutes on 2 cores, later runs reuse the cache. When the suite
runs on pytest-xdist workers, every end-to-end test goes to the same worker (tests/conftest.py schedules
them as one unit), so that one cluster serves them all while the other workers run the unit tests.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from e2e.cluster import ApiError, ClusterConfig, KubeAPI, LocalCluster, ensure_binaries  # noqa: E402
from e2e.fleet.chart import OperatorRelease, install_chart, uninstall_chart  # noqa: E402
from e2e.fleet.gateway import gateway_enabled  # noqa: E402
from e2e.fleet.manifests import services_path  # noqa: E402
from e2e.fleet.traffic import ReadyEndpoints  # noqa: E402

PROBE_TARGET = REPO_ROOT / "e2e" / "support" / "probe_target.py"
CLUSTER_FIXTURES = {"local_cluster", "cluster_bin_dir", "namespace", "module_namespace", "kvfleet_release"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # Every xdist worker collects every test, and none runs one before all have reported their collection: the
    # first builds before it reports (so before xdist's own hook, which does). Otherwise the other worker may
    # start the end-to-end tests meanwhile, and wait for a cold build inside their timeout.
    worker = getattr(session.config, "workerinput", {}).get("workerid", "gw0")
    if worker == "gw0" and any(CLUSTER_FIXTURES & set(getattr(i, "fixturenames", ())) for i in session.items):
        capture = session.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            # stderr: an xdist worker's stdout goes nowhere.
            print("\nbuilding the local control plane's binaries (first run only)", file=sys.stderr)
            session.config.stash[_BIN_DIR] = ensure_binaries()


_BIN_DIR = pytest.StashKey[Path]()
# What the tests measured, in the process that prints the summary.
_measured: list[str] = []
# The key of a measurement among a test's user properties, which travel with its reports from an xdist
# worker to the process that prints the summary.
_MEASUREMENT = "e2e-measurement"


# The test this process runs now: a module's fixture records its figures on the first test that needs it.
_running: list[pytest.Item] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    _running[:] = [item]


@pytest.fixture(scope="session")
def measurements() -> Callable[[str], None]:
    """Records a figure a test measured (reaction times, recovery times); all of them are printed in an
    "end-to-end measurements" section at the end of the run, passed or not, captured output or not."""
    return lambda line: _running[-1].user_properties.append((_MEASUREMENT, line))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        _measured.extend(value for key, value in report.user_properties if key == _MEASUREMENT)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _measured:
        terminalreporter.section("end-to-end measurements")
        for line in _measured:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def cluster_bin_dir(pytestconfig: pytest.Config) -> Path:
    if _BIN_DIR not in pytestconfig.stash:
        pytestconfig.stash[_BIN_DIR] = ensure_binaries()
    return pytestconfig.stash[_BIN_DIR]


@pytest.fixture(scope="session")
def probe_target_program(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The `probe-target` command the runner's own tests put in pods (see support/probe_target.py)."""
    path = tmp_path_factory.mktemp("programs") / "probe-target"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{PROBE_TARGET}" "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="session")
def local_cluster(
    tmp_path_factory: pytest.TempPathFactory, cluster_bin_dir: Path, probe_target_program: str
) -> Iterator[LocalCluster]:
    state_dir = tmp_path_factory.mktemp("local-cluster")
    cluster = LocalCluster(
        state_dir,
        ClusterConfig(),
        bin_dir=cluster_bin_dir,
        runner_programs={"probe-target": probe_target_program},
    )
    with cluster:
        yield cluster


def _namespace_name(test_name: str) -> str:
    slug = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"{slug}-{secrets.token_hex(3)}"


@pytest.fixture(scope="session")
def kvfleet_release(local_cluster: LocalCluster) -> Iterator[OperatorRelease]:
    """charts/kvfleet installed with Helm (CRDs, RBAC, PriorityClasses, the operator as a pod that the pod
    runner runs with its ServiceAccount's rights); uninstalled after the last test."""
    release = install_chart(local_cluster)
    yield release
    uninstall_chart(release)


def _make_model(path: Path, *options: str, preset: str = "tiny") -> Path:
    kvfleet = Path(sys.executable).parent / "kvfleet"
    subprocess.run(
        [str(kvfleet), "make-model", "--arch", "llama", "--preset", preset, *options, str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with its tokenizer, made by `kvfleet make-model` (a few seconds)."""
    return _make_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small random Llama (107 MB of float32 weights): a decode step of two sequences takes about 10 ms
    on one thread, so a replica's engine, not the servers relaying its tokens, takes its core's time."""
    return _make_model(tmp_path_factory.mktemp("models") / "small-llama", preset="small")


@pytest.fixture(scope="session")
def tiny_w8a16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its projections stored as int8 weights with float scales, in compressed-tensors'
    format (`make-model --quantize w8a16`, a few seconds)."""
    return _make_model(tmp_path_factory.mktemp("models") / "tiny-llama-w8a16", "--quantize", "w8a16")


def _delete_inference_services(api: KubeAPI, namespace: str, timeout: float) -> None:
    """Deletes the namespace's InferenceServices and waits for them (the operator removes its finalizer),
    so no Deployment is re-created while the namespace is emptied."""
    try:
        api.delete(services_path(namespace))
    except ApiError as error:
        if error.status == 404:  # the CRD is not installed
            return
        raise
    deadline = time.monotonic() + timeout
    while api.get(services_path(namespace))["items"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"InferenceServices of {namespace} still exist {timeout:.0f}s after deletion")
        time.sleep(0.2)


@contextlib.contextmanager
def fresh_namespace(cluster: LocalCluster, name: str) -> Iterator[str]:
    """A new namespace, deleted afterwards; waits until its pods (and their processes) are gone."""
    api = cluster.api
    api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    deadline = time.monotonic() + 30
    while True:  # pods are rejected until the controller manager made the namespace's default account
        try:
            api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default")
            break
        except ApiError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    try:
        yield name
    finally:
        try:
            _delete_inference_services(api, name, timeout=60)
        finally:
            # Deleting the workloads and pods directly (each pod gracefully) is faster than waiting for the
            # garbage collector and the namespace controller.
            api.delete(f"/apis/apps/v1/namespaces/{name}/deployments")
            api.delete(f"/apis/apps/v1/namespaces/{name}/replicasets")
            api.delete(f"/api/v1/namespaces/{name}/pods")
            api.delete(f"/api/v1/namespaces/{name}")
            deadline = time.monotonic() + 120
            while api.get(f"/api/v1/namespaces/{name}/pods")["items"]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"pods of namespace {name} still exist 120s after its deletion")
                time.sleep(0.2)


@pytest.fixture
def namespace(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test."""
    with fresh_namespace(local_cluster, _namespace_name(request.node.name)) as name:
        yield name


@pytest.fixture(scope="module")
def module_namespace(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace shared by the tests of one module (what they set up costs a model load)."""
    with fresh_namespace(local_cluster, _namespace_name(request.module.__name__.rpartition(".")[2])) as name:
        yield name


@pytest.fixture(scope="module")
def gateway(local_cluster: LocalCluster, kvfleet_release: OperatorRelease) -> Iterator[ReadyEndpoints]:
    """The release's fleet gateway turned on (two replicas) for one module, and off again after it."""
    with gateway_enabled(local_cluster, kvfleet_release) as endpoints:
        yield endpoints
