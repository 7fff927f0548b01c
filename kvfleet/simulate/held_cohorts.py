"""The gateway's queue in the cohort model: shares of cohorts held while no replica has room, by tier, then
arrival, bounded in length and in time as the gateway's queue is. A full queue sheds by the gateway's own
rule (kvfleet.contract.precedence): a newcomer takes the places of the newest of the least urgent tier it
displaces, or is refused."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvfleet.contract.precedence import QueuedRequest, choose_victim
from kvfleet.contract.tiers import TIERS
from kvfleet.simulate.report import RunReport

# Fewer requests than this are none: what is left of a share once rounding has taken the rest.
_LEAST = 1e-9


@dataclass(eq=False, slots=True)
class HeldShare:
    """Requests of one tier and prefix group that came to the gateway at one time, and wait together."""

    tier: str
    prefix_group: str
    count: float
    prompt_tokens: float
    output_tokens: float
    queued_at: float
    # The prompt tokens a replica computes for them, where that was settled when they were placed before
    # (None: as the replica they go to finds their prefix).
    work_tokens: float | None = None

    def split(self, count: float) -> HeldShare:
        """Takes `count` of the requests (and their tokens' share) off into a share of their own."""
        share = count / self.count
        work = self.work_tokens * share if self.work_tokens is not None else None
        taken = HeldShare(
            self.tier,
            self.prefix_group,
            count,
            self.prompt_tokens * share,
            self.output_tokens * share,
            self.queued_at,
            work,
        )
        self.count -= count
        self.prompt_tokens -= taken.prompt_tokens
        self.output_tokens -= taken.output_tokens
        if self.work_tokens is not None and work is not None:
            self.work_tokens -= work
        return taken


class HeldCohorts:
    def __init__(self, max_queue: int, report: RunReport) -> None:
        self.max_queue = max_queue
        self.report = report
        self.held = 0.0
        self._queues: dict[int, deque[HeldShare]] = {}
        # The queues' priorities, most urgent first: head() is asked once a share the gateway sends.
        self._order: list[int] = []

    def __len__(self) -> int:
        """The shares held."""
        return sum(len(queue) for queue in self._queues.values())

    def hold(self, share: HeldShare) -> None:
        """Queues the share; what finds the queue full displaces the newest of less urgent tiers, or is
        shed."""
        priority = TIERS[share.tier]  # type: ignore[index]
        over = share.count - max(0.0, self.max_queue - self.held)
        while over > _LEAST:
            newest = (
                QueuedRequest(str(held), held, queue[-1].queued_at)
                for held, queue in self._queues.items()
                if queue
            )
            victim = choose_victim(newest, priority)
            if victim is None:
                refused = share.split(over) if over < share.count else share
                self.report.shed(refused.tier, refused.count)
                if refused is share:
                    return
                break
            queue = self._queues[int(victim)]
            displaced = min(over, queue[-1].count)
            self._shed(queue[-1].split(displaced) if displaced < queue[-1].count else queue.pop())
            over -= displaced
        if priority not in self._queues:
            self._queues[priority] = deque()
            self._order = sorted(self._queues)
        self._queues[priority].append(share)
        self.held += share.count
        # A share turned back at a replica's cap (fluid_fleet) waits again, and counts again.
        self.report.waited(share.tier, share.count)

    def expire(self, now: float, hold_s: float) -> None:
        """Sheds what has waited longer than the gateway holds a request."""
        for queue in self._queues.values():
            while queue and now - queue[0].queued_at > hold_s:
                self._shed(queue.popleft())

    def head(self) -> HeldShare | None:
        """The share the gateway sends first: the most urgent tier's oldest."""
        for priority in self._order:
            queue = self._queues[priority]
            if queue:
                return queue[0]
        return None

    def take(self, share: HeldShare, count: float) -> HeldShare:
        """Takes `count` requests off the head share `share` to send them."""
        self.held -= count
        if count < share.count:
            return share.split(count)
        return self._queues[TIERS[share.tier]].popleft()  # type: ignore[index]

    def _shed(self, share: HeldShare) -> None:
        self.held -= share.count
        self.report.shed(share.tier, share.count)
