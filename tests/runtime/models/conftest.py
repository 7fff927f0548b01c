"""Helpers for the model tests: tiny model folders, and a hand-written scheduler that drives a ModelRunner.

The driver plays the scheduler's part of the contract: it feeds prompts in chunks, hands out blocks from a
shuffled free list, optionally starts a request on blocks another request already computed (a prefix-cache
hit), and appends sampled tokens, so the runner sees the same SchedulerOutputs a real engine would send.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvfleet.runtime.models.make_model import make_model
from kvfleet.runtime.request import Request
from kvfleet.runtime.worker.model_runner import ModelRunner


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """arch -> a tiny model folder written by make_model, once per session."""
    made: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_model(arch, "tiny", tmp_path_factory.mktemp(f"tiny-{arch}"), seed=1)
        return made[arch]

    return build


def make_runner(model_dir: Path, *, num_blocks: int = 128, **options: object) -> ModelRunner:
    settings: dict[str, object] = {"dtype": "float32", "block_size": 4, **options}
    config = EngineConfig(model=str(model_dir), **settings)  # type: ignore[arg-type]
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


@dataclass
class StepRecord:
    output: SchedulerOutput
    result: ModelRunnerOutput
    # (request id, position whose next token the row predicts) for each logits row, and the logits.
    logit_rows: list[tuple[str, int]]
    logits: torch.Tensor | None


@dataclass
class HandScheduler:
    runner: ModelRunner
    chunk_size: int
    seed: int = 0
    records: list[StepRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_blocks = list(range(self.runner.kv_caches[0].shape[1]))
        random.Random(self.seed).shuffle(self.free_blocks)
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self._captured: list[torch.Tensor] = []
        model = self.runner.model
        assert model is not None
        compute_logits = model.compute_logits

        def capture(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute_logits(hidden)
            self._captured.append(logits.clone())
            return logits

        model.compute_logits = capture  # type: ignore[method-assign]

    def add(
        self, request: Request, *, shared_prefix_from: Request | None = None, shared_tokens: int = 0
    ) -> None:
        """Admit a request; with shared_prefix_from, its first shared_tokens (whole blocks) are cached."""
        block_size = self.runner.block_size
        assert shared_tokens % block_size == 0
        self.blocks[request.request_id] = []
        self.computed[request.request_id] = 0
        if shared_prefix_from is not None:
            assert request.all_token_ids[:shared_tokens] == shared_prefix_from.all_token_ids[:shared_tokens]
            assert self.computed[shared_prefix_from.request_id] >= shared_tokens
            donor = self.blocks[shared_prefix_from.request_id]
            self.blocks[request.request_id] = donor[: shared_tokens // block_size]
            self.computed[request.request_id] = shared_tokens

    def step(self, requests: list[Request], finished: set[str] | None = None) -> StepRecord:
        block_size = self.runner.block_size
        scheduled, counts, computed, tables = [], [], [], []
        for request in requests:
            done = self.computed[request.request_id]
            count = min(self.chunk_size, request.num_tokens - done)
            assert count > 0
            table = self.blocks[request.request_id]
            while len(table) * block_size < done + count:
                table.append(self.free_blocks.pop())
            scheduled.append(request)
            counts.append(count)
            computed.append(done)
            tables.append(list(table))
        output = SchedulerOutput(
            requests=scheduled,
            num_scheduled_tokens=counts,
            num_computed_tokens=computed,
            block_ids=tables,
            total_num_scheduled_tokens=sum(counts),
            finished_request_ids=finished or set(),
            preempted_request_ids=set(),
        )
        self._captured.clear()
        result = self.runner.execute_model(output)
        rows = []
        for request, count, done, tokens in zip(
            scheduled, counts, computed, result.sampled_token_ids, strict=True
        ):
            self.computed[request.request_id] = done + count
            if done + count == request.num_tokens:
                rows.append((request.request_id, done + count - 1))
                assert len(tokens) == 1
                request.append_output_token_ids(tokens)
            else:
                assert tokens == []
        logits = self._captured[0] if self._captured else None
        record = StepRecord(output, result, rows, logits)
        self.records.append(record)
        return record

    def run(self, requests: list[Request], num_output_tokens: int) -> None:
        """Step every request until each has num_output_tokens outputs."""
        while True:
            active = [r for r in requests if r.num_output_tokens < num_output_tokens]
            if not active:
                return
            self.step(active)


@pytest.fixture
def runner_for() -> Callable[..., ModelRunner]:
    """(model folder, num_blocks=..., EngineConfig options...) -> a loaded runner with its KV cache."""
    return make_runner


@pytest.fixture
def hand_scheduler() -> type[HandScheduler]:
    return HandScheduler
