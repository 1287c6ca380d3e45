"""A KV cache kind of a model's own, declared through the public model contract with no engine change: a
`KVCacheSpec` subclass stating its pages (a container of its own whose `block_axis` says where blocks sit) and its
bytes, and a layer that writes and reads them itself through `PagedKVCache.layer` / `meta_of` / `with_layer`. The
engine sizes, allocates, shares (prefix hits), forks (copy-on-write along the container's block axis), preempts
and fuses decode steps over it like any built-in kind: greedy tokens equal the same model computed densely."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.config.kv_spec import ArraySpec, KVCacheSpec
from pagedjax.model.api import ModelSpec, PagedKVCache, check_model
from tests.dense import greedy_by_recompute

VOCAB, DIM, LAYERS, MAX_LEN, BS = 31, 16, 2, 32, 4


class MeanPages(NamedTuple):
    """One vector per token position, `[num_blocks, block_size, dim]`."""

    block_axis = 0

    values: Any


@dataclass(frozen=True)
class PrefixMean(KVCacheSpec):
    """A layer whose query reads the mean of one stored vector per earlier position (a test-only kind)."""

    dim: int

    kind = "prefix-mean"

    def page_shapes(self, num_blocks, block_size, dtype, *, quantized=False, num_kv_heads=None) -> MeanPages:
        if quantized:
            raise ValueError("PrefixMean stores float pages only")
        return MeanPages(ArraySpec((num_blocks, block_size, self.dim), dtype))

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        return self.dim * element_bytes


def _mix(x: jax.Array, mean: jax.Array) -> jax.Array:
    return x + jnp.tanh(mean)


class MeanModel(nnx.Module):
    """Embedding, then per layer: store v = x W, add tanh(mean of v over the positions up to this one)."""

    def __init__(self, seed: int = 0):
        keys = jax.random.split(jax.random.key(seed), LAYERS + 2)
        self.embed = nnx.Param(jax.random.normal(keys[0], (VOCAB, DIM)))
        self.w = nnx.Param(jnp.stack([jax.random.normal(k, (DIM, DIM)) / math.sqrt(DIM) for k in keys[1:-1]]))
        self.head = nnx.Param(jax.random.normal(keys[-1], (DIM, VOCAB)))
        self.spec = ModelSpec(vocab_size=VOCAB, num_layers=LAYERS, num_q_heads=1, kv_layers=(PrefixMean(DIM),) * LAYERS,
                              max_position_embeddings=MAX_LEN)

    def __call__(self, token_ids, positions, cache: PagedKVCache):
        x = self.embed[token_ids]
        for i in range(LAYERS):
            pages, meta = cache.layer(i), cache.meta_of(i)
            v = x @ self.w[i]
            num_blocks, bs, _ = pages.values.shape
            block = jnp.where(meta.slot_mapping < 0, num_blocks, meta.slot_mapping // bs)  # padding: dropped
            values = pages.values.at[block, meta.slot_mapping % bs].set(v, mode="drop")
            # Each token reads its sequence's positions 0..its own through the sequence's block table.
            seq = jnp.searchsorted(meta.cu_q_lens[1:], jnp.arange(token_ids.shape[0]), side="right")
            seq = jnp.minimum(seq, meta.block_tables.shape[0] - 1)
            j = jnp.arange(meta.block_tables.shape[1] * bs)
            rows = values[meta.block_tables[seq][:, j // bs], j % bs]  # [T, blocks * bs, dim]
            seen = j[None, :] <= positions[:, None]
            mean = jnp.where(seen[..., None], rows, 0).sum(1) / (positions[:, None] + 1)
            x = _mix(x, mean)
            cache = cache.with_layer(i, MeanPages(values))
        return x, cache

    def compute_logits(self, hidden):
        return (hidden @ self.head).astype(jnp.float32)

    def forward_dense(self, tokens):  # [B, S] -> logits [B, S, vocab]
        x = self.embed[tokens]
        count = jnp.arange(1, tokens.shape[1] + 1)[None, :, None]
        for i in range(LAYERS):
            x = _mix(x, jnp.cumsum(x @ self.w[i], axis=1) / count)
        return self.compute_logits(x)


def test_a_kind_of_the_models_own_is_served_like_a_built_in_one():
    model = MeanModel()
    assert check_model(model) == model.spec and model.spec.kv_layout.num_groups == 1
    assert CacheConfig(block_size=BS).block_bytes(model.spec) == BS * LAYERS * DIM * 4
    rng = np.random.default_rng(0)
    shared = rng.integers(0, VOCAB, 9).tolist()
    prompts = [shared + [1], shared + [2, 3], rng.integers(0, VOCAB, 3).tolist()]
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))
    want, margin = greedy_by_recompute(forward, prompts, 8, MAX_LEN)
    assert margin > 1e-4
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = LLMEngine(model=model, cache_config=CacheConfig(block_size=BS, num_blocks=9),
                       scheduler_config=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8,
                                                        max_model_len=MAX_LEN), decode_steps_per_call=4)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy, use_tqdm=False)] == want
    stats = engine.stats().scheduler
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0  # a hit on `shared`; 9 blocks for 3 requests
    # Forks share the prompt's blocks and copy the partial last one before writing (along block_axis 0).
    samples = engine.generate([prompts[1]], SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)[0]
    assert [c.token_ids for c in samples.outputs] == [want[1]] * 2
    assert engine.stats().scheduler.memory.num_used_blocks == 0
