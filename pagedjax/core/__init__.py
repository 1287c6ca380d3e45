"""Host side of pagedjax: block pool, KV cache manager, scheduler, and a step's plan and result. Plain Python +
numpy, no JAX."""

from pagedjax.core.block_pool import BlockPool, FreeBlockQueue, hash_block_tokens
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.scheduler import Scheduler, SchedulerStats
from pagedjax.core.step_plan import FusedDecode, StepPlan, build_step_plan, device_pop_step, simulate_device_pops
from pagedjax.core.step_result import StepResult
from pagedjax.outputs import RequestOutput  # re-exported: its old home
from pagedjax.sampling_params import SamplingParams  # re-exported: its old home

__all__ = [
    "BlockPool", "FreeBlockQueue", "hash_block_tokens", "KVCacheManager", "Request", "RequestOutput", "RequestStatus",
    "SamplingParams", "FusedDecode",
    "Scheduler", "SchedulerStats", "StepPlan", "StepResult", "build_step_plan", "device_pop_step",
    "simulate_device_pops",
]
