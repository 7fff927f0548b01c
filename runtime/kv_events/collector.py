"""What a step changed in the prefix cache, as KV events: the device's block pool and the host tier report
here as they register, spill and evict blocks, and the engine core takes the step's events once it ran.

A block spilled to the host tier is announced like a stored one, with its parent and tokens, so a router that
never saw it on the device can still place it in its prompt's chain: with a host tier, the collector keeps
what it announced of every block one of the tiers holds (its tokens packed, 8 bytes each), and forgets it
when neither does.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvfleet.contract.block_hash import BlockHash, external_block_hash
from kvfleet.contract.kv_events import MEDIUM_DEVICE, MEDIUM_HOST
from kvfleet.runtime.kv_events.config import KVEventsConfig
from kvfleet.runtime.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvfleet.runtime.lora.request import LoRARequest


class KVEventSink(Protocol):
    def stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora: LoRARequest | None,
    ) -> None:
        """Consecutive blocks of one prompt registered in the device's prefix cache: `parent` is the hash of
        the block before the first (None at a chain's start), `token_ids` their tokens, `lora` their adapter
        (None for the base model)."""

    def evicted(self, block_hash: BlockHash) -> None:
        """A device block left the prefix cache to be reused."""

    def spilled(self, block_hash: BlockHash) -> None:
        """A block the device is evicting is now held by the host tier."""

    def dropped_from_host(self, block_hash: BlockHash) -> None:
        """The host tier let go of a prefix block."""

    def cleared(self) -> None:
        """The prefix cache of both tiers was reset."""

    def take(self) -> list[KVEvent]:
        """The events since the last take, in the order they happened."""


class NullKVEventSink:
    """Where the prefix cache reports when no events are published: nothing is kept."""

    def stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora: LoRARequest | None,
    ) -> None:
        pass

    def evicted(self, block_hash: BlockHash) -> None:
        pass

    def spilled(self, block_hash: BlockHash) -> None:
        pass

    def dropped_from_host(self, block_hash: BlockHash) -> None:
        pass

    def cleared(self) -> None:
        pass

    def take(self) -> list[KVEvent]:
        return []


def make_event_sink(config: KVEventsConfig | None, block_size: int, *, host_tier: bool) -> KVEventSink:
    """A collector when events are published (`host_tier`: whether device blocks may spill), else the null
    sink."""
    if config is None or not config.publishes:
        return NullKVEventSink()
    return KVEventCollector(block_size, remembers_blocks=host_tier)


@dataclass
class _Announced:
    """What a BlockStored said of a block, and which tiers hold it now."""

    parent: int | None
    token_ids: array[int]
    lora: LoRARequest | None
    on_device: bool = False
    on_host: bool = False


class KVEventCollector:
    def __init__(self, block_size: int, *, remembers_blocks: bool) -> None:
        """`remembers_blocks`: keep what was announced of each block, for its spill to the host tier."""
        self._block_size = block_size
        self._remembers_blocks = remembers_blocks
        self._events: list[KVEvent] = []
        self._announced: dict[BlockHash, _Announced] = {}
        # Blocks a tier let go of this step, forgotten at take() unless a tier holds them again.
        self._unheld: list[BlockHash] = []

    def stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora: LoRARequest | None,
    ) -> None:
        if self._remembers_blocks:
            self._remember(block_hashes, parent, token_ids, lora)
        self._events.append(
            BlockStored(
                block_hashes=[external_block_hash(block_hash) for block_hash in block_hashes],
                parent_block_hash=None if parent is None else external_block_hash(parent),
                token_ids=list(token_ids),
                block_size=self._block_size,
                lora_id=None if lora is None else lora.lora_int_id,
                medium=MEDIUM_DEVICE,
                lora_name=None if lora is None else lora.lora_name,
            )
        )

    def _remember(
        self,
        block_hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        lora: LoRARequest | None,
    ) -> None:
        block_size = self._block_size
        external_parent = None if parent is None else external_block_hash(parent)
        for index, block_hash in enumerate(block_hashes):
            block = self._announced.get(block_hash)
            if block is None:
                block_tokens = array("q", token_ids[index * block_size : (index + 1) * block_size])
                block = self._announced[block_hash] = _Announced(external_parent, block_tokens, lora)
            block.on_device = True
            external_parent = external_block_hash(block_hash)

    def evicted(self, block_hash: BlockHash) -> None:
        block = self._announced.get(block_hash)
        if block is not None:
            block.on_device = False
            self._unheld.append(block_hash)
        self._removed(block_hash, MEDIUM_DEVICE)

    def spilled(self, block_hash: BlockHash) -> None:
        block = self._announced.get(block_hash)
        if block is None:  # never announced (registered before a reset): nothing to say of it
            return
        block.on_host = True
        self._events.append(
            BlockStored(
                block_hashes=[external_block_hash(block_hash)],
                parent_block_hash=block.parent,
                token_ids=block.token_ids.tolist(),
                block_size=self._block_size,
                lora_id=None if block.lora is None else block.lora.lora_int_id,
                medium=MEDIUM_HOST,
                lora_name=None if block.lora is None else block.lora.lora_name,
            )
        )

    def dropped_from_host(self, block_hash: BlockHash) -> None:
        block = self._announced.get(block_hash)
        if block is not None:
            block.on_host = False
            self._unheld.append(block_hash)
        self._removed(block_hash, MEDIUM_HOST)

    def cleared(self) -> None:
        self._announced.clear()
        self._unheld.clear()
        # What happened before the reset no longer matters to anyone reading this step's batch.
        self._events = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        # Forgotten only now: a device block is reported evicted just before the host tier takes it.
        for block_hash in self._unheld:
            block = self._announced.get(block_hash)
            if block is not None and not block.on_device and not block.on_host:
                del self._announced[block_hash]
        self._unheld.clear()
        events, self._events = self._events, []
        return events

    def _removed(self, block_hash: BlockHash, medium: str) -> None:
        """Evictions of one medium in a row share one BlockRemoved."""
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external_block_hash(block_hash))
        else:
            self._events.append(BlockRemoved(block_hashes=[external_block_hash(block_hash)], medium=medium))
