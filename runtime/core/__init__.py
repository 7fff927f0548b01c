"""Scheduling and KV cache bookkeeping: pure Python, no torch, cheap per step."""

from __future__ import annotations

from kvfleet.runtime.core.block_pool import BlockPool, KVCacheBlock
from kvfleet.runtime.core.kv_cache_manager import KVCacheManager
from kvfleet.runtime.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from kvfleet.runtime.core.scheduler import Scheduler

__all__ = [
    "BlockPool",
    "EngineCoreOutput",
    "KVCacheBlock",
    "KVCacheManager",
    "ModelRunnerOutput",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]
