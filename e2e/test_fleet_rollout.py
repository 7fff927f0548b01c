"""A spec change (the engine's arguments) rolls the Deployment while clients keep calling: the new replica
is Ready before the old one stops taking traffic (maxUnavailable 0), the old one drains what it holds, and no
client request fails."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from e2e.cluster import LocalCluster
from e2e.cluster.kube_api import MERGE_PATCH
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import service_selector, services_path, tiny_service
from e2e.fleet.observe import is_ready, service_pods, wait_ready
from e2e.fleet.traffic import ChatLoad, ReadyEndpoints
from e2e.support.waits import wait_for

ROLLOUT_BOUND_SECONDS = 120.0


def test_engine_change_rolls_out_without_failed_requests(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    namespace: str,
    tiny_model_dir: Path,
    measurements: Callable[[str], None],
) -> None:
    api = local_cluster.api
    api.create(services_path(namespace), tiny_service("rolling", tiny_model_dir, engine={"maxNumSeqs": 4}))
    wait_ready(api, namespace, "rolling")
    (old_pod,) = service_pods(api, namespace, "rolling")
    old_name = old_pod["metadata"]["name"]

    with (
        ReadyEndpoints(api, namespace, "rolling") as endpoints,
        ChatLoad(endpoints, 2, max_tokens=32) as load,
    ):
        wait_for("requests answered before the change", lambda: len(load.successes()) >= 5, 30)
        changed = api.patch(
            services_path(namespace, "rolling"),
            {"spec": {"engine": {"maxNumSeqs": 6}}},
            content_type=MERGE_PATCH,
        )
        started = time.monotonic()

        def rolled_out() -> bool:
            service = api.get(services_path(namespace, "rolling"))
            names = [pod["metadata"]["name"] for pod in service_pods(api, namespace, "rolling")]
            return is_ready(service) and len(names) == 1 and names != [old_name]

        wait_for("the rollout to finish", rolled_out, ROLLOUT_BOUND_SECONDS, interval=0.25)
        rollout_seconds = time.monotonic() - started
        (new_pod,) = service_pods(api, namespace, "rolling")
        new_name = new_pod["metadata"]["name"]
        wait_for(
            "requests answered by the new replica",
            lambda: any(o.pod == new_name for o in load.successes()),
            30,
        )

    served_by = {outcome.pod for outcome in load.successes()}
    measurements(
        f"rollout finished {rollout_seconds:.1f}s after the spec change; {len(load.outcomes)} requests "
        f"({len(load.failures())} failed, {load.seconds_without_endpoints:.1f}s without a serving pod)"
    )
    assert not load.failures(), load.failures()[:3]
    assert load.seconds_without_endpoints == 0.0
    assert {old_name, new_name} <= served_by
    args = new_pod["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "6"
    service = api.get(services_path(namespace, "rolling"))
    assert service["status"]["observedGeneration"] == changed["metadata"]["generation"]
    replica_sets = api.get(
        f"/apis/apps/v1/namespaces/{namespace}/replicasets", labelSelector=service_selector("rolling")
    )["items"]
    assert sorted(rs["spec"]["replicas"] for rs in replica_sets) == [0, 1]
