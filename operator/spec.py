"""The InferenceService spec as typed, defaulted, validated Python values.

The API server defaults and validates through the CRD's schema; this module applies the same defaults
(a test keeps them equal) and re-checks what rendering relies on, because objects written before a CRD
upgrade, or by a server without CEL, reach the operator too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from kvfleet.contract.engine import (
    DTYPES,
    LOADED_QUANTIZATION_METHODS,
    RUNTIMES,
    SCHEDULING_POLICIES,
    Runtime,
    SchedulingPolicy,
)
from kvfleet.contract.kv_transfer import Role
from kvfleet.contract.routing import POLICY_NAMES, PolicyName
from kvfleet.contract.tiers import DEFAULT_TIER, TIER_NAMES, TierName
from kvfleet.operator.api import API_KEY_ENV, API_KEY_FLAG, KV_TRANSFER_CONFIG_FLAG
from kvfleet.operator.model_uri import ModelSource, ModelURIError, parse_model_uri
from kvfleet.operator.schema import QUANTITY, Rule, array, derived, integer, obj, prop, string
from kvfleet.operator.tiers import TIERS
from kvfleet.runtime.lora.request import ADAPTER_NAME, ADAPTER_NAME_RULE

PullPolicy = Literal["Always", "IfNotPresent", "Never"]
PULL_POLICIES: tuple[PullPolicy, ...] = ("Always", "IfNotPresent", "Never")
BLOCK_SIZES = (8, 16, 32, 64, 128)
GroupBackend = Literal["statefulset", "leaderworkerset"]
ScalingPolicy = Literal["queue-depth", "slo"]
SCALING_POLICIES: tuple[ScalingPolicy, ...] = ("queue-depth", "slo")
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
# The condition and event reason of a spec that asks spec.engine.runtime's server for what it does not do.
UNSUPPORTED_BY_RUNTIME_REASON = "UnsupportedByRuntime"
_VLLM_LORA = (
    "the operator reports and loads adapters by the source digest of kvfleet's model cards, which vLLM's "
    "/v1/models does not give"
)


class SpecError(ValueError):
    """A spec the operator cannot render; `reason` becomes the condition and event reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# The ranks of one replica, as CEL reads them from a defaulted spec (engine and both sizes default).
_RANKS = "self.engine.tensorParallelSize * self.engine.pipelineParallelSize"
# What the server checks of metadata.name, for the same reasons as parse_spec.
NAME_RULES = (
    Rule(
        f"self.metadata.name.size() <= {_MAX_NAME_LENGTH}",
        f"metadata.name must be at most {_MAX_NAME_LENGTH} characters: the Service and the labels of the "
        "pods take the name",
    ),
    Rule(
        f"self.metadata.name.matches('^{_DNS_1035_LABEL.pattern}$')",
        "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter "
        "and ending with a letter or digit): the Service takes the name",
    ),
)


@dataclass(frozen=True)
class RuntimeRefusal:
    """A field that asks for what only kvfleet's runtime does, refused with spec.engine.runtime vllm: by the
    API server (`asks_cel`, whether the spec sets it, in CEL) and by parse_spec (`asks`, the same of the
    parsed spec)."""

    field_path: str
    asks_cel: str
    asks: Callable[[InferenceServiceSpec], bool]
    why: str

    @property
    def message(self) -> str:
        return f"{self.field_path} is not served with engine.runtime vllm: {self.why}"

    def rule(self) -> Rule:
        return Rule(
            f"!has(self.engine.runtime) || self.engine.runtime != 'vllm' || !({self.asks_cel})", self.message
        )


# The options of kvfleet's runtime alone, and the features the operator builds on them.
VLLM_REFUSALS = (
    RuntimeRefusal(
        "engine.maxWaitingRequests",
        "has(self.engine.maxWaitingRequests)",
        lambda spec: spec.engine.max_waiting_requests is not None,
        "vLLM's server has no bound on its waiting queue (kvfleet's --max-waiting-requests)",
    ),
    RuntimeRefusal(
        "adapters",
        "has(self.adapters) && size(self.adapters) > 0",
        lambda spec: bool(spec.adapters),
        _VLLM_LORA,
    ),
    RuntimeRefusal(
        "engine.enableLora",
        "has(self.engine.enableLora) && self.engine.enableLora",
        lambda spec: spec.engine.enable_lora,
        _VLLM_LORA,
    ),
    RuntimeRefusal(
        "batch",
        "has(self.batch)",
        lambda spec: spec.batch is not None,
        "vLLM's server keeps no Batch API store (kvfleet's --batch-store; `vllm run-batch` is offline)",
    ),
    RuntimeRefusal(
        "safety",
        "has(self.safety)",
        lambda spec: spec.safety is not None,
        "the guardrails are kvfleet's runtime's (--safety-config); vLLM's server has none",
    ),
    RuntimeRefusal(
        "disaggregation",
        "has(self.disaggregation)",
        lambda spec: spec.disaggregation is not None,
        "the roles move KV blocks with kvfleet's TcpConnector, which vLLM does not have",
    ),
    RuntimeRefusal(
        "scaling.sleepingReplicas",
        "has(self.scaling) && has(self.scaling.sleepingReplicas) && self.scaling.sleepingReplicas > 0",
        lambda spec: spec.scaling.sleeping_replicas > 0,
        "vLLM serves /sleep and /wake_up only in its development mode, and a sleeping vLLM replica still "
        "answers /health, so it would stay Ready and be sent requests",
    ),
    RuntimeRefusal(
        "resources.gpusPerNode",
        f"has(self.resources) && has(self.resources.gpusPerNode) && self.resources.gpusPerNode < {_RANKS}",
        lambda spec: spec.grouped,
        "a replica over several nodes joins its pods with kvfleet's flags and readiness (rank 0's /ready); "
        "vLLM's ranks past the first run headless",
    ),
    RuntimeRefusal(
        "routing.policy",
        "has(self.routing) && has(self.routing.policy) && self.routing.policy == 'precise-prefix'",
        lambda spec: spec.routing.policy == "precise-prefix",
        "precise-prefix: vLLM's KV events carry its own block hashes, which the gateway does not index for "
        "a service's pods",
    ),
)


# Across sections, as _parse_resources and _parse_batch check them. The messages are fixed: the API server's
# cost estimate refuses messageExpressions that print the numbers (the operator's own checks name them).
SPEC_RULES = (
    Rule(
        "!has(self.resources.gpus) "
        f"|| (has(self.resources.gpusPerNode) && self.resources.gpusPerNode < {_RANKS}) "
        f"|| self.resources.gpus >= {_RANKS} || (self.resources.gpus == 0 && {_RANKS} == 1)",
        "resources.gpus must be at least engine.tensorParallelSize × pipelineParallelSize (0 only for a CPU "
        "model of one rank); resources.gpusPerNode splits a model over several nodes",
    ),
    Rule(
        f"!has(self.resources.gpusPerNode) || self.resources.gpusPerNode >= {_RANKS} "
        f"|| {_RANKS} % self.resources.gpusPerNode == 0",
        "engine.tensorParallelSize × pipelineParallelSize must be a multiple of resources.gpusPerNode: every "
        "node of a group takes the same share of the ranks",
    ),
    Rule(
        "!has(self.resources.gpusPerNode) || !has(self.resources.gpus) "
        f"|| self.resources.gpusPerNode >= {_RANKS} || self.resources.gpus == self.resources.gpusPerNode",
        "resources.gpus must equal resources.gpusPerNode when the model spans nodes",
    ),
    Rule(
        "!has(self.resources.gpusPerNode) || !has(self.resources.gpus) "
        f"|| self.resources.gpusPerNode < {_RANKS} || self.resources.gpus <= self.resources.gpusPerNode",
        "resources.gpus must not exceed resources.gpusPerNode",
    ),
    Rule(
        f"!has(self.batch) || !has(self.resources.gpusPerNode) || self.resources.gpusPerNode >= {_RANKS}",
        "batch needs a replica on one node (resources.gpusPerNode at least the ranks)",
    ),
    Rule(
        "!has(self.scaling) || !has(self.scaling.policy) || self.scaling.policy != 'slo' "
        "|| (has(self.sla) && (has(self.sla.ttftTargetMilliseconds) || has(self.sla.itlTargetMilliseconds)))",
        "scaling.policy slo sizes the fleet on latency targets: set sla.ttftTargetMilliseconds or "
        "sla.itlTargetMilliseconds",
    ),
    Rule(
        f"!has(self.disaggregation) || {_RANKS} == 1",
        "disaggregation needs one rank per replica (engine.tensorParallelSize × pipelineParallelSize of 1): "
        "the KV connector moves the blocks of one rank",
    ),
    Rule(
        "!has(self.disaggregation) || !has(self.batch)",
        "batch is not served with disaggregation: the Batch API's store belongs to one colocated replica",
    ),
    Rule(
        "!has(self.disaggregation) || !has(self.scaling.replicas)",
        "scaling.replicas does not apply with disaggregation: set disaggregation.prefill.scaling.replicas "
        "and disaggregation.decode.scaling.replicas",
    ),
    Rule(
        "!has(self.disaggregation) || !has(self.engine.extraArgs) || !self.engine.extraArgs.exists(a, "
        f"a == '{KV_TRANSFER_CONFIG_FLAG}' || a.startsWith('{KV_TRANSFER_CONFIG_FLAG}='))",
        f"engine.extraArgs must not pass {KV_TRANSFER_CONFIG_FLAG} with disaggregation: the operator renders "
        "it for each role",
    ),
    # The replica that holds the Batch API's store runs its batches; a second would run them too.
    Rule(
        "!has(self.batch) || (has(self.scaling) && (has(self.scaling.replicas) ? self.scaling.replicas <= 1 "
        ": has(self.scaling.maxReplicas) && self.scaling.maxReplicas <= 1))",
        "batch needs a single replica (scaling.replicas or scaling.maxReplicas at most 1): the Batch API's "
        "store belongs to one replica",
    ),
    *(refusal.rule() for refusal in VLLM_REFUSALS),
)
# The scale subresource (`kubectl scale`, HPA, KEDA) writes scaling.replicas. On a service the autoscaler
# sizes, that write would silently turn the autoscaler off, so the count may be added only in a change that
# also pins the autoscaler's bounds together: a deliberate switch to a fixed count, which no scale write is.
AUTOSCALED_COUNT_RULE = Rule(
    "has(oldSelf.replicas) || !has(self.replicas) "
    "|| (has(self.minReplicas) && has(self.maxReplicas) && self.minReplicas == self.maxReplicas)",
    "scaling.replicas may not be set on a service the autoscaler sizes (kubectl scale, an HPA or KEDA "
    "write it): its replica count is the autoscaler's, between scaling.minReplicas and maxReplicas. To run a "
    "fixed count instead, set scaling.replicas in a change that sets minReplicas and maxReplicas equal",
)
_MODEL_URI_RULE = Rule(
    "self.matches('^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$') "
    "|| self.matches('^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?$') || self.matches('^file:///.+$')",
    "model.uri must be hf://<org>/<name>[@<revision>], pvc://<claim>/<path> or file:///<absolute path>",
)
# Flags beat the variable: an argument would replace the Secret's key.
_API_KEY_FLAG_RULE = Rule(
    f"self != '{API_KEY_FLAG}' && !self.startsWith('{API_KEY_FLAG}=')",
    f"engine.extraArgs must not pass {API_KEY_FLAG}: the key comes from the Secret named in "
    "engine.apiKeySecret",
)
_KV_TRANSFER_FLAG_RULE = Rule(
    f"self != '{KV_TRANSFER_CONFIG_FLAG}' && !self.startsWith('{KV_TRANSFER_CONFIG_FLAG}=')",
    f"extraArgs must not pass {KV_TRANSFER_CONFIG_FLAG}: the operator renders it for each role",
)
# The gateway, the kubelet's probes and the operator's scrapes reach a replica over plain HTTP.
_TLS_FLAGS_RULE = Rule(
    "!self.startsWith('--ssl-') && self != '--enable-ssl-refresh'",
    "extraArgs must not pass --ssl-* or --enable-ssl-refresh: the gateway, the probes and the operator's "
    "metrics scrapes reach the replicas over HTTP (TLS ends at the gateway or the ingress in front of it)",
)
_ENV_SCHEMA = array(
    "",
    obj(
        "",
        {
            "name": string("The variable's name.", minLength=1, maxLength=256),
            "value": string("The variable's value (empty when unset).", maxLength=32768),
        },
        required=["name"],
        rules=[
            Rule(
                f"self.name != '{API_KEY_ENV}'",
                f"engine.env must not set {API_KEY_ENV}: the key comes from the Secret named in "
                "engine.apiKeySecret",
            )
        ],
    ),
    maxItems=64,
)
_TOLERATIONS_SCHEMA = array(
    "",
    obj(
        "",
        {
            "key": string("The taint key the toleration matches; empty matches every key (with Exists)."),
            "operator": string("Exists matches any value, Equal only `value`.", enum=["Exists", "Equal"]),
            "value": string("The taint value the toleration matches (with Equal)."),
            "effect": string(
                "The taint effect the toleration matches; empty matches every effect.",
                enum=["NoSchedule", "PreferNoSchedule", "NoExecute"],
            ),
            "tolerationSeconds": integer(
                "With NoExecute, how long the pod stays bound after the taint appears."
            ),
        },
    ),
    maxItems=32,
)


def _safety_schema() -> Mapping[str, Any]:
    from kvfleet.operator.safety import POLICY_SCHEMA  # it imports this module's SpecError

    return POLICY_SCHEMA


@dataclass(frozen=True)
class ModelSpec:
    uri: str = prop(
        "Where the weights are: hf://<org>/<name>[@<revision>] (downloaded by an init container), "
        "pvc://<claim>/<path> (mounted read-only) or file:///<path> (a path inside the pod; see hostPath).",
        required=True,
        maxLength=512,
        rules=[_MODEL_URI_RULE],
    )
    source: ModelSource = derived()
    served_name: str = prop(
        "Model name clients send in requests (to the fleet gateway as <namespace>/<servedName>); defaults "
        "to the resource's name. Of the services of a namespace serving one name, the one created first "
        "owns it.",
        maxLength=256,
        minLength=1,
    )
    tokenizer: str | None = prop(
        "Tokenizer folder inside the pod, if not the model's own.", None, maxLength=512
    )
    chat_template: str | None = prop(
        "Chat template (a path inside the pod, or the Jinja text) overriding the model's.",
        None,
        maxLength=65536,
    )
    host_path: bool = prop(
        "Mount a file:/// path from the node's filesystem at the same path (read-only). For single-node and "
        "test clusters; it needs a policy that allows hostPath volumes.",
        False,
    )
    credentials_secret: str | None = prop(
        "Secret whose HF_TOKEN key authenticates hf:// downloads.", None, maxLength=253
    )
    cache_size_limit: str | None = prop(
        "Size limit of the volume an hf:// model is downloaded into.", None, schema=QUANTITY
    )


@dataclass(frozen=True)
class EngineSpec:
    runtime: Runtime = prop(
        "The server the replicas run: kvfleet (`kvfleet serve`) or vllm (vLLM's own `vllm serve`, from the "
        "operator's vLLM image). Options only kvfleet's runtime has are refused with vllm "
        "(docs/vllm-runtime.md).",
        "kvfleet",
    )
    image: str | None = prop(
        "Runtime image; defaults to the operator's configured image for spec.engine.runtime.",
        None,
        maxLength=512,
    )
    image_pull_policy: PullPolicy = prop("When the kubelet pulls the runtime image.", "IfNotPresent")
    image_pull_secrets: tuple[str, ...] = prop(
        "Secrets of the namespace that hold the credentials to pull the runtime image with.",
        (),
        maxItems=16,
        items={"maxLength": 253},
    )
    max_num_seqs: int | None = prop(
        "Requests a replica runs at once (the runtime's --max-num-seqs).", None, minimum=1, maximum=65536
    )
    max_model_len: int | None = prop(
        "The longest sequence a replica accepts, prompt and output tokens together (the runtime's "
        "--max-model-len).",
        None,
        minimum=1,
        maximum=16777216,
    )
    block_size: int | None = prop(
        "Tokens per block of the paged KV cache (the runtime's --block-size).", None, enum=list(BLOCK_SIZES)
    )
    enable_prefix_caching: bool | None = prop(
        "Reuse the KV cache of a prompt's start that earlier requests shared (the runtime's "
        "--enable-prefix-caching, or --no-enable-prefix-caching when false); the runtime's default when "
        "unset.",
        None,
    )
    scheduling_policy: SchedulingPolicy | None = prop(
        "Defaults from the SLA tier (priority for critical and high, fcfs otherwise).", None
    )
    dtype: str | None = prop(
        "The data type of the weights and activations (the runtime's --dtype).", None, enum=list(DTYPES)
    )
    quantization: str | None = prop(
        "The checkpoint's quantization method, in vLLM's names (the runtime's --quantization): checked "
        "against the model folder's quantization_config when the replica starts; read from the folder when "
        "unset.",
        None,
        enum=list(LOADED_QUANTIZATION_METHODS),
    )
    tensor_parallel_size: int = prop(
        "Ranks each layer is split over; a replica's ranks are tensorParallelSize × pipelineParallelSize.",
        1,
        minimum=1,
        maximum=64,
    )
    pipeline_parallel_size: int = prop(
        "Pipeline stages; a replica's ranks are tensorParallelSize × pipelineParallelSize.",
        1,
        minimum=1,
        maximum=64,
    )
    enable_expert_parallel: bool = prop(
        "Give each tensor-parallel rank whole experts of a mixture-of-experts model (a share of them) "
        "instead of a slice of every expert (the runtime's --enable-expert-parallel).",
        False,
    )
    max_waiting_requests: int | None = prop(
        "Requests a replica queues before it sheds load with 503.", None, minimum=1, maximum=1000000
    )
    # Short: behind the fleet gateway, what a stopping replica hands back goes on on another replica, so
    # rollouts and scale-downs need not wait for long generations.
    drain_timeout_seconds: int = prop(
        "How long a stopping replica lets in-flight requests finish before it hands the rest back: the fleet "
        "gateway resumes those on another replica, a client calling the replica directly gets a `draining` "
        "error (raise this for such clients).",
        5,
        minimum=0,
        maximum=3600,
    )
    startup_timeout_seconds: int = prop(
        "How long a replica may take to load its model before it is restarted.",
        600,
        minimum=30,
        maximum=86400,
    )
    api_key_secret: str | None = prop(
        "Secret whose KVFLEET_API_KEY key clients must send as `Authorization: Bearer <key>` (probes and "
        "/metrics stay open).",
        None,
        maxLength=253,
    )
    # LoRA stays on without adapters, so that adding the first one does not restart the replicas.
    enable_lora: bool = prop(
        "Serve LoRA adapters even while spec.adapters is empty, so that adding the first one does not "
        "restart the replicas (with adapters listed, LoRA is on regardless).",
        False,
    )
    max_loras: int | None = prop(
        "Adapters one batch may mix (the runtime's --max-loras).", None, minimum=1, maximum=256
    )
    max_lora_rank: int | None = prop(
        "The largest adapter rank a replica accepts (the runtime's --max-lora-rank).",
        None,
        minimum=1,
        maximum=512,
    )
    # Off: the adapters are the replicas' flags, and no client can load one. On: the operator loads them into
    # running replicas (no restart), through the API that any holder of the service's key may call too.
    allow_runtime_lora_updates: bool = prop(
        "Load and unload spec.adapters in running replicas (no pod restarts) through the runtime's "
        "/v1/load_lora_adapter, which any holder of the service's API key may call too. Off: the adapters "
        "are the replicas' --lora-modules, and changing them rolls the pods out.",
        False,
    )
    extra_args: tuple[str, ...] = prop(
        "More arguments of the runtime's command line, after the ones the operator renders from this spec.",
        (),
        maxItems=64,
        items={
            "maxLength": 1024,
            "x-kubernetes-validations": [_API_KEY_FLAG_RULE.render(), _TLS_FLAGS_RULE.render()],
        },
    )
    env: tuple[tuple[str, str], ...] = prop(
        "More environment variables of the runtime container.", (), schema=_ENV_SCHEMA
    )

    @property
    def world_size(self) -> int:
        """The ranks the model is split over: tensor parallel times pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class ResourcesSpec:
    # GPUs per pod: all the ranks' on one pod, or one node's share of a group.
    gpus: int = prop(
        "GPUs per pod; defaults to the replica's ranks (engine.tensorParallelSize × pipelineParallelSize), "
        "or to gpusPerNode when the model spans nodes.",
        1,
        server_default=None,
        minimum=0,
        maximum=16,
    )
    # The most GPUs one node (one pod) can take; unset: a replica's ranks always fit one pod.
    gpus_per_node: int | None = prop(
        "The most GPUs one node (one pod) gives a replica. With fewer than the replica's ranks, each replica "
        "is a group of ranks/gpusPerNode pods on as many nodes.",
        None,
        minimum=1,
        maximum=16,
    )
    # Pods per replica: 1, or the nodes of a group that share the model.
    nodes: int = derived(1)
    gpu_resource_name: str = prop(
        "The extended resource the pods request their GPUs as (requests and limits alike).",
        "nvidia.com/gpu",
        maxLength=253,
    )
    cpu: str | None = prop("CPU the runtime container requests.", None, schema=QUANTITY)
    memory: str | None = prop(
        "Memory the runtime container requests, and its limit too (memory is not compressible).",
        None,
        schema=QUANTITY,
    )
    node_selector: Mapping[str, str] = prop("Labels a node must carry to run the pods.", default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = prop(
        "Taints the pods tolerate, besides the GPU resource's own NoSchedule taint.",
        (),
        schema=_TOLERATIONS_SCHEMA,
    )
    affinity: Mapping[str, Any] | None = prop(
        "A pod affinity block, passed through as written.",
        None,
        schema={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    )


@dataclass(frozen=True)
class ScalingSpec:
    replicas: int | None = prop(
        "A fixed replica count; when set, autoscaling is off (0 suspends the service).",
        None,
        minimum=0,
        maximum=1000,
    )
    min_replicas: int = prop(
        "0 lets the fleet scale to zero when idle; the fleet gateway holds requests meanwhile and the "
        "operator scales back to one when the gateway's queue for the model fills.",
        1,
        minimum=0,
        maximum=1000,
    )
    max_replicas: int = prop("The most replicas the autoscaler runs.", 4, minimum=1, maximum=1000)
    target_queue_depth: int = prop(
        "Requests (running plus waiting) each replica should hold on average.", 32, minimum=1, maximum=100000
    )
    policy: ScalingPolicy = prop(
        "queue-depth: the replicas the mean queue depth wants at targetQueueDepth each; slo: the fewest "
        "replicas whose predicted latency, from the replicas' own latency at the load they carry, meets "
        "spec.sla's targets at the forecast demand (needs sla.ttftTargetMilliseconds or "
        "sla.itlTargetMilliseconds).",
        "queue-depth",
    )
    stable_window_seconds: int = prop(
        "The window whose mean queue depth sets the replicas wanted; panic mode lasts as long.",
        60,
        minimum=6,
        maximum=3600,
    )
    panic_window_seconds: int = prop(
        "The short window whose mean queue depth detects a burst (see panicThresholdPercent).",
        6,
        minimum=1,
        maximum=600,
    )
    panic_threshold_percent: int = prop(
        "Scale in panic mode when the panic window wants this share of ready replicas.",
        200,
        minimum=110,
        maximum=1000,
    )
    scale_down_delay_seconds: int = prop(
        "Scale down only to the highest replica count wanted over this long.", 120, minimum=0, maximum=3600
    )
    max_scale_up_step: int = prop(
        "The most replicas one decision adds, unless maxScaleUpPercent allows more.",
        4,
        minimum=1,
        maximum=1000,
    )
    max_scale_down_step: int = prop(
        "The most replicas one decision removes, unless maxScaleDownPercent allows more.",
        1,
        minimum=1,
        maximum=1000,
    )
    # As Kubernetes' HPA takes the larger of its Pods and Percent policies: with a fixed step alone, a fleet
    # of hundreds of replicas takes minutes to follow a burst, or to give back what the burst needed.
    max_scale_up_percent: int = prop(
        "The most replicas one decision adds, as a share of the replicas asked for (0: maxScaleUpStep "
        "alone).",
        100,
        minimum=0,
        maximum=1000,
    )
    max_scale_down_percent: int = prop(
        "The most replicas one decision removes, as a share of the replicas asked for (0: maxScaleDownStep "
        "alone).",
        10,
        minimum=0,
        maximum=100,
    )
    metrics_interval_seconds: int = prop(
        "How often the operator reads the replicas' metrics and decides.", 2, minimum=1, maximum=60
    )
    # With min_replicas 0: idle this long (nothing running, waiting or held by the gateway), it goes to 0.
    scale_to_zero_after_seconds: int = prop(
        "With minReplicas 0: idle this long (nothing running, waiting or held by the gateway), the fleet "
        "goes to zero.",
        300,
        minimum=0,
        maximum=86400,
    )
    sleeping_replicas: int = prop(
        "Replicas kept started but asleep (the runtime's sleep mode: KV cache freed, weights kept in host "
        "memory) instead of deleted while the autoscaler wants fewer awake, down to zero: one wakes in about "
        "a second where a new replica loads for a minute. Asleep, a replica is not Ready.",
        0,
        minimum=0,
        maximum=1000,
    )
    # How long the gateway holds a request for a service with no ready replica; None: the gateway's default.
    activation_timeout_seconds: int | None = prop(
        "How long the gateway holds a request while no replica is ready (scaled to zero or starting) before "
        "answering 503; unset, the gateway's --hold-seconds.",
        None,
        minimum=1,
        maximum=3600,
    )
    # What runs a replica that spans nodes: a StatefulSet per group, or one LeaderWorkerSet.
    group_backend: GroupBackend = prop(
        "What runs a replica that spans nodes (resources.gpusPerNode below the ranks): a StatefulSet per "
        "group, or one LeaderWorkerSet where that API is installed.",
        "statefulset",
    )

    @property
    def autoscaling(self) -> bool:
        return self.replicas is None

    def clamp(self, replicas: int) -> int:
        if self.replicas is not None:
            return self.replicas
        return max(self.min_replicas, min(self.max_replicas, replicas))

    def scale_up_step(self, current: int) -> int:
        """The most replicas one decision adds to `current`."""
        return max(self.max_scale_up_step, current * self.max_scale_up_percent // 100)

    def scale_down_step(self, current: int) -> int:
        """The most replicas one decision removes from `current`."""
        return max(self.max_scale_down_step, current * self.max_scale_down_percent // 100)

    def started(self, awake: int) -> int:
        """The replicas the workload runs for `awake` wanted awake: the sleeping ones are kept beside them."""
        return max(awake, self.sleeping_replicas)


DEFAULT_PERCENTILE = 90
MIN_PERCENTILE, MAX_PERCENTILE = 50, 99.9


@dataclass(frozen=True)
class SlaSpec:
    tier: TierName = prop(
        "The service's tier: its pods' PriorityClass (a higher tier preempts a lower one; batch preempts no "
        "one), its requests' default priority and, unless engine.schedulingPolicy is set, the replicas' "
        "scheduling policy.",
        DEFAULT_TIER,
    )
    ttft_target_milliseconds: int | None = prop(
        "Time to first token the fleet should keep; when replicas report a higher mean, the autoscaler adds "
        "one.",
        None,
        minimum=1,
        maximum=600000,
    )
    itl_target_milliseconds: int | None = prop(
        "Inter-token latency the fleet should keep (a disaggregated service's decode role, unless "
        "disaggregation.decode.scaling sets its own); used by scaling.policy slo.",
        None,
        minimum=1,
        maximum=60000,
    )
    percentile: float = prop(
        "The share of requests, in percent, that the latency targets hold for: scaling.policy slo sizes the "
        "fleet on this percentile of the replicas' time-to-first-token and inter-token latency histograms. "
        f"From {MIN_PERCENTILE:g} (the median) to {MAX_PERCENTILE:g} (a scrape interval's observations "
        "rarely tell more of the tail).",
        DEFAULT_PERCENTILE,
        minimum=MIN_PERCENTILE,
        maximum=MAX_PERCENTILE,
    )


BatchStorage = Literal["PersistentVolumeClaim", "EmptyDir"]
BATCH_STORAGES: tuple[BatchStorage, ...] = ("PersistentVolumeClaim", "EmptyDir")
DEFAULT_BATCH_CLAIM_SIZE = "10Gi"


@dataclass(frozen=True)
class BatchSpec:
    """The OpenAI Batch API's store: a claim of its own by default, or a pod-lifetime emptyDir."""

    storage: BatchStorage = prop(
        "A PersistentVolumeClaim named <name>-batch (kept across restarts), or an emptyDir (lost with the "
        "pod).",
        "PersistentVolumeClaim",
    )
    # The claim's request, or the emptyDir's limit (none when unset).
    size: str | None = prop(
        "The claim's storage request (10Gi when unset), or the emptyDir's size limit.", None, schema=QUANTITY
    )
    storage_class_name: str | None = prop(
        "The claim's storage class; the cluster's default when unset.", None
    )
    max_file_bytes: int | None = prop(
        "The largest batch input file an upload may bring (the runtime's default when unset).",
        None,
        minimum=1,
    )

    @property
    def claim_size(self) -> str:
        return self.size or DEFAULT_BATCH_CLAIM_SIZE


@dataclass(frozen=True)
class RoutingSpec:
    """How the fleet gateway spreads the service's requests; unset fields take the gateway's defaults."""

    policy: PolicyName | None = prop(
        "round-robin; least-request (fewest in flight); prefix-hash (consistent hashing with bounded loads "
        "over the prompt's first characters, for prefix-cache hits); cache-aware (the replica likely to "
        "cache the longest start of the prompt, within the load bound); precise-prefix (the replica that "
        "caches the longest start of the prompt by its own KV events, within the load bound: its replicas "
        "publish them).",
        None,
    )
    prefix_characters: int | None = prop(
        "The prompt characters prefix-hash hashes.", None, minimum=1, maximum=65536
    )
    load_bound_percent: int | None = prop(
        "prefix-hash passes over a replica holding more than this share of the mean load (125 = 1.25x).",
        None,
        minimum=100,
        maximum=1000,
    )


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter of the base model, served under `name`."""

    name: str = prop(
        "The model name clients send for this adapter.",
        required=True,
        maxLength=128,
        pattern=ADAPTER_NAME.pattern,
    )
    uri: str = prop(
        "Where the PEFT adapter is, with the model's schemes: hf://org/name[@revision] (fetched by the "
        "replica), pvc://claim/path or file:///path.",
        required=True,
        maxLength=2048,
        pattern="^(hf|pvc|file)://",
    )
    source: ModelSource = derived()


@dataclass(frozen=True)
class RoleScalingSpec:
    """How many replicas of one role run; the windows, steps and delays are spec.scaling's."""

    replicas: int | None = prop(
        "A fixed replica count of the role; when set, the role is not autoscaled.",
        None,
        minimum=0,
        maximum=1000,
    )
    min_replicas: int = prop(
        "The fewest replicas of the role the autoscaler runs; 0 lets the role scale to zero after "
        "spec.scaling.scaleToZeroAfterSeconds idle.",
        1,
        minimum=0,
        maximum=1000,
    )
    max_replicas: int = prop("The most replicas of the role the autoscaler runs.", 4, minimum=1, maximum=1000)

    @property
    def autoscaling(self) -> bool:
        return self.replicas is None

    def policy(self, service: ScalingSpec) -> ScalingSpec:
        """The service's autoscaling policy (windows, steps, delays) within this role's bounds."""
        return dataclasses.replace(
            service, replicas=self.replicas, min_replicas=self.min_replicas, max_replicas=self.max_replicas
        )


@dataclass(frozen=True)
class PrefillScalingSpec(RoleScalingSpec):
    target_queued_prompt_tokens: int = prop(
        "Prompt tokens still to compute (waiting and running requests) each prefill replica should hold on "
        "average. While no prefill replica is ready, the decode replicas' own backlog of prompt tokens is "
        "the demand; spec.sla.ttftTargetMilliseconds holds the prefill replicas' time to first token.",
        8192,
        minimum=1,
        maximum=100000000,
    )


@dataclass(frozen=True)
class DecodeScalingSpec(RoleScalingSpec):
    target_queue_depth: int = prop(
        "Requests (running plus waiting) each decode replica should hold on average; the fleet gateway's "
        "held requests count, so that a role at zero scales back to one.",
        32,
        minimum=1,
        maximum=100000,
    )
    target_kv_cache_usage_percent: int = prop(
        "The mean share of KV cache blocks in use a decode replica should stay under.",
        80,
        minimum=1,
        maximum=100,
    )
    itl_target_milliseconds: int | None = prop(
        "Inter-token latency the decode replicas should keep; when they report a higher mean, the autoscaler "
        "adds one.",
        None,
        minimum=1,
        maximum=60000,
    )


_ROLE_SCALING_RULES = [
    Rule(
        "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
        "minReplicas must not exceed maxReplicas",
    )
]
_ROLE_EXTRA_ARGS_ITEMS = {
    "maxLength": 1024,
    "x-kubernetes-validations": [
        Rule(
            _API_KEY_FLAG_RULE.rule,
            f"extraArgs must not pass {API_KEY_FLAG}: the key comes from the Secret named in "
            "engine.apiKeySecret",
        ).render(),
        _KV_TRANSFER_FLAG_RULE.render(),
        _TLS_FLAGS_RULE.render(),
    ],
}


@dataclass(frozen=True)
class PrefillSpec:
    """The replicas that compute prompts and keep their KV blocks for decode replicas to pull."""

    scaling: PrefillScalingSpec = prop(
        "How many prefill replicas run: a fixed count, or the autoscaler's on queued prompt tokens. At zero "
        "the gateway sends every request to the decode role, which computes its prompt itself.",
        server_default={},
        rules=_ROLE_SCALING_RULES,
    )
    resources: ResourcesSpec | None = prop(
        "What each prefill pod asks of its node, in the shape of spec.resources; unset, spec.resources.", None
    )
    extra_args: tuple[str, ...] = prop(
        "More arguments of the prefill replicas' runtime command line, after spec.engine.extraArgs.",
        (),
        maxItems=64,
        items=_ROLE_EXTRA_ARGS_ITEMS,
    )


@dataclass(frozen=True)
class DecodeSpec:
    """The replicas that pull a prompt's KV blocks from a prefill replica and generate its tokens."""

    scaling: DecodeScalingSpec = prop(
        "How many decode replicas run: a fixed count, or the autoscaler's on running requests and KV cache "
        "usage. At zero the fleet gateway holds requests and the operator scales back to one, as with "
        "spec.scaling.minReplicas 0.",
        server_default={},
        rules=_ROLE_SCALING_RULES,
    )
    resources: ResourcesSpec | None = prop(
        "What each decode pod asks of its node, in the shape of spec.resources; unset, spec.resources.", None
    )
    extra_args: tuple[str, ...] = prop(
        "More arguments of the decode replicas' runtime command line, after spec.engine.extraArgs.",
        (),
        maxItems=64,
        items=_ROLE_EXTRA_ARGS_ITEMS,
    )


@dataclass(frozen=True)
class DisaggregationSpec:
    """Prefill and decode on separate replicas, each role its own Deployment, sized and scaled apart."""

    prefill: PrefillSpec = prop(
        "The replicas that compute prompts and hand their KV cache to decode replicas.", server_default={}
    )
    decode: DecodeSpec = prop(
        "The replicas that generate, from KV cache pulled from a prefill replica (or computed themselves); "
        "the service's Service sends requests to them.",
        server_default={},
    )

    def role(self, role: Role) -> PrefillSpec | DecodeSpec:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec = prop(
        "The model the replicas serve.",
        required=True,
        rules=[
            Rule(
                "!has(self.hostPath) || !self.hostPath || self.uri.startsWith('file:///')",
                "model.hostPath applies only to file:/// URIs",
            )
        ],
    )
    engine: EngineSpec = prop(
        "Options of the replicas' runtime (the names of its command-line flags, which kvfleet's and vLLM's "
        "share).",
        server_default={},
    )
    resources: ResourcesSpec = prop(
        "What each pod asks of its node: GPUs, CPU and memory, and where it may run.", server_default={}
    )
    scaling: ScalingSpec = prop(
        "How many replicas run: a fixed count, or the autoscaler's on queue depth between minReplicas and "
        "maxReplicas.",
        server_default={},
        rules=[
            # has(): the server also checks the bare default ({}) against these rules.
            Rule(
                "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
                "scaling.minReplicas must not exceed scaling.maxReplicas",
            ),
            Rule(
                "!has(self.panicWindowSeconds) || !has(self.stableWindowSeconds) "
                "|| self.panicWindowSeconds <= self.stableWindowSeconds",
                "scaling.panicWindowSeconds must not exceed scaling.stableWindowSeconds",
            ),
            AUTOSCALED_COUNT_RULE,
        ],
    )
    sla: SlaSpec = prop("The service level the fleet is run for.", server_default={})
    batch: BatchSpec | None = prop(
        "Serve the OpenAI Batch API (/v1/files, /v1/batches) with its store on a volume mounted in the pod: "
        "a PersistentVolumeClaim named <name>-batch (kept across restarts, so batches resume) or an "
        "emptyDir (lost with the pod).",
        None,
    )
    routing: RoutingSpec = prop(
        "How the fleet gateway spreads this service's requests over its replicas; unset fields take the "
        "gateway's defaults.",
        RoutingSpec(),
    )
    # spec.safety as given (kvfleet.operator.safety merges it with the platform's defaults).
    safety: Mapping[str, Any] | None = prop(
        "Guardrails on input and output, merged over the platform's defaults (chart values "
        "safety.defaults); loosening them beyond what the platform allows is refused with SafetyLoosened. "
        "The shape of `kvfleet serve --safety-config` (docs/safety.md).",
        None,
        schema=_safety_schema,
    )
    adapters: tuple[AdapterSpec, ...] = prop(
        "LoRA adapters of the model, each served under its name (a replica serves 256 at most). They are "
        "the replicas' flags, or with engine.allowRuntimeLoraUpdates the operator loads them into the "
        "running replicas and unloads removed ones, without restarting a pod (adapters on a claim not yet "
        "mounted are the exception: the pods roll out to mount it).",
        (),
        maxItems=256,
        **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    disaggregation: DisaggregationSpec | None = prop(
        "Run prefill and decode on separate replicas (vLLM's disaggregated serving): a prefill role computes "
        "each prompt and a decode role pulls its KV cache over TCP and generates, each role with its own "
        "replicas, resources and scaling (spec.scaling's windows, steps and delays; its replica bounds do "
        "not apply). Unset, every replica does both. Needs one rank per replica.",
        None,
    )

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

    def for_role(self, role: Role) -> InferenceServiceSpec:
        """The spec one role's replicas run: the role's resources and extra arguments over the service's."""
        assert self.disaggregation is not None
        section = self.disaggregation.role(role)
        engine = dataclasses.replace(self.engine, extra_args=(*self.engine.extra_args, *section.extra_args))
        return dataclasses.replace(self, engine=engine, resources=section.resources or self.resources)


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
    if scaling.sleeping_replicas:
        _check_sleeping_replicas(root, scaling, resources)
    parsed = InferenceServiceSpec(
        model=model,
        engine=engine,
        resources=resources,
        scaling=scaling,
        sla=_parse_sla(root.section("sla"), scaling),
        batch=_parse_batch(root, scaling, resources),
        routing=_parse_routing(root.section("routing")),
        adapters=_parse_adapters(root, model.served_name),
        safety=parse_safety(root.raw.get("safety"), name=name),
        disaggregation=_parse_disaggregation(root, engine, scaling),
    )
    if engine.runtime == "vllm":
        _check_vllm_runtime(parsed)
    return parsed


def _check_vllm_runtime(spec: InferenceServiceSpec) -> None:
    """Refuses, naming the field, what a `vllm serve` replica cannot do (VLLM_REFUSALS)."""
    for refusal in VLLM_REFUSALS:
        if refusal.asks(spec):
            raise SpecError(UNSUPPORTED_BY_RUNTIME_REASON, f"spec.{refusal.message}")


def rendezvous_name(service: str) -> str:
    """The headless Service through which a group's ranks find rank 0, and the LeaderWorkerSet's name."""
    return f"{service}-ranks"


def role_name(service: str, role: Role) -> str:
    """The Deployment of one role of a disaggregated service."""
    return f"{service}-{role}"


def group_name(service: str, backend: GroupBackend, index: int) -> str:
    """A replica group's name: its StatefulSet, or the LeaderWorkerSet's worker StatefulSet of the group."""
    prefix = service if backend == "statefulset" else rendezvous_name(service)
    return f"{prefix}-{index}"


def _check_sleeping_replicas(root: _Section, scaling: ScalingSpec, resources: ResourcesSpec) -> None:
    """Sleeping replicas are kept beside the autoscaler's awake ones, of a service of whole-pod replicas."""
    if scaling.replicas is not None:
        problem = "needs the autoscaler (scaling.replicas unset): with a fixed count none would ever sleep"
    elif scaling.sleeping_replicas > scaling.max_replicas:
        problem = f"must not exceed scaling.maxReplicas ({scaling.max_replicas})"
    elif resources.nodes > 1 or root.raw.get("disaggregation") is not None:
        problem = "applies to replicas of one pod, not to groups over several nodes or disaggregated roles"
    else:
        return
    raise SpecError("InvalidSpec", f"spec.scaling.sleepingReplicas {problem}")


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
    _refuse_flag(section, extra_args, API_KEY_FLAG, _API_KEY_SOURCE)
    return EngineSpec(
        runtime=cast(Runtime, section.choice("runtime", RUNTIMES, defaults.runtime)),
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
        quantization=section.choice("quantization", LOADED_QUANTIZATION_METHODS),
        tensor_parallel_size=section.required_integer("tensorParallelSize", defaults.tensor_parallel_size, 1),
        pipeline_parallel_size=section.required_integer(
            "pipelineParallelSize", defaults.pipeline_parallel_size, 1
        ),
        enable_expert_parallel=section.boolean("enableExpertParallel", defaults.enable_expert_parallel),
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
                f"{section.path}.gpus ({gpus}) must be at least {ranks}; set {section.path}.gpusPerNode "
                "to split the model over several nodes",
            )
        if gpus_per_node is not None and gpus > gpus_per_node:
            raise SpecError(
                "InvalidSpec",
                f"{section.path}.gpus ({gpus}) must not exceed {section.path}.gpusPerNode ({gpus_per_node})",
            )
    else:
        if world % gpus_per_node:
            raise SpecError(
                "InvalidSpec",
                f"{ranks} must be a multiple of {section.path}.gpusPerNode ({gpus_per_node}): every node "
                "of a group takes the same share of the ranks",
            )
        nodes = world // gpus_per_node
        gpus = section.required_integer("gpus", gpus_per_node, 0)
        if gpus != gpus_per_node:
            raise SpecError(
                "InvalidSpec",
                f"{section.path}.gpus ({gpus}) must equal {section.path}.gpusPerNode ({gpus_per_node}) when "
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
        policy=cast(ScalingPolicy, section.choice("policy", SCALING_POLICIES, defaults.policy)),
        stable_window_seconds=integer("stableWindowSeconds", defaults.stable_window_seconds, 1),
        panic_window_seconds=integer("panicWindowSeconds", defaults.panic_window_seconds, 1),
        panic_threshold_percent=integer("panicThresholdPercent", defaults.panic_threshold_percent, 101),
        scale_down_delay_seconds=integer("scaleDownDelaySeconds", defaults.scale_down_delay_seconds, 0),
        max_scale_up_step=integer("maxScaleUpStep", defaults.max_scale_up_step, 1),
        max_scale_down_step=integer("maxScaleDownStep", defaults.max_scale_down_step, 1),
        max_scale_up_percent=integer("maxScaleUpPercent", defaults.max_scale_up_percent, 0),
        max_scale_down_percent=integer("maxScaleDownPercent", defaults.max_scale_down_percent, 0),
        metrics_interval_seconds=integer("metricsIntervalSeconds", defaults.metrics_interval_seconds, 1),
        scale_to_zero_after_seconds=integer(
            "scaleToZeroAfterSeconds", defaults.scale_to_zero_after_seconds, 0
        ),
        sleeping_replicas=integer("sleepingReplicas", defaults.sleeping_replicas, 0),
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


def _parse_disaggregation(
    root: _Section, engine: EngineSpec, scaling: ScalingSpec
) -> DisaggregationSpec | None:
    if root.raw.get("disaggregation") is None:
        return None
    section = root.section("disaggregation")
    if engine.world_size > 1:
        raise SpecError(
            "InvalidSpec",
            "spec.disaggregation needs one rank per replica: spec.engine.tensorParallelSize × "
            f"pipelineParallelSize is {engine.world_size}, and the KV connector moves the blocks of one rank",
        )
    if root.raw.get("batch") is not None:
        raise SpecError(
            "InvalidSpec",
            "spec.batch is not served with spec.disaggregation: the Batch API's store belongs to one "
            "colocated replica",
        )
    if scaling.replicas is not None:
        raise SpecError(
            "InvalidSpec",
            "spec.scaling.replicas does not apply with spec.disaggregation: set "
            "spec.disaggregation.prefill.scaling.replicas and spec.disaggregation.decode.scaling.replicas",
        )
    _refuse_kv_transfer_flag(root.section("engine"), engine.extra_args)
    prefill, decode = section.section("prefill"), section.section("decode")
    prefill_scaling = prefill.section("scaling")
    decode_scaling = decode.section("scaling")
    return DisaggregationSpec(
        prefill=PrefillSpec(
            scaling=PrefillScalingSpec(
                **_role_bounds(prefill_scaling),
                target_queued_prompt_tokens=prefill_scaling.required_integer(
                    "targetQueuedPromptTokens", PrefillScalingSpec.target_queued_prompt_tokens, 1
                ),
            ),
            resources=_parse_role_resources(prefill, engine),
            extra_args=_parse_role_extra_args(prefill),
        ),
        decode=DecodeSpec(
            scaling=DecodeScalingSpec(
                **_role_bounds(decode_scaling),
                target_queue_depth=decode_scaling.required_integer(
                    "targetQueueDepth", DecodeScalingSpec.target_queue_depth, 1
                ),
                target_kv_cache_usage_percent=_percent(
                    decode_scaling,
                    "targetKvCacheUsagePercent",
                    DecodeScalingSpec.target_kv_cache_usage_percent,
                ),
                itl_target_milliseconds=decode_scaling.integer("itlTargetMilliseconds", minimum=1),
            ),
            resources=_parse_role_resources(decode, engine),
            extra_args=_parse_role_extra_args(decode),
        ),
    )


def _role_bounds(section: _Section) -> dict[str, Any]:
    bounds = {
        "replicas": section.integer("replicas", minimum=0),
        "min_replicas": section.required_integer("minReplicas", RoleScalingSpec.min_replicas, 0),
        "max_replicas": section.required_integer("maxReplicas", RoleScalingSpec.max_replicas, 1),
    }
    if bounds["min_replicas"] > bounds["max_replicas"]:
        raise SpecError(
            "InvalidSpec",
            f"{section.path}.minReplicas ({bounds['min_replicas']}) must not exceed "
            f"{section.path}.maxReplicas ({bounds['max_replicas']})",
        )
    return bounds


def _percent(section: _Section, key: str, default: int) -> int:
    value = section.required_integer(key, default, 1)
    if value > 100:
        raise SpecError("InvalidSpec", f"{section.path}.{key} must be at most 100")
    return value


def _parse_role_resources(role: _Section, engine: EngineSpec) -> ResourcesSpec | None:
    if role.raw.get("resources") is None:
        return None
    return _parse_resources(role.section("resources"), engine)


def _parse_role_extra_args(role: _Section) -> tuple[str, ...]:
    extra_args = role.strings("extraArgs")
    _refuse_flag(role, extra_args, API_KEY_FLAG, _API_KEY_SOURCE)
    _refuse_kv_transfer_flag(role, extra_args)
    return tuple(extra_args)


def _refuse_kv_transfer_flag(section: _Section, extra_args: Sequence[str]) -> None:
    why = "the operator renders it for each role of spec.disaggregation"
    _refuse_flag(section, extra_args, KV_TRANSFER_CONFIG_FLAG, why)


def _refuse_flag(section: _Section, extra_args: Sequence[str], flag: str, why: str) -> None:
    """Raises SpecError for the first of a section's extraArgs that passes `flag`, alone or with its value."""
    for index, arg in enumerate(extra_args):
        if arg == flag or arg.startswith(f"{flag}="):
            raise SpecError("InvalidSpec", f"{section.path}.extraArgs[{index}] must not pass {flag}: {why}")


def _parse_sla(section: _Section, scaling: ScalingSpec) -> SlaSpec:
    tier = section.choice("tier", TIER_NAMES, DEFAULT_TIER)
    sla = SlaSpec(
        tier=cast(TierName, tier),
        ttft_target_milliseconds=section.integer("ttftTargetMilliseconds", minimum=1),
        itl_target_milliseconds=section.integer("itlTargetMilliseconds", minimum=1),
        percentile=_percentile(section),
    )
    if (
        scaling.policy == "slo"
        and sla.ttft_target_milliseconds is None
        and sla.itl_target_milliseconds is None
    ):
        raise SpecError(
            "InvalidSpec",
            "spec.scaling.policy slo sizes the fleet on latency targets: set spec.sla.ttftTargetMilliseconds "
            "or spec.sla.itlTargetMilliseconds",
        )
    return sla


def _percentile(section: _Section) -> float:
    value = section.raw.get("percentile", DEFAULT_PERCENTILE)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (MIN_PERCENTILE <= value <= MAX_PERCENTILE)
    ):
        raise SpecError(
            "InvalidSpec",
            f"{section.path}.percentile must be a number from {MIN_PERCENTILE:g} to {MAX_PERCENTILE:g} (the "
            f"percentile of requests the latency targets hold for), not {value!r}",
        )
    return float(value)


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
