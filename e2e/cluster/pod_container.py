"""A pod's container as `podman run` options, as a kubelet would run it: the pod's and the container's
securityContext, its volumes, environment, command and resource limits.

Whatever of a securityContext this does not know raises UnsupportedPodSpec instead of being left out, so a
test that runs a chart's or the operator's pod with it fails when they ask for something it would not enforce.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from images.build import podman

from .pod_spec import bind_to_pod_ip, expand_references, parse_quantity


class UnsupportedPodSpec(ValueError):
    """The pod asks for something these options cannot express."""


# The securityContext fields this module turns into podman options, pod level and container level.
POD_SECURITY_FIELDS = {
    "runAsUser",
    "runAsGroup",
    "runAsNonRoot",
    "fsGroup",
    "supplementalGroups",
    "seccompProfile",
}
CONTAINER_SECURITY_FIELDS = {
    "runAsUser",
    "runAsGroup",
    "runAsNonRoot",
    "readOnlyRootFilesystem",
    "allowPrivilegeEscalation",
    "capabilities",
    "privileged",
    "seccompProfile",
}


def image_config(image: str) -> dict[str, Any]:
    """The image's configuration as podman reports it (User, Entrypoint, Env, Labels, ...)."""
    argv = podman("image", "inspect", "--format", "{{json .Config}}", image)
    return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)


def _check_fields(context: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(context) - known)
    if unknown:
        raise UnsupportedPodSpec(f"{where} securityContext fields without a podman equivalent: {unknown}")


def security_options(pod_spec: Mapping[str, Any], container: Mapping[str, Any], image_user: str) -> list[str]:
    """The container's effective securityContext (its own fields over the pod's) as podman options.

    image_user: the image's configured USER, which runAsNonRoot must be able to verify when no runAsUser is
    given (as a kubelet does: a numeric, non-zero uid).
    """
    pod_context = pod_spec.get("securityContext", {})
    context = container.get("securityContext", {})
    _check_fields(pod_context, POD_SECURITY_FIELDS, "pod")
    _check_fields(context, CONTAINER_SECURITY_FIELDS, "container")
    merged = {**pod_context, **context}
    options: list[str] = []
    user = merged.get("runAsUser")
    if merged.get("runAsNonRoot"):
        uid = str(user) if user is not None else image_user.partition(":")[0]
        if not uid.isdigit() or int(uid) == 0:
            raise UnsupportedPodSpec(f"runAsNonRoot cannot be verified: the container's user is {uid!r}")
    if user is not None:
        group = merged.get("runAsGroup")
        options += ["--user", f"{user}:{group}" if group is not None else str(user)]
    for group in [
        *pod_context.get("supplementalGroups", []),
        *([pod_context["fsGroup"]] if "fsGroup" in pod_context else []),
    ]:
        options += ["--group-add", str(group)]
    if merged.get("readOnlyRootFilesystem"):
        # podman would add writable tmpfs mounts at /tmp, /var/tmp and /run; a kubelet adds none.
        options += ["--read-only", "--read-only-tmpfs=false"]
    if merged.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    if merged.get("privileged"):
        options.append("--privileged")
    capabilities = merged.get("capabilities", {})
    options += [f"--cap-drop={name.lower()}" for name in capabilities.get("drop", [])]
    options += [f"--cap-add={name.lower()}" for name in capabilities.get("add", [])]
    seccomp = merged.get("seccompProfile", {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        options += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":  # podman's default profile is the runtime's default
        raise UnsupportedPodSpec(f"seccompProfile {seccomp} has no podman equivalent here")
    return options


def volume_options(
    pod_spec: Mapping[str, Any], container: Mapping[str, Any], volume_dirs: Mapping[str, Path]
) -> list[str]:
    """The container's volume mounts: each from the host folder standing in for its volume (volume_dirs), but
    a memory-backed emptyDir, which is a tmpfs."""
    volumes = {volume["name"]: volume for volume in pod_spec.get("volumes", [])}
    options: list[str] = []
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is None:
            raise UnsupportedPodSpec(f"volume {mount['name']!r} is mounted but not declared")
        if volume.get("emptyDir", {}).get("medium") == "Memory":
            size = volume["emptyDir"].get("sizeLimit")
            limit = f",tmpfs-size={int(parse_quantity(size))}" if size else ""
            options += ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-mode=1777{limit}"]
            continue
        if mount["name"] not in volume_dirs:
            raise UnsupportedPodSpec(f"no host folder stands in for volume {mount['name']!r}")
        source = volume_dirs[mount["name"]] / mount.get("subPath", "")
        mode = "ro" if mount.get("readOnly") else "rw"
        options += ["--volume", f"{source}:{mount['mountPath']}:{mode}"]
    return options


def resource_options(container: Mapping[str, Any]) -> list[str]:
    limits = container.get("resources", {}).get("limits", {})
    options: list[str] = []
    if "memory" in limits:
        options += ["--memory", str(int(parse_quantity(limits["memory"])))]
    if "cpu" in limits:
        options += ["--cpus", str(parse_quantity(limits["cpu"]))]
    return options


def podman_run_options(
    pod_spec: Mapping[str, Any],
    container: Mapping[str, Any],
    env: Mapping[str, str],
    volume_dirs: Mapping[str, Path],
    image_user: str,
) -> list[str]:
    """Every option of `podman run` for the container but its command (see container_command)."""
    options = security_options(pod_spec, container, image_user)
    options += volume_options(pod_spec, container, volume_dirs)
    options += resource_options(container)
    for name, value in env.items():
        options += ["--env", f"{name}={value}"]
    return options


def container_command(
    container: Mapping[str, Any], env: Mapping[str, str], pod_ip: str, image_entrypoint: list[str]
) -> tuple[list[str], list[str]]:
    """(--entrypoint options, arguments after the image): the container's command (else the image's
    entrypoint) and args, $(VAR) references expanded and its servers bound to the pod's IP, since on the host
    network each pod has one loopback address of its own."""
    command = [expand_references(part, env) for part in container.get("command", [])] or image_entrypoint
    args = [expand_references(part, env) for part in container.get("args", [])]
    argv = bind_to_pod_ip([*command, *args], pod_ip)
    return ["--entrypoint", json.dumps(argv[:1])], argv[1:]
