"""Host side of pagedjax: block pool, KV cache manager, scheduler. Plain Python + numpy, no JAX."""

from pagedjax.core.block_pool import BlockPool, FreeBlockQueue, hash_block_tokens
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.request import Request, RequestOutput, RequestStatus, SamplingParams
from pagedjax.core.scheduler import Scheduler, SchedulerStats
from pagedjax.core.step_plan import FusedDecodePlan, StepPlan, build_step_plan, device_pop_step, simulate_device_pops

__all__ = [
    "BlockPool", "FreeBlockQueue", "hash_block_tokens", "KVCacheManager", "Request", "RequestOutput",
    "RequestStatus", "SamplingParams", "FusedDecodePlan", "Scheduler", "SchedulerStats", "StepPlan",
    "build_step_plan", "device_pop_step", "simulate_device_pops",
]
