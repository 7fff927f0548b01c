"""The KV connector interface, shaped like vLLM v1's: a scheduler-side half that decides what moves (asked by
admission, told when requests finish) and a worker-side half beside the paged cache that moves it. What the
scheduler side decides travels to the worker side in SchedulerOutput (KVConnectorMetadata); what the worker
side finished comes back in ModelRunnerOutput (KVConnectorOutput). The transport stays behind the worker
side, so a GPU transport (NIXL, NCCL) is one more connector."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from kvfleet.runtime.core.outputs import SchedulerStats
    from kvfleet.runtime.request import Request


@dataclass(frozen=True)
class LoadSpec:
    """Pull remote_block_ids[i] of a prefill replica's offer into local block local_block_ids[i]."""

    request_id: str
    host: str
    port: int
    transfer_id: str
    kv_digest: bytes
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass(frozen=True)
class OfferSpec:
    """Serve these blocks to a puller presenting this transfer id and digest."""

    transfer_id: str
    block_ids: list[int]
    kv_digest: bytes


@dataclass
class KVConnectorMetadata:
    """One step's orders to the worker side."""

    loads: list[LoadSpec] = field(default_factory=list)
    offers: list[OfferSpec] = field(default_factory=list)
    # Offers to stop serving (expired); their transfer ids come back in finished_sending once withdrawn.
    withdrawals: list[str] = field(default_factory=list)
    # Loads to stop (aborted requests); they come back failed once their pull stopped writing.
    cancels: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.offers or self.withdrawals or self.cancels)


@dataclass
class KVConnectorOutput:
    """What the worker side finished since it last reported."""

    # Transfer ids whose blocks are no longer read: pulled to the end, or withdrawn.
    finished_sending: list[str] = field(default_factory=list)
    # Requests whose blocks were loaded, and those whose load failed (request id -> reason), each only once
    # the pull stopped writing into them.
    finished_recving: list[str] = field(default_factory=list)
    failed_recving: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


class KVConnectorScheduler(ABC):
    """The scheduler-side half."""

    # What a failed load leads to: "recompute" (the request computes its prompt itself) or "fail" (it ends
    # with an error).
    load_failure_policy: str = "recompute"

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens of the request past num_computed_tokens (the prefix cache's hits) that this connector can
        bring in, and whether they arrive asynchronously (the request then waits for them)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request got its blocks (block_ids: its whole table): load the num_external_tokens tokens
        after its prefix-cache hits into them."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """This step's orders to the worker side; what was ordered is forgotten here."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished: whether its blocks must wait (for a pull) before they are freed, and the
        kv_transfer_params its answer carries."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> list[str]:
        """Take the worker side's report; the requests whose held blocks may now be freed."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Whether blocks are held for pulls or orders wait for the worker side: the engine keeps stepping."""

    @abstractmethod
    def fill_stats(self, stats: SchedulerStats) -> None:
        """Add this half's counters (fallbacks, blocks held) to the step's stats."""

    def set_xfer_handshake_metadata(self, metadata: dict[str, Any]) -> None:  # noqa: B027 (optional)
        """What the worker side reports once its transport is up (the port its server took)."""


class KVConnectorWorker(ABC):
    """The worker-side half, beside the paged cache."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The paged cache, once allocated: the transport reads and writes its blocks."""

    def get_handshake_metadata(self) -> dict[str, Any]:
        """What the scheduler side needs of the transport (see set_xfer_handshake_metadata)."""
        return {}

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Carry out a step's orders; loads run in the background and never hold the step."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """What finished since the last call."""

    @abstractmethod
    def wait(self, timeout: float) -> None:
        """Return when a load ends, or after timeout: a step with nothing to run waits here instead of
        spinning."""

    @abstractmethod
    def fill_stats(self, stats: SchedulerStats) -> None:
        """Add the transport's counters (blocks, bytes, seconds pulled) to the step's stats."""

    @abstractmethod
    def close(self) -> None: ...
