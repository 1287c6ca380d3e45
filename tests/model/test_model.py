"""The paged serving forward equals the dense no-cache forward of the same weights."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.device.attention import AttentionMetadata
from pagedjax.device.kv_cache import KVCache, LayerKV, init_kv_cache
from pagedjax.model.api import PagedAttention, PagedKVCache
from pagedjax.model.layers.rope import RoPE, layer_rope
from pagedjax.model.llama import init_model
from pallas_kernels import paged_attention_reference, ragged_paged_attention_reference

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
    cache = init_kv_cache(cfg.spec.kv_layers, num_blocks, block_size)
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


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_paged_attention_sinks_reach_the_backend(backend):
    """`PagedAttention(...)(q, k, v, cache, sinks=)` with a bfloat16 parameter (gpt-oss stores its sinks in the
    model's dtype; they are taken in float32): a prefill step (a prompt and a decode token) and a decode-only step
    give the float32 references with those sinks, on the XLA path and the Pallas kernels (interpreted)."""
    rng = np.random.default_rng(1)
    hq, hkv, d, block_size = 6, 2, 16, 4
    attn = PagedAttention(0, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    sinks = nnx.Param(jnp.asarray(rng.normal(0.0, 2.0, hq), jnp.bfloat16))
    f32_sinks = jnp.asarray(sinks[...], jnp.float32)
    tables = np.array([[5, 2, 7], [0, 3, 1]], np.int32)
    layer = LayerKV(jnp.zeros((hkv, 8, block_size, d)), jnp.zeros((hkv, 8, block_size, d)))
    for step, (q_lens, kv_lens, decode_only) in enumerate((([6, 1], [6, 1], False), ([1, 1], [7, 2], True))):
        slots = [tables[s, p // block_size] * block_size + p % block_size
                 for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True))
                 for p in range(kv_len - q_len, kv_len)]
        cu = np.cumsum([0, *q_lens]).astype(np.int32)
        meta = AttentionMetadata(np.array(slots, np.int32), tables, np.array(kv_lens, np.int32), cu)
        q, k, v = (jnp.asarray(rng.standard_normal((len(slots), h, d)), jnp.float32) for h in (hq, hkv, hkv))
        o, cache = attn(q, k, v, PagedKVCache((layer,), meta, backend=backend, decode_only=decode_only), sinks=sinks)
        layer = cache.layers[0]
        args = (q, layer.k, layer.v, meta.block_tables, meta.kv_lens)
        want = (paged_attention_reference(*args, sinks=f32_sinks) if decode_only else
                ragged_paged_attention_reference(*args, meta.cu_q_lens, sinks=f32_sinks))
        np.testing.assert_allclose(np.asarray(o), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
        sink_free = paged_attention_reference(*args) if decode_only else ragged_paged_attention_reference(
            *args, meta.cu_q_lens)
        assert np.abs(np.asarray(o) - np.asarray(sink_free)).max() > 1e-3
    cache = PagedKVCache((layer,), meta, backend=backend, decode_only=True)
    with pytest.raises(ValueError, match=r"PagedAttention\(layer_index=0\): sinks must be a float array \[num_q"):
        attn(q, k, v, cache, sinks=jnp.zeros((hkv,), jnp.float32))


def test_rope_llama3_scaling_changes_only_low_frequencies():
    base = ModelConfig(head_dim=64, rope_theta=500000.0)
    scaled = base.replace(rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                        ("original_max_position_embeddings", 8192), ("rope_type", "llama3")))
    f0, f1 = layer_rope(base, 0).inv_freq(), layer_rope(scaled, 0).inv_freq()
    assert np.allclose(f0[:8], f1[:8])  # high frequencies untouched
    assert np.allclose(f1[-4:], f0[-4:] / 8.0)  # lowest frequencies divided by the factor
    with pytest.raises(ValueError, match="rope_scaling"):
        layer_rope(base.replace(rope_scaling=(("rope_type", "dynamic"), ("factor", 2.0))), 0)


def test_rope_per_layer_and_longrope():
    """rope_local_theta: windowed layers rotate by it, unscaled; the others keep rope_theta and its scaling.
    LongRoPE within its context: frequencies divided by the short factors, cos and sin scaled."""
    linear = (("factor", 2.0), ("rope_type", "linear"))
    cfg = ModelConfig(num_layers=3, head_dim=8, rope_theta=1e6, rope_scaling=linear, rope_local_theta=100.0,
                      sliding_windows=(4, None, 4))
    assert [layer_rope(cfg, i) for i in range(3)] == [RoPE(8, 100.0), RoPE(8, 1e6, linear), RoPE(8, 100.0)]
    assert layer_rope(cfg.replace(rope_local_theta=None), 0) == RoPE(8, 1e6, linear)
    np.testing.assert_allclose(layer_rope(cfg, 1).inv_freq(), 1e6 ** (-np.arange(0, 8, 2) / 8) / 2, rtol=1e-6)

    longrope = {"rope_type": "longrope", "short_factor": [1.0, 2.0, 3.0, 4.0], "attention_factor": 1.5,
                "original_max_position_embeddings": 64}
    rope = layer_rope(ModelConfig(head_dim=8, max_position_embeddings=64, rope_scaling=longrope), 0)
    np.testing.assert_allclose(rope.inv_freq(), 1e4 ** (-np.arange(0, 8, 2) / 8) / [1, 2, 3, 4], rtol=1e-6)
    x = jnp.ones((1, 1, 8), jnp.float32)
    np.testing.assert_allclose(np.asarray(rope(x, jnp.zeros((1,), jnp.int32))), 1.5 * np.ones((1, 1, 8)))


_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 16, "attention_factor": 1.2,
             "original_max_position_embeddings": 4096}


def test_new_fields_round_trip_and_default_to_todays_model():
    cfg = ModelConfig(architecture="gemma2", qk_norm="head", norm_placement="post", rope_local_theta=1e4,
                      sliding_windows=(8, None, 8, None), rope_scaling=_LONGROPE)
    d = json.loads(json.dumps(cfg.to_dict()))  # JSON-ready, as pagedjax checkpoints store it
    assert ModelConfig.from_dict(d) == cfg and d["rope_scaling"]["short_factor"] == [1.0] * 16
    assert dict(cfg.rope_scaling)["short_factor"] == (1.0,) * 16  # hashable
    old = {k: v for k, v in ModelConfig().to_dict().items()
           if k not in ("qk_norm", "norm_placement", "rope_local_theta", "attention_sinks", "o_proj_bias")}
    assert ModelConfig.from_dict(old) == ModelConfig()
    assert (ModelConfig().block_norms, ModelConfig(architecture="gemma2").block_norms) == ("pre", "sandwich")
    assert cfg.block_norms == "post"
    gpt_oss = ModelConfig(attention_sinks=True, o_proj_bias=True, rope_scaling=_YARN)
    assert ModelConfig.from_dict(json.loads(json.dumps(gpt_oss.to_dict()))) == gpt_oss
    assert not ModelConfig.from_dict(old).attention_sinks and not ModelConfig.from_dict(old).o_proj_bias


_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
         "truncate": False}


@pytest.mark.parametrize("changes, error, field", [
    ({"qk_norm": "per_head"}, ValueError, "qk_norm"),
    ({"qk_norm": 1}, TypeError, "qk_norm"),
    ({"norm_placement": "middle"}, ValueError, "norm_placement"),
    ({"norm_placement": True}, TypeError, "norm_placement"),
    ({"rope_local_theta": 0}, ValueError, "rope_local_theta"),
    ({"rope_local_theta": "1e4"}, TypeError, "rope_local_theta"),
    ({"rope_scaling": {**_LONGROPE, "short_factor": [1.0] * 15}}, ValueError, "short_factor"),
    ({"rope_scaling": {**_LONGROPE, "short_factor": [1.0] * 15 + ["2"]}}, TypeError, r"short_factor\[15\]"),
    ({"rope_scaling": {**_LONGROPE, "short_factor": 1.0}}, TypeError, "short_factor"),
    ({"rope_scaling": {**_LONGROPE, "attention_factor": 0.0}}, ValueError, "attention_factor"),
    ({"rope_scaling": {k: v for k, v in _LONGROPE.items() if k != "attention_factor"}}, ValueError,
     "attention_factor"),
    ({"rope_scaling": {**_LONGROPE, "original_max_position_embeddings": 1024}}, ValueError,
     "original_max_position_embeddings"),
    ({"attention_sinks": 1}, TypeError, "attention_sinks"),
    ({"o_proj_bias": "yes"}, TypeError, "o_proj_bias"),
    ({"rope_scaling": {**_YARN, "truncate": 0}}, TypeError, "truncate"),
    ({"rope_scaling": {**_YARN, "low_freq_factor": 1.0}}, ValueError, "low_freq_factor"),
    ({"rope_scaling": {**_YARN, "factor": 0.0}}, ValueError, "factor"),
    ({"rope_scaling": {k: v for k, v in _YARN.items() if k != "original_max_position_embeddings"}}, ValueError,
     "original_max_position_embeddings"),
])
def test_new_fields_validation_names_the_field(changes, error, field):
    with pytest.raises(error, match=field):
        ModelConfig(**changes)


@pytest.mark.parametrize("placement, qk_norm, norms, qk_dims", [
    (None, None, {"input_layernorm", "post_attention_layernorm"}, None),
    ("sandwich", "head", {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                          "post_feedforward_layernorm"}, (32, 32)),  # per head: head_dim
    ("post", "full", {"post_attention_layernorm", "post_feedforward_layernorm"}, (8 * 32, 2 * 32)),  # heads * D
])
def test_block_parameters_follow_transformers_names(placement, qk_norm, norms, qk_dims):
    cfg = ModelConfig(num_layers=1, norm_placement=placement, qk_norm=qk_norm)
    layer = nnx.state(nnx.eval_shape(lambda: init_model(cfg)))["layers"][0]
    assert set(layer) == norms | {"self_attn", "mlp"}
    attn = layer["self_attn"]
    if qk_dims is None:
        assert "q_norm" not in attn and "k_norm" not in attn
    else:
        assert (attn["q_norm"]["weight"].get_value().shape, attn["k_norm"]["weight"].get_value().shape) == (
            (qk_dims[0],), (qk_dims[1],))


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
