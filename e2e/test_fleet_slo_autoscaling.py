"""The slo policy with real replicas, and the simulator beside them.

One replica of the small model is calibrated through the fleet gateway (`kvfleet simulate calibrate`'s
measurement), and the rate it answers requests at with its places always full is measured there too. Then a
generated trace is replayed through the gateway, every request streamed, open loop: from a share of that rate
it doubles at a steady pace until the fleet grows (the machine's speed, shared with other tests, may differ
from the measurement's by several times), holds, comes back down as fast to half its start and goes on at that
rate until the fleet has shrunk back to one replica. The fleet must grow before the rate is far past what one
replica answered, keep its p90 time to first token within the target, shrink without flapping, fail no request
as replicas go (streams included), and say why with the numbers. The simulator then runs the same trace on the
calibrated profile with the pod start the real fleet showed; its TTFT percentiles and replica counts are
printed beside the real ones, and the real percentiles of the requests outside the pod starts (the measured
error is in docs/benchmarks.md). The target holds for those: a starting pod here takes the cores of the
replica already serving, which a fleet's pods, on nodes of their own, do not.

The small model, not the tiny one: each replica computes on one thread, and the small model's steps (about
9 ms a decode step, 0.6 ms a prompt token) keep that thread's core busy, where the servers, the gateway and
the clients relaying the tokens take a few percent of a core beside them. The tiny model's steps took less
time than relaying their tokens, so on two shared cores the replicas ran at the speed of the whole machine's
load, which a profile fitted to one replica cannot know.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy
from kvfleet.runtime.bench.serve_client import bench_client, send_workload
from kvfleet.runtime.bench.serve_report import RequestResult

from e2e.cluster import LocalCluster
from e2e.fleet.gateway import serve_through_gateway
from e2e.fleet.manifests import services_path, tiny_service
from e2e.fleet.observe import ReplicaHistory, ReplicaSample, events_for
from e2e.fleet.replay import replay_at_rate, trace_workload
from e2e.fleet.traffic import ReadyEndpoints
from e2e.support.waits import wait_for
from kvfleet.simulate.calibrate import describe, fit_profile, measure
from kvfleet.simulate.engine import EngineProfile
from kvfleet.simulate.fleet import Simulation, load_config
from kvfleet.simulate.trace import TraceRequest, TraceShapeSpec, generate

MAX_NUM_SEQS = 2
SCALING = {
    "replicas": None,
    "minReplicas": 1,
    "maxReplicas": 2,
    "policy": "slo",
    "stableWindowSeconds": 10,
    # The demand is never taken below this window's mean: at the tail's rate on a slow machine (a request a
    # second or less), two scrapes hold one or two prompts, and a chance cluster of four or five in them looks
    # like more than a replica serves. Six scrapes are a rate.
    "panicWindowSeconds": 6,
    # Past the stable window: a replica added for one decision may go a scale-down delay after it, and the
    # test reads the counts every 0.2 s (with the delay equal to the window, a fall read 9.8 s after its rise
    # was taken for a flap).
    "scaleDownDelaySeconds": 11,
    "metricsIntervalSeconds": 1,
    "maxScaleUpStep": 2,
}
# Where the replicas meet it with room to spare, so that the test is about scaling. The policy's decisions do
# not depend on it here: a replica is full where the gateway's waits pass the tail, long before its own
# latency line reaches the target.
TTFT_TARGET_MS = 2000
# The ramp starts at this share of the rate one replica answers through the gateway with its two places always
# full, measured before it, and doubles every DOUBLING_SECONDS until the fleet grows. A ramp to a peak set in
# advance from that rate (0.7 of it) failed in CI: the rate was measured at 0.8/s (a twentieth of a quiet
# machine's, with other tests on the cores), the peak of 0.57/s queued few requests (p90 0.36 s), and the
# fleet rightly stayed at one. Where the fleet grows is the policy's to find, at any speed of the machine.
START_SHARE_OF_ONE_REPLICA = 0.15
# At this pace a window holds its rate's rise of 41%: a trend the policy can follow, and past one replica's
# rate (from the start's share) in under a minute.
DOUBLING_SECONDS = 20.0
# The rate stops rising here, five times one replica's measured rate, and the test fails if the fleet has not
# grown by then (101 s into the ramp): far past what one replica serves on a machine as busy as when the rate
# was measured, with room for a measurement taken while other tests held the cores, as CI's was.
CEILING_SHARE_OF_ONE_REPLICA = 5.0
# At the rate it grew at: the second replica starts under the load that called for it, then the rate halves
# every DOUBLING_SECONDS down to this share of the start's.
HOLD_SECONDS = 20.0
TAIL_SHARE_OF_START = 0.5
# Then that rate goes on until the fleet has wanted one replica for a stable window (at once, where it has by
# then): the replica added for the peak goes under traffic. A starting replica takes the serving one's cores
# here, and the full load measured then, about half the first rise's (165.7 against 359.8 prompt tokens/s a
# replica in one run alone, 96 against 178 in a suite's), is what the policy remembers until it measures one
# again, as docs/benchmarks.md says. At the start's rate the chance clusters of a window's few requests came
# over that figure often enough that in a suite's run the second replica stayed through a 150 s tail, and a
# tail of a fixed 90 s failed in one suite of five.
TAIL_LIMIT_SECONDS = 150.0
PROMPT_TOKENS = 96.0
# About 0.3 s of decode steps: a replica with its two places full answers about five requests a second.
OUTPUT_TOKENS = 32.0
SHARED_PREFIX_TOKENS = 32
# Requests sent back to back, two at a time, to measure that rate.
RATE_PROBE_REQUESTS = 40
# The simulated fleet's count is compared with the real one's this often.
SERIES_SECONDS = 2.0
# The real first tokens' p90 is printed for each such part of the trace too.
INTERVAL_SECONDS = 15.0
# A decision's reason names the latency line it fitted and the demand it sized for; until its window holds a
# latency measured under load (after the traffic, say), the policy sizes on the queue depth and says so.
SLO_REASON = re.compile(r"slo: time to first token p90 \d+ms \+ [\d.]+ms per .*; demand [\d.]+ ")
QUEUE_REASON = re.compile(r"queue depth [\d.]+ over the last \d+s, target \d+ per replica")


def steady_trace() -> Iterator[TraceRequest]:
    """The ramp's requests at one a second, without end: `replay_at_rate` stretches their gaps by its rate."""
    spec = TraceShapeSpec(
        shape="steady",
        duration_s=math.inf,
        base_rate=1.0,
        mean_prompt_tokens=PROMPT_TOKENS,
        mean_output_tokens=OUTPUT_TOKENS,
        prefix_groups=4,
        seed=1,
    )
    return generate(spec)


@dataclasses.dataclass
class Ramp:
    """The rate of the trace, decided as it is sent: from `start` it doubles every DOUBLING_SECONDS until the
    fleet wants more than one replica, holds that rate HOLD_SECONDS, halves as fast down to `tail_rate` and
    stays there until the fleet has wanted one replica for a stable window, TAIL_LIMIT_SECONDS at most. It
    stops early if it passes `ceiling` before the fleet grows. `latest` is the replica history's last
    change."""

    start: float
    ceiling: float
    latest: Callable[[], ReplicaSample]
    # When the fleet grew, in seconds from the start, and the rate then.
    rise: tuple[float, float] | None = None
    # How long the rate stayed at `tail_rate` after the fall.
    tail: float | None = None

    @property
    def tail_rate(self) -> float:
        return TAIL_SHARE_OF_START * self.start

    @classmethod
    def measured(cls, one_replica_rate: float, latest: Callable[[], ReplicaSample]) -> Ramp:
        """The ramp for a replica that answered `one_replica_rate` requests a second with its places full."""
        start = START_SHARE_OF_ONE_REPLICA * one_replica_rate
        return cls(start, CEILING_SHARE_OF_ONE_REPLICA * one_replica_rate, latest)

    def __call__(self, seconds: float) -> float | None:
        if self.rise is None:
            rate = self.start * 2 ** (seconds / DOUBLING_SECONDS)
            if self.latest().desired > 1:
                self.rise = (seconds, rate)
            elif rate > self.ceiling:
                return None
            return rate
        rose_at, peak = self.rise
        falling_for = seconds - rose_at - HOLD_SECONDS
        fall_seconds = DOUBLING_SECONDS * math.log2(peak / self.tail_rate)
        if falling_for < fall_seconds:
            return peak * 2 ** (-max(falling_for, 0.0) / DOUBLING_SECONDS)
        tail = falling_for - fall_seconds
        if tail < TAIL_LIMIT_SECONDS and not settled_at_one(self.latest()):
            return self.tail_rate
        self.tail = tail
        return None

    def describe(self) -> str:
        if self.rise is None:
            return (
                f"from {self.start:.2f}/s, doubling every {DOUBLING_SECONDS:g}s, past {self.ceiling:.2f}/s "
                "with one replica"
            )
        rose_at, peak = self.rise
        return (
            f"from {self.start:.2f}/s, doubling every {DOUBLING_SECONDS:g}s until the fleet grew "
            f"{rose_at:.1f}s in at {peak:.2f}/s, held {HOLD_SECONDS:g}s and down as fast, then "
            f"{self.tail or 0.0:.1f}s at {self.tail_rate:.2f}/s"
        )


def ramp_service(model_dir: Path) -> dict[str, Any]:
    """The autoscaled service of the small model, its p90 time to first token held to the target."""
    # Room for calibration's longest prompt (1,024 tokens) and the trace's.
    engine = {"maxNumSeqs": MAX_NUM_SEQS, "maxModelLen": 1280}
    sla = {"ttftTargetMilliseconds": TTFT_TARGET_MS, "percentile": 90}
    model = {"servedName": "small"}
    return tiny_service("ramp", model_dir, model=model, engine=engine, scaling=SCALING, sla=sla)


def rate_with_places_full(url: str, model: str, vocab_size: int) -> float:
    """Requests a second answered when each of MAX_NUM_SEQS clients sends its next request, shaped as the
    ramp's are, as soon as its last one is answered. The prompts are sent reversed: trace_workload gives the
    n-th request of any trace the same ids after its prefix group's, and the ramp's must not find these in the
    prefix cache."""
    shaped = trace_workload(
        itertools.islice(steady_trace(), RATE_PROBE_REQUESTS), vocab_size, SHARED_PREFIX_TOKENS
    )
    at_once = [
        dataclasses.replace(request, send_at=0.0, prompt_token_ids=request.prompt_token_ids[::-1])
        for request in shaped
    ]

    async def run() -> float:
        async with bench_client(url, MAX_NUM_SEQS, 300.0) as client:
            results, seconds = await send_workload(client, model, at_once, max_concurrency=MAX_NUM_SEQS)
        failed = [result.error for result in results if not result.ok]
        assert not failed, failed[:3]
        return len(results) / seconds

    return asyncio.run(run())


def as_sent(results: list[RequestResult]) -> list[TraceRequest]:
    """The replayed requests at the moments they were sent: the trace the simulator runs. steady_trace is
    seeded, so it yields the replayed requests again, in the order they were sent."""
    return [
        dataclasses.replace(request, arrival_s=result.start_time)
        for result, request in zip(results, steady_trace(), strict=False)
    ]


def simulate(
    manifest: dict[str, Any], profile: EngineProfile, trace: list[TraceRequest], starts: list[float]
) -> dict[str, Any]:
    """The simulator's run of the trace on the service, its replicas starting as fast as the real ones did."""
    config = load_config(
        manifest["spec"],
        profile,
        pod_start_s=float(numpy.mean(starts)) if starts else 0.0,
        shared_prefix_tokens=SHARED_PREFIX_TOKENS,
        initial_replicas=1,
        series_interval_s=SERIES_SECONDS,
    )
    return Simulation(config).run(iter(trace))


def simulated_beside(
    simulated: dict[str, Any], samples: list[ReplicaSample], began: float, ended: float
) -> str:
    """The simulated run's percentiles, and how far its replica counts were from the real ones'."""
    gaps = [
        abs(point["desired"] - desired_at(samples, began + point["time_s"]))
        for point in simulated["series"]
        if began + point["time_s"] <= ended
    ]
    return (
        f"simulated {simulated['ttft_p50_s']:.3f}/{simulated['ttft_p90_s']:.3f} s; simulated replicas "
        f"differ from the real ones by at most {max(gaps, default=0)} over {len(gaps)} intervals of "
        f"{SERIES_SECONDS:g}s"
    )


def pod_starts(samples: list[ReplicaSample]) -> list[tuple[float, float]]:
    """For each rise of the desired count, its moment and the moment that many replicas were ready."""
    starts = []
    for before, sample in itertools.pairwise(samples):
        if sample.desired > before.desired:
            ready = next((s for s in samples if s.at >= sample.at and s.ready >= sample.desired), None)
            if ready is not None:
                starts.append((sample.at, ready.at))
    return starts


def first_tokens_apart_from(
    windows: list[tuple[float, float]], results: list[RequestResult], began: float
) -> list[float]:
    """The first-token times of the requests that were not waiting for one within any of the windows."""
    return [
        result.ttft
        for result in results
        if result.ttft is not None
        and not any(
            began + result.start_time <= end and began + result.start_time + result.ttft >= start
            for start, end in windows
        )
    ]


def p50_p90(seconds: list[float]) -> tuple[float, float]:
    """The median and the 90th percentile (not a number where there are none)."""
    if not seconds:
        return math.nan, math.nan
    p50, p90 = numpy.percentile(seconds, [50, 90])
    return float(p50), float(p90)


def p90_by_interval(results: list[RequestResult], seconds: float) -> list[tuple[int, int, float]]:
    """For each `seconds` of the trace, by when its requests were sent: the interval's start, its count of
    first tokens and their 90th percentile. Where the tail was spent, for the record and a failure."""
    spans: dict[int, list[float]] = {}
    for result in results:
        if result.ttft is not None:
            start = int(result.start_time // seconds * seconds)
            spans.setdefault(start, []).append(result.ttft)
    return [(start, len(ttfts), round(p50_p90(ttfts)[1], 2)) for start, ttfts in sorted(spans.items())]


def flaps(samples: list[ReplicaSample], window: float) -> list[tuple[float, float]]:
    """Each rise of the desired count followed by a fall within `window` seconds: (rise, fall) moments."""
    pairs = itertools.pairwise(samples)
    changes = [(b.at, b.desired - a.desired) for a, b in pairs if b.desired != a.desired]
    return [
        (rise, fall)
        for rise, up in changes
        if up > 0
        for fall, down in changes
        if down < 0 and rise < fall < rise + window
    ]


def desired_at(samples: list[ReplicaSample], moment: float) -> int:
    """The desired count at a monotonic moment: the last one set before it."""
    return [s.desired for s in samples if s.at <= moment][-1]


def settled_at_one(last: ReplicaSample, since: float = -math.inf) -> bool:
    """Whether the last change left one replica wanted, a stable window ago, counted from the monotonic
    moment `since` at the earliest: at the trace's end, the window's last requests can still raise the count
    a moment after the last answer (a cluster of them seen as a rising trend), and a count read before it is
    not the last one."""
    return last.desired == 1 and time.monotonic() - max(last.at, since) >= SCALING["stableWindowSeconds"]


def test_the_slo_policy_keeps_a_ramp_within_its_target_and_scales_down_under_streams(
    local_cluster: LocalCluster,
    gateway: ReadyEndpoints,
    namespace: str,
    small_model_dir: Path,
    measurements: Callable[[str], None],
) -> None:
    api = local_cluster.api
    manifest = ramp_service(small_model_dir)
    model = serve_through_gateway(local_cluster, gateway, namespace, manifest)
    (front,) = gateway.current()[:1]
    front_url = f"http://{front.ip}:{front.port}"
    # Through the gateway, as the trace's requests go: its time is part of what they see.
    profile = fit_profile(measure(front_url, MAX_NUM_SEQS, model), EngineProfile(max_num_seqs=MAX_NUM_SEQS))
    vocab_size = json.loads((small_model_dir / "config.json").read_text())["vocab_size"]
    one_replica_rate = rate_with_places_full(front_url, model, vocab_size)
    workload = trace_workload(steady_trace(), vocab_size, SHARED_PREFIX_TOKENS)

    with ReplicaHistory(api, namespace, "ramp") as history:
        ramp = Ramp.measured(one_replica_rate, latest=lambda: history.snapshot()[-1])
        # The calibration's requests were load too: the ramp starts from one replica.
        wait_for("one replica wanted", lambda: history.snapshot() and history.snapshot()[-1].desired == 1, 60)
        # ... and a stable window with none of its requests, which would be taken for the ramp's.
        time.sleep(SCALING["stableWindowSeconds"])
        began, load_before = time.monotonic(), os.getloadavg()[0]
        results = replay_at_rate(front_url, model, workload, ramp)
        ended, load_after = time.monotonic(), os.getloadavg()[0]
        wait_for("back to one replica for good", lambda: settled_at_one(history.snapshot()[-1], ended), 120)
    samples = history.snapshot()

    failed = [result.error for result in results if not result.ok]
    real_p50, real_p90 = p50_p90([result.ttft for result in results if result.ttft is not None])
    windows = pod_starts(samples)
    starts = [ready - rise for rise, ready in windows]
    # A starting pod takes the cores the running replica computes on (all share this machine's two); a real
    # fleet's replica starts on a node of its own, as the simulator's do.
    apart = first_tokens_apart_from(windows, results, began)
    apart_p50, apart_p90 = p50_p90(apart)
    counts = history.desired_counts()
    status = api.get(services_path(namespace, "ramp"))["status"]
    events = events_for(api, namespace, "ramp")
    scale_ups = [event["message"] for event in events if event["reason"] == "ScaledUp"]

    real_changes = [(round(s.at - began, 1), s.desired) for s in samples]
    # The operator's decisions, for the record and a failure's message.
    decisions = [
        (event["reason"], event["message"]) for event in events if event["reason"].startswith("Scaled")
    ]
    summary = (
        f"slo ramp: one replica answered {one_replica_rate:.1f}/s with its places full; "
        f"{len(results)} requests {ramp.describe()}; "
        f"calibrated {describe(profile)}; {len(failed)} failed; desired {counts} "
        f"(seconds into the ramp, count: {real_changes}), pod starts {[round(s, 1) for s in starts]} s; "
        f"TTFT p50/p90 real {real_p50:.3f}/{real_p90:.3f} s ({apart_p50:.3f}/{apart_p90:.3f} s outside "
        f"the pod starts, {len(apart)} of {len(results)} requests; by {INTERVAL_SECONDS:g}s of the trace, "
        f"sent from, count, p90: "
        f"{p90_by_interval(results, INTERVAL_SECONDS)}), "
        f"{simulated_beside(simulate(manifest, profile, as_sent(results), starts), samples, began, ended)}; "
        f"decisions {decisions}; load average {load_before:.1f} before the trace, {load_after:.1f} after"
    )
    measurements(summary)

    assert not failed, failed[:3]
    # Held to the target outside the pod starts, where most requests are (above: the requests sent during one
    # wait on how this test bed shares its two cores; a whole trace's p90 of 4.0 s on a slow machine, where
    # the simulator, whose pods start on nodes of their own as a fleet's do, gave 0.3 s). The whole summary: a
    # failure's output may not reach the measurements printed at the end of the run.
    assert len(apart) >= len(results) / 2, summary
    assert apart_p90 <= TTFT_TARGET_MS / 1000, summary
    # Grown on the way up, before the rate passed five times what one replica answered, and back to one.
    assert ramp.rise is not None and counts[-1] == 1, summary
    # A replica went while the trace was still sending: its streams finished (none failed, above).
    went = any(b.desired < a.desired and b.at < ended for a, b in itertools.pairwise(samples))
    assert went, (real_changes, round(ended - began, 1), decisions)
    assert not flaps(samples, SCALING["stableWindowSeconds"]), (real_changes, decisions)
    reason = status["lastScaleReason"]
    assert SLO_REASON.search(reason) or QUEUE_REASON.search(reason), reason
    assert scale_ups and all(SLO_REASON.search(message) for message in scale_ups), scale_ups
