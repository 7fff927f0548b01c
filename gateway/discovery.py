"""Where the gateway learns which models exist and which replicas serve them.

A discovery source publishes the whole fleet as a mapping of model name to ModelConfig each time it changes;
the static source does it once (local use and tests), the Kubernetes one on every change of an
InferenceService or of its replicas' pods (kvfleet.gateway.kube). The LoRA adapters each replica serves are
learnt from the replicas themselves (kvfleet.gateway.adapters).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvfleet.contract.routing import DEFAULT_POLICY, PolicyName
from kvfleet.contract.tiers import DEFAULT_TIER, TIERS
from kvfleet.gateway.routing import DEFAULT_LOAD_BOUND, DEFAULT_PREFIX_CHARS

DEFAULT_MAX_IN_FLIGHT = 32
DEFAULT_HOLD_SECONDS = 60.0
# Disaggregated prefill and decode: a prompt with fewer new tokens than this on the chosen decode replica (its
# length less the prefix that replica is taken to cache) is prefilled there, skipping the prefill replicas, as
# llm-d's selective P/D does. 256 tokens are 16 KV blocks of the runtime's default block size and an eighth of
# its default step budget (2048 tokens with chunked prefill): the decodes sharing that step are barely slowed,
# whereas a prefill call and the pull of its blocks would add two round trips to the request's first token. A
# chat turn whose history the decode replica caches stays there, and long prompts, whose prefill is what
# stalls the decodes, go to the prefill replicas. (llm-d's decider is off unless configured; its P/D guide
# disaggregates from 16 new tokens, nearly every request.)
DEFAULT_PD_THRESHOLD_TOKENS = 256


@dataclass(frozen=True)
class ClientKey:
    """The API key a model's clients must send (its service's Secret), kept as a SHA-256 digest; a None digest
    means the Secret could not be read, and the model's requests are refused until it can."""

    sha256: bytes | None


@dataclass(frozen=True)
class ModelConfig:
    """One model as the gateway routes it."""

    # What clients ask for: an InferenceService's model is `NAMESPACE/SERVED_NAME` (see Fleet.resolve).
    name: str
    # Base URLs of the ready replicas, e.g. http://10.0.0.7:8000; empty while the model is at zero. Of a model
    # with prefill replicas, the decode replicas.
    endpoints: tuple[str, ...]
    # Disaggregated prefill and decode: the ready replicas that compute prompts for the decode replicas (see
    # kvfleet.contract.kv_transfer). None ready: the decode replicas compute their prompts themselves.
    prefill_endpoints: tuple[str, ...] = ()
    pd_threshold_tokens: int = DEFAULT_PD_THRESHOLD_TOKENS
    policy: PolicyName = DEFAULT_POLICY
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    load_bound: float = DEFAULT_LOAD_BOUND
    # Requests the gateway sends one replica at most; the rest wait in the gateway's tier-ordered queue.
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    # Whether the replicas preempt less urgent requests to run a more urgent one (the `priority` scheduling
    # policy), or run what they are sent in arrival order (`fcfs`, the runtime's default).
    replicas_preempt: bool = False
    # How long a request may wait for a usable replica (a model at zero: for one to start).
    hold_seconds: float = DEFAULT_HOLD_SECONDS
    # The priority of requests that name no tier: the service's own tier.
    default_priority: int = TIERS[DEFAULT_TIER]
    # For a LoRA adapter: the base model whose replicas serve it (its endpoints are those that hold it).
    adapter_of: str | None = None
    # The key clients must send, checked before a request is queued (so none can wake a model at zero).
    client_key: ClientKey | None = None
    # Whether the client's Authorization header goes on to the replicas. An InferenceService's replicas get
    # it only once the gateway checked it is their own key, and those without a key get none; replicas given
    # with --model check their own key, unknown to the gateway.
    forward_authorization: bool = True
    # The namespace of the service it belongs to ("" for --model replicas): its adapters are routed under it.
    namespace: str = ""
    # The name its replicas serve it under, when it differs from `name`.
    served_name: str = ""
    # Of a service that keeps replicas asleep (spec.scaling.sleepingReplicas), its started replicas that are
    # not ready: a request that finds no ready replica wakes one of them (POST /wake_up) and goes there.
    sleeping_endpoints: tuple[str, ...] = ()
    # Whether its replicas continue a request from the tokens another replica delivered (kvfleet's
    # `continuation`). vLLM's do not, and would start it again: their streams are relayed as they come,
    # and one whose replica fails mid-way ends there instead of being resumed.
    replicas_resume: bool = True

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name


Publish = Callable[[Mapping[str, ModelConfig]], None]


class Discovery(Protocol):
    async def run(self, publish: Publish) -> None:
        """Publishes the fleet now and on every change, until cancelled."""
        ...


class StaticDiscovery:
    """A fixed fleet, e.g. from `--model NAME=URL[,URL...]` and `--prefill`/`--decode` options."""

    def __init__(self, models: Mapping[str, ModelConfig]) -> None:
        self._models = dict(models)

    async def run(self, publish: Publish) -> None:
        publish(self._models)
        await asyncio.Event().wait()
