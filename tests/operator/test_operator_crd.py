"""The InferenceService CRD: examples admitted, invalid objects rejected, defaults equal to the operator's."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvfleet.operator.api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kvfleet.operator.crd import FILE_NAME, render
from kvfleet.operator.schema import dataclass_schema, derived, prop
from kvfleet.operator.spec import ScalingSpec, SpecError, parse_spec

MINIMAL: dict[str, Any] = {
    "apiVersion": API_VERSION,
    "kind": KIND,
    "metadata": {"name": "m"},
    "spec": {"model": {"uri": "hf://org/model"}},
}


def named(name: str) -> dict[str, Any]:
    return {**copy.deepcopy(MINIMAL), "metadata": {"name": name}}


# The longest name the children can take: a Service name is a DNS-1035 label of 63 characters at most.
LONGEST_NAME = "llama-3-1-8b-instruct-" + "x" * 40 + "9"


def with_spec(**sections: Any) -> dict[str, Any]:
    obj = copy.deepcopy(MINIMAL)
    for name, value in sections.items():
        obj["spec"][name] = {**obj["spec"].get(name, {}), **value}
    return obj


def test_crd_names_and_version(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert (spec["group"], spec["names"]["kind"], spec["names"]["plural"]) == (GROUP, KIND, PLURAL)
    assert spec["scope"] == "Namespaced"
    assert "isvc" not in spec["names"]["shortNames"]
    (version,) = spec["versions"]
    assert version["name"] == VERSION and version["served"] and version["storage"]
    assert set(version["subresources"]) == {"status", "scale"}
    assert "kvis" in spec["names"]["shortNames"], "the kind is also KServe's: kvis names it unambiguously"


def _schema_at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    for part in path.strip(".").split("."):
        schema = schema["properties"][part]
    return schema


def test_scale_subresource_points_at_the_fixed_count_and_the_status(crd: dict[str, Any]) -> None:
    version = crd["spec"]["versions"][0]
    scale, schema = version["subresources"]["scale"], version["schema"]["openAPIV3Schema"]
    replicas = _schema_at(schema, scale["specReplicasPath"])
    assert replicas["type"] == "integer" and "default" not in replicas, "unset: the autoscaler's count"
    assert _schema_at(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert _schema_at(schema, scale["labelSelectorPath"])["type"] == "string"


def _scaled(stored: dict[str, Any], replicas: int, crd_validator: Any) -> list[str]:
    """What a scale subresource write (kubectl scale) of `stored` meets: the update's errors."""
    update = copy.deepcopy(stored)
    update["spec"]["scaling"]["replicas"] = replicas
    return crd_validator.admit(update, old=stored)[1]


def test_kubectl_scale_sets_a_fixed_count_and_is_refused_on_an_autoscaled_service(crd_validator: Any) -> None:
    fixed, errors = crd_validator.admit(with_spec(scaling={"replicas": 1}))
    assert errors == []
    assert _scaled(fixed, 3, crd_validator) == []
    assert _scaled(fixed, 0, crd_validator) == []
    autoscaled, errors = crd_validator.admit(with_spec(scaling={"maxReplicas": 8}))
    assert errors == []
    (refusal,) = _scaled(autoscaled, 3, crd_validator)
    assert "autoscaler" in refusal and "minReplicas and maxReplicas equal" in refusal
    # A deliberate switch to a fixed count pins the bounds in the same change; handing the count back to
    # the autoscaler (removing replicas) is always allowed.
    switched = with_spec(scaling={"replicas": 3, "minReplicas": 3, "maxReplicas": 3})
    assert crd_validator.admit(switched, old=autoscaled)[1] == []
    back = copy.deepcopy(fixed)
    del back["spec"]["scaling"]["replicas"]
    assert crd_validator.admit(back, old=fixed)[1] == []
    # Created with a count, a service is simply fixed.
    assert crd_validator.admit(with_spec(scaling={"replicas": 3, "maxReplicas": 8}))[1] == []


def test_printer_columns_point_at_schema_fields(crd: dict[str, Any]) -> None:
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    names = [column["name"] for column in version["additionalPrinterColumns"]]
    assert names == [
        "Model",
        "Tier",
        "Desired",
        "Available",
        "Prefill-Desired",
        "Prefill-Ready",
        "Decode-Desired",
        "Decode-Ready",
        "URL",
        "Ready",
        "Reason",
        "Age",
    ]
    wide = [column["name"] for column in version["additionalPrinterColumns"] if column.get("priority")]
    assert wide == names[4:8], "a colocated service has no roles: kubectl get shows them with -o wide only"
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"].split("[")[0].strip(".").split(".")
        node = schema
        for part in path:
            if part == "metadata":
                break
            assert part in node["properties"], column
            node = node["properties"][part]
            if node.get("type") == "array":
                node = node["items"]


def test_defaults_pass_their_own_validation(crd_validator: Any) -> None:
    assert crd_validator.default_errors() == []


def test_every_example_is_admitted(example_path: Path, crd_validator: Any) -> None:
    for doc in yaml.safe_load_all(example_path.read_text()):
        if doc and doc["kind"] == KIND:
            assert doc["apiVersion"] == API_VERSION
            _, errors = crd_validator.admit(doc)
            assert errors == []


def test_server_defaults_match_the_operator_defaults(example_path: Path, crd_validator: Any) -> None:
    # The operator re-applies defaults for objects the server did not default; both must agree.
    for doc in [MINIMAL, *yaml.safe_load_all(example_path.read_text())]:
        if doc and doc["kind"] == KIND:
            defaulted, errors = crd_validator.admit(doc)
            assert errors == []
            name = doc["metadata"]["name"]
            assert parse_spec(defaulted["spec"], name=name) == parse_spec(doc["spec"], name=name)


def test_minimal_object_gets_documented_defaults(crd_validator: Any) -> None:
    defaulted, errors = crd_validator.admit(MINIMAL)
    assert errors == []
    spec = defaulted["spec"]
    assert spec["sla"] == {"tier": "standard", "percentile": 90}
    assert spec["scaling"]["minReplicas"] == 1 and spec["scaling"]["maxReplicas"] == 4
    assert spec["scaling"]["stableWindowSeconds"] == 60 and spec["scaling"]["panicWindowSeconds"] == 6
    assert spec["engine"]["tensorParallelSize"] == 1 and spec["engine"]["imagePullPolicy"] == "IfNotPresent"
    assert spec["resources"]["gpuResourceName"] == "nvidia.com/gpu"
    assert "gpus" not in spec["resources"]
    assert spec["model"]["hostPath"] is False


INVALID = {
    "min over max": (with_spec(scaling={"minReplicas": 5, "maxReplicas": 2}), "minReplicas must not exceed"),
    "unknown tier": (with_spec(sla={"tier": "gold"}), "unsupported value 'gold'"),
    "gpus as string": (with_spec(resources={"gpus": "two"}), ".spec.resources.gpus: wrong type"),
    "replicas as string": (with_spec(scaling={"maxReplicas": "4"}), ".spec.scaling.maxReplicas: wrong type"),
    "prefix caching as string": (with_spec(engine={"enablePrefixCaching": "yes"}), "wrong type"),
    "negative min replicas": (with_spec(scaling={"minReplicas": -1}), "greater than or equal to 0"),
    "unknown routing policy": (with_spec(routing={"policy": "random"}), "unsupported value 'random'"),
    "load bound under 100": (with_spec(routing={"loadBoundPercent": 99}), "greater than or equal to 100"),
    "negative replicas": (with_spec(scaling={"replicas": -1}), "greater than or equal to 0"),
    "block size not allowed": (with_spec(engine={"blockSize": 12}), "unsupported value 12"),
    "bad dtype": (with_spec(engine={"dtype": "int4"}), "unsupported value 'int4'"),
    "unknown scheme": (with_spec(model={"uri": "s3://bucket/model"}), "model.uri must be"),
    "hf without name": (with_spec(model={"uri": "hf://just-a-name"}), "model.uri must be"),
    "file relative": (with_spec(model={"uri": "file://relative/path"}), "model.uri must be"),
    "hostPath with hf": (with_spec(model={"hostPath": True}), "hostPath applies only to file"),
    "fewer gpus than tp": (
        with_spec(engine={"tensorParallelSize": 2}, resources={"gpus": 1}),
        "resources.gpus must be at least engine.tensorParallelSize × pipelineParallelSize",
    ),
    "fewer gpus than the ranks": (
        with_spec(engine={"tensorParallelSize": 2, "pipelineParallelSize": 2}, resources={"gpus": 2}),
        "resources.gpus must be at least engine.tensorParallelSize × pipelineParallelSize",
    ),
    "ranks not a multiple of the gpus per node": (
        with_spec(engine={"tensorParallelSize": 3}, resources={"gpusPerNode": 2}),
        "engine.tensorParallelSize × pipelineParallelSize must be a multiple of resources.gpusPerNode",
    ),
    "group pods with other than the gpus per node": (
        with_spec(engine={"tensorParallelSize": 4}, resources={"gpusPerNode": 2, "gpus": 1}),
        "resources.gpus must equal resources.gpusPerNode when the model spans nodes",
    ),
    "one pod with more gpus than a node has": (
        with_spec(engine={"tensorParallelSize": 2}, resources={"gpusPerNode": 4, "gpus": 8}),
        "resources.gpus must not exceed resources.gpusPerNode",
    ),
    "batch over nodes": (
        with_spec(
            engine={"tensorParallelSize": 2}, resources={"gpusPerNode": 1}, batch={}, scaling={"replicas": 1}
        ),
        "batch needs a replica on one node",
    ),
    "unknown group backend": (
        with_spec(scaling={"groupBackend": "jobset"}),
        "unsupported value 'jobset'",
    ),
    "cpu with tp": (
        with_spec(engine={"tensorParallelSize": 2}, resources={"gpus": 0}),
        "resources.gpus must be at least engine.tensorParallelSize × pipelineParallelSize (0 only for",
    ),
    "panic window over stable": (
        with_spec(scaling={"panicWindowSeconds": 30, "stableWindowSeconds": 20}),
        "panicWindowSeconds must not exceed",
    ),
    "unknown field": (with_spec(engine={"maxBatchSize": 8}), ".spec.engine.maxBatchSize: unknown field"),
    "bad quantity": (with_spec(resources={"memory": "lots"}), ".spec.resources.memory: should match"),
    "missing model": ({**MINIMAL, "spec": {}}, ".spec.model: Required value"),
    "name too long": (named(LONGEST_NAME + "a"), "metadata.name must be at most 63 characters"),
    "name with a dot": (named("llama.8b"), "metadata.name must be a DNS-1035 label"),
    "name starting with a digit": (named("8b-llama"), "metadata.name must be a DNS-1035 label"),
    "api key in env": (
        with_spec(
            engine={
                "apiKeySecret": "m-key",
                "env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "KVFLEET_API_KEY", "value": "k"}],
            }
        ),
        ".spec.engine.env[1]: Invalid value: engine.env must not set KVFLEET_API_KEY",
    ),
    "api key flag": (
        with_spec(engine={"extraArgs": ["--seed", "1", "--api-key", "k"]}),
        ".spec.engine.extraArgs[2]: Invalid value: engine.extraArgs must not pass --api-key",
    ),
    "tls flag": (
        with_spec(engine={"extraArgs": ["--ssl-certfile=/certs/tls.crt"]}),
        ".spec.engine.extraArgs[0]: Invalid value: extraArgs must not pass --ssl-* or --enable-ssl-refresh",
    ),
    "role with a tls refresh flag": (
        with_spec(disaggregation={"decode": {"extraArgs": ["--seed", "1", "--enable-ssl-refresh"]}}),
        ".spec.disaggregation.decode.extraArgs[2]: Invalid value: extraArgs must not pass --ssl-*",
    ),
    "batch with several replicas": (
        with_spec(batch={}),
        "batch needs a single replica",
    ),
    "batch with fixed replicas": (
        with_spec(batch={}, scaling={"replicas": 2}),
        "batch needs a single replica",
    ),
    "batch storage unknown": (
        with_spec(batch={"storage": "HostPath"}, scaling={"replicas": 1}),
        "unsupported value 'HostPath'",
    ),
    "api key flag with its value": (
        with_spec(engine={"extraArgs": ["--api-key=k"]}),
        ".spec.engine.extraArgs[0]: Invalid value: engine.extraArgs must not pass --api-key",
    ),
    "disaggregation with tensor parallel": (
        with_spec(disaggregation={}, engine={"tensorParallelSize": 2}),
        "disaggregation needs one rank per replica",
    ),
    "disaggregation with batch": (
        with_spec(disaggregation={}, batch={}, scaling={"replicas": 1}),
        "batch is not served with disaggregation",
    ),
    "disaggregation with service replicas": (
        with_spec(disaggregation={}, scaling={"replicas": 2}),
        "scaling.replicas does not apply with disaggregation",
    ),
    "disaggregation with a kv transfer flag": (
        with_spec(disaggregation={}, engine={"extraArgs": ["--kv-transfer-config={}"]}),
        "engine.extraArgs must not pass --kv-transfer-config with disaggregation",
    ),
    "role with a kv transfer flag": (
        with_spec(disaggregation={"decode": {"extraArgs": ["--kv-transfer-config", "{}"]}}),
        ".spec.disaggregation.decode.extraArgs[0]: Invalid value: extraArgs must not pass "
        "--kv-transfer-config",
    ),
    "role with an api key flag": (
        with_spec(disaggregation={"prefill": {"extraArgs": ["--api-key=k"]}}),
        ".spec.disaggregation.prefill.extraArgs[0]: Invalid value: extraArgs must not pass --api-key: "
        "the key",
    ),
    "role min over max": (
        with_spec(disaggregation={"prefill": {"scaling": {"minReplicas": 3, "maxReplicas": 2}}}),
        ".spec.disaggregation.prefill.scaling: Invalid value: minReplicas must not exceed maxReplicas",
    ),
    "role kv usage over 100": (
        with_spec(disaggregation={"decode": {"scaling": {"targetKvCacheUsagePercent": 101}}}),
        "less than or equal to 100",
    ),
    "role unknown field": (
        with_spec(disaggregation={"decode": {"replicas": 2}}),
        ".spec.disaggregation.decode.replicas: unknown field",
    ),
}


@pytest.mark.parametrize("case", INVALID.values(), ids=INVALID.keys())
def test_invalid_objects_are_rejected(case: tuple[dict[str, Any], str], crd_validator: Any) -> None:
    obj, expected = case
    _, errors = crd_validator.admit(obj)
    assert errors, "the server would have accepted it"
    assert any(expected in error for error in errors), errors


@pytest.mark.parametrize(
    "name",
    [
        "min over max",
        "unknown tier",
        "negative min replicas",
        "unknown routing policy",
        "load bound under 100",
        "gpus as string",
        "hf without name",
        "fewer gpus than tp",
        "fewer gpus than the ranks",
        "ranks not a multiple of the gpus per node",
        "group pods with other than the gpus per node",
        "one pod with more gpus than a node has",
        "batch over nodes",
        "unknown group backend",
        "name too long",
        "name with a dot",
        "name starting with a digit",
        "api key in env",
        "api key flag",
        "api key flag with its value",
        "batch with several replicas",
        "batch with fixed replicas",
        "batch storage unknown",
        "disaggregation with tensor parallel",
        "disaggregation with batch",
        "disaggregation with service replicas",
        "disaggregation with a kv transfer flag",
        "role with a kv transfer flag",
        "role with an api key flag",
        "role min over max",
        "role kv usage over 100",
    ],
)
def test_operator_rejects_what_the_schema_rejects(name: str) -> None:
    # Objects that predate a CRD upgrade skip the server's checks; the operator must not render them.
    obj, _ = INVALID[name]
    with pytest.raises(SpecError):
        parse_spec(obj["spec"], name=obj["metadata"]["name"])


def test_scale_to_zero_and_routing_are_admitted_and_read_as_written(crd_validator: Any) -> None:
    scaling = {"minReplicas": 0, "scaleToZeroAfterSeconds": 60, "activationTimeoutSeconds": 120}
    routing = {"policy": "prefix-hash", "prefixCharacters": 512, "loadBoundPercent": 150}
    defaulted, errors = crd_validator.admit(with_spec(scaling=scaling, routing=routing))
    assert errors == []
    spec = parse_spec(defaulted["spec"], name="m")
    assert (spec.scaling.min_replicas, spec.scaling.scale_to_zero_after_seconds) == (0, 60)
    assert spec.scaling.activation_timeout_seconds == 120
    assert (spec.routing.policy, spec.routing.prefix_characters, spec.routing.load_bound_percent) == (
        "prefix-hash",
        512,
        150,
    )
    plain, _ = crd_validator.admit(MINIMAL)
    assert plain["spec"]["scaling"]["scaleToZeroAfterSeconds"] == ScalingSpec().scale_to_zero_after_seconds
    assert "routing" not in plain["spec"], "unset routing takes the gateway's defaults"


def test_fixed_replicas_may_be_zero(crd_validator: Any) -> None:
    _, errors = crd_validator.admit(with_spec(scaling={"replicas": 0}))
    assert errors == []


def test_variables_and_flags_near_the_api_key_are_admitted(crd_validator: Any) -> None:
    engine = {
        "apiKeySecret": "m-key",
        "env": [{"name": "KVFLEET_API_KEY_FILE", "value": "x"}, {"name": "OMP_NUM_THREADS", "value": "1"}],
        "extraArgs": ["--api-key-header", "--seed", "7"],
    }
    obj = with_spec(engine=engine)
    _, errors = crd_validator.admit(obj)
    assert errors == []
    assert parse_spec(obj["spec"], name="m").engine.api_key_secret == "m-key"


def test_the_longest_name_is_admitted(crd_validator: Any) -> None:
    assert len(LONGEST_NAME) == 63
    for name in (LONGEST_NAME, "a", "x-1"):
        _, errors = crd_validator.admit(named(name))
        assert errors == [], name
        assert parse_spec(MINIMAL["spec"], name=name).model.served_name == name


def test_batch_on_one_replica_is_admitted_with_its_defaults(crd_validator: Any) -> None:
    for scaling in ({"replicas": 1}, {"maxReplicas": 1}, {"replicas": 0}):
        obj = with_spec(batch={}, scaling=scaling)
        defaulted, errors = crd_validator.admit(obj)
        assert errors == []
        assert defaulted["spec"]["batch"] == {"storage": "PersistentVolumeClaim"}
        assert parse_spec(defaulted["spec"], name="m") == parse_spec(obj["spec"], name="m")


def test_disaggregation_is_admitted_with_each_roles_defaults(crd_validator: Any) -> None:
    obj = with_spec(disaggregation={"decode": {"scaling": {"maxReplicas": 8}, "resources": {"gpus": 2}}})
    defaulted, errors = crd_validator.admit(obj)
    assert errors == []
    roles = defaulted["spec"]["disaggregation"]
    prefill = {"minReplicas": 1, "maxReplicas": 4, "targetQueuedPromptTokens": 8192}
    assert roles["prefill"]["scaling"] == prefill
    assert roles["decode"]["scaling"] == {
        "minReplicas": 1,
        "maxReplicas": 8,
        "targetQueueDepth": 32,
        "targetKvCacheUsagePercent": 80,
    }
    assert "resources" not in roles["prefill"], "unset: the service's resources"
    assert parse_spec(defaulted["spec"], name="m") == parse_spec(obj["spec"], name="m")
    plain, _ = crd_validator.admit(MINIMAL)
    assert "disaggregation" not in plain["spec"], "colocated unless asked"


def _properties(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every property under `schema`, with its path, through objects, arrays' items and maps' values."""
    found = []
    for key, sub in schema.get("properties", {}).items():
        found.append((f"{path}.{key}", sub))
        found += _properties(sub, f"{path}.{key}")
    if "items" in schema:
        found += _properties(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += _properties(schema["additionalProperties"], f"{path}.*")
    return found


def test_every_property_is_described(crd: dict[str, Any]) -> None:
    # `kubectl explain` shows these; a property without one explains nothing. The API server describes
    # metadata itself and refuses a CRD that says more of it than its type.
    properties = _properties(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    assert len(properties) > 100
    undescribed = [path for path, schema in properties if not str(schema.get("description", "")).strip()]
    assert undescribed == [".metadata"]


def test_checked_in_crds_are_the_rendered_model(repo: Path) -> None:
    # The spec and status models are the one source: `make crds` rewrites both copies.
    rendered = render()
    assert (repo / "crds" / FILE_NAME).read_text() == rendered
    assert (repo / "charts" / "kvfleet" / "crds" / FILE_NAME).read_text() == rendered


def test_a_field_without_a_description_is_refused() -> None:
    # A field added to a spec model reaches the CRD only through prop() and its description.
    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        described: int = prop("A described property.", 1)
        bare: int = 2

    with pytest.raises(TypeError, match=r"Undeclared\.bare"):
        dataclass_schema(Undeclared, "A model with an undeclared field.")
    with pytest.raises(ValueError, match="description"):
        prop(" ", 1)

    @dataclasses.dataclass(frozen=True)
    class Derived:
        described: int = prop("A described property.", 1)
        worked_out: int = derived(2)

    assert list(dataclass_schema(Derived, "A model with a derived field.")["properties"]) == ["described"]
