"""The routing policies, on their own and through the real gateway."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import openai
from gateway_harness import FakeReplica, model, replicas, running_gateway
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfleet.gateway.routing import (
    CACHE_CHUNK_CHARS,
    CacheAware,
    LeastRequest,
    PrefixHash,
    Prompt,
    Replica,
    RoundRobin,
)


def fleet(*loads: int) -> list[Replica]:
    return [Replica(f"http://10.0.0.{index}:8000", load) for index, load in enumerate(loads)]


def anyone(replica: Replica) -> bool:
    return True


def test_round_robin_takes_usable_replicas_in_turn() -> None:
    replicas_ = fleet(0, 0, 0)
    policy = RoundRobin()
    picks = [policy.choose(replicas_, Prompt(""), anyone) for _ in range(6)]
    assert picks == replicas_ + replicas_
    skip_middle = [policy.choose(replicas_, Prompt(""), lambda r: r is not replicas_[1]) for _ in range(4)]
    assert skip_middle == [replicas_[0], replicas_[2], replicas_[0], replicas_[2]]
    assert policy.choose(replicas_, Prompt(""), lambda r: False) is None


def test_least_request_takes_the_fewest_in_flight_and_spreads_ties() -> None:
    replicas_ = fleet(3, 1, 2)
    policy = LeastRequest()
    assert policy.choose(replicas_, Prompt(""), anyone) is replicas_[1]
    assert policy.choose(replicas_, Prompt(""), lambda r: r is not replicas_[1]) is replicas_[2]
    tied = fleet(0, 0, 0)
    assert {id(policy.choose(tied, Prompt(""), anyone)) for _ in range(3)} == {id(r) for r in tied}


def _placed(policy: LeastRequest, replicas_: list[Replica], requests: int) -> int:
    """The most requests any replica holds once `requests` are placed, none finishing."""
    for _ in range(requests):
        chosen = policy.choose(replicas_, Prompt(""), anyone)
        assert chosen is not None
        chosen.in_flight += 1
    return max(replica.in_flight for replica in replicas_)


def test_least_request_over_a_large_fleet_compares_two_replicas_and_stays_balanced() -> None:
    # 10,000 requests on 1,000 replicas, 10 each on average. One random choice leaves the busiest about
    # sqrt(2 × 10 × ln 1000) ≈ 12 over the mean; two choices, about log2(ln 1000) ≈ 3.
    large = [Replica(f"http://10.0.{index // 250}.{index % 250}:8000") for index in range(1000)]
    assert _placed(LeastRequest(), large, 10_000) <= 10 + 4
    # Where neither replica drawn is usable, every one is looked at.
    only = large[617]
    assert all(
        LeastRequest(seed).choose(large, Prompt(""), lambda r: r is only) is only for seed in range(20)
    )


def test_prefix_hash_keeps_a_prefix_on_one_replica_and_spreads_prefixes() -> None:
    replicas_ = fleet(0, 0, 0, 0)
    policy = PrefixHash(prefix_chars=16)
    tenants = [f"tenant {index:04d} system prompt" for index in range(200)]
    homes = {tenant: policy.choose(replicas_, Prompt(tenant + " question A"), anyone) for tenant in tenants}
    # Only the first 16 characters count: a different question keeps the tenant's replica.
    assert all(
        policy.choose(replicas_, Prompt(tenant + " question B"), anyone) is homes[tenant]
        for tenant in tenants
    )
    spread = Counter(id(replica) for replica in homes.values())
    assert len(spread) == 4 and min(spread.values()) >= 20


def test_prefix_hash_moves_only_the_keys_of_a_removed_replica() -> None:
    replicas_ = fleet(0, 0, 0, 0)
    policy = PrefixHash()
    keys = [f"prompt {index}" for index in range(300)]
    before = {key: policy.choose(replicas_, Prompt(key), anyone) for key in keys}
    remaining = replicas_[:3]
    after = {key: policy.choose(remaining, Prompt(key), anyone) for key in keys}
    moved = [key for key in keys if after[key] is not before[key]]
    assert moved and all(before[key] is replicas_[3] for key in moved)


# A property of the choice, not of its speed: no deadline, which a busy machine would miss.
@settings(deadline=None)
@given(
    loads=st.lists(st.integers(0, 50), min_size=1, max_size=8),
    bound_percent=st.integers(100, 300),
    key=st.text(max_size=40),
)
def test_prefix_hash_never_exceeds_its_load_bound(loads: list[int], bound_percent: int, key: str) -> None:
    replicas_ = fleet(*loads)
    bound = bound_percent / 100
    chosen = PrefixHash(load_bound=bound).choose(replicas_, Prompt(key), anyone)
    assert chosen is not None
    assert chosen.in_flight + 1 <= math.ceil(bound * (sum(loads) + 1) / len(loads))


def test_prefix_hash_passes_over_a_loaded_home_replica() -> None:
    replicas_ = fleet(0, 0, 0)
    policy = PrefixHash(load_bound=1.25)
    home = policy.choose(replicas_, Prompt("shared prefix"), anyone)
    assert home is not None
    home.in_flight = 5  # the others hold none: 1.25 * 6 / 3 rounds up to 3 < 6
    elsewhere = policy.choose(replicas_, Prompt("shared prefix"), anyone)
    assert elsewhere is not home and elsewhere is not None
    assert policy.choose(replicas_, Prompt("shared prefix"), lambda r: r is home) is home, (
        "the only usable replica"
    )


def _system_prompt(tenant: int) -> str:
    # Several chunks long, as system prompts are; tenants differ from the first chunk on.
    return f"tenant {tenant:03d} " + "You answer questions about this tenant's documents. " * 8


def test_cache_aware_follows_the_longest_cached_start_and_otherwise_the_load() -> None:
    replicas_ = fleet(0, 0, 0)
    policy = CacheAware()
    homes = {}
    for tenant in range(6):
        homes[tenant] = policy.choose(replicas_, Prompt(_system_prompt(tenant) + "first question"), anyone)
        assert homes[tenant] is not None
        homes[tenant].in_flight += 1  # each new tenant, matching nothing, goes to the least loaded
    assert sorted(replica.in_flight for replica in replicas_) == [2, 2, 2]
    for replica in replicas_:
        replica.in_flight = 0
    for tenant in range(6):
        # Another question after the same system prompt: its start is cached where the first one went.
        assert (
            policy.choose(replicas_, Prompt(_system_prompt(tenant) + "another question"), anyone)
            is homes[tenant]
        )
    # Unusable or over the load bound, the home is passed over for the least loaded.
    home = homes[0]
    assert policy.choose(replicas_, Prompt(_system_prompt(0)), lambda r: r is not home) is not home
    home.in_flight = 9
    assert policy.choose(replicas_, Prompt(_system_prompt(0)), anyone) is not home


def test_cache_aware_spreads_new_prefixes_over_the_caches_of_an_idle_fleet() -> None:
    replicas_ = fleet(0, 0, 0)
    policy = CacheAware()
    # Nothing in flight anywhere: each new tenant goes where the cache holds least, not to the first replica.
    homes = [
        policy.choose(replicas_, Prompt(_system_prompt(tenant) + "a question"), anyone) for tenant in range(6)
    ]
    assert sorted(replicas_.index(home) for home in homes if home is not None) == [0, 0, 1, 1, 2, 2]


def test_cache_aware_forgets_least_recent_prompts_and_removed_replicas() -> None:
    replicas_ = fleet(0, 0)
    chunks_per_prompt = len(_system_prompt(0)) // CACHE_CHUNK_CHARS
    policy = CacheAware(cache_chars=2 * chunks_per_prompt * CACHE_CHUNK_CHARS)
    first = policy.choose(replicas_, Prompt(_system_prompt(0)), anyone)
    assert first is replicas_[0]
    first.in_flight = 1
    for tenant in (1, 2):  # two more prompts on the first replica push tenant 0 out of its index
        assert policy.choose(replicas_, Prompt(_system_prompt(tenant)), lambda r: r is first) is first
    other = replicas_[1]
    # Still loaded by one request, the first replica would take tenant 2 (cached there), not tenant 0.
    assert policy.choose(replicas_, Prompt(_system_prompt(2)), anyone) is first
    assert policy.choose(replicas_, Prompt(_system_prompt(0)), anyone) is other, "tenant 0 was evicted"
    assert policy.choose([other], Prompt(_system_prompt(2)), anyone) is other
    first.in_flight = 0
    assert policy.choose(replicas_, Prompt(_system_prompt(2)), anyone) is other, (
        "the removed replica was forgotten"
    )


def test_the_gateway_routes_a_shared_prefix_to_one_replica_under_prefix_hash() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("r0"), FakeReplica("r1"), FakeReplica("r2")) as fleet_:
            # The hashed text is "system\nYou are the assistant of tenant NNN.\nuser\n...": 48 characters end
            # before the question.
            config = model("m", *fleet_, policy="prefix-hash", prefix_chars=48)
            async with running_gateway({"m": config}) as (_, _, url):
                sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
                answered: dict[str, set[str]] = {}
                for tenant in range(12):
                    system = {"role": "system", "content": f"You are the assistant of tenant {tenant:03d}."}
                    for question in range(4):
                        chat = await sdk.chat.completions.create(
                            model="m", messages=[system, {"role": "user", "content": f"question {question}"}]
                        )
                        answered.setdefault(str(tenant), set()).add(chat.choices[0].message.content or "")
        assert all(len(served_by) == 1 for served_by in answered.values())
        assert len({replica for served_by in answered.values() for replica in served_by}) > 1

    asyncio.run(scenario())
