"""The InferenceService CRD, rendered from the spec and status models: `python -m kvfleet.operator.crd`
prints it, and `make crds` writes it to crds/ and to the chart.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml
from kvfleet.contract.kv_transfer import ROLES
from kvfleet.operator.api import GROUP, KIND, PLURAL, VERSION
from kvfleet.operator.schema import dataclass_schema, obj, string
from kvfleet.operator.spec import NAME_RULES, SPEC_RULES, InferenceServiceSpec
from kvfleet.operator.status import STATUS_SCHEMA

FILE_NAME = f"{GROUP}_{PLURAL}.yaml"
HEADER = "# Rendered from kvfleet.operator.spec and kvfleet.operator.status by `make crds`: edit those.\n"
# `kubectl scale`, HPA and KEDA set spec.scaling.replicas, the fixed count; on a service the autoscaler sizes
# the API server refuses that write (AUTOSCALED_COUNT_RULE). The selector picks one pod per replica.
SCALE_SUBRESOURCE = {
    "specReplicasPath": ".spec.scaling.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}
PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
    {"name": "Tier", "type": "string", "jsonPath": ".spec.sla.tier"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
    {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas"},
    # A disaggregated service's roles, with -o wide (a colocated service has none to show).
    *(
        {
            "name": f"{role.capitalize()}-{column}",
            "type": "integer",
            "jsonPath": f".status.roles.{role}.{field}",
            "priority": 1,
        }
        for role in ROLES
        for column, field in (("Desired", "desiredReplicas"), ("Ready", "readyReplicas"))
    ),
    {"name": "URL", "type": "string", "jsonPath": ".status.url"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def openapi_schema() -> dict[str, Any]:
    """The resource's openAPIV3Schema."""
    return obj(
        "An LLM served by a fleet of kvfleet runtime pods, scaled on queue depth.",
        {
            "apiVersion": string("The API group and version of the object: kvfleet.dev/v1alpha1."),
            "kind": string("The object's kind: InferenceService."),
            # The API server describes metadata itself and refuses a CRD that says more than its type.
            "metadata": obj(""),
            "spec": dataclass_schema(
                InferenceServiceSpec, "The model to serve and how to run, scale and route it.", SPEC_RULES
            ),
            "status": STATUS_SCHEMA,
        },
        required=["spec"],
        # The children take the resource's name, and a Service name must be a DNS-1035 label.
        rules=NAME_RULES,
    )


def custom_resource_definition() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "kvfleet"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["kvis"],
                "categories": ["kvfleet"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def render() -> str:
    """The CRD's file, as checked in."""
    body = yaml.safe_dump(custom_resource_definition(), sort_keys=False, allow_unicode=True, width=110)
    return HEADER + body


if __name__ == "__main__":
    sys.stdout.write(render())
