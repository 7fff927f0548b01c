"""Queue-depth autoscaling with real replicas: a burst of chat requests fills the waiting queue, the operator
adds a replica (the reaction time, and the time from the decision to the new replica's first answer, are
measured and printed), and once idle the fleet returns to minReplicas
after the scale-down delay without flapping. Short windows from the spec keep this to about a minute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from e2e.cluster import LocalCluster
from e2e.fleet.chart import OperatorRelease
from e2e.fleet.manifests import services_path, tiny_service
from e2e.fleet.observe import ReplicaHistory, events_for, wait_ready
from e2e.fleet.traffic import ChatLoad, ReadyEndpoints
from e2e.support.waits import wait_for

SCALING = {
    "replicas": None,
    "minReplicas": 1,
    "maxReplicas": 2,
    # Two sequences at a time per replica and 8 clients: about 6 wait, and 8 in all want 4 replicas.
    "targetQueueDepth": 2,
    "stableWindowSeconds": 6,
    "panicWindowSeconds": 2,
    "scaleDownDelaySeconds": 6,
    "metricsIntervalSeconds": 1,
    "maxScaleUpStep": 1,
}
CLIENTS = 8
SCALE_UP_BOUND_SECONDS = 15.0
NEW_REPLICA_READY_BOUND_SECONDS = 90.0


def test_burst_scales_up_and_idle_scales_back_without_flapping(
    local_cluster: LocalCluster,
    kvfleet_release: OperatorRelease,
    namespace: str,
    tiny_model_dir: Path,
    measurements: Callable[[str], None],
) -> None:
    api = local_cluster.api
    manifest = tiny_service("burst", tiny_model_dir, engine={"maxNumSeqs": 2}, scaling=SCALING)
    api.create(services_path(namespace), manifest)
    wait_ready(api, namespace, "burst")

    with (
        ReplicaHistory(api, namespace, "burst") as history,
        ReadyEndpoints(api, namespace, "burst") as endpoints,
    ):
        first_replicas = {endpoint.pod for endpoint in endpoints.refresh()}
        with ChatLoad(endpoints, CLIENTS, max_tokens=192) as load:
            burst_began = time.monotonic()
            decided = wait_for(
                "a scale-up", lambda: history.first(lambda s: s.desired >= 2), SCALE_UP_BOUND_SECONDS
            )
            ready = wait_for(
                "the new replica Ready",
                lambda: history.first(lambda s: s.ready >= 2),
                NEW_REPLICA_READY_BOUND_SECONDS,
            )
            # Both replicas take traffic before the burst ends.
            wait_for(
                "requests answered by both replicas", lambda: len({o.pod for o in load.successes()}) >= 2, 30
            )
        idle_since = time.monotonic()
        scale_up_seconds = decided.at - burst_began
        first_answer = min(o.finished for o in load.successes() if o.pod not in first_replicas)
        measurements(
            f"scale-up reaction: replicas 1 -> 2 decided {scale_up_seconds:.1f}s after the burst began, "
            f"new replica Ready after {ready.at - burst_began:.1f}s, its first answer "
            f"{first_answer - decided.at:.1f}s after the decision; "
            f"{len(load.successes())} requests answered, {len(load.failures())} failed"
        )
        assert not load.failures(), load.failures()[:3]

        scaled_down = wait_for(
            "back to minReplicas", lambda: history.first(lambda s: s.at > idle_since and s.desired == 1), 90
        )
        measurements(f"back to 1 replica {scaled_down.at - idle_since:.1f}s after the load stopped")
        # No flapping: it stays at minReplicas through several more autoscaler passes.
        time.sleep(3 * SCALING["metricsIntervalSeconds"] + 2)
    assert history.desired_counts() == [1, 2, 1], history.snapshot()
    assert scaled_down.at - idle_since >= SCALING["scaleDownDelaySeconds"]
    reasons = [event["reason"] for event in events_for(api, namespace, "burst")]
    assert reasons.count("ScaledUp") == 1 and reasons.count("ScaledDown") == 1, reasons
    status = api.get(services_path(namespace, "burst"))["status"]
    assert status["desiredReplicas"] == 1 and "queue depth" in status["lastScaleReason"]
