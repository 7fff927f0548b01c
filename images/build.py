"""`make images`: the runtime and operator images, built from the Dockerfile with podman, without a daemon.

    python3 images/build.py            # from the repository root; needs root (apt-get, podman's storage)

1. Installs podman, runc, skopeo, mmdebstrap and docker-registry (for the tests) with apt-get when missing.
2. Makes the base image from Debian bookworm's own packages with mmdebstrap (Python 3.11 as `python` and
   `pip`, the parts of `python:3.11-slim` the images use), once per recipe, and passes it as `BASE_IMAGE`.
3. Builds both targets with podman's layer cache: the layer that installs torch is built once per set of pins.
4. Exports each image as an OCI archive and writes its CycloneDX SBOM, both under $KVFLEET_CACHE/images.

    python3 images/build.py --push-to REGISTRY   # `make push`: copies the archives built before

copies each archive with skopeo to REGISTRY/kvfleet/<target>:<version>, the name the chart pulls with its
`imageRegistry` set to REGISTRY (the release workflow does this on a tag).

Importable too: the image tests and the demo take the names, paths and podman options from here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VERSION: str = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
TARGETS = ("runtime", "operator")
# The OCI label keys that say where an image comes from.
SOURCE_LABEL = "org.opencontainers.image.source"
REVISION_LABEL = "org.opencontainers.image.revision"
VERSION_LABEL = "org.opencontainers.image.version"
BASE_RECIPE_LABEL = "io.kvfleet.base-recipe"

# Debian's trust store, in the base images and on a Debian host alike.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BASE_IMAGE = "localhost/kvfleet/python:3.11-bookworm"
DEBIAN_SOURCES = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# What the Dockerfile asks of its base: `python` and `pip` (pip installing into /usr/local as root, as in
# python:3.11-slim, so Debian's externally-managed marker goes), groupadd/useradd, and apt-get for gcc; and
# what python:3.11-slim has that the runtime needs: Python's C headers, which Triton's launchers include.
BASE_PACKAGES = (
    "python3.11",
    "libpython3.11-dev",
    "python3-pip",
    "python-is-python3",
    "passwd",
    "ca-certificates",
)
BASE_HOOKS = (
    'rm -f "$1"/usr/lib/python3.11/EXTERNALLY-MANAGED',
    'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
)
BASE_EXCLUDED = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
BASE_CONFIG = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["python3"]',
)

# Debian package of each command the build uses, and of the local registry the image tests push to.
TOOLS = {
    "podman": "podman",
    "runc": "runc",
    "skopeo": "skopeo",
    "mmdebstrap": "mmdebstrap",
    "docker-registry": "docker-registry",
}
# crun 1.8 (Debian bookworm's) refuses to start containers on a hybrid cgroup hierarchy (v1 controllers with
# some on the v2 mount); runc runs on v1, hybrid and v2 alike.
OCI_RUNTIME = "runc"


def cache_dir() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE", Path.home() / ".cache" / "kvfleet")) / "images"


def image_name(target: str) -> str:
    """The local name of an image: the chart's `kvfleet/<target>:<version>` in podman's localhost registry."""
    return f"localhost/kvfleet/{target}:{VERSION}"


def pod_images() -> dict[str, str]:
    """The images the chart and the operator name (`kvfleet/<target>:<version>`) -> the local images."""
    return {image_name(target).removeprefix("localhost/"): image_name(target) for target in TARGETS}


def missing_images() -> list[str]:
    """The local images that are not built (all of them where podman is not installed)."""
    images = list(pod_images().values())
    if shutil.which("podman") is None:
        return images
    return [image for image in images if subprocess.run(podman("image", "exists", image)).returncode != 0]


def oci_archive(target: str) -> Path:
    return cache_dir() / "oci" / f"kvfleet-{target}-{VERSION}.tar"


def sbom_path(target: str) -> Path:
    return cache_dir() / "sbom" / f"kvfleet-{target}-{VERSION}.cdx.json"


def podman(*args: str) -> list[str]:
    return ["podman", "--runtime", OCI_RUNTIME, *args]


def run_limits() -> list[str]:
    """`podman run` options giving the container this host's hard limits on open files and processes.

    podman's defaults (1048576 open files) ask for more than a host without CAP_SYS_RESOURCE may grant, and
    runc then refuses to start the container; process limits above the kernel's PID space (kernel.pid_max)
    were refused the same way, so that caps the process limit.
    """
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    processes = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    processes = pid_max if processes == resource.RLIM_INFINITY else min(processes, pid_max)
    return ["--ulimit", f"nofile={files}:{files}", "--ulimit", f"nproc={processes}:{processes}"]


def say(text: str) -> None:
    print(f"==> {text}", flush=True)


def run(
    argv: list[str], env: dict[str, str] | None = None, capture_output: bool = False
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, text=True, env=env, capture_output=capture_output)


def ensure_tools() -> None:
    missing = sorted({package for command, package in TOOLS.items() if shutil.which(command) is None})
    if not missing:
        return
    say(f"installing {', '.join(missing)} with apt-get (missing on this machine)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], env=env)
    run(["apt-get", "install", "--yes", "-q", *missing], env=env)


def _base_recipe() -> str:
    recipe = json.dumps([DEBIAN_SOURCES, BASE_PACKAGES, BASE_HOOKS, BASE_EXCLUDED, BASE_CONFIG])
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def _labels(image: str) -> dict[str, str]:
    result = subprocess.run(
        podman("image", "inspect", "--format", "{{json .Labels}}", image), capture_output=True, text=True
    )
    return (json.loads(result.stdout) or {}) if result.returncode == 0 else {}


def ensure_base_image() -> None:
    recipe = _base_recipe()
    if _labels(BASE_IMAGE).get(BASE_RECIPE_LABEL) == recipe:
        return
    say(f"making {BASE_IMAGE} from Debian bookworm's packages with mmdebstrap")
    with tempfile.TemporaryDirectory(prefix="kvfleet-base-") as scratch:
        tarball = Path(scratch) / "rootfs.tar"
        argv = ["mmdebstrap", "--variant=minbase", "--mode=root", "--format=tar"]
        argv += [f"--include={','.join(BASE_PACKAGES)}", '--aptopt=APT::Install-Recommends "false"']
        argv += [f"--dpkgopt=path-exclude={pattern}" for pattern in BASE_EXCLUDED]
        argv += ["--dpkgopt=path-include=/usr/share/doc/*/copyright"]  # the licences stay
        argv += [f"--customize-hook={hook}" for hook in BASE_HOOKS]
        run([*argv, "bookworm", str(tarball), *DEBIAN_SOURCES])
        changes = [*BASE_CONFIG, f"LABEL {BASE_RECIPE_LABEL}={recipe}"]
        run(podman("import", *(f"--change={change}" for change in changes), str(tarball), BASE_IMAGE))


def _git(*args: str) -> str:
    result = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def source_labels() -> dict[str, str]:
    """The OCI labels of both images: the version, the commit, and the repository when it has a remote."""
    labels = {VERSION_LABEL: VERSION, REVISION_LABEL: _git("rev-parse", "HEAD")}
    source = _git("remote", "get-url", "origin")
    if source:
        labels[SOURCE_LABEL] = source
    return labels


def image_id(image: str) -> str:
    result = subprocess.run(
        podman("image", "inspect", "--format", "{{.Id}}", image), capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else ""


def build(target: str) -> None:
    image = image_name(target)
    previous = image_id(image)
    say(f"building {image} (Dockerfile target {target}, BASE_IMAGE={BASE_IMAGE})")
    argv = podman("build", "--layers", "--target", target, "--tag", image)
    argv += ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    argv += trust_host_certificates()  # for the RUN steps only
    for key, value in source_labels().items():
        # The labels go into the image's configuration; the annotations into its OCI manifest.
        argv += ["--label", f"{key}={value}", "--annotation", f"{key}={value}"]
    run([*argv, str(REPO_ROOT)])
    current = image_id(image)
    if previous and previous != current:
        # The image the tag named before, with its layers that nothing else uses: one version on disk.
        subprocess.run(podman("rmi", previous), capture_output=True, text=True)


def export(target: str) -> None:
    """The image as an OCI archive (re-exported only when the image changed)."""
    archive = oci_archive(target)
    config_digest = f"sha256:{image_id(image_name(target))}"
    if archive.exists():
        result = subprocess.run(["skopeo", "inspect", "--raw", f"oci-archive:{archive}"], capture_output=True)
        if result.returncode == 0 and json.loads(result.stdout)["config"]["digest"] == config_digest:
            return
    say(f"exporting {image_name(target)} to {archive}")
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    reference = image_name(target).removeprefix("localhost/")
    run(
        [
            "skopeo",
            "copy",
            "--quiet",
            f"containers-storage:{image_name(target)}",
            f"oci-archive:{partial}:{reference}",
        ]
    )
    partial.replace(archive)


def trust_host_certificates() -> list[str]:
    """Options that let pip in a build or a container trust what this host trusts (a TLS-inspecting proxy's
    CA, say): the host's bundle over the image's own, for that run only; the images keep Debian's."""
    return ["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"] if HOST_CA_BUNDLE.exists() else []


def sbom_tool() -> Path:
    """CycloneDX's SBOM tool, as pinned in requirements/sbom.txt, in a folder of its own (reinstalled when
    the pin changes), installed by the base image's pip so that it runs on the images' Python; the images
    never contain it."""
    requirements = REPO_ROOT / "requirements" / "sbom.txt"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()[:16]
    folder = cache_dir() / f"sbom-tool-{digest}"
    if not folder.exists():
        say(f"installing the SBOM tool ({requirements.relative_to(REPO_ROOT)}) into {folder}")
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        argv = podman("run", "--rm", *run_limits(), *trust_host_certificates())
        argv += [
            "--volume",
            f"{partial}:/mnt",
            "--volume",
            f"{requirements}:/requirements.txt:ro",
            BASE_IMAGE,
        ]
        argv += [
            "pip",
            "install",
            "--quiet",
            "--no-compile",
            "--target",
            "/mnt",
            "--requirement",
            "/requirements.txt",
        ]
        run(argv)
        partial.replace(folder)
    return folder


# Runs the tool from a folder mounted at /mnt: on sys.path for this process only, so the image's interpreter
# it inspects (a child process) lists the image's own packages and not the tool's.
_SBOM_PROGRAM = (
    "import runpy, sys; sys.path.insert(0, '/mnt'); "
    "sys.argv = ['cyclonedx-py', 'environment', '--output-reproducible', '--output-format', 'JSON', "
    "sys.executable]; "
    "runpy.run_module('cyclonedx_py', run_name='__main__')"
)


def write_sbom(target: str) -> None:
    path = sbom_path(target)
    say(f"writing the SBOM of {image_name(target)} to {path}")
    argv = podman("run", "--rm", "--network", "none", *run_limits(), "--volume", f"{sbom_tool()}:/mnt:ro")
    argv += ["--entrypoint", "python", image_name(target), "-c", _SBOM_PROGRAM]
    document = run(argv, capture_output=True).stdout
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document)


def pushed_name(registry: str, target: str) -> str:
    """Where `--push-to` puts an image: the chart's name for it under its `imageRegistry`."""
    return f"{registry.rstrip('/')}/{image_name(target).removeprefix('localhost/')}"


def push(registry: str, targets: tuple[str, ...]) -> None:
    """Copies each target's OCI archive, as `make images` exported it, to the registry (its manifest
    annotations and SBOM-bearing labels with it); skopeo reads credentials from `skopeo login`."""
    for target in targets:
        archive = oci_archive(target)
        if not archive.exists():
            raise SystemExit(f"{archive} is missing: run `make images` first")
        run(["skopeo", "copy", f"oci-archive:{archive}", f"docker://{pushed_name(registry, target)}"])
        say(f"pushed {pushed_name(registry, target)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="images/build.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "targets", nargs="*", metavar="TARGET", help=f"any of {', '.join(TARGETS)} (default: both)"
    )
    parser.add_argument(
        "--push-to", metavar="REGISTRY", help="push the archives built before to REGISTRY instead of building"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; the Dockerfile's are {list(TARGETS)}")
    if args.push_to:
        push(args.push_to, tuple(args.targets) or TARGETS)
        return 0
    ensure_tools()
    ensure_base_image()
    for target in args.targets or TARGETS:
        started = time.monotonic()
        build(target)
        export(target)
        write_sbom(target)
        say(f"{image_name(target)} ready in {time.monotonic() - started:.0f}s: {oci_archive(target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
