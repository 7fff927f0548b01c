"""Names the operator and its manifests share: the API group, labels, the field manager, ports, env; and the
rule that says which service owns a model name, which the operator and the gateway share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GROUP = "kvfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

# Every child is applied under this one field manager, so server-side apply sees a single owner.
FIELD_MANAGER = "kvfleet-operator"
MANAGED_BY = "kvfleet-operator"

SERVICE_LABEL = f"{GROUP}/inference-service"
TIER_LABEL = f"{GROUP}/tier"
# Disaggregated services label each replica with its role (kvfleet.contract.kv_transfer.ROLES).
ROLE_LABEL = f"{GROUP}/role"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
COMPONENT = "inference-server"
# The chart labels its fleet gateway pods with this component.
GATEWAY_COMPONENT = "gateway"

HTTP_PORT = 8000
HTTP_PORT_NAME = "http"
# `kvfleet serve` reads its API key from this variable; the pods set it from the apiKeySecret.
API_KEY_ENV = "KVFLEET_API_KEY"
# ...or from this flag, which beats the variable: a spec may pass neither itself.
API_KEY_FLAG = "--api-key"

# The runtime's option that makes a replica one side of disaggregated prefill and decode (vLLM's name and
# JSON); the operator renders it for each role, so a spec may not pass it.
KV_TRANSFER_CONFIG_FLAG = "--kv-transfer-config"
# Where a prefill replica serves its KV blocks to decode replicas (vLLM's default port).
KV_TRANSFER_PORT = 14579
KV_TRANSFER_PORT_NAME = "kv-transfer"
# The runtime's option that makes a replica publish its KV-cache events (vLLM's name and JSON); the operator
# renders it for a service routed by precise-prefix, whose gateway subscribes to them at the contract's ports.
KV_EVENTS_CONFIG_FLAG = "--kv-events-config"
KV_EVENTS_PORT_NAME = "kv-events"
KV_REPLAY_PORT_NAME = "kv-replay"

# A replica split over several nodes is a group of pods, one per node rank. The StatefulSet of a group labels
# its pods with their ordinal, which is the rank; a LeaderWorkerSet labels its pods with their worker index.
# Only rank 0 serves the OpenAI API; the others answer GET /health alone.
GROUP_LABEL = f"{GROUP}/group"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
# The StatefulSet controller labels each pod with the revision of the template it was made from.
REVISION_LABEL = "controller-revision-hash"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# The port the ranks of a group meet on (torch.distributed's TCP store on rank 0; the engine core's socket for
# the other nodes' workers is the port after it).
RENDEZVOUS_PORT = 29500


def node_rank(labels: Mapping[str, str]) -> int | None:
    """The rank of a group's pod from its labels; None for a pod that is a whole replica by itself."""
    if GROUP_LABEL in labels:
        value = labels.get(POD_INDEX_LABEL)
    elif LWS_GROUP_INDEX_LABEL in labels:
        value = labels.get(LWS_WORKER_INDEX_LABEL)
    else:
        return None
    return int(value) if value is not None and value.isdigit() else None


def group_index(labels: Mapping[str, str]) -> int | None:
    """Which replica group a pod belongs to; None outside groups."""
    value = labels.get(GROUP_LABEL, labels.get(LWS_GROUP_INDEX_LABEL))
    return int(value) if value is not None and value.isdigit() else None


def serves_api(labels: Mapping[str, str]) -> bool:
    """Whether the pod serves requests: a whole replica, or rank 0 of a group."""
    return node_rank(labels) in (None, 0)


def qualified_name(namespace: str, name: str) -> str:
    """The name a service's model (or one of its LoRA adapters) is routed and counted under in the fleet
    gateway: `NAMESPACE/NAME`. A namespace owns the names under it, so no service elsewhere can take them."""
    return f"{namespace}/{name}"


def claim_order(metadata: Mapping[str, Any]) -> tuple[str, str]:
    """Which of a namespace's services serving the same model name owns it: the one created first (RFC 3339
    timestamps of one format order as text), then the first by name. A later claimant is never routed; the
    operator says so in its NameConflict condition."""
    return str(metadata.get("creationTimestamp") or ""), str(metadata.get("name", ""))
