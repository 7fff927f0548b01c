"""Names the operator and its manifests share: the API group, labels, the field manager, ports, env."""

from __future__ import annotations

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
