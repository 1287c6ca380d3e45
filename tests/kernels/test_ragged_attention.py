"""Ragged kernel: mixes of decode tokens, partial prefill chunks, whole prompts and padding, against the
dense reference (interpret mode on CPU, compiled on a GPU)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.gpu.ragged_attention import default_num_warps
from pallas_kernels.tiles import max_tiles, next_pow2, tile_metadata
from tests.kernels.cases import HEAD_DIMS, assert_close, build, examples, gqa_heads, relocate
from tests.kernels.test_paged_attention import _worked_example

pytestmark = pytest.mark.kernels

KINDS = ("decode", "chunk", "prompt", "padding", "idle")
RAGGED_BLOCK_SIZES = (8, 16, 12, 32, 5)


@st.composite
def ragged_params(draw, dtypes=("float32", "bfloat16")):
    block_size = draw(st.sampled_from(RAGGED_BLOCK_SIZES))
    max_blocks = draw(st.integers(1, 4))
    cap = block_size * max_blocks
    num_q_heads, num_kv_heads = draw(gqa_heads())
    seqs = []  # (q_len, kv_len)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(KINDS))
        if kind == "decode":  # one new token after some context
            special = [x for x in (1, block_size, block_size + 1, cap) if x <= cap]
            kv = draw(st.sampled_from(special) | st.integers(1, cap))
            seqs.append((1, kv))
        elif kind == "chunk":  # a prefill chunk after earlier chunks or prefix-cached blocks
            kv = draw(st.integers(2, cap))
            seqs.append((draw(st.integers(1, min(kv - 1, 24))), kv))
        elif kind == "prompt":  # a whole prompt at once
            q = draw(st.integers(1, min(cap, 24)))
            seqs.append((q, q))
        elif kind == "padding":  # a padding sequence: no queries, no context
            seqs.append((0, 0))
        else:  # a sequence with context but nothing scheduled this step
            seqs.append((0, draw(st.integers(0, cap))))
    return dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        block_size=block_size,
        max_blocks=max_blocks,
        seqs=seqs,
        padding_rows=draw(st.integers(0, 3)),
        dtype=draw(st.sampled_from(dtypes)),
        block_q=draw(st.sampled_from([None, 16, 32])),
    )


def _case(p, poison=True):
    rng = np.random.default_rng(p["seed"])
    q_lens = [q for q, _ in p["seqs"]]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return build(rng, num_q_rows=int(cu[-1]) + p["padding_rows"], num_q_heads=p["num_q_heads"],
                 num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"], block_size=p["block_size"],
                 max_blocks=p["max_blocks"], kv_lens=[kv for _, kv in p["seqs"]], dtype=p["dtype"],
                 poison=poison, cu_q_lens=cu)


def _tuning(p):
    rows = p["block_q"] * p["num_q_heads"] // p["num_kv_heads"] if p["block_q"] else 0
    if not rows or rows > 128 or rows * next_pow2(p["head_dim"]) > 128 * 128:
        return {}  # explicit tiles stay <= 128 x 128 accumulators: bigger ones exhaust a GPU's registers
    return {"block_q": p["block_q"]}


EDGE = dict(seed=0, num_q_heads=4, num_kv_heads=2, head_dim=80, block_size=8, max_blocks=3, dtype="float32",
            padding_rows=2, block_q=None)


@settings(max_examples=examples(12))
@given(ragged_params())
@example(dict(EDGE, seqs=[(1, 9), (5, 24), (8, 8), (0, 0), (0, 17)]))
@example(dict(EDGE, num_q_heads=1, num_kv_heads=1, head_dim=16, max_blocks=1, seqs=[(1, 8)], padding_rows=0))
@example(dict(EDGE, seqs=[(24, 24)], padding_rows=3, block_q=16, dtype="bfloat16"))
@example(dict(EDGE, num_q_heads=8, num_kv_heads=1, head_dim=96, seqs=[(1, 1), (1, 24), (3, 10)],
              padding_rows=0))
def test_matches_reference_with_nan_poisoned_unused_slots(p):
    case = _case(p)
    out = ragged_paged_attention(*case.ragged_args(), **_tuning(p))
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, ragged_paged_attention_reference(*case.ragged_args()), p["dtype"])


@settings(max_examples=examples(6))
@given(ragged_params(), st.integers(0, 2**32 - 1))
def test_placement_invariance_is_bit_exact(p, seed):
    case = _case(p)
    moved = relocate(np.random.default_rng(seed), case)
    a = ragged_paged_attention(*case.ragged_args(), **_tuning(p))
    b = ragged_paged_attention(*moved.ragged_args(), **_tuning(p))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_padding_rows_and_sequences_give_exact_zeros():
    p = dict(EDGE, seqs=[(0, 0), (3, 7), (0, 0), (0, 12)], padding_rows=5)
    case = _case(p)
    out = np.asarray(ragged_paged_attention(*case.ragged_args()))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[3:], 0.0)
    assert np.abs(out[:3]).sum() > 0


def test_decode_only_batch_equals_decode_kernel():
    p = dict(EDGE, seqs=[(1, 1), (1, 8), (1, 9), (1, 24)], padding_rows=0)
    case = _case(p)
    ragged = ragged_paged_attention(*case.ragged_args())
    decode = paged_attention(*case.decode_args())
    assert_close(ragged, decode, "float32")
    assert_close(ragged, paged_attention_reference(*case.decode_args()), "float32")


@pytest.mark.parametrize("block_q,pages_per_iter", [(8, 4), (16, 2), (32, 8), (64, 4)])
def test_tilings_agree(block_q, pages_per_iter):
    p = dict(EDGE, seqs=[(1, 9), (13, 24), (17, 17), (0, 5), (2, 2)], padding_rows=1)
    case = _case(p)
    out = ragged_paged_attention(*case.ragged_args(), block_q=block_q, pages_per_iter=pages_per_iter)
    assert_close(out, ragged_paged_attention_reference(*case.ragged_args()), "float32")


def _boundary_seqs(block_size):
    """(seqs, max_blocks): a decode token, a chunk and a prompt ending at a block boundary +- 1, a padding
    and an idle sequence. Lengths in units of u = block_size tokens (6 for blocks of one token)."""
    u = block_size if block_size > 1 else 6
    seqs = [(1, 2 * u + 1), (u + 1, 3 * u), (2 * u - 1, 2 * u - 1), (0, 0), (0, u), (1, u - 1)]
    return seqs, 3 * u // block_size


# Non-power-of-two GQA groups (Qwen2-7B: 28 query heads on 4 KV heads) on block sizes other than 8/16/32.
# tiling: None (defaults) or (block_q, pages_per_iter), the smallest legal tiles (16 query rows; 16 padded
# tokens, or one block of 24), so sequences span several query tiles and several KV iterations.
ODD_SHAPES = [
    # dtype, num_q_heads, num_kv_heads, head_dim, block_size, tiling
    ("float32", 28, 4, 16, 5, None),
    ("bfloat16", 28, 4, 32, 12, None),
    ("float32", 6, 2, 48, 1, (4, 16)),
    ("bfloat16", 15, 3, 16, 4, (2, 4)),
    ("float32", 15, 3, 32, 24, (2, 1)),
    ("bfloat16", 9, 3, 48, 5, (4, 2)),
]


ODD_IDS = [f"{d}-{q}q{kv}kv-d{h}-bs{bs}-" + ("default" if t is None else f"q{t[0]}p{t[1]}")
           for d, q, kv, h, bs, t in ODD_SHAPES]


@pytest.mark.parametrize("dtype,num_q_heads,num_kv_heads,head_dim,block_size,tiling", ODD_SHAPES, ids=ODD_IDS)
def test_odd_groups_and_block_sizes(dtype, num_q_heads, num_kv_heads, head_dim, block_size, tiling):
    seqs, max_blocks = _boundary_seqs(block_size)
    p = dict(seed=4, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
             block_size=block_size, max_blocks=max_blocks, seqs=seqs, padding_rows=3, dtype=dtype)
    case = _case(p)
    tuning = {} if tiling is None else dict(zip(("block_q", "pages_per_iter"), tiling, strict=True))
    out = ragged_paged_attention(*case.ragged_args(), **tuning)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, ragged_paged_attention_reference(*case.ragged_args()), dtype)
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0.0)  # padding rows


def test_worked_example_as_last_token_of_a_prompt():
    """The PagedAttention example's query as the 4th token of a 4-token prompt: it sees all 4 keys."""
    q, k, v, tables, _ = _worked_example()
    q4 = jnp.concatenate([jnp.zeros((3, 1, 16), jnp.float32), q], axis=0)
    args = (q4, k, v, tables, jnp.asarray([4], jnp.int32), jnp.asarray([0, 4], jnp.int32))
    for out in (ragged_paged_attention(*args, scale=2**-0.5), ragged_paged_attention_reference(*args,
                                                                                              scale=2**-0.5)):
        np.testing.assert_allclose(np.asarray(out)[3, 0, :2], [1.8, 2.3], rtol=1e-6)


_tile_metadata = jax.jit(tile_metadata, static_argnums=(2, 3, 4))


@settings(max_examples=examples(30))
@given(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.sampled_from([1, 2, 4, 16]))
def test_tiles_cover_every_row_once(q_lens, block_q):
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = 168  # fixed, so few shapes compile; rows past cu[-1] are padding
    kv = np.asarray(q_lens, np.int32) + 3
    meta = np.asarray(_tile_metadata(jnp.asarray(kv), jnp.asarray(cu), num_tokens, block_q, 10_000))
    assert meta.shape == (max_tiles(num_tokens, len(q_lens), block_q), 5)
    covered = np.zeros(num_tokens, int)
    for seq, row0, rows, pos0, kv_len in meta:
        assert 0 <= rows <= block_q and 0 <= seq < len(q_lens)
        covered[row0:row0 + rows] += 1
        if rows and row0 >= cu[-1]:
            assert kv_len == 0
        elif rows:
            assert cu[seq] <= row0 and row0 + rows <= cu[seq + 1]
            assert pos0 == kv[seq] - q_lens[seq] + (row0 - cu[seq])
    np.testing.assert_array_equal(covered, 1)


def _args(**over):
    base = dict(q=jnp.zeros((5, 4, 64), jnp.float32), k_pages=jnp.zeros((2, 6, 8, 64), jnp.float32),
                v_pages=jnp.zeros((2, 6, 8, 64), jnp.float32), block_tables=jnp.zeros((2, 3), jnp.int32),
                kv_lens=jnp.zeros((2,), jnp.int32), cu_q_lens=jnp.asarray([0, 2, 5], jnp.int32))
    base.update(over)
    return base


@pytest.mark.parametrize("over,match", [
    (dict(q=jnp.zeros((5, 3, 64), jnp.float32)), "multiple of num_kv_heads"),
    (dict(q=jnp.zeros((5, 4, 64), jnp.float16)), "share one dtype"),
    (dict(kv_lens=jnp.zeros((3,), jnp.int32)), r"kv_lens must have shape \(2,\)"),
    (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), r"cu_q_lens must have shape \(3,\)"),
    (dict(cu_q_lens=jnp.zeros((3,), jnp.float32)), "cu_q_lens must be int32"),
    (dict(block_tables=jnp.zeros((2, 3), jnp.float32)), "block_tables must be int32"),
])
def test_validation_errors(over, match):
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(**_args(**over))


def test_tuning_validation():
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_splits'"):
        ragged_paged_attention(**_args(), num_splits=2)
    with pytest.raises(ValueError, match="power of two"):
        ragged_paged_attention(**_args(), block_q=3)
    with pytest.raises(ValueError, match=">= 16"):
        ragged_paged_attention(**_args(), block_q=4)  # 4 tokens x 2 heads per group < 16 rows
    with pytest.raises(ValueError, match=">= 16"):
        ragged_paged_attention(**_args(), pages_per_iter=1)  # 1 page of 8 tokens < 16 rows
    with pytest.raises(ValueError, match="num_warps must be a positive int"):
        ragged_paged_attention(**_args(), num_warps=0)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        ragged_paged_attention(**_args(), num_stages=0)


def test_tuning_keywords_show_in_the_signature():
    params = inspect.signature(ragged_paged_attention).parameters
    tuning = dict(block_q=None, pages_per_iter=None, num_warps=None, num_stages=2)
    assert {name: params[name].default for name in tuning} == tuning
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in tuning)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert default_num_warps(block_q=16, group=7, head_dim=80) == 8  # 16 x 8 rows x 128 padded columns
    assert default_num_warps(block_q=8, group=8, head_dim=128) == 4  # 64 rows x 128


def test_no_tokens():
    out = ragged_paged_attention(**_args(q=jnp.zeros((0, 4, 64), jnp.float32),
                                         cu_q_lens=jnp.zeros((3,), jnp.int32)))
    assert out.shape == (0, 4, 64)
