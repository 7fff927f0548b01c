"""Routing policies: which of a model's usable replicas takes a request.

A replica is usable when it is below its in-flight cap, the request has not failed on it already and it has
not lately said that it is draining; the pool decides that, the policy only picks among usable replicas.

- `round-robin`: the next usable replica in turn; the baseline.
- `least-request`: the usable replica with the fewest requests in flight (ties taken in turn). Past
  SAMPLED_FLEET replicas, the one with fewer of two drawn at random (Mitzenmacher's power of two choices: the
  most loaded of n replicas then holds about log log n more than the mean, against log n / log log n with one
  random choice), so that a request costs the same however large the fleet.
- `prefix-hash`: consistent hashing with bounded loads (Mirrokni et al., 2018) over the first characters of
  the prompt, so requests sharing a prefix land where that prefix is cached; a replica holding more than
  `load_bound` times the mean load (counting the new request) is passed over for the next one on the ring.
- `cache-aware`: the replica whose prefix cache most likely holds the longest start of the prompt, within the
  same load bound; with no such replica, the least loaded, then the one holding least. Each replica's cache
  is modelled by the prompts this gateway sent it, as chained hashes of fixed-size text chunks in a
  least-recently-used index of CACHE_CHARS characters per replica, so prompts that only share a system
  prompt still meet where it is cached, and prompts a replica must long have evicted stop attracting more.
  It is the approximate prefix-cache scoring of llm-d's endpoint picker: a replica's real cache is not read,
  and each gateway replica keeps its own index.
- `precise-prefix`: the replica that really caches the longest start of the prompt, within the same load
  bound, read from the replicas' own KV events (kvfleet.gateway.kv_events) in an index of which replica
  holds which block (kvfleet.gateway.kv_index). The prompt's blocks are hashed as the engine hashes them, with
  each replica's block size and its id for the request's LoRA adapter. A block the replica holds on its
  device counts 1; one only in its host tier counts HOST_BLOCK_WEIGHT. Ties go to the replica with fewest
  requests in flight, then by a hash of the prompt's start and the replica's URL: a rule that two gateway
  replicas fed the same events agree on, and that sends a new prefix's first requests to one replica even
  before its events arrive. A prompt the gateway cannot hash goes to the least loaded replica, ties broken the
  same way.

Where the gateway needs a prompt's length in tokens (disaggregated prefill), it takes CHARS_PER_TOKEN
characters of prompt text to a token, as llm-d's endpoint picker does.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from kvfleet.contract.precedence import displaces
from kvfleet.contract.routing import PolicyName
from kvfleet.gateway.kv_index import KVBlockIndex, PrefixMatch

DEFAULT_PREFIX_CHARS = 256
DEFAULT_LOAD_BOUND = 1.25
# Points per replica on the hash ring: enough that keys spread evenly over a handful of replicas.
RING_POINTS_PER_REPLICA = 160
# English text averages about this many characters to a token.
CHARS_PER_TOKEN = 4
# cache-aware: prompts are matched in chunks of this many characters (16 tokens of English text)...
CACHE_CHUNK_CHARS = 16 * CHARS_PER_TOKEN
# ...up to this many characters of each prompt, and each replica's cache is taken to hold this many.
CACHE_PROMPT_CHARS = 64 * 1024
CACHE_CHARS = 4 * 1024 * 1024
# precise-prefix: a block only the host tier holds saves the request its prefill compute, yet costs a copy
# back to the device before the request can run, and it is an older block, likelier to be gone by then.
HOST_BLOCK_WEIGHT = 0.5
# least-request: past this many replicas, a request compares two drawn at random, not all of them (when
# neither is usable, it looks at all).
SAMPLED_FLEET = 64
# How long a replica that said it is draining gets no request: long enough for discovery to take it out of
# the fleet; one still draining after that refuses the next request and is passed over again.
DRAIN_MEMORY_S = 10.0


@dataclass(eq=False)
class Replica:
    """One ready endpoint of a model, and the requests the gateway has in flight on it."""

    url: str
    in_flight: int = 0
    # The same requests by priority (smaller: more urgent).
    by_priority: Counter[int] = field(default_factory=Counter)
    # The replica's lora_int_id for each LoRA adapter it serves, by adapter name: the seed of the adapter's
    # block hashes there.
    lora_int_ids: dict[str, int] = field(default_factory=dict)
    # Until when (time.monotonic()) the pool sends it nothing: it refused a request, or handed one back,
    # because it is draining, and discovery may list it as ready a while longer.
    draining_until: float = 0.0

    def drains(self) -> None:
        """The replica said it is draining: it is passed over for DRAIN_MEMORY_S."""
        self.draining_until = time.monotonic() + DRAIN_MEMORY_S

    def in_flight_before(self, priority: int) -> int:
        """The requests in flight that are at least as urgent as `priority`: those the replica would not
        preempt for a request of that priority."""
        return sum(count for held, count in self.by_priority.items() if not displaces(priority, held))


Usable = Callable[[Replica], bool]
# The prompt's external block hashes (kvfleet.contract.block_hash) for a replica's block size and its
# lora_int_id of the request's adapter (0 for the base model).
BlockHashes = Callable[[int, int], Sequence[int]]


@dataclass(frozen=True)
class Prompt:
    """What routing knows of a request's prompt."""

    # The messages' roles and contents in order, or the completion prompt.
    text: str
    # The LoRA adapter the request names, as the replicas serve it; None for the base model.
    adapter: str | None = None
    # None when the gateway cannot hash this prompt as the engine does.
    block_hashes: BlockHashes | None = None


class Policy(Protocol):
    def choose(self, replicas: Sequence[Replica], prompt: Prompt, usable: Usable) -> Replica | None: ...

    def cached_chars(self, replicas: Sequence[Replica], prompt: Prompt) -> Mapping[str, int]:
        """By replica URL, how many of the prompt's first characters the policy takes that replica's prefix
        cache to hold; a replica not named holds none."""
        ...


class _NoCacheModel:
    """For the policies that model no replica's cache."""

    def cached_chars(self, replicas: Sequence[Replica], prompt: Prompt) -> Mapping[str, int]:
        return {}


class RoundRobin(_NoCacheModel):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[Replica], prompt: Prompt, usable: Usable) -> Replica | None:
        count = len(replicas)
        for step in range(count):
            replica = replicas[(self._next + step) % count]
            if usable(replica):
                self._next = (self._next + step + 1) % count
                return replica
        return None


class LeastRequest(_NoCacheModel):
    def __init__(self, seed: int = 0) -> None:
        self._next = 0
        self._random = random.Random(seed)

    def choose(self, replicas: Sequence[Replica], prompt: Prompt, usable: Usable) -> Replica | None:
        count = len(replicas)
        if count > SAMPLED_FLEET:
            first, second = self._below(count), self._below(count - 1)
            one, other = replicas[first], replicas[second + (second >= first)]
            # The less loaded of the two that are usable; the first drawn on a tie.
            if usable(one):
                return other if usable(other) and other.in_flight < one.in_flight else one
            if usable(other):
                return other
        return self._least(replicas, usable)

    def _below(self, count: int) -> int:
        """Random.randrange(count), drawn as it draws (CPython's _randbelow_with_getrandbits), so that a seed
        gives the same choices, without its argument checks: the cohort simulator routes every piece of
        its days through here."""
        bits = count.bit_length()
        drawn = self._random.getrandbits(bits)
        while drawn >= count:
            drawn = self._random.getrandbits(bits)
        return drawn

    def _least(self, replicas: Sequence[Replica], usable: Usable) -> Replica | None:
        """The usable replica with the fewest in flight, the first in turn from the last one chosen on a
        tie (min() keeps the first of equals)."""
        count = len(replicas)
        if not count:
            return None
        start = self._next % count
        turn = [*replicas[start:], *replicas[:start]]
        best = min(filter(usable, turn), key=_in_flight, default=None)
        if best is not None:
            self._next = (start + turn.index(best) + 1) % count
        return best


class PrefixHash(_NoCacheModel):
    def __init__(
        self, prefix_chars: int = DEFAULT_PREFIX_CHARS, load_bound: float = DEFAULT_LOAD_BOUND
    ) -> None:
        self.prefix_chars = prefix_chars
        self.load_bound = _checked(load_bound)
        self._ring_of: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def choose(self, replicas: Sequence[Replica], prompt: Prompt, usable: Usable) -> Replica | None:
        if not replicas:
            return None
        by_url = {replica.url: replica for replica in replicas}
        self._build_ring(tuple(sorted(by_url)))
        capacity = bounded_load(replicas, self.load_bound)
        start = bisect.bisect(self._points, _hash(prompt.text[: self.prefix_chars]))
        seen: set[str] = set()
        for offset in range(len(self._points)):
            url = self._owners[(start + offset) % len(self._points)]
            if url in seen:
                continue
            seen.add(url)
            replica = by_url[url]
            if usable(replica) and replica.in_flight + 1 <= capacity:
                return replica
            if len(seen) == len(by_url):
                break
        # Replicas the request may not use can leave only ones over the bound: the least loaded of those.
        candidates = [replica for replica in replicas if usable(replica)]
        return min(candidates, key=lambda replica: replica.in_flight) if candidates else None

    def _build_ring(self, urls: tuple[str, ...]) -> None:
        if urls == self._ring_of:
            return
        points = sorted(
            (_hash(f"{url}#{index}"), url) for url in urls for index in range(RING_POINTS_PER_REPLICA)
        )
        self._ring_of = urls
        self._points = [point for point, _ in points]
        self._owners = [url for _, url in points]


class CacheAware:
    def __init__(self, load_bound: float = DEFAULT_LOAD_BOUND, cache_chars: int = CACHE_CHARS) -> None:
        self.load_bound = _checked(load_bound)
        self.capacity_chunks = max(1, cache_chars // CACHE_CHUNK_CHARS)
        # Replica URL -> chunk hashes of prompts sent there, least recently used first.
        self._cached: dict[str, OrderedDict[int, None]] = {}

    def choose(self, replicas: Sequence[Replica], prompt: Prompt, usable: Usable) -> Replica | None:
        present = {replica.url for replica in replicas}
        for gone in [url for url in self._cached if url not in present]:
            del self._cached[gone]
        candidates = [replica for replica in replicas if usable(replica)]
        if not candidates:
            return None
        chunks = _chunk_hashes(prompt.text)
        capacity = bounded_load(replicas, self.load_bound)
        within = [replica for replica in candidates if replica.in_flight + 1 <= capacity] or candidates
        # Longest cached start first; among equals (no match at all included), the least loaded, then the one
        # whose cache holds least, so that new prefixes spread over the fleet's caches.
        chosen = max(
            within,
            key=lambda replica: (
                self._matched(replica.url, chunks),
                -replica.in_flight,
                -len(self._cached.get(replica.url, ())),
            ),
        )
        self._remember(chosen.url, chunks)
        return chosen

    def cached_chars(self, replicas: Sequence[Replica], prompt: Prompt) -> Mapping[str, int]:
        chunks = _chunk_hashes(prompt.text)
        return {url: self._matched(url, chunks) * CACHE_CHUNK_CHARS for url in self._cached}

    def _matched(self, url: str, chunks: list[int]) -> int:
        cached = self._cached.get(url)
        if cached is None:
            return 0
        for index, chunk in enumerate(chunks):
            if chunk not in cached:
                return index
        return len(chunks)

    def _remember(self, url: str, chunks: list[int]) -> None:
        cached = self._cached.setdefault(url, OrderedDict())
        for chunk in chunks:
            cached[chunk] = None
            cached.move_to_end(chunk)
        while len(cached) > self.capacity_chunks:
            cached.popitem(last=False)


@dataclass(frozen=True)
class Decision:
    """Why precise-prefix chose a replica (the metric's reason), and the prompt's leading blocks it holds."""

    reason: str
    match: PrefixMatch = field(default_factory=PrefixMatch)


class PrecisePrefix:
    def __init__(
        self,
        index: KVBlockIndex,
        load_bound: float = DEFAULT_LOAD_BOUND,
        record: Callable[[Decision], None] = lambda decision: None,
    ) -> None:
        """`record` is told of every choice."""
        self.index = index
        self.load_bound = _checked(load_bound)
        self._record = record

    def choose(self, replicas: Sequence[Replica], prompt: Prompt, usable: Usable) -> Replica | None:
        candidates = [replica for replica in replicas if usable(replica)]
        if not candidates:
            return None
        capacity = bounded_load(replicas, self.load_bound)
        within = [replica for replica in candidates if replica.in_flight + 1 <= capacity]
        # The last tie-break: a hash of the prompt's start and the replica, the same in every gateway.
        start = prompt.text[:DEFAULT_PREFIX_CHARS]
        if prompt.block_hashes is None:
            chosen = max(within or candidates, key=lambda r: (-r.in_flight, _hash(f"{r.url}#{start}")))
            self._record(Decision("not_tokenized"))
            return chosen
        matches = {replica.url: self._match(replica, prompt) for replica in candidates}
        chosen = max(
            within or candidates,
            key=lambda r: (matches[r.url][1], -r.in_flight, _hash(f"{r.url}#{start}")),
        )
        match, score = matches[chosen.url]
        if max(score for _, score in matches.values()) > score:
            reason = "over_load_bound"
        elif match.blocks == 0:
            reason = "no_hit"
        else:
            reason = "device_hit" if match.device_blocks else "host_hit"
        self._record(Decision(reason, match))
        return chosen

    def cached_chars(self, replicas: Sequence[Replica], prompt: Prompt) -> Mapping[str, int]:
        if prompt.block_hashes is None:
            return {}
        cached = {}
        for replica in replicas:
            match, _ = self._match(replica, prompt)
            block_size = self.index.block_size(replica.url) or 0
            cached[replica.url] = min(len(prompt.text), match.blocks * block_size * CHARS_PER_TOKEN)
        return cached

    def _match(self, replica: Replica, prompt: Prompt) -> tuple[PrefixMatch, float]:
        """The prompt's leading blocks the replica holds, and their worth in tokens."""
        assert prompt.block_hashes is not None
        block_size = self.index.block_size(replica.url)
        lora_int_id = 0 if prompt.adapter is None else replica.lora_int_ids.get(prompt.adapter)
        if block_size is None or lora_int_id is None:
            return PrefixMatch(), 0.0
        match = self.index.match(replica.url, prompt.block_hashes(block_size, lora_int_id))
        return match, (match.device_blocks + HOST_BLOCK_WEIGHT * match.host_blocks) * block_size


def estimated_tokens(chars: int) -> int:
    """The tokens of `chars` characters of prompt text, rounded up."""
    return -(-chars // CHARS_PER_TOKEN)


def _chunk_hashes(prompt_text: str) -> list[int]:
    """Chained hashes of the prompt's whole chunks: equal hashes mean equal text from the start."""
    hashes: list[int] = []
    previous = b""
    text = prompt_text[:CACHE_PROMPT_CHARS]
    for start in range(0, len(text) - CACHE_CHUNK_CHARS + 1, CACHE_CHUNK_CHARS):
        digest = hashlib.blake2b(previous + text[start : start + CACHE_CHUNK_CHARS].encode(), digest_size=8)
        previous = digest.digest()
        hashes.append(int.from_bytes(previous, "big"))
    return hashes


def _checked(load_bound: float) -> float:
    if load_bound < 1.0:
        raise ValueError("the load bound must be at least 1.0: below it no replica could take a request")
    return load_bound


def bounded_load(replicas: Sequence[Replica], load_bound: float) -> int:
    """The most requests one of `replicas` may hold under the load bound, counting the one being placed."""
    total = sum(replica.in_flight for replica in replicas) + 1
    return math.ceil(load_bound * total / len(replicas))


def make_policy(
    name: PolicyName,
    prefix_chars: int,
    load_bound: float,
    index: KVBlockIndex | None = None,
    record: Callable[[Decision], None] = lambda decision: None,
) -> Policy:
    """`index` and `record`: precise-prefix's block index (an empty one when None) and its decisions' log."""
    if name == "precise-prefix":
        return PrecisePrefix(index if index is not None else KVBlockIndex(), load_bound, record)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-request":
        return LeastRequest()
    if name == "cache-aware":
        return CacheAware(load_bound)
    return PrefixHash(prefix_chars, load_bound)


# In C: a fleet's scan for its least loaded replica calls it once a usable replica.
_in_flight = attrgetter("in_flight")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
