"""The model runner: owns the device state (weights, paged KV cache) and executes padded steps with jit.

Inputs come padded to bucket sizes (`pagedjax.runner.inputs`), so a long run compiles a handful of programs;
each new shape (`pagedjax.runner.shapes`) is compiled ahead of time, logged and counted, in the background while
a bigger program already compiled runs its steps, if there is one (`pagedjax.runner.programs`). The KV cache is
donated to every call, so XLA updates it in place.

Two entry points:
  `execute(inputs)`              one ragged step (prefill chunks and decodes together), returns sampled tokens.
  `execute_fused_decode(inputs)` N decode steps in one `lax.while_loop` on device: forward, KV write, paged
                                 attention, sampling, stop checks and block allocation (`page_state`), no host
                                 round trip until the end.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pagedjax.config import ModelSpec
from pagedjax.config.lora import LoRAConfig
from pagedjax.core.disk_tier import DiskTier
from pagedjax.core.host_tier import TierMoves
from pagedjax.core.step_plan import StepPlan
from pagedjax.core.step_result import StepResult
from pagedjax.device.attention import AttentionMetadata, probe_attention, resolve_backend
from pagedjax.device.kv_cache import KVCache, copy_blocks, init_kv_cache
from pagedjax.device.page_state import PageState, append_tokens
from pagedjax.device.sampling import (
    LogprobArrays,
    PenaltyMetadata,
    SamplingMetadata,
    apply_token_mask,
    chosen_logprobs,
    count_tokens,
    sample,
    token_logprobs,
)
from pagedjax.model.api import ImageEmbeds, PagedKVCache, PagedModel, param_partition_fn
from pagedjax.model.layers.lora import LoRABatch, init_lora_weights, slot_writer
from pagedjax.model.layers.quant import check_tensor_parallel, holds_quantized
from pagedjax.runner.host_tier import HostBlocks
from pagedjax.runner.images import ImageFeatures
from pagedjax.runner.inputs import NO_EXTRAS, FusedDecodeInputs, StepExtras, StepInputs
from pagedjax.runner.programs import ProgramCache, abstract_value
from pagedjax.runner.shapes import (
    LoopShape,
    StepShape,
    dominates,
    loop_shape,
    padding_fused_decode,
    padding_step,
    repad_fused_decode,
    repad_step,
    run_cost,
    step_shape,
)

logger = logging.getLogger(__name__)


class StepOutputs(NamedTuple):
    """What a step returns: sampled tokens i32 `[S]`, their log-probabilities (and top alternatives) when asked,
    the prompt log-probabilities at every position `[T]` when asked, the logits `[S, vocab]` when asked, a
    sparse-attention model's indexer ties (`PagedKVCache.indexer_ties`: i32[], None for other models), for
    pooling requests each sequence's sum of the hidden states its tokens pool (f32 `[S, hidden]`, `pooled_sums`),
    and a runner built with `keep_hidden` the final hidden states of every token `[T, hidden]`, left on the device
    (an MTP head's input: `pagedjax.spec_decode.mtp`)."""

    tokens: Any
    logprobs: LogprobArrays | None
    prompt_logprobs: LogprobArrays | None
    logits: Any
    indexer_ties: Any = None
    pooled: Any = None
    hidden: Any = None


def _forward_step(graphdef, params, kv_cache: KVCache, token_ids, positions, meta: AttentionMetadata,
                  logits_indices, sampling: SamplingMetadata, extras: StepExtras = NO_EXTRAS,
                  lora: LoRABatch | None = None, images: ImageEmbeds | None = None, *, backend: str,
                  decode_only: bool, return_logits: bool = False, num_top_logprobs: int | None = None,
                  num_prompt_top_logprobs: int = 0, samples: bool = True, draws: bool = True, keep_hidden: bool = False,
                  mesh=None, block_sizes: tuple[int, ...]) -> tuple[StepOutputs, KVCache]:
    model: PagedModel = nnx.merge(graphdef, params)
    if extras.block_copies is not None:
        kv_cache = copy_blocks(kv_cache, extras.block_copies, model.spec.kv_layout.slot_pools)  # before the writes
    hidden, kv_cache, ties = _model_forward(model, token_ids, positions, kv_cache, meta, backend=backend,
                                            decode_only=decode_only, mesh=mesh, block_sizes=block_sizes, lora=lora,
                                            images=images)
    pooled = None if extras.pool_rows is None else pooled_sums(hidden, extras.pool_rows, meta.kv_lens.shape[0])
    kept = hidden if keep_hidden else None
    if not (samples or return_logits or extras.prompt_targets is not None):  # no sequence emits a token: no logits
        return StepOutputs(jnp.zeros(logits_indices.shape, jnp.int32), None, None, None, ties, pooled, kept), kv_cache
    all_logits = None
    if extras.prompt_targets is not None:  # logits at every position, once
        all_logits = _gathered(model.compute_logits(hidden), mesh)
        logits = all_logits[logits_indices]
    else:
        logits = _gathered(model.compute_logits(hidden[logits_indices]), mesh)
    if extras.token_mask is not None:  # structured output: disallowed tokens out before anything else
        logits = apply_token_mask(logits, extras.token_mask)
    tokens = sample(logits, sampling, extras.penalties, draws=draws)
    prompt_logprobs, logprobs = None, None
    if all_logits is not None:
        # One log-softmax over the prompt rows and the sampled rows together: XLA:CPU rounds a row's log-softmax
        # by the row count of the op (`pagedjax.runner.invariant`), so a sampled token's log-probability is then
        # the bits of its score (a prompt row's) in batch-invariant mode; separate ops over T and S rows differed.
        both = jax.nn.log_softmax(jnp.concatenate([all_logits, logits]).astype(jnp.float32), axis=-1)
        prompt_logprobs = chosen_logprobs(both[:len(all_logits)], extras.prompt_targets, num_prompt_top_logprobs)
        if num_top_logprobs is not None:
            logprobs = chosen_logprobs(both[len(all_logits):], tokens, num_top_logprobs)
    elif num_top_logprobs is not None:
        logprobs = token_logprobs(logits, tokens, num_top_logprobs)
    outputs = StepOutputs(tokens, logprobs, prompt_logprobs, logits if return_logits else None, ties, pooled, kept)
    return outputs, kv_cache


def pooled_sums(hidden, pool_rows, num_seqs: int):
    """f32[S, hidden]: row s the float32 sum of the hidden states of the tokens whose `pool_rows` entry is s (-1:
    none; each pooling request's positions of this step, `runner.inputs.pool_rows`). A scatter-add, O(T x hidden):
    0.1-0.4 ms on this CPU for 512 tokens (a one-hot product costs the same at few sequences, S times more at many)."""
    take = (pool_rows >= 0)[:, None]
    return jax.ops.segment_sum(jnp.where(take, hidden.astype(jnp.float32), 0.0), jnp.maximum(pool_rows, 0),
                               num_segments=num_seqs)


def _model_forward(model: PagedModel, token_ids, positions, kv_cache: KVCache, meta: AttentionMetadata, *,
                   backend: str, decode_only: bool, mesh, block_sizes: tuple[int, ...], lora: LoRABatch | None = None,
                   images: ImageEmbeds | None = None) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """The model's forward over the cache as the contract gives it (`pagedjax.model.api.PagedKVCache`); with
    `lora` (a built-in model: the engine checks), each token through its adapter; with `images`, image features in
    place of their placeholders' embeddings (a model whose spec declares images). Returns (hidden, the cache, its
    indexer ties: None without sparse layers)."""
    cache = PagedKVCache(kv_cache.layers, meta, backend=backend, decode_only=decode_only, mesh=mesh,
                         spec=model.spec, block_sizes=block_sizes)
    extra = {}
    if lora is not None:
        extra["lora"] = lora
    if images is not None:
        extra["images"] = images
    hidden, cache = model(token_ids, positions, cache, **extra)
    return hidden, KVCache(cache.layers), cache.indexer_ties


def _gathered(logits, mesh):
    """Logits `[..., vocab]` replicated on every device of a tensor-parallel mesh (the LM head shards them by
    vocabulary): sampling's top-k / top-p sort whole rows. A no-op (no op at all) on one device."""
    if mesh is None:
        return logits
    return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, PartitionSpec()))


class FusedDecodeState(NamedTuple):
    """The fused decode loop's carry."""

    step: jax.Array  # i32[]: iterations run so far
    kv_cache: KVCache
    pages: tuple[PageState, ...]  # one per KV cache group
    last_tokens: jax.Array  # i32[S]: each sequence's newest token (its KV not cached yet)
    active: jax.Array  # bool[S]: still generating
    num_generated: jax.Array  # i32[S]: tokens generated in this call
    sampled: jax.Array  # i32[num_steps, S]: -1 where a sequence did not run
    logprobs: LogprobArrays | None  # [num_steps, S] (and top alternatives [num_steps, S, K]) when asked
    penalties: PenaltyMetadata | None  # output_counts follow the sampled tokens
    indexer_ties: jax.Array  # i32[]: the sparse layers' indexer ties so far (`PagedKVCache.indexer_ties`; 0 without)


def _fused_decode_loop(graphdef, params, kv_cache: KVCache, pages: PageState | tuple[PageState, ...], tokens,
                       sampling: SamplingMetadata,
                 stop_ids, max_new, penalties: PenaltyMetadata | None = None, lora: LoRABatch | None = None, *,
                 num_steps: int, block_sizes: tuple[int, ...],
                 backend: str, num_top_logprobs: int | None = None, draws: bool = True, mesh=None):
    """Up to `num_steps` decode steps with no host round trip.

    tokens int32 `[S]` (each sequence's last token, whose KV is not yet cached); stop_ids int32 `[S, K]`
    (-1 = none); max_new int32 `[S]` tokens each sequence may still generate (0 = padding row); lora: each
    sequence's adapter slot (`[S]`: one token per sequence each iteration); pages: the `PageState` of a model of
    one KV cache group, one per group of a model of several (each pops a block when a sequence crosses one of its
    group's `block_sizes`).
    Returns (sampled int32 `[num_steps, S]` with -1 after a sequence stopped, their `LogprobArrays`
    `[num_steps, S]`, the final page state(s) as given, the indexer ties of every iteration (i32[]), cache).
    """
    one_group = isinstance(pages, PageState)
    num_seqs = tokens.shape[0]
    cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)

    def cond(s: FusedDecodeState):
        return (s.step < num_steps) & jnp.any(s.active)

    def body(s: FusedDecodeState) -> FusedDecodeState:
        # The weights pass an optimization barrier together with the iteration counter, so that every value
        # computed from them depends on the iteration. Else XLA's loop-invariant code motion hoists the quantized
        # kernels' conversions (`pagedjax.model.layers.quant`: int8 / fp8 -> float, int4's scaled nibble planes)
        # out of the loop: a float copy of every quantized kernel written before the first iteration, 4x the
        # stored bytes, which every iteration's products then read (156M model, batch 1: int8 31 tokens/s fused
        # against 79 single-step, int4 6; with the barrier 73 fused). A barrier of the weights alone is hoisted
        # with them; the counter is the one operand that differs each iteration.
        model: PagedModel = nnx.merge(graphdef, jax.lax.optimization_barrier((params, s.step))[0])
        positions = s.pages[0].seq_lens
        pages, slots = zip(*(append_tokens(p, s.active, bs) for p, bs in zip(s.pages, block_sizes, strict=True)),
                           strict=True)
        tables = [p.block_tables for p in pages]
        one = len(pages) == 1  # a model of one group: its table and slots as they are, else stacked per group
        meta = AttentionMetadata(slots[0] if one else jnp.stack(slots), tables[0] if one else jnp.stack(tables),
                                 jnp.where(s.active, pages[0].seq_lens, 0), cu_q_lens)
        hidden, kv_cache, ties = _model_forward(model, s.last_tokens, positions, s.kv_cache, meta, backend=backend,
                                                decode_only=True, mesh=mesh, block_sizes=block_sizes, lora=lora)
        logits = _gathered(model.compute_logits(hidden), mesh)
        new = sample(logits, sampling._replace(step=sampling.step + s.num_generated), s.penalties, draws=draws)
        logprobs = s.logprobs
        if logprobs is not None:
            lp = token_logprobs(logits, new, num_top_logprobs)
            logprobs = jax.tree.map(lambda acc, x: acc.at[s.step].set(x), logprobs, lp)
        new = jnp.where(s.active, new, -1)
        num_generated = s.num_generated + s.active.astype(jnp.int32)
        stopped = jnp.any(new[:, None] == stop_ids, axis=1) | (num_generated >= max_new)
        pen = s.penalties
        if pen is not None:
            pen = pen._replace(output_counts=count_tokens(pen.output_counts, new, s.active))
        return FusedDecodeState(step=s.step + 1, kv_cache=kv_cache, pages=tuple(pages),
                               last_tokens=jnp.where(s.active, new, s.last_tokens), active=s.active & ~stopped,
                               num_generated=num_generated, sampled=s.sampled.at[s.step].set(new),
                               logprobs=logprobs, penalties=pen,
                               indexer_ties=s.indexer_ties if ties is None else s.indexer_ties + ties)

    init = FusedDecodeState(step=jnp.int32(0), kv_cache=kv_cache, pages=(pages,) if one_group else tuple(pages),
                            last_tokens=tokens,
                           active=max_new > 0, num_generated=jnp.zeros((num_seqs,), jnp.int32),
                           sampled=jnp.full((num_steps, num_seqs), -1, jnp.int32),
                           logprobs=None if num_top_logprobs is None else LogprobArrays(
                               jnp.zeros((num_steps, num_seqs), jnp.float32),
                               jnp.zeros((num_steps, num_seqs, num_top_logprobs), jnp.int32),
                               jnp.zeros((num_steps, num_seqs, num_top_logprobs), jnp.float32)),
                           penalties=penalties, indexer_ties=jnp.int32(0))
    final = jax.lax.while_loop(cond, body, init)
    return final.sampled, final.logprobs, final.pages[0] if one_group else final.pages, final.indexer_ties, \
        final.kv_cache


@functools.lru_cache(maxsize=8)
def _jitted(graphdef, params_treedef, block_sizes: tuple[int, ...], mesh=None) -> tuple:
    """The jitted step and decode loop for one model structure, its KV cache groups' `block_sizes` (over a
    tensor-parallel `mesh` of two or more devices, or None: one device).

    The graphdef and the parameters' tree structure are closed over (hashed once, here), so a call passes
    only a flat list of arrays. The KV cache argument is donated: XLA updates it in place. Runners of the same
    structure share them (the last eight structures' are kept), and with them JAX's own caches of traces, lowerings
    and compiled programs: a second engine of a model in the same process compiles nothing its predecessor
    compiled (JAX's persistent compilation cache still pays tracing and lowering). A dead engine's programs live
    on until its structure leaves this cache or a runner of it drops a program (`ModelRunner._forget_traces`).
    """
    def model_fn(fn):
        def call(param_leaves, *args, **kwargs):
            kwargs["block_sizes"] = block_sizes
            if mesh is not None:
                kwargs["mesh"] = mesh
            return fn(graphdef, jax.tree.unflatten(params_treedef, param_leaves), *args, **kwargs)
        return call

    step = jax.jit(model_fn(_forward_step), static_argnames=("backend", "decode_only", "return_logits",
                                                            "num_top_logprobs", "num_prompt_top_logprobs", "samples",
                                                            "draws", "keep_hidden"),
                   donate_argnums=(1,))
    loop = jax.jit(model_fn(_fused_decode_loop), static_argnames=("num_steps", "backend",
                                                           "num_top_logprobs", "draws"),
                   donate_argnums=(1,))
    return step, loop


# XLA:CPU hands dots to YNNPACK by default. Measured with scripts/bench_engine.py (interleaved, same machine):
# on a float32 model of hidden size 1024 (the 156M shape), its dots of 1-16 rows are slower than XLA's own (Eigen)
# ones (decode at batch 16: 503 vs 468 tokens/s, batch 1: 75 vs 71), while from 32 rows on (prefill, big
# batches) YNNPACK is 15-20% faster, 16-bit dots need it (Eigen's bf16 decode ran at half the speed), and on
# small float32 models the two are within noise. So only small-row steps of large float32 models opt out, unless
# they hold quantized linears (`pagedjax.model.layers.quant`): their several-row dots of kernels stored `[out, in]` ran
# about 3x slower on Eigen than on YNNPACK, and their one-row products are loops XLA emits itself, which it
# vectorizes 256 bits wide unless told 512 (int4's ran about 2x faster so, int8's about 10%: `python
# scripts/bench_quant.py --chain`, 156M shape).
_EIGEN_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}  # no YNNPACK fusion: dots stay XLA's
_QUANTIZED = {"xla_cpu_prefer_vector_width": 512}  # YNNPACK on; XLA's own loops in AVX-512 where the CPU has it


def cpu_compiler_options(spec: ModelSpec, rows: int, quantized: bool = False) -> dict | None:
    """XLA compile options for a step of `rows` tokens of a model of `spec` (None: XLA's defaults); `quantized`:
    the model holds quantized linears (`pagedjax.model.layers.quant.holds_quantized`)."""
    if jax.default_backend() != "cpu":
        return None
    if quantized:
        return _QUANTIZED
    if spec.dtype == "float32" and (spec.hidden_size or 0) >= 1024 and rows <= 16:
        return _EIGEN_DOTS
    return None


class ModelRunner:
    """Executes steps of one model over one paged KV cache of `num_blocks` x `block_size` tokens (and the pools
    past the first: `extra_pools` blocks each, of `pool_block_sizes` tokens, default `block_size`).

    With a `mesh` (a 1-D `tp` mesh, see `pagedjax.parallel`), the weights and the KV cache are placed sharded
    over it and the steps run SPMD on its devices; without one, everything is on the default device and the
    steps carry no sharding at all."""

    def __init__(self, model: PagedModel, num_blocks: int, block_size: int, *, extra_pools: tuple[int, ...] = (),
                 pool_block_sizes: tuple[int, ...] = (), kv_dtype=None,
                 backend: str = "auto", mesh: Mesh | None = None, max_programs: int = 64,
                 compile_in_background: bool = True, lora: LoRAConfig | None = None,
                 image_slots: int | None = None, host_tier_blocks: tuple[int, ...] = (),
                 disk_tiers: tuple[DiskTier | None, ...] = (), keep_hidden: bool = False):
        spec = model.spec  # `check_model(model)` passed (the engine checks it)
        self.model_spec = spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.extra_pools = tuple(extra_pools)  # blocks of the pools past the first (recurrent state snapshots)
        sizes = tuple(pool_block_sizes) or (block_size,) * len(spec.kv_layout.pools)
        self.group_block_sizes = tuple(sizes[p] for p in spec.kv_layout.group_pools)  # tokens per block, per group
        self.backend = resolve_backend(backend)
        self.mesh = mesh
        self.graphdef, self.params = nnx.split(model)
        # Without a mesh a model may take its weights in a single-device form (`served_params`).
        self._single_device = getattr(model, "single_device_params", None) if mesh is None else None
        self._quantized = holds_quantized(self.params)
        check_tensor_parallel(model, 1 if mesh is None else mesh.size)
        if mesh is not None:
            from pagedjax.parallel.sharding import shard_state

            self.params = shard_state(self.params, param_partition_fn(model, mesh.size), mesh)
        self.params = self.served_params(self.params)
        self.kv_dtype = jnp.dtype(kv_dtype or spec.dtype)
        self.kv_cache = self._new_kv_cache()
        # The host tiers' bytes (host_tier_blocks: slots per pool), moved by each plan's `tier_moves` before its step;
        # the disk tiers under them (`disk_tiers`: the scheduler's own, whose files the spills write).
        self.host_blocks = (HostBlocks(self.kv_cache, spec.kv_layout.slot_pools, tuple(host_tier_blocks),
                                       tuple(disk_tiers)) if any(host_tier_blocks) else None)
        self.asleep = False  # the KV cache's arrays were deleted (`pagedjax.runner.weights.sleep`)
        self.fixed_shape: StepShape | None = None  # batch-invariant mode: every step's program (`engine.invariant`)
        # Every ragged step also returns its final hidden states, left on the device (`StepResult.hidden`): one
        # setting for all of the runner's programs, so it adds no program variant.
        self.keep_hidden = keep_hidden
        self._check_attention_serves()
        # Every slot's adapter weights (`pagedjax.model.layers.lora`), an argument of every step: None, or zeros
        # until `set_lora_slot` writes one (a built-in dense model: the engine checks), split over the mesh as the
        # linears they adapt.
        self.lora_weights = None if lora is None else init_lora_weights(model.config, lora.num_slots,
                                                                         lora.max_lora_rank, mesh)
        self._write_lora_slot = None if lora is None else slot_writer(model.config, mesh)
        # The encoder cache's features (`image_slots` images; a model that takes images), an argument of every step
        # of image placeholders.
        self.image_features = None if image_slots is None else ImageFeatures(self.graphdef, self.params, spec,
                                                                             image_slots, mesh)
        self.device_seconds = 0.0  # wall time inside compiled calls, results read back
        self.indexer_ties = 0  # the steps' sparse-layer indexer ties (`PagedKVCache.indexer_ties`), warm-up's not
        self._param_leaves, treedef = jax.tree.flatten(self.params)
        # A one-device mesh (a data-parallel replica with tp 1) runs the plain single-device program there.
        self._step, self._loop = _jitted(self.graphdef, treedef, self.group_block_sizes,
                                         mesh if mesh is not None and mesh.size > 1 else None)
        # Compiled ahead of time, by shape: at most `max_programs` are kept (each holds its machine code and
        # buffers: about 12 MiB for the bundled model's steps), the least recently used dropped. One needed again is
        # compiled again, or loaded from JAX's persistent compilation cache.
        self.programs = ProgramCache(max_programs, background=compile_in_background, on_drop=self._forget_traces)
        logger.info("pagedjax runner: backend=%s, KV cache %d blocks x %d tokens of %s (%.1f MiB, %.1f MiB per "
                    "device)", self.backend, num_blocks, block_size, self.kv_dtype.name, self.kv_cache.nbytes / 2**20,
                    self.kv_cache.nbytes_per_device / 2**20)

    def _forget_traces(self) -> None:
        """JAX's own caches (traces and lowerings, by signature) keep every program compiled through a jitted
        function alive: without clearing them a dropped program's memory is never freed. The programs held
        stay alive through `programs`; only a new signature is traced again, as it would be anyway."""
        self._step.clear_cache()
        self._loop.clear_cache()

    def _new_kv_cache(self) -> KVCache:
        cfg = self.model_spec
        if self.mesh is None:
            return init_kv_cache(cfg.kv_layout, self.num_blocks, self.block_size, self.kv_dtype,
                                 extra_pools=self.extra_pools)
        from pagedjax.config.parallel import kv_heads_stored
        from pagedjax.parallel.sharding import pages_sharding

        # Full-attention pages split by KV heads (tp > Hkv: each KV head repeated); recurrent states by their heads
        # (and conv windows by channels); latent pages, one entry per token for every head, whole on every device.
        heads = None if cfg.num_kv_heads is None else kv_heads_stored(cfg.num_kv_heads, self.mesh.size)
        sharding = lambda spec: pages_sharding(self.mesh, spec.heads_axis)
        return init_kv_cache(cfg.kv_layout, self.num_blocks, self.block_size, self.kv_dtype, num_kv_heads=heads,
                             sharding_of=sharding, extra_pools=self.extra_pools)

    def _check_attention_serves(self) -> None:
        """Trace (no compile, no run) a decode and a ragged attention call of one device's shapes over each kind of
        page array this cache holds, so that a combination the Pallas kernels reject (8-bit pages on the TPU
        kernels, a dtype or block size the target lacks) fails here with the kernels' own reason, not at the first
        step."""
        if self.backend != "pallas":
            return  # the XLA gather paths take every dtype and block size
        cfg = self.model_spec
        tp = 1 if self.mesh is None else self.mesh.size
        heads = max(cfg.num_q_heads // tp, 1)
        first = {}  # one page array of each spec: all of one spec have the same pages
        for spec, layer in zip(cfg.kv_layout.slot_specs, self.kv_cache.layers, strict=True):
            first.setdefault(spec, layer)
        for spec, layer in first.items():
            if spec.splits_kv_heads:  # one device's KV heads
                layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // tp, *a.shape[1:]), a.dtype), layer)
            for decode_only in (True, False):
                try:
                    probe_attention(spec, layer, heads=heads, dtype=jnp.dtype(cfg.dtype), decode_only=decode_only,
                                    backend=self.backend)
                except (ValueError, TypeError, NotImplementedError) as e:
                    raise ValueError(f"the {self.backend!r} attention backend on {jax.default_backend()} cannot "
                                     f"serve {self.kv_dtype.name} KV pages of block size {self.block_size} for "
                                     f"this model: {e}") from None

    @property
    def _num_groups(self) -> int:
        return self.model_spec.kv_layout.num_groups

    @property
    def _num_pools(self) -> int:
        return len(self.model_spec.kv_layout.pools)

    def block_bytes_per_pool(self) -> tuple[int, ...]:
        """Bytes of one block of each block pool on each device (its share of every page array of the pool)."""
        layout = self.model_spec.kv_layout
        blocks = (self.num_blocks, *self.extra_pools)
        nbytes = [0] * len(blocks)
        for layer, pool in zip(self.kv_cache.layers, layout.slot_pools, strict=True):
            nbytes[pool] += sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                                for a in jax.tree.leaves(layer))
        return tuple(n // b for n, b in zip(nbytes, blocks, strict=True))

    @property
    def kv_cache_lost(self) -> bool:
        """True when the KV cache was donated to a call that then failed: its buffers are gone."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.kv_cache))

    def reset_kv_cache(self) -> None:
        """A fresh (zero) KV cache: after `kv_cache_lost`, the host must treat every block as unwritten."""
        self.kv_cache = self._new_kv_cache()

    def served_params(self, params: nnx.State) -> nnx.State:
        """The model's parameters `params` in the form the steps take them: the model's `single_device_params`
        without a mesh where it has one (mixture-of-experts layers: the experts as separate arrays), else as
        given."""
        return params if self._single_device is None else self._single_device(params)

    @property
    def param_leaves(self) -> list[jax.Array]:
        """`params`' leaves in order, as every step takes them (a flat list: no pytree to walk per call)."""
        return self._param_leaves

    def set_params(self, leaves: list[jax.Array]) -> None:
        """Run every later step on these weights: `self.params`' leaves in order, each of the same shape, dtype
        and sharding (`pagedjax.runner.weights.checked_leaves`), so every compiled program takes them as is."""
        self.params = jax.tree.unflatten(jax.tree.structure(self.params), leaves)
        self._param_leaves = list(leaves)

    def set_lora_slot(self, slot: int, a: list[dict], b: list[dict], scale: float) -> None:
        """Serve adapter weights `a`, `b` (per layer, per target: float32 `[in, r]`, `[r, out]` at the slots'
        rank r) scaled by `scale` from slot `slot` (>= 1) from the next step on: array contents only, nothing
        recompiled (over a mesh each device receives and writes its own part only)."""
        if not 1 <= slot < self.lora_weights.scales.shape[0]:
            raise ValueError(f"LoRA slot {slot} outside [1, {self.lora_weights.scales.shape[0] - 1}]")
        self.lora_weights = self._write_lora_slot(self.lora_weights, np.int32(slot), tuple(a), tuple(b),
                                                  np.float32(scale))

    def clear_lora_slot(self, slot: int) -> None:
        """Zeros in slot `slot` (>= 1) from the next step on, as in a slot never written: its adapter left it.
        Written by `set_lora_slot`'s program (nothing compiled for it)."""
        a = tuple({m: np.zeros((s.shape[0], s.shape[2]), np.float32) for m, s in layer.items()}
                  for layer in self.lora_weights.a)
        b = tuple({m: np.zeros(s.shape[1:], np.float32) for m, s in layer.items()} for layer in self.lora_weights.b)
        self.set_lora_slot(slot, a, b, 0.0)

    def _lora(self, slots: np.ndarray | None, n: int) -> LoRABatch | None:
        """A step's adapters: None without LoRA; with it, `slots` (None: a step of no adapter, e.g. padding)."""
        if self.lora_weights is None:
            return None
        return LoRABatch(self.lora_weights, np.zeros(n, np.int32) if slots is None else slots)

    def check_awake(self) -> None:
        """RuntimeError while the KV cache is released (`pagedjax.runner.weights.sleep`)."""
        if self.asleep:
            raise RuntimeError("the engine is asleep (its KV pool was released by sleep()): call wake() first")

    @property
    def num_programs(self) -> int:
        """Compiled programs held now (see `ProgramCache` for the cap)."""
        return len(self.programs)

    def close(self) -> None:
        """Cancel the background compiles still waiting; later misses compile at once."""
        self.programs.close()

    def _prepare(self, jitted, args: tuple, static: dict, rows: int):
        """The job that compiles `jitted` for these arguments' shapes (`rows`: the tokens a step runs): abstract
        arguments only, so it may run on another thread after the KV cache it saw was donated."""
        abstract = jax.tree.map(abstract_value, args)
        return functools.partial(_compile, jitted, abstract, static, cpu_compiler_options(self.model_spec, rows,
                                                                                             self._quantized))

    def _step_call(self, inputs: StepInputs, shape: StepShape) -> tuple[tuple, dict]:
        images = None if inputs.image_index is None else ImageEmbeds(self.image_features.array, inputs.image_index)
        args = (self._param_leaves, self.kv_cache, inputs.token_ids, inputs.positions, inputs.meta,
                inputs.logits_indices, inputs.sampling, inputs.extras,
                self._lora(inputs.lora_slots, len(inputs.token_ids)), images)
        static = dict(backend=self.backend, decode_only=shape.decode_only, return_logits=shape.return_logits,
                      num_top_logprobs=shape.num_top_logprobs, num_prompt_top_logprobs=shape.num_prompt_top_logprobs,
                      samples=shape.sample, draws=shape.draws, keep_hidden=self.keep_hidden)
        return args, static

    def _loop_call(self, inputs: FusedDecodeInputs, shape: LoopShape) -> tuple[tuple, dict]:
        # Host numpy arrays straight into the compiled call: `init_page_state`'s jnp conversions would run eagerly
        # here, five small device ops per call (~0.6 ms, a third of a small model's 8-step batch-1 call).
        x = inputs
        state = lambda tables, lent: PageState(block_tables=tables, seq_lens=x.seq_lens, free_blocks=lent,
                                               num_popped=np.zeros((), np.int32), overflow=np.zeros((), np.bool_))
        pages = state(x.block_tables, x.lent_blocks) if x.block_tables.ndim == 2 else \
            tuple(state(t, lent) for t, lent in zip(x.block_tables, x.lent_blocks, strict=True))
        args = (self._param_leaves, self.kv_cache, pages, x.tokens, x.sampling, x.stop_ids, x.max_new, x.penalties,
                self._lora(x.lora_slots, len(x.tokens)))
        static = dict(num_steps=shape.num_steps, backend=self.backend, num_top_logprobs=shape.num_top_logprobs,
                      draws=shape.draws)
        return args, static

    def move_tiers(self, moves: tuple[TierMoves, ...]) -> None:
        """Run block moves between the KV cache and the host tiers (`HostBlocks.move`): a plan's, before its step,
        or a save's (`LLMEngine.save_kv_tiers`)."""
        self.check_awake()
        self.kv_cache = self.host_blocks.move(self.kv_cache, moves)

    def run(self, plan: StepPlan, inputs: StepInputs | FusedDecodeInputs) -> StepResult:
        """Run any step (`runner.inputs.step_inputs` of `plan`) on its program: a fused decode on the loop, a
        ragged step on the step program. Returns its `StepResult`: the tokens sampled for each sequence, in order,
        their log-probabilities when asked, and a fused decode's block tables. The plan's host tier moves run
        first."""
        if plan.tier_moves is not None:
            self.move_tiers(plan.tier_moves)
        if isinstance(inputs, FusedDecodeInputs):
            sampled, logprobs, tables = self.execute_fused_decode(inputs)
            return StepResult.from_fused(plan, sampled, tables, logprobs)
        if plan.encode_images:  # the step's new images, into their encoder cache slots first
            self.image_features.encode(self.params, plan.encode_images)
        out = self.execute(inputs)
        return StepResult.from_rows(plan, out.tokens, out.logprobs, out.prompt_logprobs,
                                    inputs.extras.prompt_targets if out.prompt_logprobs is not None else None,
                                    pooled=None if out.pooled is None else out.pooled[:plan.num_seqs],
                                    hidden=out.hidden)

    def execute(self, inputs: StepInputs, *, return_logits: bool = False) -> StepOutputs:
        """Run one padded step (on a bigger compiled program while its own compiles: `ProgramCache`). Returns
        its `StepOutputs` as numpy (logits `[S, vocab]` only if asked), shaped as its own program returns them."""
        shape = self._held_twin(step_shape(inputs, return_logits))
        args, static = self._step_call(inputs, shape)
        if self.fixed_shape is not None:
            run_shape, exe = self._fixed_program(shape)
        else:
            run_shape, exe = self.programs.lookup(
                shape, lambda: self._prepare(self._step, args, static, rows=shape.tokens))
        if run_shape != shape:
            args, _ = self._step_call(repad_step(inputs, run_shape, self.model_spec.vocab_size, self._num_pools),
                                      run_shape)
        start = time.perf_counter()
        outputs, self.kv_cache = exe(*args)
        hidden = outputs.hidden  # stays on the device: the tokens' rows are the same in a bigger program's
        outputs = jax.device_get(outputs._replace(hidden=None))._replace(hidden=hidden)
        self._ran(run_shape, time.perf_counter() - start)
        if outputs.indexer_ties is not None:
            self.indexer_ties += int(outputs.indexer_ties)
        return outputs if run_shape == shape else _cut_step(outputs, shape)

    def _fixed_program(self, shape: StepShape):
        """Batch-invariant mode's one program (`pagedjax.runner.invariant`), compiled on first use; ValueError for
        a step it cannot run (one asking for logits, or more stop ids than it has columns)."""
        fixed = self.fixed_shape
        if not dominates(fixed, shape):
            raise ValueError(f"batch-invariant mode runs every step on one program, {fixed}, which cannot run this "
                             f"step ({shape}: logits, or more stop ids than it has columns)")
        padding = padding_step(fixed, self.model_spec.vocab_size, self._num_groups, self._num_pools)
        return self.programs.lookup(fixed, lambda: self._prepare(self._step, *self._step_call(padding, fixed),
                                                                 rows=fixed.tokens))

    def execute_fused_decode(self, inputs: FusedDecodeInputs):
        """Run up to `inputs.num_steps` decode steps on device (on a bigger compiled loop while its own compiles).

        Returns (sampled `[num_steps, S]` with -1 where a sequence did not run, their `LogprobArrays`
        `[num_steps, S]`, block_tables `[(num_groups,) S, B]` as the device left them), as numpy.
        """
        shape = self._held_twin(loop_shape(inputs))
        args, static = self._loop_call(inputs, shape)
        run_shape, exe = self.programs.lookup(
            shape, lambda: self._prepare(self._loop, args, static, rows=shape.tables[0]))
        if run_shape != shape:
            args, _ = self._loop_call(repad_fused_decode(inputs, run_shape, self.model_spec.vocab_size), run_shape)
        start = time.perf_counter()
        out, logprobs, pages, ties, self.kv_cache = exe(*args)
        pages = (pages,) if isinstance(pages, PageState) else pages  # one per KV cache group
        out, logprobs, tables, overflow, ties = jax.device_get((out, logprobs, [p.block_tables for p in pages],
                                                                [p.overflow for p in pages], ties))
        self._ran(run_shape, time.perf_counter() - start)
        self.indexer_ties += int(ties)
        if any(overflow):
            raise RuntimeError("fused decode ran out of lent blocks or table columns: the host lent too few (a bug)")
        tables = tables[0] if len(tables) == 1 else np.stack(tables)
        if run_shape != shape:
            s, b = shape.tables
            out, logprobs, tables = out[:, :s], _cut(logprobs, (slice(None), slice(s)), shape.num_top_logprobs), \
                tables[..., :s, :b]
        return out, logprobs, tables

    def _held_twin(self, shape: StepShape | LoopShape) -> StepShape | LoopShape:
        """A greedy step's shape (`draws` off), or its drawing twin's where only the twin's program is held: the
        twin runs it with the same results (its draw is skipped at run time for greedy rows) and no compile, so a
        workload that mixes sampled and greedy steps compiles one program per shape, not two."""
        if shape.draws:
            return shape
        twin = shape._replace(draws=True)
        held = self.programs.executables
        return twin if twin in held and shape not in held else shape

    def _ran(self, shape: StepShape | LoopShape, seconds: float) -> None:
        self.device_seconds += seconds
        self.programs.record_run(shape, seconds)

    def _padding_call(self, shape: StepShape | LoopShape):
        """(a call of `shape`'s program on padding only: its arguments, the job that compiles it)."""
        vocab = self.model_spec.vocab_size
        if isinstance(shape, LoopShape):
            args, static = self._loop_call(padding_fused_decode(shape, vocab, self._num_groups), shape)
            jitted, rows = self._loop, shape.tables[0]
        else:
            args, static = self._step_call(padding_step(shape, vocab, self._num_groups, self._num_pools), shape)
            jitted, rows = self._step, shape.tokens
        return args, functools.partial(self._prepare, jitted, args, static, rows)

    def warmup(self, shapes: list[StepShape | LoopShape]) -> None:
        """Compile the programs of `shapes` now, hold them for good (stand-ins for every step they dominate), and
        run each once on padding only (no KV written or read: the cache's contents stay as they are); with host
        tiers, their moves too (`HostBlocks.warmup`)."""
        self.check_awake()
        for i, shape in enumerate(shapes):
            args, prepare = self._padding_call(shape)
            exe = self.programs.compile(shape, prepare, pinned=True, note=f"warm-up {i + 1} of {len(shapes)}")
            start = time.perf_counter()
            *outputs, self.kv_cache = exe(*args)
            jax.block_until_ready(outputs)
            self.programs.record_run(shape, time.perf_counter() - start)  # not the steps' device time
        if self.host_blocks is not None:  # the host tiers' moves of every count a step can make
            self.kv_cache = self.host_blocks.warmup(self.kv_cache, (self.num_blocks, *self.extra_pools))

    def warm_in_background(self, shapes: list[StepShape | LoopShape]):
        """Compile the programs of `shapes` in the background, the cheapest first, behind any step's own program
        (`ProgramCache.warm_in_background`; each held for good once a step's lookup installs it, unrun until a
        step runs on it); returns the future of the seconds until all of them are compiled."""
        ordered = sorted(shapes, key=run_cost)
        return self.programs.warm_in_background([(shape, self._padding_call(shape)[1]) for shape in ordered])


def _compile(jitted, args: tuple, static: dict, options: dict | None):
    return jitted.lower(*args, **static).compile(compiler_options=options)


def _cut(lps: LogprobArrays | None, rows: tuple, num_top: int | None) -> LogprobArrays | None:
    """Log-probabilities of a bigger program's rows and alternatives, cut to `rows` and `num_top` (None: the
    step asked for none)."""
    if num_top is None:
        return None
    cols = (*rows, slice(num_top))
    return LogprobArrays(lps.logprob[rows], lps.top_ids[cols], lps.top_logprobs[cols])


def _cut_step(out: StepOutputs, shape: StepShape) -> StepOutputs:
    """A step's outputs from a bigger program, as its own program (`shape`) returns them."""
    s = shape.num_rows
    return StepOutputs(out.tokens[:s], _cut(out.logprobs, (slice(s),), shape.num_top_logprobs),
                       _cut(out.prompt_logprobs, (slice(shape.tokens),),
                            shape.num_prompt_top_logprobs if shape.prompt_targets else None),
                       out.logits[:s] if shape.return_logits else None, out.indexer_ties,
                       out.pooled[:shape.tables[0]] if shape.pool else None, out.hidden)
