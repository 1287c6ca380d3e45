"""The model runner: owns the device state (weights, paged KV cache) and executes step plans with jit.

Shapes are bucketed to powers of two (tokens, sequences, blocks per sequence) so that a long run compiles a
handful of times; each new bucket is logged and counted. The KV cache is donated to every call, so XLA
updates it in place.

Two entry points:
  `execute(plan)`            one ragged step (prefill chunks and decodes together), returns sampled tokens.
  `execute_multi_decode(..)` N decode steps in one `lax.while_loop` on device: forward, KV write, paged
                             attention, sampling, stop checks and block allocation (`page_state`), no host
                             round trip until the end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.device.attention import AttentionMetadata, resolve_backend
from pagedjax.device.kv_cache import KVCache, init_kv_cache
from pagedjax.device.page_state import PageState, append_tokens, init_page_state
from pagedjax.device.sampling import SamplingMetadata, sample
from pagedjax.model.llama import Llama

logger = logging.getLogger(__name__)


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def _pad(x, n: int, value, dtype=np.int32) -> np.ndarray:
    """`x` along its first axis, padded with `value` to length n."""
    out = np.full((n,) + np.shape(x)[1:], value, dtype)
    out[: len(x)] = x
    return out


def _pad_table(table: np.ndarray, rows: int, cols: int) -> np.ndarray:
    out = np.zeros((rows, cols), np.int32)
    out[: table.shape[0], : table.shape[1]] = table
    return out


def pad_sampling(sampling: SamplingMetadata, n: int) -> SamplingMetadata:
    """Padding rows are greedy."""
    return SamplingMetadata(
        temperature=_pad(sampling.temperature, n, 0.0, np.float32),
        top_k=_pad(sampling.top_k, n, 0),
        top_p=_pad(sampling.top_p, n, 1.0, np.float32),
        seed_hi=_pad(sampling.seed_hi, n, 0, np.uint32),
        seed_lo=_pad(sampling.seed_lo, n, 0, np.uint32),
        step=_pad(sampling.step, n, 0),
    )


@dataclass(frozen=True)
class StepInputs:
    """A padded, device-ready step. Shapes: T tokens, S sequences, B blocks per sequence (all buckets)."""

    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    meta: AttentionMetadata  # slot_mapping [T], block_tables [S, B], kv_lens [S], cu_q_lens [S + 1]
    logits_indices: np.ndarray  # int32 [S]
    sampling: SamplingMetadata  # [S] each
    decode_only: bool


def pad_step(*, token_ids: np.ndarray,  # i32[T]
             positions: np.ndarray,  # i32[T]
             slot_mapping: np.ndarray,  # i32[T]
             block_tables: np.ndarray,  # i32[S, B]
             kv_lens: np.ndarray,  # i32[S]
             cu_q_lens: np.ndarray,  # i32[S + 1]
             sampling: SamplingMetadata,  # [S] each
             ) -> StepInputs:
    """Pad a ragged step to bucket sizes. Padding tokens write nowhere (slot -1); padding sequences have
    q_len 0 and kv_len 0, so every kernel returns zeros for them. Sequences are bucketed from 1 (a batch
    of one runs as one row: on a CPU a padded row costs nearly as much as a real one)."""
    num_tokens, num_seqs = len(token_ids), len(kv_lens)
    decode_only = num_tokens == num_seqs
    s_b = bucket(num_seqs)
    t_b = s_b if decode_only else bucket(num_tokens, 16)
    tables = _pad_table(block_tables, s_b, bucket(block_tables.shape[1], 2))
    return StepInputs(
        token_ids=_pad(token_ids, t_b, 0),
        positions=_pad(positions, t_b, 0),
        meta=AttentionMetadata(_pad(slot_mapping, t_b, -1), tables, _pad(kv_lens, s_b, 0),
                               _pad(cu_q_lens, s_b + 1, num_tokens)),
        logits_indices=_pad(np.asarray(cu_q_lens[1:]) - 1, s_b, 0),
        sampling=pad_sampling(sampling, s_b),
        decode_only=decode_only,
    )


@dataclass(frozen=True)
class MultiDecodeInputs:
    """A padded fused decode of S sequences (buckets; padding rows have max_new 0 and never run)."""

    tokens: np.ndarray  # int32 [S]: each sequence's last token, whose KV is not cached yet
    block_tables: np.ndarray  # int32 [S, B], wide enough for num_steps more tokens
    seq_lens: np.ndarray  # int32 [S]: tokens in the cache before step 1
    lent_blocks: np.ndarray  # int32 [F]: the stack the device pops from, front first, padded with -1
    sampling: SamplingMetadata  # [S] each
    stop_ids: np.ndarray  # int32 [S, K], -1 = none
    max_new: np.ndarray  # int32 [S]: tokens each sequence may generate in this call
    num_steps: int


def pad_multi_decode(*, tokens: np.ndarray,  # i32[S]
                     block_tables: np.ndarray,  # i32[S, B]
                     seq_lens: np.ndarray,  # i32[S]
                     lent_blocks: np.ndarray,  # i32[F]
                     sampling: SamplingMetadata,  # [S] each
                     stop_ids: list[list[int]],  # S lists
                     max_new: np.ndarray,  # i32[S]
                     num_steps: int,
                     block_size: int) -> MultiDecodeInputs:
    """Pad a fused decode to bucket sizes. The lent stack is padded with -1, which the device never pops
    (a short stack raises `overflow` instead of writing into block 0), to a length fixed by the batch bucket
    and `num_steps`: one sequence pops at most `cdiv(num_steps, block_size)` blocks in `num_steps` steps, so
    the stack's length adds no shape of its own to compile."""
    n = len(tokens)
    s_b = bucket(n)
    stack = s_b * -(-num_steps // block_size)
    if len(lent_blocks) > stack:
        raise ValueError(f"{len(lent_blocks)} lent blocks for {n} sequences and {num_steps} steps of block size "
                         f"{block_size}: at most {stack} can be popped")
    stops = np.full((s_b, bucket(max(map(len, stop_ids), default=1), 1)), -1, np.int32)
    for i, ids in enumerate(stop_ids):
        stops[i, : len(ids)] = ids
    return MultiDecodeInputs(
        tokens=_pad(tokens, s_b, 0),
        block_tables=_pad_table(block_tables, s_b, bucket(block_tables.shape[1], 2)),
        seq_lens=_pad(seq_lens, s_b, 0),
        lent_blocks=_pad(lent_blocks, bucket(stack), -1),
        sampling=pad_sampling(sampling, s_b),
        stop_ids=stops,
        max_new=_pad(max_new, s_b, 0),
        num_steps=num_steps,
    )


def _forward_step(graphdef, params, kv_cache: KVCache, token_ids, positions, meta: AttentionMetadata,
                  logits_indices, sampling: SamplingMetadata, *, backend: str, decode_only: bool,
                  return_logits: bool):
    model: Llama = nnx.merge(graphdef, params)
    hidden, kv_cache = model(token_ids, positions, kv_cache, meta, backend=backend, decode_only=decode_only)
    logits = model.compute_logits(hidden[logits_indices])
    tokens = sample(logits, sampling)
    return tokens, kv_cache, (logits if return_logits else None)


class DecodeLoopState(NamedTuple):
    """The fused decode loop's carry."""

    step: jax.Array  # i32[]: iterations run so far
    kv_cache: KVCache
    pages: PageState
    last_tokens: jax.Array  # i32[S]: each sequence's newest token (its KV not cached yet)
    active: jax.Array  # bool[S]: still generating
    num_generated: jax.Array  # i32[S]: tokens generated in this call
    sampled: jax.Array  # i32[num_steps, S]: -1 where a sequence did not run


def _decode_loop(graphdef, params, kv_cache: KVCache, pages: PageState, tokens, sampling: SamplingMetadata,
                 stop_ids, max_new, *, num_steps: int, block_size: int, backend: str):
    """Up to `num_steps` decode steps with no host round trip.

    tokens int32 `[S]` (each sequence's last token, whose KV is not yet cached); stop_ids int32 `[S, K]`
    (-1 = none); max_new int32 `[S]` tokens each sequence may still generate (0 = padding row).
    Returns (sampled int32 `[num_steps, S]` with -1 after a sequence stopped, final PageState, cache).
    """
    model: Llama = nnx.merge(graphdef, params)
    num_seqs = tokens.shape[0]
    cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)

    def cond(s: DecodeLoopState):
        return (s.step < num_steps) & jnp.any(s.active)

    def body(s: DecodeLoopState) -> DecodeLoopState:
        positions = s.pages.seq_lens
        pages, slots = append_tokens(s.pages, s.active, block_size)
        meta = AttentionMetadata(slots, pages.block_tables, jnp.where(s.active, pages.seq_lens, 0), cu_q_lens)
        hidden, kv_cache = model(s.last_tokens, positions, s.kv_cache, meta, backend=backend, decode_only=True)
        new = sample(model.compute_logits(hidden), sampling._replace(step=sampling.step + s.num_generated))
        new = jnp.where(s.active, new, -1)
        num_generated = s.num_generated + s.active.astype(jnp.int32)
        stopped = jnp.any(new[:, None] == stop_ids, axis=1) | (num_generated >= max_new)
        return DecodeLoopState(step=s.step + 1, kv_cache=kv_cache, pages=pages,
                               last_tokens=jnp.where(s.active, new, s.last_tokens), active=s.active & ~stopped,
                               num_generated=num_generated, sampled=s.sampled.at[s.step].set(new))

    init = DecodeLoopState(step=jnp.int32(0), kv_cache=kv_cache, pages=pages, last_tokens=tokens,
                           active=max_new > 0, num_generated=jnp.zeros((num_seqs,), jnp.int32),
                           sampled=jnp.full((num_steps, num_seqs), -1, jnp.int32))
    final = jax.lax.while_loop(cond, body, init)
    return final.sampled, final.pages, final.kv_cache


def _jitted(graphdef, params_treedef) -> tuple:
    """The jitted step and decode loop for one model structure.

    The graphdef and the parameters' tree structure are closed over (hashed once, here), so a call passes
    only a flat list of arrays. The KV cache argument is donated: XLA updates it in place. Each runner
    makes its own, so compiled programs live as long as their engine (JAX's persistent compilation cache
    is what makes a second engine of the same shape start fast).
    """
    def model_fn(fn):
        def call(param_leaves, *args, **kwargs):
            return fn(graphdef, jax.tree.unflatten(params_treedef, param_leaves), *args, **kwargs)
        return call

    step = jax.jit(model_fn(_forward_step), static_argnames=("backend", "decode_only", "return_logits"),
                   donate_argnums=(1,))
    loop = jax.jit(model_fn(_decode_loop), static_argnames=("num_steps", "block_size", "backend"),
                   donate_argnums=(1,))
    return step, loop


class ModelRunner:
    """Executes steps of one model over one paged KV cache of `num_blocks` x `block_size` tokens."""

    def __init__(self, model: Llama, num_blocks: int, block_size: int, *, kv_dtype=None, backend: str = "auto"):
        cfg = model.config
        self.model_config = cfg
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = resolve_backend(backend)
        self.graphdef, self.params = nnx.split(model)
        self.kv_dtype = jnp.dtype(kv_dtype or cfg.dtype)
        self.kv_cache = self._new_kv_cache()
        self.device_seconds = 0.0  # wall time inside compiled calls, results read back
        self.compile_seconds = 0.0  # wall time tracing and compiling new signatures
        self._param_leaves, treedef = jax.tree.flatten(self.params)
        self._step, self._loop = _jitted(self.graphdef, treedef)
        self._executables: dict[tuple, Any] = {}  # compiled ahead of time, by input signature
        logger.info("pagedjax runner: backend=%s, KV cache %d blocks x %d tokens (%.1f MiB)", self.backend,
                    num_blocks, block_size, self.kv_cache.nbytes / 2**20)

    def _new_kv_cache(self) -> KVCache:
        cfg = self.model_config
        return init_kv_cache(cfg.num_layers, cfg.num_kv_heads, self.num_blocks, self.block_size, cfg.head_dim,
                             self.kv_dtype)

    @property
    def kv_cache_lost(self) -> bool:
        """True when the KV cache was donated to a call that then failed: its buffers are gone."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.kv_cache))

    def reset_kv_cache(self) -> None:
        """A fresh (zero) KV cache: after `kv_cache_lost`, the host must treat every block as unwritten."""
        self.kv_cache = self._new_kv_cache()

    @property
    def num_compilations(self) -> int:
        return len(self._executables)

    def _executable(self, jitted, key: tuple, args: tuple, static: dict):
        """The compiled executable for this input signature, compiling it (timed, logged) if new."""
        exe = self._executables.get(key)
        if exe is None:
            start = time.perf_counter()
            exe = jitted.lower(*args, **static).compile()
            self.compile_seconds += time.perf_counter() - start
            self._executables[key] = exe
            logger.info("compiled %s in %.2f s", key, time.perf_counter() - start)
        return exe

    def execute(self, inputs: StepInputs, *, return_logits: bool = False):
        """Run one padded step. Returns sampled tokens `[S]` (numpy), and logits `[S, vocab]` if asked."""
        m = inputs.meta
        args = (self._param_leaves, self.kv_cache, inputs.token_ids, inputs.positions, m, inputs.logits_indices,
                inputs.sampling)
        static = dict(backend=self.backend, decode_only=inputs.decode_only, return_logits=return_logits)
        key = ("step", len(inputs.token_ids), m.block_tables.shape, inputs.decode_only, return_logits)
        exe = self._executable(self._step, key, args, static)
        start = time.perf_counter()
        tokens, self.kv_cache, logits = exe(*args)
        tokens = np.asarray(tokens)
        self.device_seconds += time.perf_counter() - start
        return (tokens, np.asarray(logits)) if return_logits else tokens

    def execute_multi_decode(self, inputs: MultiDecodeInputs):
        """Run up to `inputs.num_steps` decode steps on device.

        Returns (sampled `[num_steps, S]` with -1 where a sequence did not run, block_tables `[S, B]` as the
        device left them), as numpy.
        """
        x = inputs
        pages = init_page_state(x.block_tables, x.seq_lens, x.lent_blocks)
        args = (self._param_leaves, self.kv_cache, pages, x.tokens, x.sampling, x.stop_ids, x.max_new)
        static = dict(num_steps=x.num_steps, block_size=self.block_size, backend=self.backend)
        key = ("decode_loop", x.block_tables.shape, len(x.lent_blocks), x.stop_ids.shape[1], x.num_steps)
        exe = self._executable(self._loop, key, args, static)
        start = time.perf_counter()
        out, pages, self.kv_cache = exe(*args)
        out, tables, overflow = jax.device_get((out, pages.block_tables, pages.overflow))
        self.device_seconds += time.perf_counter() - start
        if overflow:
            raise RuntimeError("fused decode ran out of lent blocks or table columns: the host lent too few (a bug)")
        return out, tables
