"""Static batching, done honestly in the same engine: the baseline continuous batching is measured against.

New requests are held back until the engine is idle; then up to max_num_seqs of them (in arrival order, or by
priority under the priority policy) are admitted together and run until the last one finishes.
`kvfleet bench static-server` serves with this core instead of the real one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import EngineCoreOutput
from kvfleet.runtime.engine.core import EngineCore
from kvfleet.runtime.engine.messages import AddRequest, EngineCoreOutputs, RequestError
from kvfleet.runtime.errors import InvalidRequestError
from kvfleet.runtime.request import FinishReason


class StaticBatchingEngineCore(EngineCore):
    def __init__(self, config: EngineConfig, **options: Any) -> None:
        super().__init__(config, **options)
        # Held back while a batch runs, in arrival order.
        self._held: list[AddRequest] = []

    def add_request(self, add: AddRequest) -> None:
        try:
            self.validate_prompt(add.prompt_token_ids, add.sampling_params)
        except InvalidRequestError as error:
            self._errors.append(RequestError(add.request_id, error.kind, str(error)))
            return
        self._held.append(add)

    def abort_requests(self, request_ids: list[str]) -> None:
        aborted = set(request_ids)
        self._held = [add for add in self._held if add.request_id not in aborted]
        super().abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self._held)

    def step(self) -> EngineCoreOutputs:
        expired = self._expire_held()
        if self._held and not self.scheduler.has_unfinished_requests():
            self._release_batch()
        outputs = super().step()
        outputs.outputs.extend(expired)
        # Held requests wait as much as queued ones do, and the autoscaler should see them.
        outputs.stats = dataclasses.replace(
            outputs.stats, num_waiting=outputs.stats.num_waiting + len(self._held)
        )
        return outputs

    def _expire_held(self) -> list[EngineCoreOutput]:
        now = time.monotonic()
        expired = [add for add in self._held if add.deadline is not None and add.deadline <= now]
        for add in expired:
            self._held.remove(add)
        return [EngineCoreOutput(add.request_id, [], None, FinishReason.TIMEOUT, None, 0) for add in expired]

    def _release_batch(self) -> None:
        order = self._held
        if self.config.scheduling_policy == "priority":
            order = sorted(order, key=lambda add: (add.priority, add.arrival_time))
        batch = order[: self.config.max_num_seqs]
        released = {add.request_id for add in batch}
        self._held = [add for add in self._held if add.request_id not in released]
        for add in batch:
            super().add_request(add)
