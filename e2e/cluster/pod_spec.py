"""What a pod asks a kubelet to run, turned into a local process: argv, environment and paths.

Pure functions over pod dicts, as a kubelet reads them: `$(VAR)` references, env and envFrom, the downward
API, and volume mounts (a container's paths are mapped to the host folders that stand in for its volumes).
"""

from __future__ import annotations

import base64
import math
import os
import re
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

# kvfleet's images: the repository kvfleet, kvfleet/operator or kvfleet/runtime (the chart's and the
# operator's defaults), with any registry, tag or digest. Go's RE2 reads it too (kwok's stage selectors).
DEFAULT_IMAGE_PATTERN = r"(^|/)kvfleet(/(operator|runtime))?(:[A-Za-z0-9_.-]+)?(@sha256:[0-9a-f]+)?$"

# Reads a ConfigMap or Secret: (kind, namespace, name) -> its string data, or None when it does not exist.
ObjectLookup = Callable[[str, str, str], "dict[str, str] | None"]


class ContainerConfigError(ValueError):
    """The pod asks for something the runner cannot provide (kubelet: CreateContainerConfigError)."""


def runs_image(image: str, pattern: str) -> bool:
    return re.search(pattern, image) is not None


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_references(text: str, variables: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, unknown ones kept, and $$ escapes a $."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return variables.get(name, match.group(0))

    return _REFERENCE.sub(replace, text)


_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")
_SUFFIXES = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
}


def parse_quantity(quantity: str | int | float) -> Decimal:
    match = _QUANTITY.match(str(quantity).strip())
    if match is None or match.group(2) not in _SUFFIXES:
        raise ContainerConfigError(f"not a resource quantity: {quantity!r}")
    return Decimal(match.group(1)) * _SUFFIXES[match.group(2)]


def _field_value(pod: Mapping[str, Any], field_path: str) -> str:
    metadata, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path)
    if keyed:
        return metadata.get(keyed.group(1), {}).get(keyed.group(2), "")
    simple = {
        "metadata.name": metadata.get("name", ""),
        "metadata.namespace": metadata.get("namespace", ""),
        "metadata.uid": metadata.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs", [])),
        "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs", [])),
    }
    if field_path not in simple:
        raise ContainerConfigError(f"unsupported fieldRef {field_path!r}")
    return simple[field_path]


def _resource_value(
    container: Mapping[str, Any], ref: Mapping[str, Any], node_allocatable: Mapping[str, str]
) -> str:
    kind, _, resource = ref["resource"].partition(".")
    if kind not in ("limits", "requests") or not resource:
        raise ContainerConfigError(f"unsupported resourceFieldRef {ref['resource']!r}")
    resources = container.get("resources", {})
    value = resources.get(kind, {}).get(resource)
    if value is None and kind == "requests":
        value = resources.get("limits", {}).get(resource)  # an unset request defaults to the limit
    if value is None:
        value = node_allocatable.get(resource, "0")  # an unset limit is the node's allocatable
    divisor = parse_quantity(ref.get("divisor", "1"))
    return str(math.ceil(parse_quantity(value) / divisor))


def referenced_data(
    lookup: ObjectLookup, kind: str, namespace: str, ref: Mapping[str, Any]
) -> dict[str, str] | None:
    """The data of the ConfigMap or Secret ref names; None when it is missing and optional."""
    data = lookup(kind, namespace, ref["name"])
    if data is None and not ref.get("optional", False):
        raise ContainerConfigError(f"{kind} {namespace}/{ref['name']} not found")
    return data


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    lookup: ObjectLookup,
    node_allocatable: Mapping[str, str],
) -> dict[str, str]:
    """The variables a kubelet would give the container: envFrom first, then env, in order."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in source:
                data = referenced_data(lookup, kind, namespace, source[key]) or {}
                env.update({prefix + name: value for name, value in data.items()})
    for variable in container.get("env", []):
        name = variable["name"]
        if "valueFrom" not in variable:
            env[name] = expand_references(variable.get("value", ""), env)
            continue
        source = variable["valueFrom"]
        if "fieldRef" in source:
            env[name] = _field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[name] = _resource_value(container, source["resourceFieldRef"], node_allocatable)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind, ref = (
                ("ConfigMap", source["configMapKeyRef"])
                if "configMapKeyRef" in source
                else ("Secret", source["secretKeyRef"])
            )
            data = referenced_data(lookup, kind, namespace, ref)
            if data is not None and ref["key"] in data:
                env[name] = data[ref["key"]]
            elif not ref.get("optional", False):
                raise ContainerConfigError(f"key {ref['key']!r} not in {kind} {namespace}/{ref['name']}")
        else:
            raise ContainerConfigError(f"unsupported valueFrom for {name}: {sorted(source)}")
    return env


def secret_strings(secret: Mapping[str, Any]) -> dict[str, str]:
    decoded = {key: base64.b64decode(value).decode() for key, value in (secret.get("data") or {}).items()}
    return {**decoded, **(secret.get("stringData") or {})}


def cpu_threads(container: Mapping[str, Any]) -> int | None:
    """Whole cores the container may use (its CPU limit, else request), for thread-pool sizes; None: unset."""
    resources = container.get("resources", {})
    cpu = resources.get("limits", {}).get("cpu") or resources.get("requests", {}).get("cpu")
    return max(1, math.ceil(parse_quantity(cpu))) if cpu else None


Mounts = list[tuple[str, Path]]


def container_mounts(container: Mapping[str, Any], volume_dirs: Mapping[str, Path]) -> Mounts:
    """(path in the container, host path) for each mount, longest container path first."""
    mounts: Mounts = []
    for mount in container.get("volumeMounts", []):
        if mount["name"] not in volume_dirs:
            raise ContainerConfigError(f"volume {mount['name']!r} is mounted but not provided")
        host = volume_dirs[mount["name"]]
        if mount.get("subPath"):
            host = host / mount["subPath"]
        mounts.append((mount["mountPath"].rstrip("/") or "/", host))
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)


def host_path(value: str, mounts: Mounts) -> str:
    """value with a container path (plain, as file:// URI, or after `--option=`) mapped to the host."""
    option, equals, rest = value.partition("=")
    if equals and option.startswith("--"):
        return f"{option}={host_path(rest, mounts)}"
    if value.startswith("file://"):
        return "file://" + host_path(value[len("file://") :], mounts)
    for container_path, host in mounts:
        if value == container_path or value.startswith(container_path.rstrip("/") + "/"):
            return str(host) + value[len(container_path.rstrip("/")) :]
    return value


def container_argv(
    container: Mapping[str, Any], env: Mapping[str, str], programs: Mapping[str, str]
) -> list[str]:
    """The command line, with the program mapped to its executable on this host.

    programs: the image's commands (name -> executable here); with no command, the entrypoint is `kvfleet`.
    """
    command = container.get("command") or ["kvfleet"]
    argv = [expand_references(part, env) for part in [*command, *container.get("args", [])]]
    program = os.path.basename(argv[0])
    if program in programs:
        return [programs[program], *argv[1:]]
    raise ContainerConfigError(
        f"{argv[0]!r} is not a command the pod runner knows (it runs {sorted(programs)})"
    )


_ANY_ADDRESS = re.compile(r"(?<![0-9.])0\.0\.0\.0(?![0-9.])")
# The subcommands of the kvfleet image that listen, and the flag of their listen address.
_LISTEN_FLAGS = {"serve": "--host", "operator": "--bind", "gateway": "--host"}


def bind_to_pod_ip(argv: list[str], pod_ip: str) -> list[str]:
    """argv as if the pod had its own network: any 0.0.0.0 becomes the pod's IP (all interfaces of a pod are
    its one IP; on a shared host two pods would claim the same port), and so does the listen address of the
    kvfleet servers (`serve --host`, `operator --bind`, `gateway --host`), added when the arguments leave it
    to the default."""
    argv = [argv[0], *(_ANY_ADDRESS.sub(pod_ip, part) for part in argv[1:])]
    flags = {_LISTEN_FLAGS[part] for part in argv[1:] if part in _LISTEN_FLAGS}
    result: list[str] = [argv[0]]
    replaced: set[str] = set()
    skip_next = False
    for index, part in enumerate(argv[1:], start=1):
        if skip_next:
            skip_next = False
            continue
        flag = part.split("=", 1)[0]
        if flag in flags and "=" in part:
            result.append(f"{flag}={pod_ip}")
            replaced.add(flag)
        elif flag in flags and index + 1 < len(argv):
            result += [flag, pod_ip]
            replaced.add(flag)
            skip_next = True
        else:
            result.append(part)
    for flag in sorted(flags - replaced):
        result += [flag, pod_ip]
    return result


def container_port(container: Mapping[str, Any], port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports", []):
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ContainerConfigError(f"container {container['name']!r} has no port named {port!r}")
