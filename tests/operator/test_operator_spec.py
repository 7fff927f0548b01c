"""Spec parsing: defaults, derived values, and the messages a user sees for what the schema let through."""

from __future__ import annotations

from typing import Any

import pytest
from kvfleet.operator.metrics import OperatorMetrics
from kvfleet.operator.spec import ScalingSpec, SpecError, parse_spec


def spec(**sections: Any) -> dict[str, Any]:
    return {"model": {"uri": "file:///m"}, **sections}


def test_defaults_and_derived_values() -> None:
    parsed = parse_spec(spec(), name="svc")
    assert parsed.model.served_name == "svc" and parsed.model.source.location == "/m"
    assert parsed.resources.gpus == 1, "one GPU per replica unless told otherwise"
    assert parsed.scaling == ScalingSpec() and parsed.scaling.autoscaling
    assert parsed.sla.tier == "standard" and parsed.sla.ttft_target_milliseconds is None
    tp = parse_spec(spec(engine={"tensorParallelSize": 4}), name="svc")
    assert tp.resources.gpus == 4, "GPUs default to the tensor-parallel size"


def test_engine_env_and_lists() -> None:
    parsed = parse_spec(
        spec(engine={"env": [{"name": "A", "value": "1"}, {"name": "B"}], "imagePullSecrets": ["regcred"]}),
        name="svc",
    )
    assert parsed.engine.env == (("A", "1"), ("B", ""))
    assert parsed.engine.image_pull_secrets == ("regcred",)


def test_fixed_replicas_bypass_the_bounds() -> None:
    scaling = parse_spec(spec(scaling={"replicas": 7, "maxReplicas": 2}), name="svc").scaling
    assert not scaling.autoscaling and scaling.clamp(1) == 7
    bounded = parse_spec(spec(scaling={"minReplicas": 2, "maxReplicas": 5}), name="svc").scaling
    assert [bounded.clamp(n) for n in (0, 3, 9)] == [2, 3, 5]


@pytest.mark.parametrize(
    ("raw", "reason", "message"),
    [
        ({}, "InvalidSpec", "spec.model is required"),
        ({"model": "hf://a/b"}, "InvalidSpec", "spec.model must be an object"),
        (spec(model={"uri": 5}), "InvalidSpec", "spec.model.uri must be a string"),
        (spec(model={"uri": "s3://b/m"}), "InvalidModelURI", "scheme must be"),
        (spec(engine={"tensorParallelSize": True}), "InvalidSpec", "tensorParallelSize must be an integer"),
        (spec(engine={"dtype": "int8"}), "InvalidSpec", "spec.engine.dtype must be one of auto, float32"),
        (
            spec(engine={"quantization": "gptq"}),
            "InvalidSpec",
            "spec.engine.quantization must be one of compressed-tensors",
        ),
        (spec(engine={"env": [{"value": "x"}]}), "InvalidSpec", "spec.engine.env[0].name is required"),
        (spec(engine={"extraArgs": ["--a", 1]}), "InvalidSpec", "extraArgs must be a list of strings"),
        (spec(resources={"cpu": 1.5}), "InvalidSpec", "spec.resources.cpu must be a quantity"),
        (spec(resources={"tolerations": ["x"]}), "InvalidSpec", "tolerations must be an object"),
        (spec(scaling={"maxReplicas": 0}), "InvalidSpec", "spec.scaling.maxReplicas must be at least 1"),
        (spec(sla={"tier": "gold"}), "InvalidSpec", "spec.sla.tier must be one of critical, high"),
        (spec(adapters=[{"name": "a"}]), "InvalidSpec", "spec.adapters[0].uri is required"),
        (spec(adapters=[{"name": "a b", "uri": "file:///x"}]), "InvalidSpec", "'a b' is not a valid name"),
        (
            spec(adapters=[{"name": "a", "uri": "file:///x"}, {"name": "a", "uri": "file:///y"}]),
            "InvalidSpec",
            "spec.adapters[1].name 'a' is already the model's or another adapter's name",
        ),
        (spec(adapters=[{"name": "svc", "uri": "file:///x"}]), "InvalidSpec", "already the model's"),
        (spec(adapters=[{"name": "a", "uri": "s3://b/a"}]), "InvalidModelURI", "spec.adapters[0].uri"),
        (spec(engine={"maxLoraRank": 0}), "InvalidSpec", "spec.engine.maxLoraRank must be at least 1"),
    ],
)
def test_errors_name_the_field(raw: dict[str, Any], reason: str, message: str) -> None:
    with pytest.raises(SpecError) as raised:
        parse_spec(raw, name="svc")
    assert raised.value.reason == reason
    assert message in raised.value.message


def test_metrics_of_a_deleted_service_are_dropped() -> None:
    metrics = OperatorMetrics()
    metrics.desired_replicas.labels("ns", "svc").set(3)
    metrics.scale_events.labels("ns", "svc", "up").inc()
    metrics.desired_replicas.labels("ns", "other").set(1)
    metrics.forget("ns", "svc")
    names = {
        (s.name, tuple(sorted(s.labels.items())))
        for family in metrics.registry.collect()
        for s in family.samples
    }
    assert not any(("name", "svc") in labels for _, labels in names)
    assert ("kvfleet_operator_desired_replicas", (("name", "other"), ("namespace", "ns"))) in names


def disaggregated(**sections: Any) -> dict[str, Any]:
    return spec(disaggregation=sections)


def test_disaggregation_defaults_and_what_each_role_runs() -> None:
    assert parse_spec(spec(), name="svc").disaggregation is None, "absent: colocated"
    parsed = parse_spec(
        disaggregated(
            prefill={"scaling": {"minReplicas": 0, "targetQueuedPromptTokens": 2048}},
            decode={"resources": {"gpus": 2, "memory": "8Gi"}, "extraArgs": ["--seed", "1"]},
        )
        | {"engine": {"extraArgs": ["--max-num-batched-tokens", "512"]}, "resources": {"cpu": "4"}},
        name="svc",
    )
    roles = parsed.disaggregation
    assert roles is not None
    assert (roles.prefill.scaling.min_replicas, roles.prefill.scaling.max_replicas) == (0, 4)
    assert roles.prefill.scaling.target_queued_prompt_tokens == 2048
    decode = roles.decode.scaling
    assert (decode.min_replicas, decode.target_queue_depth) == (1, 32)
    assert decode.target_kv_cache_usage_percent == 80
    assert decode.itl_target_milliseconds is None and decode.autoscaling
    prefill_runs, decode_runs = parsed.for_role("prefill"), parsed.for_role("decode")
    assert prefill_runs.resources == parsed.resources, "a role without resources takes the service's"
    decode_resources = decode_runs.resources
    assert (decode_resources.gpus, decode_resources.memory, decode_resources.cpu) == (2, "8Gi", None)
    assert prefill_runs.engine.extra_args == ("--max-num-batched-tokens", "512")
    assert decode_runs.engine.extra_args == ("--max-num-batched-tokens", "512", "--seed", "1")
    # The service's windows and steps, the role's bounds.
    policy = roles.prefill.scaling.policy(parsed.scaling)
    assert (policy.min_replicas, policy.max_replicas, policy.replicas) == (0, 4, None)
    assert policy.stable_window_seconds == parsed.scaling.stable_window_seconds
    fixed = parse_spec(disaggregated(prefill={"scaling": {"replicas": 0, "maxReplicas": 1}}), name="svc")
    assert fixed.disaggregation is not None
    prefill_policy = fixed.disaggregation.prefill.scaling.policy(fixed.scaling)
    assert not fixed.disaggregation.prefill.scaling.autoscaling and prefill_policy.clamp(3) == 0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            disaggregated() | {"engine": {"tensorParallelSize": 2}},
            "spec.disaggregation needs one rank per replica: spec.engine.tensorParallelSize × "
            "pipelineParallelSize is 2",
        ),
        (
            disaggregated() | {"engine": {"pipelineParallelSize": 2}, "resources": {"gpusPerNode": 1}},
            "needs one rank per replica",
        ),
        (
            disaggregated() | {"batch": {}, "scaling": {"maxReplicas": 1}},
            "spec.batch is not served with spec.disaggregation",
        ),
        (
            disaggregated() | {"scaling": {"replicas": 2}},
            "spec.scaling.replicas does not apply with spec.disaggregation: set "
            "spec.disaggregation.prefill.scaling.replicas and spec.disaggregation.decode.scaling.replicas",
        ),
        (
            disaggregated() | {"engine": {"extraArgs": ["--kv-transfer-config", "{}"]}},
            "spec.engine.extraArgs[0] must not pass --kv-transfer-config",
        ),
        (
            disaggregated(decode={"extraArgs": ["--seed", "1", "--kv-transfer-config={}"]}),
            "spec.disaggregation.decode.extraArgs[2] must not pass --kv-transfer-config",
        ),
        (
            disaggregated(prefill={"extraArgs": ["--api-key", "k"]}),
            "spec.disaggregation.prefill.extraArgs[0] must not pass --api-key",
        ),
        (
            disaggregated(prefill={"scaling": {"minReplicas": 3, "maxReplicas": 2}}),
            "spec.disaggregation.prefill.scaling.minReplicas (3) must not exceed "
            "spec.disaggregation.prefill.scaling.maxReplicas (2)",
        ),
        (
            disaggregated(decode={"scaling": {"targetKvCacheUsagePercent": 120}}),
            "spec.disaggregation.decode.scaling.targetKvCacheUsagePercent must be at most 100",
        ),
        (
            disaggregated(decode={"scaling": {"itlTargetMilliseconds": 0}}),
            "spec.disaggregation.decode.scaling.itlTargetMilliseconds must be at least 1",
        ),
        (
            disaggregated(decode={"resources": {"gpus": 2, "gpusPerNode": 1}}),
            "spec.disaggregation.decode.resources.gpus (2) must not exceed "
            "spec.disaggregation.decode.resources.gpusPerNode (1)",
        ),
        (disaggregated(prefill=[]), "spec.disaggregation.prefill must be an object"),
    ],
)
def test_disaggregation_errors_name_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as raised:
        parse_spec(raw, name="svc")
    assert raised.value.reason == "InvalidSpec"
    assert message in raised.value.message


def test_the_kv_transfer_flag_stays_the_users_own_without_disaggregation() -> None:
    parsed = parse_spec(spec(engine={"extraArgs": ["--kv-transfer-config", "{}"]}), name="svc")
    assert parsed.engine.extra_args == ("--kv-transfer-config", "{}")
