"""The paged serving forward equals the dense no-cache forward of the same weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.device.attention import AttentionMetadata
from pagedjax.device.kv_cache import KVCache, init_kv_cache
from pagedjax.model.api import PagedKVCache
from pagedjax.model.llama import init_model, rope_inv_freq

CONFIGS = {
    "gqa": ModelConfig(vocab_size=61, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=96),
    "mha-bias-untied": ModelConfig(vocab_size=61, hidden_size=48, num_layers=2, num_q_heads=3, num_kv_heads=3,
                                   head_dim=16, intermediate_size=64, qkv_bias=True, tie_word_embeddings=False),
    "mqa": ModelConfig(vocab_size=61, hidden_size=64, num_layers=1, num_q_heads=4, num_kv_heads=1, head_dim=32,
                       intermediate_size=64),
}


def _ragged_batch(prompts, block_size, num_blocks, rng):
    """One prefill step for all prompts with blocks scattered through the pool."""
    perm = rng.permutation(num_blocks)
    tables, slots, used = [], [], 0
    max_blocks = max(-(-len(p) // block_size) for p in prompts) + 1
    for p in prompts:
        n = -(-(len(p) + 1) // block_size)  # room for one decode token
        row = perm[used: used + n]
        used += n
        tables.append(np.pad(row, (0, max_blocks - n)))
        slots += [row[i // block_size] * block_size + i % block_size for i in range(len(p))]
    cu = np.cumsum([0] + [len(p) for p in prompts])
    return (np.concatenate(prompts).astype(np.int32),
            np.concatenate([np.arange(len(p)) for p in prompts]).astype(np.int32),
            AttentionMetadata(np.array(slots, np.int32), np.array(tables, np.int32),
                              np.array([len(p) for p in prompts], np.int32), cu.astype(np.int32)))


def _right_pad(seqs):
    out = np.zeros((len(seqs), max(len(s) for s in seqs)), np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def _jitted(model):
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames=("decode_only",))
    def serve(state, tokens, positions, cache, meta, decode_only=False):
        m = nnx.merge(graphdef, state)
        hidden, paged = m(tokens, positions, PagedKVCache(cache.layers, meta, backend="xla", decode_only=decode_only))
        return m.compute_logits(hidden), KVCache(paged.layers)

    @jax.jit
    def dense(state, tokens):
        return nnx.merge(graphdef, state).forward_dense(tokens)

    return functools.partial(serve, state), functools.partial(dense, state)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_forward_matches_dense(name, block_size):
    cfg = CONFIGS[name]
    serve, dense_forward = _jitted(init_model(cfg, seed=3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in (1, block_size, 2 * block_size + 3, 5)]
    num_blocks = 32
    cache = init_kv_cache(cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    tokens, positions, meta = _ragged_batch(prompts, block_size, num_blocks, rng)
    logits, cache = serve(jnp.asarray(tokens), jnp.asarray(positions), cache, meta)
    logits = np.asarray(logits)
    # Causal attention: right-padding a batch leaves every real position's logits unchanged.
    dense = np.asarray(dense_forward(jnp.asarray(_right_pad(prompts))))
    offset = 0
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[offset: offset + len(p)], dense[i, : len(p)], rtol=1e-5, atol=1e-5)
        offset += len(p)

    # One decode token per sequence, reading the cache written above.
    nxt = rng.integers(0, cfg.vocab_size, len(prompts)).astype(np.int32)
    tables = meta.block_tables
    slots = np.array([tables[i, len(p) // block_size] * block_size + len(p) % block_size
                      for i, p in enumerate(prompts)], np.int32)
    kv_lens = np.array([len(p) + 1 for p in prompts], np.int32)
    meta2 = AttentionMetadata(slots, tables, kv_lens, np.arange(len(prompts) + 1, dtype=np.int32))
    logits, cache = serve(jnp.asarray(nxt), jnp.asarray(kv_lens - 1), cache, meta2, decode_only=True)
    logits = np.asarray(logits)
    extended = [np.append(p, t) for p, t in zip(prompts, nxt, strict=True)]
    dense = np.asarray(dense_forward(jnp.asarray(_right_pad(extended))))
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[i], dense[i, len(p)], rtol=1e-5, atol=1e-5)


def test_rope_llama3_scaling_changes_only_low_frequencies():
    base = ModelConfig(head_dim=64, rope_theta=500000.0)
    scaled = base.replace(rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                        ("original_max_position_embeddings", 8192), ("rope_type", "llama3")))
    f0, f1 = rope_inv_freq(base), rope_inv_freq(scaled)
    assert np.allclose(f0[:8], f1[:8])  # high frequencies untouched
    assert np.allclose(f1[-4:], f0[-4:] / 8.0)  # lowest frequencies divided by the factor
    with pytest.raises(ValueError, match="rope_scaling"):
        rope_inv_freq(base.replace(rope_scaling=(("rope_type", "yarn"), ("factor", 2.0))))


@pytest.mark.xla_default  # -O0 code computes the one-row and the batched float32 dot in different orders
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_linear_one_row_equals_its_row_in_a_batch(dtype):
    """A single 16-bit row runs as two rows on the CPU (XLA:CPU's one-row 16-bit dot is ~10x slower); the
    result is that row of a batched call, exactly, and within 16-bit rounding of the float32 product."""
    from pagedjax.model.llama import _linear

    layer = _linear(64, 48, True, jnp.dtype(dtype), nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 64), jnp.float32).astype(dtype)
    one = jax.jit(layer)(x[:1])
    batch = jax.jit(layer)(x)
    assert one.dtype == x.dtype and one.shape == (1, 48)
    np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(batch[:1], np.float32))
    exact = np.asarray(x, np.float32) @ np.asarray(layer.kernel[...], np.float32) + np.asarray(layer.bias[...],
                                                                                                   np.float32)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(batch, np.float32), exact, rtol=tol, atol=tol * np.abs(exact).max())
