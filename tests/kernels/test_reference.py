"""The oracles themselves: the jnp references against a plain numpy loop, and the XLA gather paths
against the references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import (
    paged_attention_reference,
    paged_attention_xla,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)
from pallas_kernels.dense import default_q_tile, num_query_tiles
from tests.kernels.cases import assert_close, build, examples

pytestmark = pytest.mark.kernels


def _numpy_attention(q, keys, values, scale):
    """q [Hq, D]; keys/values [n, Hkv, D] (float64) -> [Hq, D]."""
    num_q_heads, _ = q.shape
    out = np.zeros_like(q)
    if len(keys) == 0:
        return out
    group = num_q_heads // keys.shape[1]
    for h in range(num_q_heads):
        s = keys[:, h // group] @ q[h] * scale
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ values[:, h // group]
    return out


def _tokens(k, tables, s, n):
    """The first n tokens of sequence s, [n, Hkv, D]."""
    block_size = k.shape[2]
    return np.stack([k[:, tables[s, p // block_size], p % block_size] for p in range(n)]) if n else \
        np.zeros((0, k.shape[0], k.shape[3]))


@settings(max_examples=examples(15))
@given(st.integers(0, 2**32 - 1), st.sampled_from([(2, 2), (4, 1), (8, 2)]), st.sampled_from([4, 8]),
       st.lists(st.integers(0, 16), min_size=3, max_size=3))
def test_decode_reference_matches_numpy_loop(seed, heads, block_size, lengths):
    rng = np.random.default_rng(seed)
    case = build(rng, num_q_rows=len(lengths), num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=16,
                 block_size=block_size, max_blocks=16 // block_size, kv_lens=lengths)
    q, k, v, tables = (np.asarray(x, np.float64) for x in case.decode_args()[:4])
    tables = tables.astype(int)
    want = np.stack([_numpy_attention(q[s], _tokens(k, tables, s, n), _tokens(v, tables, s, n), 0.25)
                     for s, n in enumerate(lengths)])
    assert_close(paged_attention_reference(*case.decode_args()), want, "float32")
    assert_close(paged_attention_xla(*case.decode_args()), want, "float32")
    assert_close(paged_attention_xla(*case.decode_args(), kv_chunk=block_size), want, "float32")  # a page a chunk


@settings(max_examples=examples(15))
@given(st.integers(0, 2**32 - 1), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 11)), min_size=3,
                                          max_size=3))
def test_ragged_reference_matches_numpy_loop(seed, seqs):
    seqs = [(min(q, kv), kv) for q, kv in seqs]  # q_len <= kv_len
    padding_rows = 16 - sum(q for q, _ in seqs)  # one shape for every example: fast
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    case = build(rng, num_q_rows=int(cu[-1]) + padding_rows, num_q_heads=4, num_kv_heads=2, head_dim=16,
                 block_size=4, max_blocks=3, kv_lens=[kv for _, kv in seqs], cu_q_lens=cu)
    q, k, v, tables = (np.asarray(x, np.float64) for x in case.ragged_args()[:4])
    tables = tables.astype(int)
    want = np.zeros_like(q)
    for s, (q_len, kv_len) in enumerate(seqs):
        for i in range(q_len):
            n = kv_len - q_len + i + 1  # causal: positions <= its own
            want[cu[s] + i] = _numpy_attention(q[cu[s] + i], _tokens(k, tables, s, n), _tokens(v, tables, s, n),
                                               0.25)
    assert_close(ragged_paged_attention_reference(*case.ragged_args()), want, "float32")
    assert_close(ragged_paged_attention_xla(*case.ragged_args(), q_tile=2), want, "float32")
    assert_close(ragged_paged_attention_xla(*case.ragged_args(), q_tile=16), want, "float32")
    # Keys a page at a time (3 chunks), and two pages at a time (the 3-page table padded to 4)
    assert_close(ragged_paged_attention_xla(*case.ragged_args(), q_tile=2, kv_chunk=4), want, "float32")
    assert_close(ragged_paged_attention_xla(*case.ragged_args(), q_tile=16, kv_chunk=8), want, "float32")
    assert_close(ragged_paged_attention_xla(*case.ragged_args(), q_tile=3), want, "float32")  # tiles of no power of 2


@settings(max_examples=examples(15))
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(0, 9), st.sampled_from([1, 3, 16, 256]))
def test_query_tiles_fit_their_static_bound_which_is_reached(q_lens, padding_rows, q_tile):
    """`num_query_tiles` bounds the tiles of any sequences holding the step's rows, and one long sequence beside
    sequences of one row each reaches it: no lower bound would do."""
    num_tokens, num_seqs = sum(q_lens) + padding_rows, len(q_lens)
    bound = num_query_tiles(num_tokens, num_seqs, q_tile)
    assert sum(-(-n // q_tile) for n in q_lens) <= bound
    if num_tokens >= num_seqs:
        worst = [1] * (num_seqs - 1) + [num_tokens - num_seqs + 1]
        assert sum(-(-n // q_tile) for n in worst) == bound


def test_default_query_tiles_grow_with_the_rows_a_sequence_has():
    """The default tile: 16 rows for steps of many short sequences, up to 256 where the unused tiles stay within
    half the step's rows, and a quarter of a sliding window at most; a long prefill in tiles of 32 and of 16 rows
    gives the reference's results."""
    assert default_q_tile(512, 1) == 256 and default_q_tile(4096, 1) == 256
    assert default_q_tile(512, 8) == 32 and default_q_tile(512, 16) == 16 and default_q_tile(16, 16) == 16
    assert default_q_tile(64, 1) == 32 and default_q_tile(8, 1) == 16
    assert default_q_tile(512, 1, sliding_window=128) == 32 and default_q_tile(512, 1, sliding_window=4096) == 256
    assert default_q_tile(512, 1, sliding_window=8) == 16
    rng = np.random.default_rng(3)
    case = build(rng, num_q_rows=64, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8, max_blocks=12,
                 kv_lens=[90], cu_q_lens=[0, 64])
    want = ragged_paged_attention_reference(*case.ragged_args())
    assert_close(ragged_paged_attention_xla(*case.ragged_args()), want, "float32")  # tiles of 32
    assert_close(ragged_paged_attention_xla(*case.ragged_args(), q_tile=16), want, "float32")


def test_xla_ragged_row_is_bitwise_the_same_in_any_step():
    """The XLA ragged path walks keys in chunks at fixed positions, up to the step's longest context: a row's
    bits do not depend on the other sequences of its step (how many chunks run), on how wide the table is padded,
    or on its tile's other rows."""
    rng = np.random.default_rng(7)
    alone = build(rng, num_q_rows=5, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, max_blocks=3,
                  kv_lens=[9], cu_q_lens=[0, 5])
    q, k, v, tables, kv_lens, cu = alone.ragged_args()
    want = np.asarray(ragged_paged_attention_xla(q, k, v, tables, kv_lens, cu, q_tile=4, kv_chunk=4))
    assert_close(want, ragged_paged_attention_reference(*alone.ragged_args()), "float32")
    # The same sequence after a 30-token one (8 chunks run instead of 3), its table padded to 8 entries with
    # pages of the other sequence, 6 rows of the other's queries before it and padding rows after.
    other = build(rng, num_q_rows=6, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, max_blocks=8,
                  kv_lens=[30], cu_q_lens=[0, 6])
    k2 = np.concatenate([np.asarray(k), np.asarray(other.k_pages)], axis=1)
    v2 = np.concatenate([np.asarray(v), np.asarray(other.v_pages)], axis=1)
    t_other = np.asarray(other.block_tables) + k.shape[1]
    t_alone = np.concatenate([np.asarray(tables), t_other[:, :5]], axis=1)
    batch = ragged_paged_attention_xla(np.concatenate([np.asarray(other.q), np.asarray(q), np.zeros_like(q[:2])]),
                                       k2, v2, np.concatenate([t_other, t_alone]).astype(np.int32),
                                       np.array([30, 9], np.int32), np.array([0, 6, 11], np.int32),
                                       q_tile=4, kv_chunk=4)
    np.testing.assert_array_equal(np.asarray(batch)[6:11], want)


def test_xla_paths_in_bfloat16():
    rng = np.random.default_rng(0)
    case = build(rng, num_q_rows=3, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=8, max_blocks=4,
                 kv_lens=[0, 9, 32], dtype="bfloat16", cu_q_lens=[0, 0, 1, 3])
    assert_close(paged_attention_xla(*case.decode_args()), paged_attention_reference(*case.decode_args()),
                 "bfloat16")
    assert_close(ragged_paged_attention_xla(*case.ragged_args()),
                 ragged_paged_attention_reference(*case.ragged_args()), "bfloat16")


def test_xla_decode_row_is_bitwise_the_same_in_any_batch():
    """The XLA decode path walks keys in chunks at fixed positions, up to the batch's longest sequence: a row's bits
    do not depend on the other rows (how many chunks run) or on how wide the table is padded."""
    rng = np.random.default_rng(8)
    case = build(rng, num_q_rows=2, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, max_blocks=8,
                 kv_lens=[9, 30])
    q, k, v, tables, lengths = case.decode_args()
    batch = np.asarray(paged_attention_xla(q, k, v, tables, lengths, kv_chunk=4))
    assert_close(batch, paged_attention_reference(*case.decode_args()), "float32")
    alone = paged_attention_xla(q[:1], k, v, tables[:1, :3], lengths[:1], kv_chunk=4)
    np.testing.assert_array_equal(np.asarray(alone), batch[:1])


def test_xla_paths_over_nothing_give_zeros():
    """No sequences, no query rows, or a table of no pages: every row attends to nothing (zeros of q's shape), as
    the chunk loop's trip count (the longest context) is never taken of an empty batch."""
    pool = np.ones((2, 6, 8, 16), np.float32)
    q = np.ones((3, 4, 16), np.float32)
    i32 = lambda *shape: np.zeros(shape, np.int32)
    cases = [(paged_attention_xla, (q[:0], pool, pool, i32(0, 3), i32(0))),
             (paged_attention_xla, (q[:2], pool, pool, i32(2, 0), np.array([0, 0], np.int32))),
             (ragged_paged_attention_xla, (q, pool, pool, i32(0, 3), i32(0), i32(1))),
             (ragged_paged_attention_xla, (q[:0], pool, pool, i32(2, 3), np.array([4, 5], np.int32), i32(3)))]
    for fn, args in cases:
        out = np.asarray(fn(*args))
        assert out.shape == args[0].shape and not out.any(), (fn.__name__, out.shape)
