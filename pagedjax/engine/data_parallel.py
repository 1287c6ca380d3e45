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
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import jax

from pagedjax.config.engine import EngineConfig, engine_config, takes_options
from pagedjax.config.parallel import ParallelConfig
from pagedjax.core.request import Request, RequestIds
from pagedjax.engine.generate import classify_batch, embed_batch, generate_batch
from pagedjax.engine.image_prompts import EncodedPrompt
from pagedjax.engine.llm_engine import LLMEngine, token_list
from pagedjax.engine.protocol import PreparedRequest
from pagedjax.engine.relevance import relevance_batch
from pagedjax.engine.scoring import completion_logprobs
from pagedjax.engine.stats import EngineStats, stats_dict
from pagedjax.errors import InvalidRequest
from pagedjax.model.loading.loader import load_engine_inputs
from pagedjax.outputs import RequestOutput
from pagedjax.parallel.mesh import replica_meshes
from pagedjax.pooling_params import PoolingParams
from pagedjax.runner.programs import CompileEvent, all_done
from pagedjax.runner.weights import checked_leaves
from pagedjax.sampling_params import LoRARequest, SamplingParams, StructuredOutput
from pagedjax.structured_output.compiler import Constraint

logger = logging.getLogger(__name__)


# Fields of EngineStats that combine otherwise than by adding up: times (replicas step concurrently: the slowest
# replica's), and each replica's own layout (the same on every replica: the first's).
_SLOWEST = frozenset({"steps", "elapsed_s", "device_s", "compile_s", "warmup_s", "encoder_s",
                      "host_move_s", "disk_s", "spec_proposer_s"})
_PER_REPLICA = frozenset({"tensor_parallel_size", "kv_cache_bytes_per_device", "kv_dtype", "kv_bytes_per_token",
                          "kv_bytes_per_block"})


def combined_stats(replicas: Sequence[EngineStats], requests_per_replica: Sequence[int]) -> EngineStats:
    """One `EngineStats` over replicas that step concurrently: counts add up (every counter, a new one included),
    times are the slowest replica's (so `tokens_per_s` is the whole engine's), the pool is every replica's blocks;
    `replicas` keeps each one's own stats."""
    values = {}
    for f in dataclasses.fields(EngineStats):
        vals = [getattr(r, f.name) for r in replicas]
        if f.name in _SLOWEST:
            values[f.name] = max(vals)
        elif f.name == "scheduler":
            values[f.name] = _summed(vals)
        elif f.name not in _PER_REPLICA and all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            values[f.name] = sum(vals)
    return dataclasses.replace(replicas[0], **values, replicas=tuple(replicas),
                               requests_per_replica=tuple(requests_per_replica))


def _summed(stats):
    """Dataclass snapshots of the same type, their int fields added up (a `largest_*` one: the largest; nested
    snapshots likewise; tuples of ints, one per KV cache group, element by element); other fields (a block size,
    None for an uncomputed count) are the first one's unless they differ (then None)."""
    stats = list(stats)
    values = {}
    for f in dataclasses.fields(stats[0]):
        vals = [getattr(x, f.name) for x in stats]
        if dataclasses.is_dataclass(vals[0]):
            values[f.name] = _summed(vals)
        elif isinstance(vals[0], tuple) and all(isinstance(v, int) for t in vals for v in t):
            values[f.name] = tuple(map(sum, zip(*vals, strict=True)))
        elif f.name == "block_size" or not all(isinstance(v, int) for v in vals):
            values[f.name] = vals[0] if all(v == vals[0] for v in vals) else None
        elif f.name.startswith("largest"):
            values[f.name] = max(vals)
        else:
            values[f.name] = sum(vals)
    return dataclasses.replace(stats[0], **values)


class DataParallelEngine:
    """`data_parallel_size` `LLMEngine` replicas of `tensor_parallel_size` devices each, with `LLMEngine`'s
    methods (`pagedjax.make_engine` / `load_engine` build one from a `ParallelConfig` with
    `data_parallel_size` > 1). Arguments are `LLMEngine`'s (the options' `parallel_config` is the whole
    layout; each replica gets its `tensor_parallel_size`); `params` (an `nnx.State`, e.g. loaded sharded onto
    the first replica's mesh) is copied device to device onto each replica's mesh. `close()` ends its threads."""

    @classmethod
    @takes_options(but=("model_config",))
    def from_pretrained(cls, path=None, *, dtype: str | None = None, quantization=None, tokenizer=None, devices=None,
                        classifier_from_tokens=None, **options) -> DataParallelEngine:
        """As `LLMEngine.from_pretrained`: the weights read into the first replica's shards (and quantized, with
        a `quantization`), then copied."""
        config, objects = load_engine_inputs(path, dtype, quantization, tokenizer, devices, options,
                                             "DataParallelEngine.from_pretrained", classifier_from_tokens)
        return cls(config, **objects)

    @takes_options()
    def __init__(self, config: EngineConfig | None = None, *, model=None, params=None, tokenizer=None,
                 image_processor=None, devices=None, classifier=None, **options):
        config = engine_config(config, options, "DataParallelEngine")
        parallel_config = config.parallel_config
        if not isinstance(parallel_config, ParallelConfig):
            raise TypeError(f"DataParallelEngine: parallel_config must be a ParallelConfig, got "
                            f"{type(parallel_config).__name__}")
        spec = config.model_config if model is None or config.model_config is not None else getattr(model, "spec",
                                                                                                      None)
        if spec is not None:  # else LLMEngine says what is missing
            parallel_config.check_model(spec)
        # Each replica's adapter slots would need one registry over them all.
        if config.lora_config is not None:
            raise ValueError("lora_config: LoRA with data_parallel_size > 1 is not supported")
        self.parallel_config = parallel_config
        per_replica = ParallelConfig(tensor_parallel_size=parallel_config.tensor_parallel_size)
        self.replicas: list[LLMEngine] = []
        for mesh in replica_meshes(parallel_config, devices):
            self.replicas.append(LLMEngine(config.replace(parallel_config=per_replica), model=model,
                                           params=params, devices=list(mesh.devices.flat), tokenizer=tokenizer,
                                           image_processor=image_processor, classifier=classifier))
        first = self.replicas[0]
        self.model_config, self.model_spec = first.model_config, first.model_spec
        self.tokenizer, self.image_processor, self.classifier = first.tokenizer, first.image_processor, first.classifier
        self.cache_config, self.scheduler_config = first.cache_config, first.scheduler_config
        self._owner: dict[str, tuple[int, int]] = {}  # unfinished request id -> (replica, outstanding tokens)
        self._load = [0] * len(self.replicas)
        self._assigned = [0] * len(self.replicas)
        self._prefix_home: dict[tuple, int] = {}  # (salt, first block's tokens) -> replica that computed it
        self._request_ids = RequestIds()
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="pagedjax-dp")
        logger.info("DataParallelEngine: %d replicas x %d devices", len(self.replicas),
                    parallel_config.tensor_parallel_size)

    @property
    def backend(self) -> str:
        return self.replicas[0].backend

    @property
    def num_blocks(self) -> int:
        """KV blocks of every replica's pool together."""
        return sum(r.num_blocks for r in self.replicas)

    @property
    def extra_pools(self) -> tuple[int, ...]:
        """Blocks of each pool past the first (a recurrent state's snapshots), every replica's together."""
        return tuple(map(sum, zip(*(r.extra_pools for r in self.replicas), strict=True)))

    @property
    def pool_block_sizes(self) -> tuple[int, ...]:
        """Each pool's block size in tokens (every replica's are the same)."""
        return self.replicas[0].pool_block_sizes

    @property
    def max_request_tokens(self) -> int:
        """As `LLMEngine.max_request_tokens`: a request runs on one replica."""
        return min(r.max_request_tokens for r in self.replicas)

    @property
    def decode_steps_per_call(self) -> int:
        return self.replicas[0].decode_steps_per_call

    # ----------------------------------------------------------------------------------------------- requests
    def _choose(self, request: Request) -> int:
        least = min(range(len(self.replicas)), key=lambda i: (self._load[i], i))
        bs = self.cache_config.block_size
        if request.num_prompt_tokens > bs:
            home = self._prefix_home.get((request.cache_salt, tuple(request.prompt_token_ids[:bs])))
            if home is not None and self._load[home] <= self._load[least] + request.num_prompt_tokens:
                return home
        return least

    def encode_prompt(self, request_id: str, prompt) -> EncodedPrompt:
        """A prompt's token ids and images (see `LLMEngine.encode_prompt`): every replica's model is the same."""
        return self.replicas[0].encode_prompt(request_id, prompt)

    def make_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None, *,
                     cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                     pooling: PoolingParams | None = None) -> PreparedRequest:
        """A validated, not yet queued request (see `LLMEngine.make_request`; a `lora_request` is refused as by an
        engine without adapters: replicas serve none)."""
        return self.replicas[0].make_request(request_id, prompt, sampling_params, cache_salt=cache_salt,
                                             lora_request=lora_request, pooling=pooling)

    def compile_constraint(self, structured: StructuredOutput) -> Constraint:
        """A fresh matcher of a constraint (see `LLMEngine.compile_constraint`): the first replica's compiler
        compiles every request's, as its `make_request` validates every request."""
        return self.replicas[0].compile_constraint(structured)

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        """Queue a request from `make_request` on the replica `_choose` picks (ValueError for a duplicate id)."""
        request = prepared.request
        self._check_unused(request.request_id)
        i = self._choose(request)
        self.replicas[i].add_prepared_request(prepared)
        # (make_request set a max_tokens left None to the context's room)
        cost = request.num_prompt_tokens + request.sampling_params.max_tokens * request.sampling_params.num_samples
        self._owner[request.request_id] = (i, cost)
        self._load[i] += cost
        self._assigned[i] += 1
        bs = self.cache_config.block_size
        if request.num_prompt_tokens > bs:
            self._prefix_home[(request.cache_salt, tuple(request.prompt_token_ids[:bs]))] = i

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, pooling: PoolingParams | None = None) -> None:
        """Queue a request on the least loaded replica; raises as `LLMEngine.add_request` does."""
        self._check_unused(request_id)
        self.add_prepared_request(self.make_request(request_id, token_list(request_id, prompt_token_ids),
                                                    sampling_params, cache_salt=cache_salt, lora_request=lora_request,
                                                    pooling=pooling))

    def _check_unused(self, request_id) -> None:
        """InvalidRequest (param "request_id") for an id a live request of any replica uses."""
        if isinstance(request_id, str) and request_id in self._owner:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id",
                                 code="duplicate_request_id")

    def fresh_request_ids(self, prefix: str, n: int) -> list[str]:
        """`n` ids that no live request of any replica uses (`pagedjax.core.request.RequestIds`)."""
        return self._request_ids.fresh(prefix, n, lambda rid: rid in self._owner)

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

    def beam_search(self, prompts, params) -> list:
        """`LLMEngine.beam_search`, the prompts spread over the replicas (each searches its share concurrently);
        one `BeamSearchOutput` per prompt, in order."""
        prompts = list(prompts)
        shares = [list(range(i, len(prompts), len(self.replicas))) for i in range(len(self.replicas))]
        jobs = [(r, idx) for r, idx in zip(self.replicas, shares, strict=True) if idx]
        futures = [self._pool.submit(r.beam_search, [prompts[i] for i in idx], params) for r, idx in jobs]
        results: list = [None] * len(prompts)
        for (_, idx), future in zip(jobs, futures, strict=True):
            for i, out in zip(idx, future.result(), strict=True):
                results[i] = out
        return results

    def generate(self, prompts: Sequence, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """As `LLMEngine.generate`: the batch validated first, spread over the replicas, outputs in input order."""
        return generate_batch(self, prompts, sampling_params, use_tqdm, lora_request)

    # -------------------------------------------------------------------------------------------------- stats
    # ------------------------------------------------------------------------------------------ training loop
    def update_weights(self, params) -> None:
        """`LLMEngine.update_weights` of every replica: `params` must match the first replica's weights (its devices
        and shardings: served there without a copy) and are copied device to device onto each other replica's mesh.
        Checked before any replica changes."""
        first = self.replicas[0].runner.params
        state = jax.tree.unflatten(jax.tree.structure(first), checked_leaves(first, params))
        for r in self.replicas:
            r.update_weights(state if r is self.replicas[0] else
                             jax.tree.map(lambda ref, x: jax.device_put(x, ref.sharding), r.runner.params, state))

    def save_kv_tiers(self) -> int:
        """`LLMEngine.save_kv_tiers` of every replica (they share the disk tier's folder); the blocks written."""
        return sum(r.save_kv_tiers() for r in self.replicas)

    def sleep(self) -> int:
        """`LLMEngine.sleep` of every replica; the bytes freed on each device (every replica's pool is alike)."""
        return max(r.sleep() for r in self.replicas)

    def wake(self) -> float:
        """`LLMEngine.wake` of every replica; the seconds it took."""
        start = time.perf_counter()
        for r in self.replicas:
            r.wake()
        return time.perf_counter() - start

    def embed(self, prompts, pooling_params=None, use_tqdm: bool = False, lora_request=None):
        """As `LLMEngine.embed` (the prompts spread over the replicas)."""
        return embed_batch(self, prompts, pooling_params, use_tqdm, lora_request)

    def classify(self, prompts, use_tqdm: bool = False, lora_request=None):
        """As `LLMEngine.classify` (the prompts spread over the replicas)."""
        return classify_batch(self, prompts, use_tqdm, lora_request)

    def relevance(self, text_1, text_2, use_tqdm: bool = False, lora_request=None):
        """As `LLMEngine.relevance` (the pairs spread over the replicas)."""
        return relevance_batch(self, text_1, text_2, use_tqdm, lora_request)

    def score(self, prompts, completions, lora_request=None):
        """As `LLMEngine.score` (the pairs spread over the replicas)."""
        return completion_logprobs(self, prompts, completions, lora_request)

    def stats(self) -> EngineStats:
        """The replicas' stats combined (see `combined_stats`); each replica's in `replicas`."""
        return combined_stats([r.stats() for r in self.replicas], self._assigned)

    def stats_dict(self) -> dict:
        """`stats()` as nested plain data, as `LLMEngine.stats_dict`, with the parallel layout."""
        return {**stats_dict(self.stats()), "parallel": dataclasses.asdict(self.parallel_config)}

    def warmup(self) -> float:
        """`LLMEngine.warmup` of every replica, concurrently; the seconds it took."""
        return max(f.result() for f in [self._pool.submit(r.warmup) for r in self.replicas])

    def start_warmup(self) -> Future:
        """`LLMEngine.start_warmup` of every replica; a future of the seconds until all of them are done."""
        return all_done([r.start_warmup() for r in self.replicas])

    @contextmanager
    def compile_notices(self, listener: Callable[[CompileEvent], None]) -> Iterator[None]:
        """`LLMEngine.compile_notices` of every replica (their compiles may be heard from their threads at once)."""
        with ExitStack() as stack:
            for r in self.replicas:
                stack.enter_context(r.compile_notices(listener))
            yield

    def close(self) -> None:
        """End the replicas' threads and their waiting background compiles."""
        for r in self.replicas:
            r.close()
        self._pool.shutdown(wait=True)
