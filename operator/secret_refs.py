"""The Secrets an InferenceService may name: only those labelled for kvfleet.

Whoever may write an InferenceService but not read the Secrets of its namespace could otherwise have its
pods receive any of them (as HF_TOKEN, as the API key, as registry credentials) and the operator send one to
the replicas. The label is the Secret's owner agreeing to that; the operator checks it before rendering.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvfleet.operator.spec import InferenceServiceSpec, SpecError

SECRET_LABEL = "kvfleet.dev/secret"
SECRET_LABEL_VALUE = "true"
NOT_LABELLED_REASON = "SecretNotLabelled"
UNREADABLE_REASON = "SecretUnavailable"


@dataclass(frozen=True)
class SecretReference:
    field: str
    name: str


def secret_references(spec: InferenceServiceSpec) -> list[SecretReference]:
    """Every Secret the spec names, with the field that names it."""
    references = []
    if spec.model.credentials_secret is not None:
        references.append(SecretReference("spec.model.credentialsSecret", spec.model.credentials_secret))
    if spec.engine.api_key_secret is not None:
        references.append(SecretReference("spec.engine.apiKeySecret", spec.engine.api_key_secret))
    references += [
        SecretReference(f"spec.engine.imagePullSecrets[{index}]", name)
        for index, name in enumerate(spec.engine.image_pull_secrets)
    ]
    return references


def check_labelled(reference: SecretReference, namespace: str, labels: Mapping[str, str]) -> None:
    """Raises SpecError unless the Secret's labels let InferenceServices use it."""
    if labels.get(SECRET_LABEL) != SECRET_LABEL_VALUE:
        raise SpecError(
            NOT_LABELLED_REASON,
            f"{reference.field}: Secret {namespace}/{reference.name} is not labelled"
            f" {SECRET_LABEL}={SECRET_LABEL_VALUE}, so InferenceServices may not use it (whoever may read the"
            " Secret labels it to allow that)",
        )


def unreadable(reference: SecretReference, namespace: str, message: str) -> SpecError:
    return SpecError(
        UNREADABLE_REASON, f"{reference.field}: cannot read Secret {namespace}/{reference.name}: {message}"
    )
