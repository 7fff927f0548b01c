"""The KV transfer counters of the engine's stats on /metrics: kvfleet's names, and vLLM's NixlConnector
names for the pulls."""

from __future__ import annotations

from kvfleet.runtime.core.outputs import SchedulerStats
from kvfleet.runtime.kv_transfer.tcp_connector import fallback_reason
from kvfleet.runtime.metrics import ServerMetrics


def _samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_transfer_counters_are_exported() -> None:
    stats = SchedulerStats(0, 0, 0, 0.0, 0, 0, 0)
    stats.kv_transfer_loads = 3
    stats.kv_transfer_blocks_pulled = 7
    stats.kv_transfer_bytes_pulled = 7 * 4096
    stats.kv_transfer_pull_seconds = 0.25
    stats.kv_transfer_fallbacks = {"timeout": 2, "unreachable": 1}
    stats.kv_transfer_holds_expired = 4
    stats.kv_transfer_blocks_held = 5
    metrics = ServerMetrics("m")
    metrics.set_stats_source(lambda: stats)
    samples = _samples(metrics.render().decode())
    label = '{model_name="m"}'
    assert samples[f"kvfleet:kv_transfer_loads_total{label}"] == 3
    assert samples[f"kvfleet:kv_transfer_blocks_pulled_total{label}"] == 7
    assert samples[f"kvfleet:kv_transfer_bytes_pulled_total{label}"] == 7 * 4096
    assert samples[f"kvfleet:kv_transfer_pull_seconds_total{label}"] == 0.25
    assert samples[f"kvfleet:kv_transfer_holds_expired_total{label}"] == 4
    assert samples[f"kvfleet:kv_transfer_blocks_held{label}"] == 5
    assert samples['kvfleet:kv_transfer_fallbacks_total{model_name="m",reason="timeout"}'] == 2
    assert samples['kvfleet:kv_transfer_fallbacks_total{model_name="m",reason="unreachable"}'] == 1
    assert samples[f"vllm:nixl_num_failed_transfers_total{label}"] == 3
    assert samples[f"vllm:nixl_xfer_time_seconds_count{label}"] == 3
    assert samples[f"vllm:nixl_xfer_time_seconds_sum{label}"] == 0.25
    assert samples[f"vllm:nixl_bytes_transferred_sum{label}"] == 7 * 4096


def test_fallback_reasons_are_a_bounded_set() -> None:
    assert (
        fallback_reason(
            "the block server refused the pull: the transfer is unknown, withdrawn or already pulled"
        )
        == "unknown_transfer"
    )
    assert (
        fallback_reason("the block server refused the pull: the KV digest differs from the offer's")
        == "mismatch"
    )
    assert fallback_reason("the block server refused the pull: the block layouts differ: ...") == "mismatch"
    assert fallback_reason("the load did not end within 30 s") == "timeout"
    assert (
        fallback_reason("cannot connect to 10.0.0.7:14579: [Errno 111] Connection refused") == "unreachable"
    )
    assert fallback_reason("the transfer broke off after 2 of 5 blocks: peer closed") == "unreachable"
    assert fallback_reason("something new") == "error"
