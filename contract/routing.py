"""The fleet gateway's routing policies, as `kvfleet gateway --policy` and an InferenceService's
`spec.routing.policy` name them (kvfleet.gateway.routing describes each)."""

from __future__ import annotations

from typing import Literal, get_args

PolicyName = Literal["round-robin", "least-request", "prefix-hash", "cache-aware", "precise-prefix"]
POLICY_NAMES: tuple[PolicyName, ...] = get_args(PolicyName)
DEFAULT_POLICY: PolicyName = "least-request"
