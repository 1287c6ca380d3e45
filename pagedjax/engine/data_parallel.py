"""Data parallelism: `data_parallel_size` independent engine replicas, each on its own `tp` sub-mesh (disjoint
devices) with its own scheduler and KV pool, behind one front with `LLMEngine`'s request methods.

A request goes to the replica with the fewest outstanding tokens (prompt + the most it may generate, over
its unfinished requests), unless a replica already holds a request with the same first KV block (same salt,
same first `block_size` tokens) and is within one prompt's worth of tokens of the least loaded: its prefix
cache then saves that prompt's prefill. Replicas step concurrently in threads (JAX releases the GIL while a
device computes), so their devices work at the same time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pagedjax.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedjax.core.request import Request, RequestOutput, SamplingParams
from pagedjax.engine.generate import generate_batch
from pagedjax.engine.llm_engine import EngineStats, LLMEngine
from pagedjax.parallel.config import ParallelConfig
from pagedjax.parallel.mesh import replica_meshes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataParallelStats:
    """Each replica's `EngineStats`, and how many requests each was given."""

    replicas: tuple[EngineStats, ...]
    requests_per_replica: tuple[int, ...]

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.replicas)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.replicas)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the slowest replica's stepping (they step concurrently)."""
        run_s = max((r.elapsed_s - r.compile_s for r in self.replicas), default=0.0)
        return self.generated_tokens / run_s if run_s > 0 else 0.0


class DataParallelEngine:
    """`data_parallel_size` `LLMEngine` replicas of `tensor_parallel_size` devices each (`LLMEngine(...,
    parallel_config=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp))` builds one). Arguments
    are `LLMEngine`'s; `params` (an `nnx.State`, e.g. loaded sharded onto the first replica's mesh) is copied
    device to device onto each replica's mesh."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, params=None, seed: int = 0, *,
                 parallel_config: ParallelConfig, devices=None, **engine_kwargs):
        if not isinstance(parallel_config, ParallelConfig):
            raise TypeError(f"parallel_config must be a ParallelConfig, got {type(parallel_config).__name__}")
        parallel_config.check_model(model_config.num_q_heads, model_config.num_kv_heads)
        self.parallel_config = parallel_config
        self.model_config = model_config
        per_replica = ParallelConfig(tensor_parallel_size=parallel_config.tensor_parallel_size)
        self.replicas: list[LLMEngine] = []
        for mesh in replica_meshes(parallel_config, devices):
            self.replicas.append(LLMEngine(model_config, cache_config, scheduler_config, params=params, seed=seed,
                                           parallel_config=per_replica, devices=list(mesh.devices.flat),
                                           **engine_kwargs))
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        self.cache_config, self.scheduler_config = first.cache_config, first.scheduler_config
        self._owner: dict[str, tuple[int, int]] = {}  # unfinished request id -> (replica, outstanding tokens)
        self._load = [0] * len(self.replicas)
        self._assigned = [0] * len(self.replicas)
        self._prefix_home: dict[tuple, int] = {}  # (salt, first block's tokens) -> replica that computed it
        self._calls = 0
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="pagedjax-dp")
        logger.info("DataParallelEngine: %d replicas x %d devices", len(self.replicas),
                    parallel_config.tensor_parallel_size)

    # ----------------------------------------------------------------------------------------------- requests
    def _choose(self, request: Request) -> int:
        least = min(range(len(self.replicas)), key=lambda i: (self._load[i], i))
        bs = self.cache_config.block_size
        if request.num_prompt_tokens > bs:
            home = self._prefix_home.get((request.cache_salt, tuple(request.prompt_token_ids[:bs])))
            if home is not None and self._load[home] <= self._load[least] + request.num_prompt_tokens:
                return home
        return least

    def make_request(self, request_id: str, prompt, sampling_params: SamplingParams) -> Request:
        """A validated, not yet queued request (see `LLMEngine.make_request`)."""
        return self.replicas[0].make_request(request_id, prompt, sampling_params)

    def add_prepared_request(self, request: Request) -> None:
        """Queue a request from `make_request` on the replica `_choose` picks (ValueError for a duplicate id)."""
        if request.request_id in self._owner:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        i = self._choose(request)
        self.replicas[i].add_prepared_request(request)
        cost = request.num_prompt_tokens + request.sampling_params.max_tokens * request.sampling_params.num_samples
        self._owner[request.request_id] = (i, cost)
        self._load[i] += cost
        self._assigned[i] += 1
        bs = self.cache_config.block_size
        if request.num_prompt_tokens > bs:
            self._prefix_home[(request.cache_salt, tuple(request.prompt_token_ids[:bs]))] = i

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, *, cache_salt: str | None = None) -> None:
        """Queue a request on the least loaded replica; raises as `LLMEngine.add_request` does."""
        if isinstance(request_id, str) and request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.replicas[0]._make_request(request_id, prompt_token_ids, sampling_params, cache_salt)
        self.add_prepared_request(request)

    def fresh_request_ids(self, prefix: str, n: int) -> list[str]:
        """`n` ids `<prefix>-dp<call>-<i>` that no live request uses."""
        self._calls += 1
        ids = []
        for i in range(n):
            rid = f"{prefix}-dp{self._calls}-{i}"
            while rid in self._owner:
                rid += "'"
            ids.append(rid)
        return ids

    def abort(self, request_id: str) -> bool:
        owner = self._owner.pop(str(request_id), None)
        if owner is None:
            return False
        i, cost = owner
        self._load[i] -= cost
        return self.replicas[i].abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    # --------------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work, concurrently; their outputs together."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(busy) == 1:
            results = [busy[0].step()]
        else:
            results = [f.result() for f in [self._pool.submit(r.step) for r in busy]]
        outputs = [o for outs in results for o in outs]
        for o in outputs:
            if o.finished and o.request_id in self._owner:
                i, cost = self._owner.pop(o.request_id)
                self._load[i] -= cost
        return outputs

    def generate(self, prompts: Sequence, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """As `LLMEngine.generate`: the batch validated first, spread over the replicas, outputs in input order."""
        return generate_batch(self, prompts, sampling_params, use_tqdm)

    # -------------------------------------------------------------------------------------------------- stats
    def stats(self) -> DataParallelStats:
        return DataParallelStats(tuple(r.stats() for r in self.replicas), tuple(self._assigned))

    def stats_dict(self) -> dict:
        s = self.stats()
        return {"replicas": [r.stats_dict() for r in self.replicas],
                "requests_per_replica": list(s.requests_per_replica), "generated_tokens": s.generated_tokens,
                "tokens_per_s": s.tokens_per_s, "parallel": dataclasses.asdict(self.parallel_config)}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
