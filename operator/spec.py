"""The InferenceService spec as typed, defaulted, validated Python values.

The API server defaults and validates through the CRD's schema; this module applies the same defaults
(a test keeps them equal) and re-checks what rendering relies on, because objects written before a CRD
upgrade, or by a server without CEL, reach the operator too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from kvfleet.contract.engine import DTYPES, SCHEDULING_POLICIES, SchedulingPolicy
from kvfleet.contract.routing import POLICY_NAMES, PolicyName
from kvfleet.contract.tiers import DEFAULT_TIER, TIER_NAMES, TierName
from kvfleet.operator.api import API_KEY_ENV, API_KEY_FLAG
from kvfleet.operator.model_uri import ModelSource, ModelURIError, parse_model_uri
from kvfleet.operator.tiers import TIERS
from kvfleet.runtime.lora.request import ADAPTER_NAME, ADAPTER_NAME_RULE

PullPolicy = Literal["Always", "IfNotPresent", "Never"]
PULL_POLICIES: tuple[PullPolicy, ...] = ("Always", "IfNotPresent", "Never")
BLOCK_SIZES = (8, 16, 32, 64, 128)
GroupBackend = Literal["statefulset", "leaderworkerset"]
GROUP_BACKENDS: tuple[GroupBackend, ...] = ("statefulset", "leaderworkerset")
# The children take the resource's name: a Service's must be a DNS-1035 label, and a label value is at most
# 63 characters.
_MAX_NAME_LENGTH = 63
# A group's StatefulSet is `<name>-<group>` and labels its pods with `<statefulset>-<10-character revision>`,
# a label value of at most 63 characters: the StatefulSet's name is at most 52.
_MAX_GROUP_OBJECT_NAME = 52
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# Whoever may edit a service but not read its Secret must not be able to choose the key clients need.
_API_KEY_SOURCE = "the key comes from the Secret named in spec.engine.apiKeySecret"


class SpecError(ValueError):
    """A spec the operator cannot render; `reason` becomes the condition and event reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    source: ModelSource
    served_name: str
    tokenizer: str | None = None
    chat_template: str | None = None
    host_path: bool = False
    credentials_secret: str | None = None
    cache_size_limit: str | None = None


@dataclass(frozen=True)
class EngineSpec:
    image: str | None = None
    image_pull_policy: PullPolicy = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    scheduling_policy: SchedulingPolicy | None = None
    dtype: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_waiting_requests: int | None = None
    drain_timeout_seconds: int = 30
    startup_timeout_seconds: int = 600
    api_key_secret: str | None = None
    # LoRA stays on without adapters, so that adding the first one does not restart the replicas.
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    # Off: the adapters are the replicas' flags, and no client can load one. On: the operator loads them into
    # running replicas (no restart), through the API that any holder of the service's key may call too.
    allow_runtime_lora_updates: bool = False
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def world_size(self) -> int:
        """The ranks the model is split over: tensor parallel times pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class ResourcesSpec:
    # GPUs per pod: all the ranks' on one pod, or one node's share of a group.
    gpus: int = 1
    # The most GPUs one node (one pod) can take; unset: a replica's ranks always fit one pod.
    gpus_per_node: int | None = None
    # Pods per replica: 1, or the nodes of a group that share the model.
    nodes: int = 1
    gpu_resource_name: str = "nvidia.com/gpu"
    cpu: str | None = None
    memory: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ScalingSpec:
    replicas: int | None = None
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_depth: int = 32
    stable_window_seconds: int = 60
    panic_window_seconds: int = 6
    panic_threshold_percent: int = 200
    scale_down_delay_seconds: int = 120
    max_scale_up_step: int = 4
    max_scale_down_step: int = 1
    metrics_interval_seconds: int = 2
    # With min_replicas 0: idle this long (nothing running, waiting or held by the gateway), it goes to 0.
    scale_to_zero_after_seconds: int = 300
    # How long the gateway holds a request for a service with no ready replica; None: the gateway's default.
    activation_timeout_seconds: int | None = None
    # What runs a replica that spans nodes: a StatefulSet per group, or one LeaderWorkerSet.
    group_backend: GroupBackend = "statefulset"

    @property
    def autoscaling(self) -> bool:
        return self.replicas is None

    def clamp(self, replicas: int) -> int:
        if self.replicas is not None:
            return self.replicas
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class SlaSpec:
    tier: TierName = DEFAULT_TIER
    ttft_target_milliseconds: int | None = None


BatchStorage = Literal["PersistentVolumeClaim", "EmptyDir"]
BATCH_STORAGES: tuple[BatchStorage, ...] = ("PersistentVolumeClaim", "EmptyDir")
DEFAULT_BATCH_CLAIM_SIZE = "10Gi"


@dataclass(frozen=True)
class BatchSpec:
    """The OpenAI Batch API's store: a claim of its own by default, or a pod-lifetime emptyDir."""

    storage: BatchStorage = "PersistentVolumeClaim"
    # The claim's request, or the emptyDir's limit (none when unset).
    size: str | None = None
    storage_class_name: str | None = None
    max_file_bytes: int | None = None

    @property
    def claim_size(self) -> str:
        return self.size or DEFAULT_BATCH_CLAIM_SIZE


@dataclass(frozen=True)
class RoutingSpec:
    """How the fleet gateway spreads the service's requests; unset fields take the gateway's defaults."""

    policy: PolicyName | None = None
    prefix_characters: int | None = None
    load_bound_percent: int | None = None


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter of the base model, served under `name`."""

    name: str
    uri: str
    source: ModelSource


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    engine: EngineSpec
    resources: ResourcesSpec
    scaling: ScalingSpec
    sla: SlaSpec
    batch: BatchSpec | None = None
    routing: RoutingSpec = RoutingSpec()
    # spec.safety as given (kvfleet.operator.safety merges it with the platform's defaults).
    safety: Mapping[str, Any] | None = None
    adapters: tuple[AdapterSpec, ...] = ()

    @property
    def lora_enabled(self) -> bool:
        return self.engine.enable_lora or bool(self.adapters)

    @property
    def grouped(self) -> bool:
        """Whether each replica is a group of pods on several nodes."""
        return self.resources.nodes > 1

    @property
    def scheduling_policy(self) -> SchedulingPolicy:
        """How the replicas order their requests: as the spec says, else as its tier does."""
        return self.engine.scheduling_policy or TIERS[self.sla.tier].scheduling_policy


def parse_spec(spec: Mapping[str, Any], *, name: str) -> InferenceServiceSpec:
    """Typed spec of the resource `name`; raises SpecError with a user-facing message."""
    if len(name) > _MAX_NAME_LENGTH or not _DNS_1035_LABEL.fullmatch(name):
        raise SpecError(
            "InvalidSpec",
            f"metadata.name must be a DNS-1035 label of at most {_MAX_NAME_LENGTH} characters (lowercase "
            "letters, digits and '-', starting with a letter and ending with a letter or digit): the Service "
            "and the labels of the pods take the name",
        )
    from kvfleet.operator.safety import parse_safety  # it raises this module's SpecError

    root = _Section(spec, "spec")
    engine = _parse_engine(root.section("engine"))
    scaling = _parse_scaling(root.section("scaling"))
    model = _parse_model(root.section("model", required=True), name)
    resources = _parse_resources(root.section("resources"), engine)
    if resources.nodes > 1:
        _check_group_names(name, scaling)
    return InferenceServiceSpec(
        model=model,
        engine=engine,
        resources=resources,
        scaling=scaling,
        sla=_parse_sla(root.section("sla")),
        batch=_parse_batch(root, scaling, resources),
        routing=_parse_routing(root.section("routing")),
        adapters=_parse_adapters(root, model.served_name),
        safety=parse_safety(root.raw.get("safety"), name=name),
    )


def rendezvous_name(service: str) -> str:
    """The headless Service through which a group's ranks find rank 0, and the LeaderWorkerSet's name."""
    return f"{service}-ranks"


def group_name(service: str, backend: GroupBackend, index: int) -> str:
    """A replica group's name: its StatefulSet, or the LeaderWorkerSet's worker StatefulSet of the group."""
    prefix = service if backend == "statefulset" else rendezvous_name(service)
    return f"{prefix}-{index}"


def _check_group_names(name: str, scaling: ScalingSpec) -> None:
    most_groups = scaling.replicas if scaling.replicas is not None else scaling.max_replicas
    longest = group_name(name, scaling.group_backend, max(most_groups - 1, 0))
    if len(longest) > _MAX_GROUP_OBJECT_NAME:
        raise SpecError(
            "InvalidSpec",
            f"metadata.name ({len(name)} characters) is too long for a model that spans nodes: the group "
            f"{longest} must be at most {_MAX_GROUP_OBJECT_NAME} characters, since its StatefulSet labels "
            "its pods with its name and a revision",
        )


def _parse_model(section: _Section, name: str) -> ModelSpec:
    uri = section.required_string("uri")
    try:
        source = parse_model_uri(uri)
    except ModelURIError as error:
        raise SpecError("InvalidModelURI", f"spec.model.uri {error}") from None
    host_path = section.boolean("hostPath", False)
    if host_path and source.scheme != "file":
        raise SpecError("InvalidSpec", "spec.model.hostPath applies only to file:/// URIs")
    cache_size_limit = section.quantity("cacheSizeLimit")
    return ModelSpec(
        uri=uri,
        source=source,
        served_name=section.string("servedName") or name,
        tokenizer=section.string("tokenizer"),
        chat_template=section.string("chatTemplate"),
        host_path=host_path,
        credentials_secret=section.string("credentialsSecret"),
        cache_size_limit=cache_size_limit,
    )


def _parse_engine(section: _Section) -> EngineSpec:
    defaults = EngineSpec()
    env_items = []
    for index, item in enumerate(section.list("env")):
        entry = _Section(item, f"{section.path}.env[{index}]")
        env_name = entry.required_string("name")
        if env_name == API_KEY_ENV:
            raise SpecError("InvalidSpec", f"{entry.path} must not set {API_KEY_ENV}: {_API_KEY_SOURCE}")
        env_items.append((env_name, entry.string("value") or ""))
    extra_args = section.strings("extraArgs")
    for index, arg in enumerate(extra_args):
        if arg == API_KEY_FLAG or arg.startswith(f"{API_KEY_FLAG}="):
            raise SpecError(
                "InvalidSpec",
                f"{section.path}.extraArgs[{index}] must not pass {API_KEY_FLAG}: {_API_KEY_SOURCE}",
            )
    return EngineSpec(
        image=section.string("image"),
        image_pull_policy=cast(
            PullPolicy, section.choice("imagePullPolicy", PULL_POLICIES, defaults.image_pull_policy)
        ),
        image_pull_secrets=tuple(section.strings("imagePullSecrets")),
        max_num_seqs=section.integer("maxNumSeqs", minimum=1),
        max_model_len=section.integer("maxModelLen", minimum=1),
        block_size=section.choice("blockSize", BLOCK_SIZES),
        enable_prefix_caching=section.optional_boolean("enablePrefixCaching"),
        scheduling_policy=section.choice("schedulingPolicy", SCHEDULING_POLICIES),
        dtype=section.choice("dtype", DTYPES),
        tensor_parallel_size=section.required_integer("tensorParallelSize", defaults.tensor_parallel_size, 1),
        pipeline_parallel_size=section.required_integer(
            "pipelineParallelSize", defaults.pipeline_parallel_size, 1
        ),
        max_waiting_requests=section.integer("maxWaitingRequests", minimum=1),
        drain_timeout_seconds=section.required_integer(
            "drainTimeoutSeconds", defaults.drain_timeout_seconds, 0
        ),
        startup_timeout_seconds=section.required_integer(
            "startupTimeoutSeconds", defaults.startup_timeout_seconds, 30
        ),
        api_key_secret=section.string("apiKeySecret"),
        enable_lora=section.boolean("enableLora", defaults.enable_lora),
        max_loras=section.integer("maxLoras", minimum=1),
        max_lora_rank=section.integer("maxLoraRank", minimum=1),
        allow_runtime_lora_updates=section.boolean(
            "allowRuntimeLoraUpdates", defaults.allow_runtime_lora_updates
        ),
        extra_args=tuple(extra_args),
        env=tuple(env_items),
    )


def _parse_resources(section: _Section, engine: EngineSpec) -> ResourcesSpec:
    world = engine.world_size
    ranks = (
        f"spec.engine.tensorParallelSize × pipelineParallelSize "
        f"({engine.tensor_parallel_size} × {engine.pipeline_parallel_size} = {world})"
    )
    gpus_per_node = section.integer("gpusPerNode", minimum=1)
    nodes = 1
    if gpus_per_node is None or gpus_per_node >= world:
        gpus = section.required_integer("gpus", world, 0)
        if gpus < world and not (gpus == 0 and world == 1):
            raise SpecError(
                "InvalidSpec",
                f"spec.resources.gpus ({gpus}) must be at least {ranks}; set spec.resources.gpusPerNode "
                "to split the model over several nodes",
            )
        if gpus_per_node is not None and gpus > gpus_per_node:
            raise SpecError(
                "InvalidSpec",
                f"spec.resources.gpus ({gpus}) must not exceed spec.resources.gpusPerNode ({gpus_per_node})",
            )
    else:
        if world % gpus_per_node:
            raise SpecError(
                "InvalidSpec",
                f"{ranks} must be a multiple of spec.resources.gpusPerNode ({gpus_per_node}): every node "
                "of a group takes the same share of the ranks",
            )
        nodes = world // gpus_per_node
        gpus = section.required_integer("gpus", gpus_per_node, 0)
        if gpus != gpus_per_node:
            raise SpecError(
                "InvalidSpec",
                f"spec.resources.gpus ({gpus}) must equal spec.resources.gpusPerNode ({gpus_per_node}) when "
                f"the model spans nodes ({world} ranks over {nodes} nodes of {gpus_per_node} GPUs)",
            )
    tolerations = tuple(
        _Section(item, f"{section.path}.tolerations").raw for item in section.list("tolerations")
    )
    affinity = section.mapping("affinity")
    return ResourcesSpec(
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_resource_name=section.string("gpuResourceName") or ResourcesSpec.gpu_resource_name,
        cpu=section.quantity("cpu"),
        memory=section.quantity("memory"),
        node_selector={key: str(value) for key, value in (section.mapping("nodeSelector") or {}).items()},
        tolerations=tolerations,
        affinity=affinity,
    )


def _parse_scaling(section: _Section) -> ScalingSpec:
    defaults = ScalingSpec()
    integer = section.required_integer
    scaling = ScalingSpec(
        replicas=section.integer("replicas", minimum=0),
        min_replicas=integer("minReplicas", defaults.min_replicas, 0),
        max_replicas=integer("maxReplicas", defaults.max_replicas, 1),
        target_queue_depth=integer("targetQueueDepth", defaults.target_queue_depth, 1),
        stable_window_seconds=integer("stableWindowSeconds", defaults.stable_window_seconds, 1),
        panic_window_seconds=integer("panicWindowSeconds", defaults.panic_window_seconds, 1),
        panic_threshold_percent=integer("panicThresholdPercent", defaults.panic_threshold_percent, 101),
        scale_down_delay_seconds=integer("scaleDownDelaySeconds", defaults.scale_down_delay_seconds, 0),
        max_scale_up_step=integer("maxScaleUpStep", defaults.max_scale_up_step, 1),
        max_scale_down_step=integer("maxScaleDownStep", defaults.max_scale_down_step, 1),
        metrics_interval_seconds=integer("metricsIntervalSeconds", defaults.metrics_interval_seconds, 1),
        scale_to_zero_after_seconds=integer(
            "scaleToZeroAfterSeconds", defaults.scale_to_zero_after_seconds, 0
        ),
        activation_timeout_seconds=section.integer("activationTimeoutSeconds", minimum=1),
        group_backend=cast(
            GroupBackend, section.choice("groupBackend", GROUP_BACKENDS, defaults.group_backend)
        ),
    )
    if scaling.min_replicas > scaling.max_replicas:
        raise SpecError(
            "InvalidSpec",
            f"spec.scaling.minReplicas ({scaling.min_replicas}) must not exceed "
            f"spec.scaling.maxReplicas ({scaling.max_replicas})",
        )
    if scaling.panic_window_seconds > scaling.stable_window_seconds:
        raise SpecError("InvalidSpec", "spec.scaling.panicWindowSeconds must not exceed stableWindowSeconds")
    return scaling


def _parse_batch(root: _Section, scaling: ScalingSpec, resources: ResourcesSpec) -> BatchSpec | None:
    if root.raw.get("batch") is None:
        return None
    section = root.section("batch")
    if resources.nodes > 1:
        raise SpecError(
            "InvalidSpec",
            f"spec.batch needs a replica on one node; this model spans {resources.nodes} nodes "
            "(spec.resources.gpusPerNode)",
        )
    # One replica runs the batches of its store: replicas sharing one would each run every batch.
    most = scaling.replicas if scaling.replicas is not None else scaling.max_replicas
    if most > 1:
        raise SpecError(
            "InvalidSpec",
            "spec.batch needs a single replica (spec.scaling.replicas or maxReplicas at most 1): the Batch "
            "API's store belongs to one replica",
        )
    return BatchSpec(
        storage=cast(BatchStorage, section.choice("storage", BATCH_STORAGES, BatchSpec.storage)),
        size=section.quantity("size"),
        storage_class_name=section.string("storageClassName"),
        max_file_bytes=section.integer("maxFileBytes", minimum=1),
    )


def _parse_sla(section: _Section) -> SlaSpec:
    tier = section.choice("tier", TIER_NAMES, DEFAULT_TIER)
    return SlaSpec(
        tier=cast(TierName, tier),
        ttft_target_milliseconds=section.integer("ttftTargetMilliseconds", minimum=1),
    )


def _parse_adapters(root: _Section, served_name: str) -> tuple[AdapterSpec, ...]:
    adapters: list[AdapterSpec] = []
    taken = {served_name}
    for index, item in enumerate(root.list("adapters")):
        entry = _Section(item, f"spec.adapters[{index}]")
        name, uri = entry.required_string("name"), entry.required_string("uri")
        if not ADAPTER_NAME.match(name):
            raise SpecError(
                "InvalidSpec", f"{entry.path}.name {name!r} is not a valid name ({ADAPTER_NAME_RULE})"
            )
        if name in taken:
            raise SpecError(
                "InvalidSpec", f"{entry.path}.name {name!r} is already the model's or another adapter's name"
            )
        taken.add(name)
        try:
            source = parse_model_uri(uri)
        except ModelURIError as error:
            raise SpecError("InvalidModelURI", f"{entry.path}.uri {error}") from None
        adapters.append(AdapterSpec(name, uri, source))
    return tuple(adapters)


def _parse_routing(section: _Section) -> RoutingSpec:
    return RoutingSpec(
        policy=cast(PolicyName | None, section.choice("policy", POLICY_NAMES)),
        prefix_characters=section.integer("prefixCharacters", minimum=1),
        load_bound_percent=section.integer("loadBoundPercent", minimum=100),
    )


class _Section:
    """Typed reads of one mapping of the spec, with errors that name the field's path."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, Mapping):
            raise SpecError("InvalidSpec", f"{path} must be an object")
        self.raw: Mapping[str, Any] = raw
        self.path = path

    def section(self, key: str, *, required: bool = False) -> _Section:
        value = self.raw.get(key)
        if value is None:
            if required:
                raise SpecError("InvalidSpec", f"{self.path}.{key} is required")
            value = {}
        return _Section(value, f"{self.path}.{key}")

    def string(self, key: str) -> str | None:
        value = self.raw.get(key)
        if value is not None and not isinstance(value, str):
            raise SpecError("InvalidSpec", f"{self.path}.{key} must be a string")
        return value

    def required_string(self, key: str) -> str:
        value = self.string(key)
        if not value:
            raise SpecError("InvalidSpec", f"{self.path}.{key} is required")
        return value

    def integer(self, key: str, default: int | None = None, *, minimum: int) -> int | None:
        value = self.raw.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError("InvalidSpec", f"{self.path}.{key} must be an integer")
        if value < minimum:
            raise SpecError("InvalidSpec", f"{self.path}.{key} must be at least {minimum}")
        return value

    def required_integer(self, key: str, default: int, minimum: int) -> int:
        value = self.integer(key, default, minimum=minimum)
        assert value is not None, "a default is given"
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.optional_boolean(key)
        return default if value is None else value

    def optional_boolean(self, key: str) -> bool | None:
        value = self.raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise SpecError("InvalidSpec", f"{self.path}.{key} must be true or false")
        return value

    def choice(self, key: str, allowed: tuple[Any, ...], default: Any = None) -> Any:
        value = self.raw.get(key, default)
        if value is not None and (isinstance(value, bool) or value not in allowed):
            raise SpecError(
                "InvalidSpec", f"{self.path}.{key} must be one of {', '.join(str(a) for a in allowed)}"
            )
        return value

    def quantity(self, key: str) -> str | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise SpecError("InvalidSpec", f"{self.path}.{key} must be a quantity such as 4 or 16Gi")
        return str(value)

    def list(self, key: str) -> list[Any]:
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise SpecError("InvalidSpec", f"{self.path}.{key} must be a list")
        return value

    def strings(self, key: str) -> list[str]:
        values = self.list(key)
        if not all(isinstance(value, str) for value in values):
            raise SpecError("InvalidSpec", f"{self.path}.{key} must be a list of strings")
        return values

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.raw.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise SpecError("InvalidSpec", f"{self.path}.{key} must be an object")
        return value
