import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedjax.config import CacheConfig, FullAttention, IndexedSparse, LatentAttention, ModelSpec
from pagedjax.config.cache import kv_cache_bytes
from pagedjax.device.kv_cache import (
    KVCache,
    LatentKV,
    LayerKV,
    SparseKV,
    copy_blocks,
    init_kv_cache,
    write_kv,
    write_latent,
    write_sparse,
)
from pallas_kernels.quant import is_quantized, quantize_kv


def _full(num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[FullAttention, ...]:
    return (FullAttention(num_kv_heads, head_dim),) * num_layers


def test_kv_cache_bytes_formula():
    # 32 layers x 4096 tokens x 8 KV heads x 128 dims x 2 bytes, K and V.
    assert kv_cache_bytes(32, 4096, 8, 128, 2) == 536_870_912


def test_init_kv_cache_layout_and_size():
    cache = init_kv_cache(_full(3, 2, 16), num_blocks=5, block_size=4, dtype=jnp.bfloat16)
    assert cache.num_layers == 3 and cache.num_blocks == 5 and cache.block_size == 4
    assert cache.layers[0].k.shape == (2, 5, 4, 16) and cache.layers[0].k.dtype == jnp.bfloat16
    k, v = cache.stacked()
    assert k.shape == v.shape == (3, 2, 5, 4, 16)
    assert cache.nbytes == kv_cache_bytes(3, 5 * 4, 2, 16, 2)


def _random_pages(rng, shape, dtype) -> np.ndarray:
    """Random contents of a pool (quantized ones too), so that a write that touches a wrong slot shows."""
    x = rng.normal(size=shape).astype(np.float32)
    if dtype == jnp.int8:
        return np.clip(np.round(x * 40), -127, 127).astype(np.int8)
    return np.asarray(jnp.asarray(x, dtype))


@given(st.data())
def test_write_kv_by_slot_mapping(data):
    """Each token's K/V (8-bit: its values and scales from `quantize_kv`) land in its slot; padding (-1) and
    every other slot are left alone."""
    # Drawn, not parametrized: the examples share one budget (each is a few eager scatters).
    dtype = data.draw(st.sampled_from([jnp.float32, jnp.int8, jnp.float8_e4m3fn]), label="dtype")
    num_blocks = data.draw(st.integers(1, 6), label="num_blocks")
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]), label="block_size")
    heads, dim = 2, 4
    num_slots = num_blocks * block_size
    num_tokens = data.draw(st.integers(0, num_slots), label="num_tokens")
    # Distinct slots, some replaced by -1 padding.
    slots = data.draw(st.permutations(range(num_slots)), label="perm")[:num_tokens]
    pad = data.draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens), label="pad")
    slots = np.array([-1 if p else s for s, p in zip(slots, pad, strict=True)], np.int32)
    rng = np.random.default_rng(num_tokens)
    quantized = is_quantized(dtype)
    k_pages, v_pages = (_random_pages(rng, (heads, num_blocks, block_size, dim), dtype) for _ in range(2))
    k_scales, v_scales = (rng.uniform(0.1, 1, size=(heads, num_blocks, block_size)).astype(np.float32)
                          if quantized else None for _ in range(2))
    k_new = rng.normal(size=(num_tokens, heads, dim)).astype(np.float32)
    v_new = rng.normal(size=(num_tokens, heads, dim)).astype(np.float32)
    k_new[:1, :1] = 0  # an all-zero vector: scale 0, values 0

    layer = LayerKV(*(None if a is None else jnp.asarray(a) for a in (k_pages, v_pages, k_scales, v_scales)))
    out = write_kv(layer, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots))

    expected = [k_pages.copy(), v_pages.copy()] + ([k_scales.copy(), v_scales.copy()] if quantized else [])
    if quantized:
        (k_q, k_s), (v_q, v_s) = (jax.device_get(quantize_kv(jnp.asarray(x), dtype)) for x in (k_new, v_new))
        new = [k_q, v_q, k_s, v_s]
    else:
        new = [k_new, v_new]
    for t, s in enumerate(slots):
        if s >= 0:
            for exp, x in zip(expected, new, strict=True):
                exp[:, s // block_size, s % block_size] = x[t]
    assert len(out) == 4 and (out.k_scales is None) == (not quantized)
    for got, exp in zip(out, expected, strict=False):
        assert got.dtype == exp.dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), exp.view(np.uint8))  # bit for bit


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_casts_to_cache_dtype(dtype):
    cache = init_kv_cache(_full(1, 1, 4), 2, 2, dtype)
    k, v, _, _ = write_kv(cache.layers[0], jnp.ones((1, 1, 4), jnp.float32), jnp.ones((1, 1, 4), jnp.float32),
                          jnp.array([3], jnp.int32))
    assert k.dtype == dtype
    assert float(k[0, 1, 1, 0]) == 1.0 and float(k[0, 0, 0, 0]) == 0.0


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_init_quantized_kv_cache_adds_float32_scales(dtype):
    cache = init_kv_cache(_full(2, 2, 16), num_blocks=5, block_size=4, dtype=dtype)
    for layer in cache.layers:
        assert layer.k.dtype == layer.v.dtype == dtype and layer.k.shape == (2, 5, 4, 16)
        assert layer.k_scales.dtype == layer.v_scales.dtype == jnp.float32
        assert layer.k_scales.shape == layer.v_scales.shape == (2, 5, 4)
        assert not any(np.asarray(a).astype(np.float32).any() for a in layer)
    # 1 byte per element plus a 4-byte scale per token, KV head, K and V.
    assert cache.nbytes == kv_cache_bytes(2, 5 * 4, 2, 16, 1, 4) == 2 * 2 * 20 * 2 * (16 + 4)


def test_write_kv_rejects_8bit_pages_without_scales():
    cache = init_kv_cache(_full(1, 1, 4), 2, 2, jnp.int8)
    new = jnp.ones((1, 1, 4), jnp.float32)
    with pytest.raises(ValueError, match="k_scales and v_scales"):
        write_kv(cache.layers[0]._replace(v_scales=None), new, new, jnp.array([0], jnp.int32))
    with pytest.raises(ValueError, match="k_scales and v_scales"):
        layer = init_kv_cache(_full(1, 1, 4), 2, 2, jnp.float32).layers[0]
        write_kv(layer._replace(k_scales=cache.layers[0].k_scales, v_scales=cache.layers[0].v_scales), new, new,
                 jnp.array([0], jnp.int32))


def test_copy_blocks_copies_scales_with_their_values():
    rng = np.random.default_rng(0)
    layer = LayerKV(*(jnp.asarray(_random_pages(rng, (2, 4, 2, 3), jnp.int8)) for _ in range(2)),
                    *(jnp.asarray(rng.uniform(size=(2, 4, 2)).astype(np.float32)) for _ in range(2)))
    # Block 1 -> 3 and 3 -> 0 in one call (sources read before any write); a padding row.
    out = copy_blocks(KVCache((layer,)), jnp.array([[1, 3], [3, 0], [2, -1]], jnp.int32)).layers[0]
    for got, before in zip(out, layer, strict=True):
        got, before = np.asarray(got), np.asarray(before)
        np.testing.assert_array_equal(got[:, 3], before[:, 1])
        np.testing.assert_array_equal(got[:, 0], before[:, 3])
        np.testing.assert_array_equal(got[:, 1:3], before[:, 1:3])


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
def test_mixed_layer_specs_pages_and_bytes(kv_dtype):
    """A cache of full-attention and latent layers: each layer's pages as its spec lays them out, and the pool's
    bytes exactly what `CacheConfig` sizes it by (the host side never sees the arrays)."""
    layers = (FullAttention(2, 8), LatentAttention(kv_lora_rank=12, rope_dim=4), FullAttention(1, 8, 3),
              IndexedSparse(kv_lora_rank=12, rope_dim=4, index_head_dim=8, index_topk=6))
    spec = ModelSpec(vocab_size=8, num_layers=4, num_q_heads=4, kv_layers=layers)
    config = CacheConfig(block_size=4, num_blocks=5, kv_dtype=kv_dtype)
    dtype = jnp.dtype(config.kv_array_dtype(spec))
    cache = init_kv_cache(spec.kv_layers, 5, 4, dtype)
    full, latent, windowed, sparse = cache.layers
    assert isinstance(full, LayerKV) and full.k.shape == (2, 5, 4, 8)
    assert isinstance(latent, LatentKV) and latent.pages.shape == (5, 4, 16) and latent.pages.dtype == dtype
    assert (latent.scales is None) == (not is_quantized(dtype))
    assert windowed.k.shape == (1, 5, 4, 8) and cache.num_blocks == 5 and cache.block_size == 4
    assert isinstance(sparse, SparseKV) and sparse.pages.shape == (5, 4, 16) and sparse.index_keys.shape == (5, 4, 8)
    assert (sparse.index_scales is None) == (not is_quantized(dtype))
    assert cache.nbytes == config.pool_bytes(spec) == 5 * config.block_bytes(spec)
    element, scale = (1, 4) if is_quantized(dtype) else (dtype.itemsize, 0)
    assert config.kv_bytes_per_token(spec) == 2 * 2 * (8 * element + scale) + (16 * element + scale) \
        + 2 * 1 * (8 * element + scale) + (16 * element + scale) + (8 * element + scale)
    with pytest.raises(ValueError, match="only a cache whose every layer is full attention"):
        cache.stacked()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
def test_write_latent_by_slot_mapping(dtype):
    """Each token's `[c_kv | k_rope]` lands in its slot (8-bit: the values and the one scale `quantize_kv` gives
    the whole entry); padding and every other slot are left alone."""
    rng = np.random.default_rng(1)
    num_blocks, block_size, rank, rope = 3, 4, 6, 2
    quantized = is_quantized(dtype)
    pages = _random_pages(rng, (num_blocks, block_size, rank + rope), dtype)
    scales = rng.uniform(0.1, 1, size=(num_blocks, block_size)).astype(np.float32) if quantized else None
    slots = np.array([5, -1, 0, 11], np.int32)
    c_kv = rng.normal(size=(4, rank)).astype(np.float32)
    k_rope = rng.normal(size=(4, rope)).astype(np.float32)
    layer = LatentKV(jnp.asarray(pages), None if scales is None else jnp.asarray(scales))
    out = write_latent(layer, jnp.asarray(c_kv), jnp.asarray(k_rope), jnp.asarray(slots))
    entry = np.concatenate([c_kv, k_rope], axis=-1)
    want_pages, want_scales = pages.copy(), None if scales is None else scales.copy()
    if quantized:
        values, entry_scales = jax.device_get(quantize_kv(jnp.asarray(entry)[:, None, :], dtype))
    for t, s in enumerate(slots):
        if s < 0:
            continue
        b, o = divmod(int(s), block_size)
        if quantized:
            want_pages[b, o], want_scales[b, o] = values[t, 0], entry_scales[t, 0]
        else:
            want_pages[b, o] = np.asarray(jnp.asarray(entry[t], dtype))
    np.testing.assert_array_equal(np.asarray(out.pages).view(np.uint8), want_pages.view(np.uint8))
    if quantized:
        np.testing.assert_array_equal(np.asarray(out.scales), want_scales)
    else:
        assert out.scales is None
    with pytest.raises(ValueError, match="do not fill"):
        write_latent(layer, jnp.asarray(c_kv[:, :-1]), jnp.asarray(k_rope), jnp.asarray(slots))


def test_copy_blocks_copies_latent_pages_and_full_pages_together():
    rng = np.random.default_rng(2)
    full = LayerKV(*(jnp.asarray(rng.normal(size=(2, 4, 2, 3)).astype(np.float32)) for _ in range(2)))
    latent = LatentKV(jnp.asarray(_random_pages(rng, (4, 2, 5), jnp.int8)),
                      jnp.asarray(rng.uniform(size=(4, 2)).astype(np.float32)))
    out = copy_blocks(KVCache((full, latent)), jnp.array([[1, 3], [3, 0], [2, -1]], jnp.int32))
    assert out.layers[0].k_scales is None
    for got, before in zip(out.layers[0][:2], full[:2], strict=True):
        np.testing.assert_array_equal(np.asarray(got)[:, 3], np.asarray(before)[:, 1])
        np.testing.assert_array_equal(np.asarray(got)[:, 0], np.asarray(before)[:, 3])
    for got, before in zip(out.layers[1], latent, strict=True):
        got, before = np.asarray(got), np.asarray(before)
        np.testing.assert_array_equal(got[3], before[1])
        np.testing.assert_array_equal(got[0], before[3])
        np.testing.assert_array_equal(got[1:3], before[1:3])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_write_sparse_puts_the_indexer_key_in_the_latent_entrys_slot(dtype):
    rng = np.random.default_rng(4)
    quantized = is_quantized(dtype)
    scales = lambda: jnp.ones((2, 4), jnp.float32) if quantized else None
    layer = SparseKV(jnp.zeros((2, 4, 6), dtype), jnp.zeros((2, 4, 3), dtype), scales(), scales())
    c_kv, k_rope, k_index = (jnp.asarray(rng.normal(size=(3, d)).astype(np.float32)) for d in (4, 2, 3))
    slots = jnp.array([6, -1, 1], jnp.int32)
    out = write_sparse(layer, c_kv, k_rope, k_index, slots)
    latent = write_latent(layer.latent, c_kv, k_rope, slots)
    np.testing.assert_array_equal(np.asarray(out.pages).view(np.uint8), np.asarray(latent.pages).view(np.uint8))
    keys = np.asarray(out.index_keys).astype(np.float32)
    if quantized:
        keys = keys * np.asarray(out.index_scales)[..., None]
    for t, s in ((0, 6), (2, 1)):
        np.testing.assert_allclose(keys[s // 4, s % 4], np.asarray(k_index[t]), rtol=1e-2, atol=1e-2)
    assert not keys[0, 0].any() and not keys[1, 3].any()  # padding wrote nowhere
    with pytest.raises(ValueError, match="does not fill"):
        write_sparse(layer, c_kv, k_rope, k_index[:, :2], slots)


def test_a_decode_step_writes_latent_pages_in_place():
    """A one-token decode over several latent layers (write, then attend over the written pages) compiles without a
    copy of any layer's whole pool: XLA rewrote a one-row write into a dynamic-update-slice and fused it into the
    attention's page gather, which then needed the old pages kept, a copy of every layer's pool per step (batch-1
    decode of a 145M MLA model ran 7x slower at 2k blocks than at 64)."""
    import re

    from pagedjax.device.attention import AttentionMetadata, latent_attention
    from pagedjax.device.kv_cache import LatentKV, write_latent

    n, bs, r, dr, h = 256, 16, 32, 8, 4

    def decode(layers, c_kv, k_rope, q_latent, q_rope, meta):
        x, written = q_latent, []
        for layer in layers:
            layer = write_latent(layer, c_kv, k_rope, meta.slot_mapping)
            x = x + latent_attention(x, q_rope, layer, meta, backend="xla", decode_only=True, scale=0.1)
            written.append(layer)
        return x, tuple(written)

    layers = tuple(LatentKV(jnp.zeros((n, bs, r + dr)), None) for _ in range(3))
    meta = AttentionMetadata(jnp.array([37], jnp.int32), jnp.arange(8, dtype=jnp.int32)[None],
                             jnp.array([38], jnp.int32), jnp.array([0, 1], jnp.int32))
    args = (layers, jnp.ones((1, r)), jnp.ones((1, dr)), jnp.ones((1, h, r)), jnp.ones((1, h, dr)), meta)
    hlo = jax.jit(decode, donate_argnums=(0,)).lower(*args).compile().as_text()
    assert not re.findall(rf"= f32\[{n},{bs},{r + dr}\]\{{[0-9,]*\}} copy\(", hlo)
