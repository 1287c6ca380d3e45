"""LLMEngine: the scheduler (host) and the model runner (device) in one loop.

    engine = LLMEngine(ModelConfig(...), CacheConfig(block_size=16, num_blocks=256), SchedulerConfig())
    outputs = engine.generate([[1, 2, 3], [1, 2, 4, 5]], SamplingParams(max_tokens=8))

Each `step()` asks the scheduler for a plan, pads it to bucket sizes, runs it on device and hands the sampled
tokens back to the scheduler. With `num_steps > 1`, steps where every running request is decoding run
`num_steps` decode iterations in one device call (blocks lent by the host, reconciled afterwards).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedjax.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedjax.core.request import Request, RequestOutput, SamplingParams
from pagedjax.core.scheduler import MultiStepPlan, Scheduler, StepPlan
from pagedjax.device.sampling import SamplingMetadata
from pagedjax.model.llama import Llama, init_model, model_from_state
from pagedjax.runner import ModelRunner, pad_multi_decode, pad_step

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot of the engine's counters."""

    steps: int
    fused_decode_calls: int
    prompt_tokens: int  # prompt tokens of finished or running requests
    generated_tokens: int
    prefill_tokens_computed: int  # prompt/recompute tokens actually run through the model
    elapsed_s: float  # time spent inside step()
    device_s: float  # of which in compiled device calls (dispatch + compute + read back)
    compile_s: float  # of which tracing and compiling new step shapes
    tokens_per_s: float  # generated tokens / (elapsed_s - compile_s)
    num_blocks: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    prefix_cache_hit_rate: float
    preemptions: int
    kv_waste_pct: float
    compilations: int
    num_waiting: int
    num_running: int


class LLMEngine:
    """Continuous-batching generation over a paged KV cache.

    model_config: the model's shape; params: an `nnx.State` of `Llama` (e.g. from a checkpoint) or a `Llama`
    module; None initialises random weights from `seed`. backend: "auto" | "pallas" | "xla".
    num_steps: decode iterations per device call when the batch is decode-only.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, params=None, seed: int = 0, *,
                 backend: str = "auto", num_steps: int = 1, tokenizer=None):
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.model_config = model_config
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig(
            max_model_len=min(SchedulerConfig.max_model_len, model_config.max_position_embeddings))
        self.seed = seed
        self.num_steps = num_steps
        self.tokenizer = tokenizer
        if isinstance(params, Llama):
            model = params
        elif params is None:
            model = init_model(model_config, seed)
        else:
            model = model_from_state(model_config, params)  # no random init materialised
        if self.scheduler_config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.scheduler_config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({model_config.max_position_embeddings}); lower max_model_len")
        self.num_blocks = self.cache_config.resolve_num_blocks(model_config)
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, self.num_blocks)
        self.runner = ModelRunner(model, self.num_blocks, self.cache_config.block_size,
                                  kv_dtype=self.cache_config.dtype, backend=backend)
        self._arrivals = 0
        self._empty_plans = 0
        self._steps = 0
        self._fused_calls = 0
        self._generated = 0
        self._prefill_computed = 0
        self._elapsed = 0.0
        self._finished_prompt_tokens = 0
        logger.info("LLMEngine: %d KV blocks x %d tokens, attention backend %s", self.num_blocks,
                    self.cache_config.block_size, self.runner.backend)

    @classmethod
    def from_pretrained(cls, path=None, *, dtype: str | None = None, cache_config: CacheConfig | None = None,
                        scheduler_config: SchedulerConfig | None = None, **kwargs) -> LLMEngine:
        """An engine over a saved model: a pagedjax orbax checkpoint folder, a local Hugging Face folder
        (config.json + *.safetensors [+ tokenizer.json]), or None for the bundled model."""
        from pagedjax.model.loader import load_pretrained

        cfg, state, tokenizer = load_pretrained(path, dtype=dtype)
        kwargs.setdefault("tokenizer", tokenizer)
        return cls(cfg, cache_config, scheduler_config, params=state, **kwargs)

    @property
    def backend(self) -> str:
        return self.runner.backend

    # ----------------------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, *, cache_salt: str | None = None) -> None:
        """Queue a request. Raises ValueError for ids outside the vocabulary, empty or too long prompts,
        a duplicate id, or a request that could never fit in the KV pool."""
        params = sampling_params or SamplingParams()
        tokens = [int(t) for t in prompt_token_ids]
        vocab = self.model_config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise ValueError(f"request {request_id!r}: stop_token_ids {bad_stop[:5]} outside [0, {vocab})")
        request = Request(
            request_id=str(request_id),
            prompt_token_ids=tokens,
            sampling_params=params,
            eos_token_ids=tuple(self.model_config.eos_token_ids),
            cache_salt=cache_salt,
            arrival_index=self._arrivals,
        )
        self.scheduler.add_request(request)
        self._arrivals += 1

    def abort(self, request_id: str) -> bool:
        """Stop a request and free all its blocks. Returns False if no such unfinished request."""
        return self.scheduler.abort(str(request_id)) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --------------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of the requests that got tokens or finished."""
        start = time.perf_counter()
        touched: list[Request]
        if self.num_steps > 1 and (mplan := self.scheduler.schedule_multi_decode(self.num_steps)) is not None:
            touched = self._run_multi_decode(mplan)
        else:
            touched = self._run_step(self.scheduler.schedule())
        self._elapsed += time.perf_counter() - start
        self._steps += 1
        return [self._output(r) for r in touched]

    def _sampling_metadata(self, requests: list[Request]) -> SamplingMetadata:
        return SamplingMetadata.from_lists(
            [r.sampling_params.temperature for r in requests],
            [r.sampling_params.top_k for r in requests],
            [r.sampling_params.top_p for r in requests],
            [self._request_seed(r) for r in requests],
            [r.num_output_tokens for r in requests],
        )

    def _request_seed(self, r: Request) -> int:
        if r.sampling_params.seed is not None:
            return r.sampling_params.seed
        # Unseeded requests: reproducible per engine seed and request id.
        return (self.seed << 32) ^ zlib.crc32(r.request_id.encode())

    def _run_step(self, plan: StepPlan) -> list[Request]:
        if plan.num_seqs == 0:
            # Legitimate once in a row (a request that preempted itself); never twice: the next plan admits
            # the waiting queue's head into an idle pool. Fail loudly rather than spin.
            self._empty_plans += 1
            if self._empty_plans > 2 and self.scheduler.has_unfinished_requests():
                raise RuntimeError(f"the scheduler made no progress for {self._empty_plans} steps with "
                                   f"{self.scheduler.stats().num_waiting} requests waiting (a bug)")
            return []
        self._empty_plans = 0
        requests = [self.scheduler.get_request(rid) for rid in plan.request_ids]
        inputs = pad_step(plan.token_ids, plan.positions, plan.slot_mapping, plan.block_tables, plan.kv_lens,
                          plan.cu_q_lens, self._sampling_metadata(requests))
        tokens = self.runner.execute(inputs)[: plan.num_seqs]
        before = [r.num_output_tokens for r in requests]
        q_lens = np.diff(plan.cu_q_lens)
        for r, kv_len, q_len in zip(requests, plan.kv_lens, q_lens, strict=True):
            # Every token run except a sampled token's own decode is prefill work (prompt or recompute).
            is_decode_token = r.num_output_tokens > 0 and int(kv_len) == r.num_tokens
            self._prefill_computed += int(q_len) - int(is_decode_token)
        self.scheduler.update(plan, tokens)
        return self._progressed(requests, before)

    def _run_multi_decode(self, mplan: MultiStepPlan) -> list[Request]:
        plan = mplan.plan
        n, width = plan.num_seqs, plan.block_tables.shape[1]
        requests = [self.scheduler.get_request(rid) for rid in plan.request_ids]
        inputs = pad_multi_decode(plan.token_ids, plan.block_tables, mplan.seq_lens, mplan.lent_block_ids,
                                  self._sampling_metadata(requests), [sorted(r.stop_ids) for r in requests],
                                  mplan.max_new_tokens, self.num_steps)
        sampled, tables = self.runner.execute_multi_decode(inputs)
        before = [r.num_output_tokens for r in requests]
        self.scheduler.update_multi_decode(mplan, sampled[:, :n], tables[:n, :width])
        self._fused_calls += 1
        return self._progressed(requests, before)

    def _progressed(self, requests: list[Request], before: list[int]) -> list[Request]:
        out = []
        for r, b in zip(requests, before, strict=True):
            self._generated += r.num_output_tokens - b
            if r.num_output_tokens > b or r.is_finished:
                out.append(r)
                if r.is_finished:
                    self._finished_prompt_tokens += r.num_prompt_tokens
        return out

    def _output(self, r: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_token_ids)
        return RequestOutput(request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
                             output_token_ids=list(r.output_token_ids), num_cached_tokens=max(r.num_cached_tokens, 0),
                             finish_reason=r.finish_reason(), text=text)

    # ----------------------------------------------------------------------------------------------- generate
    def generate(self, prompts: Sequence[Sequence[int] | str],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns finished outputs in input order.

        Prompts are token id lists, or strings when the engine has a tokenizer.
        """
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            rid = f"gen-{self._arrivals}"
            self.add_request(rid, self._encode(prompt), p)
            ids.append(rid)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        pending = set(ids)
        while pending:
            if not self.scheduler.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(pending)[:5]} vanished without finishing")
            for out in self.step():
                if out.finished and out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token ids or give the engine a tokenizer")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    # -------------------------------------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            steps=self._steps,
            fused_decode_calls=self._fused_calls,
            prompt_tokens=self._finished_prompt_tokens,
            generated_tokens=self._generated,
            prefill_tokens_computed=self._prefill_computed,
            elapsed_s=self._elapsed,
            device_s=self.runner.device_seconds,
            compile_s=self.runner.compile_seconds,
            tokens_per_s=self._generated / run_s if (run_s := self._elapsed - self.runner.compile_seconds) > 0 else 0.0,
            num_blocks=self.num_blocks,
            blocks_used=s.num_used_blocks,
            blocks_free=s.num_free_blocks,
            blocks_cached=s.num_cached_blocks,
            prefix_cache_hit_rate=s.prefix_cache_hit_rate,
            preemptions=s.num_preemptions,
            kv_waste_pct=100.0 * s.kv_waste_fraction,
            compilations=self.runner.num_compilations,
            num_waiting=s.num_waiting,
            num_running=s.num_running,
        )

    def stats_dict(self) -> dict:
        return dataclasses.asdict(self.stats())
