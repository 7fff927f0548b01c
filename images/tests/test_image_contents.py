"""What is in the images and what they say about themselves: sizes, compilers, the prebuilt CPU operations,
secrets, test files, the OCI labels and annotations, the exported archives and the SBOMs."""

from __future__ import annotations

import json
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from images.build import (
    HOST_CA_BUNDLE,
    REVISION_LABEL,
    SOURCE_LABEL,
    TARGETS,
    VERSION_LABEL,
    image_name,
    oci_archive,
    podman,
    run_limits,
    sbom_path,
)
from images.tests.conftest import (
    REPO_ROOT,
    PodContainer,
    host_volumes,
    image_config,
    loopback_address,
    podman_output,
    runtime_pod,
)

COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "tcc", "as", "ld")
# Names that mark a credential or a private key, wherever they are.
SECRET_NAMES = (
    "id_rsa",
    "id_ecdsa",
    "id_ed25519",
    "*.key",
    "kubeconfig",
    ".netrc",
    ".pypirc",
    ".env",
    "credentials",
    ".git-credentials",
    ".dockercfg",
)

# A Python extension module, compiled and loaded by Triton's own launcher builder.
TRITON_PROBE = r"""
import triton.runtime.build as build
source = '''
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvfleet_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kvfleet_probe(void) { return PyModule_Create(&module); }
'''
print(build.compile_module_from_src(source, "kvfleet_probe").answer())
"""

# The three CPU libraries a runtime loads, and from where.
PREBUILT_PROBE = r"""
import json, os
from kvfleet.runtime.attention.cpu_decode import load_paged_decode_attention
from kvfleet.runtime.kernels.fused_layers import _cpu_ops_available
from kvfleet.runtime.quantization.linear import int8_ops_available
assert load_paged_decode_attention() is not None and _cpu_ops_available() and int8_ops_available()
loaded = sorted({line.split()[-1] for line in open("/proc/self/maps") if "kvfleet_cpu" in line})
print(json.dumps({"loaded": loaded, "folder": os.environ["KVFLEET_PREBUILT_KERNELS"]}))
"""


def run_in(image: str, *command: str) -> subprocess.CompletedProcess[str]:
    argv = podman("run", "--rm", "--network", "none", *run_limits(), "--entrypoint", command[0], image)
    return subprocess.run([*argv, *command[1:]], capture_output=True, text=True)


def image_size(image: str) -> int:
    return int(podman_output("image", "inspect", "--format", "{{.Size}}", image))


def test_the_operator_image_has_no_compiler_and_no_torch(operator_image: str) -> None:
    found = run_in(
        operator_image, "sh", "-c", f"for c in {' '.join(COMPILERS)}; do command -v $c; done; true"
    )
    assert found.stdout == "", f"compilers in the operator image: {found.stdout.split()}"
    torch = run_in(
        operator_image, "python", "-c", "import importlib.util; print(importlib.util.find_spec('torch'))"
    )
    assert torch.stdout.strip() == "None"
    assert image_size(operator_image) * 10 < image_size(image_name("runtime")), "no runtime layers in it"


def test_the_runtime_pod_builds_a_triton_launcher(
    runtime_image: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """gcc and Python's headers, Triton's cache in the scratch volume (HOME), on a read-only root."""
    pod = runtime_pod(runtime_image, tiny_model_dir)
    (container,) = pod["spec"]["containers"]
    container = {**container, "command": ["python"], "args": ["-c", TRITON_PROBE]}
    with PodContainer(runtime_image, pod, container, host_volumes(pod["spec"], tmp_path)) as probe:
        assert probe.wait() == 0, probe.logs()
        assert probe.logs().strip() == "42"


def test_the_runtime_pod_loads_the_cpu_operations_its_image_prebuilt(
    runtime_image: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Each library for the node's level from the image's folder; the pod's scratch volume gets no build."""
    pod = runtime_pod(runtime_image, tiny_model_dir)
    (container,) = pod["spec"]["containers"]
    container = {**container, "command": ["python"], "args": ["-c", PREBUILT_PROBE]}
    volumes = host_volumes(pod["spec"], tmp_path)
    with PodContainer(runtime_image, pod, container, volumes) as probe:
        assert probe.wait() == 0, probe.logs()
        (line,) = [line for line in probe.logs().splitlines() if line.startswith('{"loaded"')]
    report = json.loads(line)
    assert len(report["loaded"]) == 3
    assert all(path.startswith(report["folder"] + "/") for path in report["loaded"]), report
    assert not list(volumes["scratch"].rglob("*.so"))


@pytest.mark.parametrize("target", TARGETS)
def test_the_image_holds_no_secrets_and_no_test_files(target: str) -> None:
    image = image_name(target)
    names = " -o ".join(f"-name '{name}'" for name in SECRET_NAMES)
    found = run_in(image, "sh", "-c", f"find / -xdev \\( {names} \\) -print 2>/dev/null; true")
    assert found.stdout == "", f"credential-like files in {image}: {found.stdout.split()}"
    keys = run_in(
        image,
        "sh",
        "-c",
        "grep -rlI --exclude-dir=proc 'PRIVATE KEY-----' /home /root /etc /tmp /srv /opt; true",
    )
    assert keys.stdout == "", f"private keys in {image}: {keys.stdout.split()}"
    # The package as installed, and nothing of the build: sources, wheels, requirements.
    record = run_in(
        image,
        "python",
        "-c",
        "import importlib.metadata as m; print('\\n'.join(map(str, m.files('kvfleet'))))",
    )
    installed = record.stdout.split()
    assert installed and not [
        path for path in installed if "test" in path.split("/")[-1] or "/tests/" in path
    ]
    leftovers = run_in(
        image, "sh", "-c", "ls -d /src /wheels /tmp/wheels /tmp/requirements 2>/dev/null; true"
    )
    assert leftovers.stdout == ""
    # The build trusted this host's CA bundle (a TLS-inspecting proxy's CA, say); the image keeps Debian's.
    bundle = run_in(image, "cat", str(HOST_CA_BUNDLE)).stdout
    extra = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    for certificate in extra:
        body = "".join(certificate.read_text().split())
        assert body not in "".join(bundle.split()), f"{certificate.name} of this host is in {image}"


@pytest.mark.parametrize("target", TARGETS)
def test_the_image_says_where_it_comes_from_and_its_archive_is_the_same_image(target: str) -> None:
    image = image_name(target)
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    labels = image_config(image)["Labels"]
    assert labels[VERSION_LABEL] == version
    revision = labels[REVISION_LABEL]
    assert (
        subprocess.run(["git", "-C", str(REPO_ROOT), "cat-file", "-e", f"{revision}^{{commit}}"]).returncode
        == 0
    )
    remote = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "remote", "get-url", "origin"], capture_output=True, text=True
    )
    assert labels.get(SOURCE_LABEL) == (remote.stdout.strip() or None)

    archive = oci_archive(target)
    manifest = json.loads(
        subprocess.run(
            ["skopeo", "inspect", "--raw", f"oci-archive:{archive}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    assert (
        manifest["config"]["digest"]
        == "sha256:" + podman_output("image", "inspect", "--format", "{{.Id}}", image).strip()
    )
    annotations = manifest.get("annotations", {})
    assert {key: annotations.get(key) for key in (VERSION_LABEL, REVISION_LABEL)} == {
        VERSION_LABEL: version,
        REVISION_LABEL: revision,
    }


@pytest.mark.parametrize("target", TARGETS)
def test_the_sbom_lists_the_packages_installed_in_the_image(target: str) -> None:
    image = image_name(target)
    sbom = json.loads(sbom_path(target).read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    listed = {component["name"].lower(): component.get("version") for component in sbom["components"]}
    installed = run_in(image, "python", "-m", "pip", "list", "--format", "json").stdout
    for package in json.loads(installed):
        name = package["name"].lower()
        assert listed.get(name) == package["version"], (
            f"{name} {package['version']} is not in the SBOM of {image}"
        )
    assert ("torch" in listed) == (target == "runtime")
    assert "cyclonedx-bom" not in listed, "the SBOM tool itself is never in the image"


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """A local registry (Debian's docker-registry, which `make images` installs) on a loopback address."""
    address = f"{loopback_address()}:5000"
    config = tmp_path / "registry.yml"
    storage = {"filesystem": {"rootdirectory": str(tmp_path / "blobs")}}
    config.write_text(
        json.dumps({"version": 0.1, "log": {"level": "warn"}, "storage": storage, "http": {"addr": address}})
    )
    process = subprocess.Popen(
        ["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}/v2/", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                assert process.poll() is None, process.stderr.read() if process.stderr else ""
                assert time.monotonic() < deadline, "the registry did not answer within 30s"
                time.sleep(0.2)
        yield address
    finally:
        process.terminate()
        process.wait(10)


def test_the_archive_is_pushed_to_a_registry_with_skopeo_as_documented(registry: str) -> None:
    """docs/images.md's `skopeo copy oci-archive:... docker://REGISTRY/...` (this registry is plain HTTP)."""
    archive = oci_archive("operator")
    destination = f"docker://{registry}/kvfleet/operator:{image_name('operator').rpartition(':')[2]}"
    subprocess.run(
        ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci-archive:{archive}", destination],
        check=True,
    )
    pushed = subprocess.run(
        ["skopeo", "inspect", "--tls-verify=false", "--config", destination],
        check=True,
        capture_output=True,
        text=True,
    )
    assert json.loads(pushed.stdout)["config"]["Labels"] == image_config(image_name("operator"))["Labels"]
    local = subprocess.run(
        ["skopeo", "inspect", "--config", f"oci-archive:{archive}"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert json.loads(pushed.stdout)["rootfs"] == json.loads(local.stdout)["rootfs"], "the same layers"
