"""The pod template of one InferenceService's replicas: the runtime container, model delivery, probes."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from kvfleet.contract.engine import Runtime
from kvfleet.contract.kv_events import DEFAULT_EVENTS_PORT, DEFAULT_REPLAY_PORT
from kvfleet.contract.kv_transfer import Role
from kvfleet.operator.api import (
    API_KEY_ENV,
    HTTP_PORT,
    HTTP_PORT_NAME,
    KV_EVENTS_CONFIG_FLAG,
    KV_EVENTS_PORT_NAME,
    KV_REPLAY_PORT_NAME,
    KV_TRANSFER_CONFIG_FLAG,
    KV_TRANSFER_PORT,
    KV_TRANSFER_PORT_NAME,
    RENDEZVOUS_PORT,
)
from kvfleet.operator.spec import AdapterSpec, InferenceServiceSpec, ModelSpec, ResourcesSpec
from kvfleet.operator.tiers import DEFAULT_PRIORITY_CLASS_PREFIX, TIERS, priority_class_name

MODEL_ROOT = "/mnt/models"
# LoRA adapters the replica fetches from the hub; claims holding adapters are mounted under ADAPTER_CLAIMS.
ADAPTER_DOWNLOADS = "/mnt/adapters"
ADAPTER_CLAIMS = "/mnt/adapter-claims"
# The Batch API's database and files.
BATCH_STORE = "/var/lib/kvfleet/batch"
# The one writable path besides the model volume: HOME, caches and temporary files.
SCRATCH = "/scratch"
# Where a node's shared kernel cache is mounted (RenderOptions.kernel_cache_host_path). Each runtime image
# builds into a folder of its own there: a build made against another image's torch must not be loaded.
KERNEL_CACHE = "/var/cache/kvfleet/kernels"
# Long enough for endpoint controllers and proxies to drop the pod before it stops accepting requests.
PRESTOP_DELAY_SECONDS = 5
# Time past the drain for the runtime to send what it hands back and exit (it gives those events 5 s, then
# its HTTP server 5 s for the last connections).
EXIT_MARGIN_SECONDS = 10
PROBE_PERIOD_SECONDS = 5
# The startup and HTTP readiness probes ask every second, so that a replica that has loaded its model takes
# traffic within a second rather than a probe period later: a request held at zero waits on it, and the
# kubelet runs no readiness probe before the startup probe passes. /health and /ready cost the server
# nothing; the failures allowed keep the time before a replica that stops answering is taken out of the
# Service as it was with the longer period.
READINESS_PERIOD_SECONDS = 1
_READINESS_FAILURE_SECONDS = 10
RUNTIME_USER = 1000
# What each runtime's container runs, and where it answers whether it takes requests: vLLM's server answers
# /health once its engine is up (it has no /ready); kvfleet's /ready also says no while it drains or sleeps.
RUNTIME_COMMANDS: dict[Runtime, list[str]] = {"kvfleet": ["kvfleet", "serve"], "vllm": ["vllm", "serve"]}
READINESS_PATHS: dict[Runtime, str] = {"kvfleet": "/ready", "vllm": "/health"}
# The flag, vLLM's and kvfleet's, of how long a stopping replica lets its requests finish
# (spec.engine.drainTimeoutSeconds).
DRAIN_FLAG = "--shutdown-timeout"
# The variable each runtime reads its API key from; the Secret holds it under API_KEY_ENV either way.
API_KEY_VARIABLES: dict[Runtime, str] = {"kvfleet": API_KEY_ENV, "vllm": "VLLM_API_KEY"}
# A group's pod reads its rank from one of its labels (downward API) into this variable, which its flags use.
NODE_RANK_ENV = "KVFLEET_NODE_RANK"
# The pod's own address, where the readiness probe of a group's pod asks (the server listens on every
# interface of the pod), and the address a prefill replica advertises for its KV blocks.
POD_IP_ENV = "KVFLEET_POD_IP"
# What a traced replica's spans name as their resource: its pod and namespace, from the downward API.
POD_NAME_ENV = "KVFLEET_POD_NAME"
POD_NAMESPACE_ENV = "KVFLEET_POD_NAMESPACE"
TRACES_ENDPOINT_FLAG = "--otlp-traces-endpoint"
# The runtime's KV connector that moves blocks between pods over TCP, and the side each role takes.
KV_CONNECTOR = "TcpConnector"
KV_ROLES: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}
RENDEZVOUS_PORT_NAME = "rendezvous"
# The pods of a StatefulSet share one template, yet only rank 0 serves /ready (ready to take requests); the
# other ranks answer /health alone (200 once they joined the group and loaded their shard). An HTTP probe has
# one path, so this probe picks it by rank.
RANK_READINESS_SCRIPT = (
    "import http.client, os, sys\n"
    f"path = '/ready' if os.environ['{NODE_RANK_ENV}'] == '0' else '/health'\n"
    f"connection = http.client.HTTPConnection(os.environ['{POD_IP_ENV}'], {HTTP_PORT}, timeout=3)\n"
    "connection.request('GET', path)\n"
    "sys.exit(connection.getresponse().status != 200)\n"
)


@dataclass(frozen=True)
class GroupPlacement:
    """Where a group's pod stands: how many nodes share the model, where rank 0 listens, and where the pod
    finds its own rank."""

    nodes: int
    master_address: str
    # The pod label that holds the rank (the StatefulSet's pod index, or the LeaderWorkerSet's worker index).
    rank_label: str
    # The readiness path when the template is for one role only (a LeaderWorkerSet's leader or workers);
    # None: the template serves every rank and the probe picks the path by rank.
    readiness_path: str | None = None


def group_args(placement: GroupPlacement) -> list[str]:
    """The flags that join a pod to its group; the rank comes from the pod's label, through NODE_RANK_ENV."""
    return [
        "--nnodes",
        str(placement.nodes),
        "--node-rank",
        f"$({NODE_RANK_ENV})",
        "--master-addr",
        placement.master_address,
        "--master-port",
        str(RENDEZVOUS_PORT),
    ]


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def model_path(model: ModelSpec) -> str:
    """Where the runtime finds the weights inside the pod."""
    source = model.source
    if source.scheme == "hf":
        return f"{MODEL_ROOT}/{source.location}"
    if source.scheme == "pvc":
        return f"{MODEL_ROOT}/{source.detail}".rstrip("/")
    return source.location


def adapter_source(adapter: AdapterSpec) -> str:
    """What the replica is asked to load: a path in the pod, or the hf:// URI it fetches itself."""
    source = adapter.source
    if source.scheme == "hf":
        return adapter.uri
    if source.scheme == "pvc":
        return f"{ADAPTER_CLAIMS}/{source.location}/{source.detail}".rstrip("/")
    return source.location


def _adapter_claims(spec: InferenceServiceSpec) -> list[str]:
    return sorted({a.source.location for a in spec.adapters if a.source.scheme == "pvc"})


def kv_transfer_config(role: Role) -> str:
    """The JSON of a role's --kv-transfer-config (vLLM's keys): the pod's own address, from the downward API,
    is where a prefill replica's blocks wait for decode replicas to pull them."""
    config = {
        "kv_connector": KV_CONNECTOR,
        "kv_role": KV_ROLES[role],
        "kv_ip": f"$({POD_IP_ENV})",
        "kv_port": KV_TRANSFER_PORT,
    }
    return json.dumps(config, separators=(",", ":"))


def kv_events_config() -> str:
    """The JSON of --kv-events-config (vLLM's keys): the replica publishes on every interface of its pod, at
    the ports where the gateway's precise-prefix policy subscribes and asks for replays."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{DEFAULT_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{DEFAULT_REPLAY_PORT}",
    }
    return json.dumps(config, separators=(",", ":"))


def publishes_kv_events(spec: InferenceServiceSpec) -> bool:
    return spec.routing.policy == "precise-prefix"


@dataclass(frozen=True)
class TraceExport:
    """Where every runtime pod sends its requests' spans (both runtimes take vLLM's flag), and over which of
    OTLP's protocols (chart values runtime.tracing.*)."""

    endpoint: str
    protocol: str = "grpc"


def runtime_args(
    spec: InferenceServiceSpec,
    safety_config: str | None = None,
    role: Role | None = None,
    traces: TraceExport | None = None,
) -> list[str]:
    """The runtime's flags: `kvfleet serve`'s, or for spec.engine.runtime vllm `vllm serve`'s (the model
    first, as its positional argument); `safety_config` is the merged safety policy, `role` the side a replica
    of a disaggregated service takes (kvfleet's alone: parse_spec refuses both for vLLM), `traces` where the
    platform collects spans (before extraArgs, which may name another collector where the admission policy
    lets them)."""
    engine = spec.engine
    drain = [DRAIN_FLAG, str(engine.drain_timeout_seconds)]
    tracing = [TRACES_ENDPOINT_FLAG, traces.endpoint] if traces is not None else []
    if engine.runtime == "vllm":
        return [model_path(spec.model), *_shared_args(spec), *drain, *tracing, *engine.extra_args]
    args = ["--model", model_path(spec.model), *_shared_args(spec)]
    args += ["--default-priority", TIERS[spec.sla.tier].name, *drain]
    if spec.scaling.sleeping_replicas:
        args.append("--enable-sleep-mode")
    args += _flags([("--max-waiting-requests", engine.max_waiting_requests)])
    if spec.batch is not None:
        args += ["--batch-store", BATCH_STORE]
        args += _flags([("--max-batch-file-bytes", spec.batch.max_file_bytes)])
    if spec.lora_enabled:
        args += ["--enable-lora", "--lora-download-dir", ADAPTER_DOWNLOADS]
        args += _flags([("--max-loras", engine.max_loras), ("--max-lora-rank", engine.max_lora_rank)])
        if engine.allow_runtime_lora_updates:
            # The adapters are not flags: the operator loads them into running replicas.
            args.append("--allow-runtime-lora-updates")
        else:
            for adapter in spec.adapters:
                args += ["--lora-modules", f"{adapter.name}={adapter_source(adapter)}"]
    args += _flags([("--safety-config", safety_config)])
    if role is not None:
        args += [KV_TRANSFER_CONFIG_FLAG, kv_transfer_config(role)]
    if publishes_kv_events(spec):
        args += [KV_EVENTS_CONFIG_FLAG, kv_events_config()]
    return args + tracing + list(engine.extra_args)


def _shared_args(spec: InferenceServiceSpec) -> list[str]:
    """The flags kvfleet's runtime and vLLM's server both take, by the same names."""
    engine = spec.engine
    args = ["--served-model-name", spec.model.served_name, "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
    optional_values: list[tuple[str, object]] = [
        ("--tokenizer", spec.model.tokenizer),
        ("--chat-template", spec.model.chat_template),
        ("--max-num-seqs", engine.max_num_seqs),
        ("--max-model-len", engine.max_model_len),
        ("--block-size", engine.block_size),
    ]
    args += _flags(optional_values)
    if engine.enable_prefix_caching is not None:
        args.append(
            "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching"
        )
    args += ["--scheduling-policy", spec.scheduling_policy]
    args += _flags([("--dtype", engine.dtype), ("--quantization", engine.quantization)])
    if engine.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    # Only sent when it matters, so single-GPU and CPU replicas work with runtimes that lack the flag.
    if engine.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
    if engine.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(engine.pipeline_parallel_size)]
    return args


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    return PRESTOP_DELAY_SECONDS + spec.engine.drain_timeout_seconds + EXIT_MARGIN_SECONDS


def batch_claim_name(service_name: str) -> str:
    return f"{service_name}-batch"


def pod_template(
    spec: InferenceServiceSpec,
    labels: dict[str, str],
    image: str,
    service_name: str,
    safety_config: str | None = None,
    group: GroupPlacement | None = None,
    role: Role | None = None,
    priority_class_prefix: str = DEFAULT_PRIORITY_CLASS_PREFIX,
    download_image: str | None = None,
    kernel_cache_host_path: str | None = None,
    traces: TraceExport | None = None,
) -> dict[str, Any]:
    """`group`: where the pod stands in a replica group, for a model that spans nodes; `role`: the side its
    replica takes in a disaggregated service; `priority_class_prefix`: the chart release's, of its tiers'
    PriorityClasses; `download_image`: the kvfleet image whose `kvfleet download-model` fetches an hf://
    model, when `image` is another runtime's (None: `image`); `kernel_cache_host_path`: the node folder its
    pods share their kernel builds in; `traces`: where the platform collects the requests' spans."""
    engine = spec.engine
    volumes, mounts = _pod_volumes(spec, service_name, kernel_cache_host_path)
    env = _runtime_env(spec, None if kernel_cache_host_path is None else _kernel_cache_folder(image))
    if traces is not None:
        env = _trace_env(traces, service_name) + env
    pod_spec: dict[str, Any] = {
        "priorityClassName": priority_class_name(priority_class_prefix, spec.sla.tier),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_USER,
            "runAsGroup": RUNTIME_USER,
            "fsGroup": RUNTIME_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_runtime_container(spec, image, mounts, env, safety_config, group, role, traces)],
        "volumes": volumes,
    }
    init = _download_container(spec.model, download_image or image, engine.image_pull_policy)
    if init is not None:
        pod_spec["initContainers"] = [init]
    if engine.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in engine.image_pull_secrets]
    pod_spec.update(_placement(spec.resources))
    return {"metadata": {"labels": labels}, "spec": pod_spec}


def _pod_volumes(
    spec: InferenceServiceSpec, service_name: str, kernel_cache_host_path: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the runtime container's mounts of them."""
    volumes, mounts = _model_volumes(spec.model)
    volumes = [
        {"name": "scratch", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *volumes,
    ]
    mounts = [{"name": "scratch", "mountPath": SCRATCH}, {"name": "dshm", "mountPath": "/dev/shm"}, *mounts]
    if spec.batch is not None:
        volumes.append(_batch_volume(spec, service_name))
        mounts.append({"name": "batch", "mountPath": BATCH_STORE})
    if spec.lora_enabled:
        volumes.append({"name": "adapters", "emptyDir": {}})
        mounts.append({"name": "adapters", "mountPath": ADAPTER_DOWNLOADS})
    for index, claim in enumerate(_adapter_claims(spec)):
        volume = f"adapter-claim-{index}"
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": volume, "mountPath": f"{ADAPTER_CLAIMS}/{claim}", "readOnly": True})
    if kernel_cache_host_path is not None:
        host_path = {"path": kernel_cache_host_path, "type": "DirectoryOrCreate"}
        volumes.append({"name": "kernel-cache", "hostPath": host_path})
        mounts.append({"name": "kernel-cache", "mountPath": KERNEL_CACHE})
    return volumes, mounts


def _runtime_container(
    spec: InferenceServiceSpec,
    image: str,
    mounts: list[dict[str, Any]],
    env: list[dict[str, Any]],
    safety_config: str | None,
    group: GroupPlacement | None,
    role: Role | None,
    traces: TraceExport | None,
) -> dict[str, Any]:
    engine = spec.engine
    ports = [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}]
    args = runtime_args(spec, safety_config, role, traces)
    readiness = _readiness_probe(READINESS_PATHS[engine.runtime])
    if group is not None:
        readiness = _join_group(group, args, env, ports)
    if role is not None:
        env.insert(0, _pod_ip())
        ports.append({"name": KV_TRANSFER_PORT_NAME, "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"})
    if publishes_kv_events(spec):
        ports.append({"name": KV_EVENTS_PORT_NAME, "containerPort": DEFAULT_EVENTS_PORT, "protocol": "TCP"})
        ports.append({"name": KV_REPLAY_PORT_NAME, "containerPort": DEFAULT_REPLAY_PORT, "protocol": "TCP"})
    return {
        "name": "runtime",
        "image": image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": RUNTIME_COMMANDS[engine.runtime],
        "args": args,
        "ports": ports,
        "env": env,
        "resources": _container_resources(spec),
        "startupProbe": _http_probe(
            "/health",
            failures=math.ceil(engine.startup_timeout_seconds / READINESS_PERIOD_SECONDS),
            period=READINESS_PERIOD_SECONDS,
        ),
        "readinessProbe": readiness,
        "livenessProbe": _http_probe("/health", failures=6),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_DELAY_SECONDS}}},
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }


def _join_group(
    group: GroupPlacement, args: list[str], env: list[dict[str, Any]], ports: list[dict[str, Any]]
) -> dict[str, Any]:
    """Adds a group rank's flags, variables and rendezvous port to the container's; returns its readiness
    probe: the role's path, or for a template that serves every rank a script that picks it by rank."""
    args += group_args(group)
    rank = {"fieldRef": {"fieldPath": f"metadata.labels['{group.rank_label}']"}}
    env.insert(0, {"name": NODE_RANK_ENV, "valueFrom": rank})
    ports.append({"name": RENDEZVOUS_PORT_NAME, "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    if group.readiness_path is not None:
        return _readiness_probe(group.readiness_path)
    env.insert(1, _pod_ip())
    return _probe({"exec": {"command": ["python", "-c", RANK_READINESS_SCRIPT]}}, failures=2)


def _pod_ip() -> dict[str, Any]:
    return {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _trace_env(traces: TraceExport, service_name: str) -> list[dict[str, Any]]:
    """OpenTelemetry's settings of the runtime's exporter: the protocol, and the spans' resource (the
    InferenceService, its namespace and the pod), ahead of the service's own env."""
    attributes = f"k8s.namespace.name=$({POD_NAMESPACE_ENV}),k8s.pod.name=$({POD_NAME_ENV})"
    return [
        {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": traces.protocol},
        {"name": "OTEL_SERVICE_NAME", "value": service_name},
        {"name": POD_NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": attributes},
    ]


def _placement(resources: ResourcesSpec) -> dict[str, Any]:
    """Where the pods may run: the spec's node selector, tolerations and affinity."""
    placement: dict[str, Any] = {}
    if resources.node_selector:
        placement["nodeSelector"] = dict(resources.node_selector)
    tolerations = [dict(toleration) for toleration in resources.tolerations]
    if resources.gpus > 0:
        # GPU node pools are commonly tainted with the device's resource name.
        tolerations.append({"key": resources.gpu_resource_name, "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        placement["tolerations"] = tolerations
    if resources.affinity:
        placement["affinity"] = dict(resources.affinity)
    return placement


def _flags(pairs: list[tuple[str, object]]) -> list[str]:
    args: list[str] = []
    for flag, value in pairs:
        if value is not None:
            args += [flag, str(value)]
    return args


def _runtime_env(spec: InferenceServiceSpec, kernel_cache: str | None) -> list[dict[str, Any]]:
    # The root filesystem is read-only: caches (kernels, tokenizers) and temporary files go to the
    # scratch volume, kernel builds to the node's cache where it has one: the C++ operations and, on GPUs,
    # Triton's compiled kernels (keyed by Triton itself on the source, the GPU's architecture and its own
    # version). The runtime reaches for the hub only to fetch hf:// adapters, with the model's token.
    env: list[dict[str, Any]] = _scratch_env()
    if kernel_cache is not None:
        env.append({"name": "TORCH_EXTENSIONS_DIR", "value": kernel_cache})
        env.append({"name": "TRITON_CACHE_DIR", "value": f"{kernel_cache}/triton"})
    if not spec.lora_enabled:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    elif spec.model.credentials_secret is not None:
        env.append(_hf_token(spec.model.credentials_secret))
    env += [{"name": name, "value": value} for name, value in spec.engine.env]
    if spec.engine.api_key_secret is not None:
        # Last, so that the Secret's key wins over any entry of the same name before it (the schema and
        # parse_spec refuse such entries; this holds however the spec was made).
        secret_ref = {"name": spec.engine.api_key_secret, "key": API_KEY_ENV}
        variable = API_KEY_VARIABLES[spec.engine.runtime]
        env.append({"name": variable, "valueFrom": {"secretKeyRef": secret_ref}})
    return env


def _kernel_cache_folder(image: str) -> str:
    """The image's folder in the node's kernel cache, named after the image reference."""
    return f"{KERNEL_CACHE}/{re.sub(r'[^A-Za-z0-9._-]+', '_', image)}"


def _scratch_env() -> list[dict[str, str]]:
    return [
        {"name": "HOME", "value": SCRATCH},
        {"name": "XDG_CACHE_HOME", "value": f"{SCRATCH}/.cache"},
        {"name": "TMPDIR", "value": SCRATCH},
    ]


def _container_resources(spec: InferenceServiceSpec) -> dict[str, dict[str, str]]:
    resources = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if resources.cpu is not None:
        requests["cpu"] = resources.cpu
    if resources.memory is not None:
        # Memory is not compressible: a limit equal to the request keeps the pod out of node OOM kills.
        requests["memory"] = limits["memory"] = resources.memory
    if resources.gpus > 0:
        requests[resources.gpu_resource_name] = limits[resources.gpu_resource_name] = str(resources.gpus)
    result: dict[str, dict[str, str]] = {}
    if requests:
        result["requests"] = requests
    if limits:
        result["limits"] = limits
    return result


def _http_probe(path: str, failures: int, period: int = PROBE_PERIOD_SECONDS) -> dict[str, Any]:
    return _probe({"httpGet": {"path": path, "port": HTTP_PORT_NAME}}, failures, period)


def _readiness_probe(path: str) -> dict[str, Any]:
    return _http_probe(path, _READINESS_FAILURE_SECONDS // READINESS_PERIOD_SECONDS, READINESS_PERIOD_SECONDS)


def _probe(handler: dict[str, Any], failures: int, period: int = PROBE_PERIOD_SECONDS) -> dict[str, Any]:
    return {
        **handler,
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _batch_volume(spec: InferenceServiceSpec, service_name: str) -> dict[str, Any]:
    batch = spec.batch
    assert batch is not None
    if batch.storage == "EmptyDir":
        return {"name": "batch", "emptyDir": {"sizeLimit": batch.size} if batch.size else {}}
    return {"name": "batch", "persistentVolumeClaim": {"claimName": batch_claim_name(service_name)}}


def _model_volumes(model: ModelSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    source = model.source
    if source.scheme == "hf":
        empty_dir: dict[str, Any] = {}
        if model.cache_size_limit is not None:
            empty_dir["sizeLimit"] = model.cache_size_limit
        mount = {"name": "model", "mountPath": MODEL_ROOT, "readOnly": True}
        return [{"name": "model", "emptyDir": empty_dir}], [mount]
    if source.scheme == "pvc":
        claim = {"claimName": source.location, "readOnly": True}
        mount = {"name": "model", "mountPath": MODEL_ROOT, "readOnly": True}
        return [{"name": "model", "persistentVolumeClaim": claim}], [mount]
    if model.host_path:
        host_path = {"path": source.location, "type": "Directory"}
        mount = {"name": "model", "mountPath": source.location, "readOnly": True}
        return [{"name": "model", "hostPath": host_path}], [mount]
    return [], []


def _hf_token(secret: str) -> dict[str, Any]:
    return {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "HF_TOKEN"}}}


def _download_container(model: ModelSpec, image: str, pull_policy: str) -> dict[str, Any] | None:
    source = model.source
    if source.scheme != "hf":
        return None
    args = [source.location]
    if source.detail is not None:
        args += ["--revision", source.detail]
    args += ["--dest", model_path(model)]
    env: list[dict[str, Any]] = [*_scratch_env(), {"name": "HF_HOME", "value": f"{MODEL_ROOT}/.cache"}]
    if model.credentials_secret is not None:
        env.append(_hf_token(model.credentials_secret))
    return {
        "name": "model-download",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["kvfleet", "download-model"],
        "args": args,
        "env": env,
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_ROOT},
            {"name": "scratch", "mountPath": SCRATCH},
        ],
    }
