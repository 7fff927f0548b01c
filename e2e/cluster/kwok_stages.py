"""kwok Stage documents: how kwok moves fake nodes and pods through their lifecycle.

The kwok controller (unlike kwokctl) ships no default stages, so the cluster passes these in its config file.
Nodes become Ready and keep their leases. Pods become Running and Ready at once, except pods whose image the
pod runner executes for real: kwok only gives those an IP, and the runner reports their state, readiness
from the real process's probe, and their deletion once the process has exited.
"""

from __future__ import annotations

from typing import Any

STAGE_API_VERSION = "kwok.x-k8s.io/v1alpha1"

_NODE_READY_STATUS = """\
{{ $now := Now }}
conditions:
{{ range NodeConditions }}
- lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
  message: {{ .message | Quote }}
  reason: {{ .reason | Quote }}
  status: {{ .status | Quote }}
  type: {{ .type | Quote }}
{{ end }}
addresses:
- address: {{ NodeIP | Quote }}
  type: InternalIP
- address: {{ .metadata.name | Quote }}
  type: Hostname
nodeInfo:
  architecture: amd64
  operatingSystem: linux
  kubeletVersion: {{ printf "kwok-%s" Version | Quote }}
  kubeProxyVersion: {{ printf "kwok-%s" Version | Quote }}
  containerRuntimeVersion: {{ printf "kwok-%s" Version | Quote }}
  kernelVersion: {{ printf "kwok-%s" Version | Quote }}
  machineID: ""
  bootID: ""
  osImage: ""
  systemUUID: ""
phase: Running
"""

_NODE_HEARTBEAT_STATUS = """\
{{ $now := Now }}
conditions:
{{ range NodeConditions }}
- lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
  message: {{ .message | Quote }}
  reason: {{ .reason | Quote }}
  status: {{ .status | Quote }}
  type: {{ .type | Quote }}
{{ end }}
"""

# IPs come from kwok's pool (the node has no podCIDR), so they never collide between the two kinds of pods.
_POD_ADDRESSES = """\
{{ with NodeIPsWith .spec.nodeName }}
hostIP: {{ index . 0 | Quote }}
hostIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
{{ with PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) \
( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
startTime: {{ Now | Quote }}
"""

_POD_RUNNING_STATUS = (
    """\
{{ $now := Now }}
conditions:
- {type: PodReadyToStartContainers, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  started: true
  restartCount: 0
  state: {running: {startedAt: {{ $now | Quote }}}}
{{ end }}
initContainerStatuses:
{{ range .spec.initContainers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  restartCount: 0
  state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, \
finishedAt: {{ $now | Quote }}}}
{{ end }}
phase: Running
"""
    + _POD_ADDRESSES
)

# The runner's pods get an address and nothing else: the runner itself reports what the process does.
_POD_ADDRESS_ONLY_STATUS = (
    """\
{{ $now := Now }}
conditions:
- {type: PodReadyToStartContainers, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
"""
    + _POD_ADDRESSES
)


def runs_image_expression(image_pattern: str) -> str:
    """A jq expression true when any container of a pod uses an image the pod runner executes."""
    escaped = image_pattern.replace("\\", "\\\\").replace('"', '\\"')
    return f'[(.spec.initContainers // [])[], .spec.containers[] | .image | test("{escaped}")] | any'


def _stage(name: str, kind: str, match: list[dict[str, Any]], next_: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": STAGE_API_VERSION,
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": kind},
            "selector": {"matchExpressions": match},
            "next": next_,
        },
    }


def _expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    expression: dict[str, Any] = {"key": key, "operator": operator}
    if values:
        expression["values"] = list(values)
    return expression


def kwok_stages(real_image_pattern: str | None, heartbeat_seconds: int = 20) -> list[dict[str, Any]]:
    """The Stage documents for kwok's config file.

    real_image_pattern: a regular expression (RE2 and Python syntax alike) for the images the pod runner
    executes; kwok leaves those pods' readiness and deletion to it. None: kwok runs every pod itself.
    """
    not_ready = _expr('.status.conditions.[] | select(.type == "Ready") | .status', "NotIn", "True")
    not_deleting = _expr(".metadata.deletionTimestamp", "DoesNotExist")
    no_ip = _expr(".status.podIP", "DoesNotExist")
    stages = [
        _stage("node-ready", "Node", [not_ready], {"statusTemplate": _NODE_READY_STATUS}),
        _stage(
            "node-heartbeat",
            "Node",
            [_expr(".status.phase", "In", "Running")],
            {"statusTemplate": _NODE_HEARTBEAT_STATUS},
        ),
    ]
    # The heartbeat stage repeats after its delay; node leases (--node-lease-duration-seconds) carry liveness.
    stages[1]["spec"]["delay"] = {"durationMilliseconds": heartbeat_seconds * 1000}
    fake_only: list[dict[str, Any]] = []
    if real_image_pattern is not None:
        runs = runs_image_expression(real_image_pattern)
        fake_only = [_expr(runs, "NotIn", "true")]
        stages.append(
            _stage(
                "pod-address",
                "Pod",
                [not_deleting, no_ip, _expr(runs, "In", "true")],
                {"statusTemplate": _POD_ADDRESS_ONLY_STATUS},
            )
        )
    stages += [
        _stage(
            "pod-running",
            "Pod",
            [not_deleting, _expr(".status.phase", "In", "Pending"), not_ready, *fake_only],
            {"statusTemplate": _POD_RUNNING_STATUS},
        ),
        _stage(
            "pod-delete",
            "Pod",
            [_expr(".metadata.deletionTimestamp", "Exists"), *fake_only],
            {"delete": True},
        ),
    ]
    return stages
