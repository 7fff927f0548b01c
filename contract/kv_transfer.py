"""Disaggregated prefill and decode: the roles a replica takes, and the keys of `kv_transfer_params`, the
request and response field through which a prefill replica hands its KV blocks to a decode replica (vLLM's
protocol, so kvfleet's gateway and vLLM's proxies speak to either engine).

The exchange: the router sends the request to a prefill replica with `{DO_REMOTE_DECODE: true}` and one
output token; that answer's `kv_transfer_params` name where the blocks wait (REMOTE_* keys,
`DO_REMOTE_PREFILL: true`); the router sends the request to a decode replica with those params, which pulls
the blocks it does not already hold and generates from there.
"""

from __future__ import annotations

from typing import Literal, get_args

# An InferenceService's replicas of each role are labelled with it; the gateway routes by it.
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = get_args(Role)

# The request asks the replica to keep its blocks for a decode replica to pull (a prefill call).
DO_REMOTE_DECODE = "do_remote_decode"
# The request's prompt was computed elsewhere: pull its blocks from there (a decode call).
DO_REMOTE_PREFILL = "do_remote_prefill"
# Where the blocks wait, as the prefill replica answers them.
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_REQUEST_ID = "remote_request_id"
TP_SIZE = "tp_size"

# What a prefill call asks of the prefill replica: one token, which the router discards.
PREFILL_MAX_TOKENS = 1
