"""The metric names a replica and the gateway export and that their readers (the operator's autoscaler,
the gateway's adapter poll, dashboards) look for.

A replica exports each metric under kvfleet's name and, where vLLM has one, under vLLM's, so that vLLM's
dashboards and autoscalers work unchanged; a reader tries kvfleet's name first, then vLLM's, so that vLLM
pods scale too. The names below are without their prefix unless they are kvfleet's alone.
"""

from __future__ import annotations

KVFLEET_PREFIX = "kvfleet:"
VLLM_PREFIX = "vllm:"
PREFIXES = (KVFLEET_PREFIX, VLLM_PREFIX)
# The autoscaler's inputs: the queue depth to scale on, the running batch, the fraction of KV cache blocks
# in use (0 to 1), the time to first token and the time between a request's output tokens (histograms: their
# _sum and _count).
WAITING = "num_requests_waiting"
RUNNING = "num_requests_running"
KV_CACHE_USAGE = "kv_cache_usage_perc"
TTFT = "time_to_first_token_seconds"
ITL = "inter_token_latency_seconds"
# Their buckets' upper bounds (+Inf besides), in seconds: the autoscaler reads a percentile from them.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0,
)  # fmt: skip
# Counters (their samples end in _total) of the prompt tokens of requests whose prefill finished and of the
# tokens generated: the token throughput the `slo` policy sizes a fleet on.
PROMPT_TOKENS = "prompt_tokens"
GENERATION_TOKENS = "generation_tokens"
# A gauge of the prompt tokens a replica has still to compute, of its waiting and running requests (tokens
# loaded from a prefill replica are not computed): the backlog a disaggregated service's prefill role is
# scaled on. kvfleet's alone (vLLM has none).
QUEUED_PROMPT_TOKENS = KVFLEET_PREFIX + "num_queued_prompt_tokens"
# One series per LoRA adapter a replica serves, its name in the LORA_NAME label and its lora_int_id (the seed
# of its prefix-cache block hashes, kvfleet.contract.block_hash) in the LORA_INT_ID label: how the gateway
# learns where each adapter runs and how to hash its prompts (/metrics needs no API key, /v1/models does).
LORA_ADAPTER_INFO = KVFLEET_PREFIX + "lora_adapter_info"
LORA_NAME_LABEL = "lora_name"
LORA_INT_ID_LABEL = "lora_int_id"
# KV-cache events, counters (kvfleet's alone): events a replica published, batches it dropped from its full
# queue (each a gap its subscribers see in the sequence numbers), and batches it sent again on replay
# requests.
KV_EVENTS_PUBLISHED = KVFLEET_PREFIX + "kv_events_published"
KV_EVENT_BATCHES_DROPPED = KVFLEET_PREFIX + "kv_event_batches_dropped"
KV_EVENT_BATCHES_REPLAYED = KVFLEET_PREFIX + "kv_event_batches_replayed"
# Continuations a replica served (requests resumed from tokens another replica delivered), and the output
# tokens they brought that it prefilled again (counters, kvfleet's alone).
RESUMED_REQUESTS = KVFLEET_PREFIX + "resumed_requests"
RESUMED_TOKENS = KVFLEET_PREFIX + "resumed_tokens"
# Requests the gateway holds for a model, by its `model` label: the autoscaler scales a model at zero
# replicas back to one on it.
GATEWAY_QUEUE_DEPTH = "kvfleet_gateway_queue_depth"
# The gateway's counters, by `model`: requests sent to a replica (retries included), requests it refused
# (its queue full, shed, held past their time), and requests that waited in its queue because no replica had
# room for them. The autoscaler takes the refused share as demand no replica shows, and the share that waited
# as part of the latency tail that no replica measures.
GATEWAY_ROUTING_DECISIONS = "kvfleet_gateway_routing_decisions"
GATEWAY_REJECTED = "kvfleet_gateway_rejected"
GATEWAY_HELD = "kvfleet_gateway_held"
# Where a replica's start went (gauges, kvfleet's alone): seconds by phase in a `phase` label (its
# EngineCore's and its API server's, which overlap), and the seconds from the API server process's start to
# the engine being ready. `kvfleet bench startup` reads them.
STARTUP_PHASE_SECONDS = KVFLEET_PREFIX + "startup_phase_seconds"
STARTUP_SECONDS = KVFLEET_PREFIX + "startup_seconds"
PHASE_LABEL = "phase"
