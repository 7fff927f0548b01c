"""TcpConnector: a decode replica pulls a prompt's KV blocks from the prefill replica that computed them, over
TCP, block by block into its own paged cache (the block transport, transport.py).

The prefill side offers a finished prompt's blocks under an unguessable transfer id and keeps them until they
are pulled to the end or `hold_timeout_s` passes. The decode side pulls only the blocks past its own
prefix-cache hits, in the background; a load that fails (refused, unknown or withdrawn transfer, digest or
layout mismatch, timeout) is counted by reason, and the request is recomputed or, under the policy "fail",
finished with an error.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfleet.runtime.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadSpec,
    OfferSpec,
)
from kvfleet.runtime.kv_transfer.config import KVTransferConfig
from kvfleet.runtime.kv_transfer.params import RemoteDecode, RemotePrefill, kv_digest, prefill_params
from kvfleet.runtime.request import RequestStatus

if TYPE_CHECKING:
    import torch
    from kvfleet.runtime.core.outputs import SchedulerStats
    from kvfleet.runtime.kv_transfer.transport import BlockPuller, BlockServer
    from kvfleet.runtime.request import Request

logger = logging.getLogger(__name__)

# The reason a load that stopped because its request ended is reported with; it is no fallback.
CANCELLED = "cancelled"
# What an empty pull's id adds to its request's (a pull that only tells a prefill replica to free its blocks).
_RELEASE = "#release"
# Fallback reasons, as metric labels: a bounded set, whatever words the transport's reasons use.
_REASON_WORDS = (
    ("unknown_transfer", ("unknown", "withdrawn", "expired")),
    ("mismatch", ("digest", "layout", "not in the offer")),
    ("timeout", ("timeout", "timed out", "did not end")),
    ("unreachable", ("connect", "broke off", "refused", "reset", "closed")),
)


def fallback_reason(reason: str) -> str:
    """The metric label of a failed load's reason."""
    text = reason.lower()
    return next((label for label, words in _REASON_WORDS if any(word in text for word in words)), "error")


@dataclass
class _Hold:
    request_id: str
    deadline: float
    num_blocks: int


class TcpConnectorScheduler(KVConnectorScheduler):
    def __init__(
        self, config: KVTransferConfig, block_size: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._config = config
        self.load_failure_policy = config.kv_load_failure_policy
        self._block_size = block_size
        self._clock = clock
        self._port = config.kv_port
        self._meta = KVConnectorMetadata()
        # Offers not yet pulled to the end, and those whose withdrawal the worker side has yet to confirm.
        self._holds: dict[str, _Hold] = {}
        self._withdrawing: dict[str, _Hold] = {}
        # Requests whose load was ordered and not yet reported; those among them that ended meanwhile.
        self._loading: set[str] = set()
        self._cancelled: set[str] = set()
        # Empty pulls ordered and not yet reported.
        self._releasing: set[str] = set()
        self.num_loads = 0
        self.num_holds_expired = 0
        self.fallbacks: Counter[str] = Counter()

    def set_xfer_handshake_metadata(self, metadata: dict[str, Any]) -> None:
        self._port = metadata.get("port", self._port)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not isinstance(request.kv_transfer, RemotePrefill):
            return 0, False
        # The prompt's last token runs here again, to give logits.
        num_external = request.num_prompt_tokens - 1 - num_computed_tokens
        if num_external <= 0:  # the prefix cache holds all of it: nothing to pull
            self._release(request)
            request.kv_transfer = None
            return 0, False
        return num_external, True

    def _release(self, request: Request) -> None:
        """An empty pull of the request's offer: the prefill replica frees its blocks now, where it would
        otherwise hold them until hold_timeout_s."""
        remote = request.kv_transfer
        assert isinstance(remote, RemotePrefill)
        release_id = request.request_id + _RELEASE
        digest = kv_digest(request)
        self._meta.loads.append(
            LoadSpec(release_id, remote.host, remote.port, remote.transfer_id, digest, [], [])
        )
        self._releasing.add(release_id)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        remote = request.kv_transfer
        assert isinstance(remote, RemotePrefill)
        block_size = self._block_size
        first = (request.num_prompt_tokens - 1 - num_external_tokens) // block_size
        end = -(-(request.num_prompt_tokens - 1) // block_size)
        self._meta.loads.append(
            LoadSpec(
                request.request_id,
                remote.host,
                remote.port,
                remote.transfer_id,
                kv_digest(request),
                remote.block_ids[first:end],
                block_ids[first:end],
            )
        )
        self._loading.add(request.request_id)

    def build_connector_meta(self) -> KVConnectorMetadata:
        now = self._clock()
        for transfer_id, hold in list(self._holds.items()):
            if hold.deadline <= now:
                del self._holds[transfer_id]
                self._withdrawing[transfer_id] = hold
                self._meta.withdrawals.append(transfer_id)
                self.num_holds_expired += 1
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        if request_id in self._loading:
            # Its blocks are freed once the pull stopped writing into them.
            self._cancelled.add(request_id)
            self._meta.cancels.append(request_id)
            return True, None
        answered = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if not isinstance(request.kv_transfer, RemoteDecode) or not answered:
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self._block_size)
        offered = block_ids[:num_blocks]
        transfer_id = secrets.token_hex(16)
        self._meta.offers.append(OfferSpec(transfer_id, offered, kv_digest(request)))
        self._holds[transfer_id] = _Hold(request_id, self._clock() + self._config.hold_timeout_s, num_blocks)
        config = self._config
        return True, prefill_params(config.engine_id, config.kv_ip, self._port, offered, transfer_id)

    def update_connector_output(self, output: KVConnectorOutput) -> list[str]:
        # Empty pulls end here, counted neither as loads nor as fallbacks: their requests ran on.
        released = self._releasing & (set(output.finished_recving) | set(output.failed_recving))
        self._releasing -= released
        freeable = []
        for transfer_id in output.finished_sending:
            hold = self._holds.pop(transfer_id, None) or self._withdrawing.pop(transfer_id, None)
            if hold is not None:
                freeable.append(hold.request_id)
        for request_id in output.finished_recving:
            if request_id not in released:
                self._loading.discard(request_id)
                self.num_loads += 1
        for request_id, reason in output.failed_recving.items():
            if request_id not in released:
                self._loading.discard(request_id)
                if request_id not in self._cancelled:
                    self.fallbacks[fallback_reason(reason)] += 1
        ended = set(output.finished_recving) | set(output.failed_recving)
        freeable += sorted(self._cancelled & ended)
        self._cancelled -= ended
        return freeable

    def has_pending(self) -> bool:
        return bool(self._holds or self._withdrawing or self._loading or self._releasing or self._meta)

    def fill_stats(self, stats: SchedulerStats) -> None:
        stats.kv_transfer_loads = self.num_loads
        stats.kv_transfer_fallbacks = dict(self.fallbacks)
        stats.kv_transfer_blocks_held = sum(hold.num_blocks for hold in self._holds.values())
        stats.kv_transfer_holds_expired = self.num_holds_expired


class TcpConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig) -> None:
        self._config = config
        self._server: BlockServer | None = None
        self._puller: BlockPuller | None = None
        self._withdrawn: list[str] = []
        # Loads that could not start (request id -> reason): reported failed, so their requests never wait.
        self._not_started: dict[str, str] = {}

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        from kvfleet.runtime.kv_transfer.transport import BlockPuller, BlockServer

        self.close()
        config = self._config
        if config.is_producer:
            self._server = BlockServer(kv_caches, config.kv_ip, config.kv_port)
            logger.info("serving KV blocks to decode replicas on %s:%d", config.kv_ip, self._server.port)
        if config.is_consumer:
            self._puller = BlockPuller(
                kv_caches, connect_timeout_s=config.connect_timeout_s, load_timeout_s=config.load_timeout_s
            )

    def get_handshake_metadata(self) -> dict[str, Any]:
        return {} if self._server is None else {"port": self._server.port}

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        server, puller = self._server, self._puller
        if server is not None:
            for offer in metadata.offers:
                server.offer(offer.transfer_id, offer.block_ids, offer.kv_digest)
            for transfer_id in metadata.withdrawals:
                server.withdraw(transfer_id)
                self._withdrawn.append(transfer_id)
        if puller is not None:
            for request_id in metadata.cancels:
                puller.cancel(request_id)
            for load in metadata.loads:
                try:
                    puller.start(
                        load.request_id,
                        load.host,
                        load.port,
                        load.transfer_id,
                        load.kv_digest,
                        load.remote_block_ids,
                        load.local_block_ids,
                    )
                except (ValueError, RuntimeError) as error:
                    self._not_started[load.request_id] = f"the load could not start: {error}"

    def get_finished(self) -> KVConnectorOutput:
        output = KVConnectorOutput()
        if self._server is not None:
            output.finished_sending = self._withdrawn + self._server.take_pulled()
            self._withdrawn = []
        if self._puller is not None:
            loaded, failed = self._puller.take_done()
            output.finished_recving, output.failed_recving = list(loaded), {**failed, **self._not_started}
            self._not_started = {}
        return output

    def wait(self, timeout: float) -> None:
        if self._puller is not None:
            self._puller.wait(timeout)
        else:
            time.sleep(timeout)

    def fill_stats(self, stats: SchedulerStats) -> None:
        puller = self._puller
        if puller is not None:
            stats.kv_transfer_blocks_pulled = puller.blocks_pulled
            stats.kv_transfer_bytes_pulled = puller.bytes_pulled
            stats.kv_transfer_pull_seconds = puller.pull_seconds

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._puller is not None:
            self._puller.close()
            self._puller = None
