import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedjax.config import kv_cache_bytes
from pagedjax.device.kv_cache import init_kv_cache, write_kv


def test_kv_cache_bytes_formula():
    # 32 layers x 4096 tokens x 8 KV heads x 128 dims x 2 bytes, K and V.
    assert kv_cache_bytes(32, 4096, 8, 128, 2) == 536_870_912


def test_init_kv_cache_layout_and_size():
    cache = init_kv_cache(num_layers=3, num_kv_heads=2, num_blocks=5, block_size=4, head_dim=16, dtype=jnp.bfloat16)
    assert cache.num_layers == 3 and cache.num_blocks == 5 and cache.block_size == 4
    assert cache.k[0].shape == (2, 5, 4, 16) and cache.k[0].dtype == jnp.bfloat16
    k, v = cache.stacked()
    assert k.shape == v.shape == (3, 2, 5, 4, 16)
    assert cache.nbytes == kv_cache_bytes(3, 5 * 4, 2, 16, 2)


@given(st.data())
def test_write_kv_by_slot_mapping(data):
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
    k_pages = rng.normal(size=(heads, num_blocks, block_size, dim)).astype(np.float32)
    v_pages = rng.normal(size=(heads, num_blocks, block_size, dim)).astype(np.float32)
    k_new = rng.normal(size=(num_tokens, heads, dim)).astype(np.float32)
    v_new = rng.normal(size=(num_tokens, heads, dim)).astype(np.float32)

    k_out, v_out = write_kv(jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(k_new), jnp.asarray(v_new),
                            jnp.asarray(slots))

    k_exp, v_exp = k_pages.copy(), v_pages.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            k_exp[:, s // block_size, s % block_size] = k_new[t]
            v_exp[:, s // block_size, s % block_size] = v_new[t]
    np.testing.assert_array_equal(np.asarray(k_out), k_exp)
    np.testing.assert_array_equal(np.asarray(v_out), v_exp)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_casts_to_cache_dtype(dtype):
    cache = init_kv_cache(1, 1, 2, 2, 4, dtype)
    k, v = write_kv(cache.k[0], cache.v[0], jnp.ones((1, 1, 4), jnp.float32), jnp.ones((1, 1, 4), jnp.float32),
                    jnp.array([3], jnp.int32))
    assert k.dtype == dtype
    assert float(k[0, 1, 1, 0]) == 1.0 and float(k[0, 0, 0, 0]) == 0.0
