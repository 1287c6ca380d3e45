"""Attention variants: sliding windows, logit soft-capping and 8-bit (int8, float8_e4m3fn) KV pages.

Both Pallas kernels (interpret mode on CPU, compiled on a GPU), the TPU kernels (TPU interpret mode) and both
XLA paths against the dense references; the references against a numpy loop; quantization error against
float32 pages within a derived bound; validation. The cases poison everything a path must not read: slots
past a length or before a query's window hold NaN (NaN scales for 8-bit pages) and the table entries of pages
wholly before a window or past the length hold -1 or far out-of-range ids.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    paged_attention_xla,
    quantize_kv,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)
from pallas_kernels.quant import QMAX
from pallas_kernels.tiles import MIN_DOT_DIM, next_pow2
from tests.kernels.cases import assert_close, boundary_lengths, build, examples, gqa_heads, quantized
from tests.kernels.test_paged_attention import _worked_example

pytestmark = pytest.mark.kernels

PAGES = ("int8", "float8_e4m3fn", "float", "int8", "float8_e4m3fn")
PAGE_DTYPES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}


@st.composite
def windows(draw, block_size: int, capacity: int):
    """None or a window W of one of the shapes that stress the page arithmetic: 1, below a block, not a
    multiple of the block size, a multiple of it, wider than any context."""
    kind = draw(st.sampled_from(("not_multiple", "one", "below_block", "wider", "multiple", "none")))
    if kind == "one":
        return 1
    if kind == "below_block":
        return draw(st.integers(1, max(1, block_size - 1)))
    if kind == "not_multiple":
        return block_size * draw(st.integers(0, 2)) + draw(st.integers(1, max(1, block_size - 1)))
    if kind == "multiple":
        return block_size * draw(st.integers(1, 2))
    if kind == "wider":
        return capacity + draw(st.integers(0, 20))
    return None


@st.composite
def variant_params(draw, ragged: bool):
    block_size = draw(st.sampled_from((4, 8, 5, 16)))
    max_blocks = draw(st.sampled_from((4, 3, 5)))
    capacity = block_size * max_blocks
    num_q_heads, num_kv_heads = draw(gqa_heads(max_q_heads=8))
    p = dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from((32, 16, 48))),
        block_size=block_size,
        max_blocks=max_blocks,
        sliding_window=draw(windows(block_size, capacity)),
        logits_soft_cap=draw(st.sampled_from((None, 1.5, 30.0))),
        pages=draw(st.sampled_from(PAGES)),
        scale_dtype=draw(st.sampled_from(("float32", "bfloat16"))),
        q_dtype=draw(st.sampled_from(("float32", "bfloat16"))),
        pages_per_iter=max(1, MIN_DOT_DIM // next_pow2(block_size)),  # several tiles per sequence
    )
    if ragged:
        seqs = []
        for _ in range(draw(st.integers(1, 3))):
            kv = draw(st.integers(0, capacity))
            seqs.append((draw(st.integers(0, min(kv, 12))), kv))  # decode, chunks, prompts, idle
        p["seqs"] = seqs
        p["q_tile"] = draw(st.sampled_from((2, 16)))  # the XLA path's query tiles
    else:
        p["lengths"] = draw(boundary_lengths(draw(st.sampled_from((3, 2))), block_size, max_blocks))
        p["num_splits"] = draw(st.sampled_from((2, 3, None, 1)))
    return p


def _case(p):
    rng = np.random.default_rng(p["seed"])
    quant = p["pages"] != "float"
    common = dict(num_q_heads=p["num_q_heads"], num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"],
                  block_size=p["block_size"], max_blocks=p["max_blocks"],
                  dtype="float32" if quant else p["q_dtype"], sliding_window=p["sliding_window"])
    if "seqs" in p:
        cu = np.concatenate([[0], np.cumsum([q for q, _ in p["seqs"]])]).astype(np.int32)
        case = build(rng, num_q_rows=int(cu[-1]) + 1, kv_lens=[kv for _, kv in p["seqs"]], cu_q_lens=cu, **common)
    else:
        case = build(rng, num_q_rows=len(p["lengths"]), kv_lens=p["lengths"], **common)
    if quant:
        case = quantized(case, PAGE_DTYPES[p["pages"]], jnp.dtype(p["scale_dtype"]), p["q_dtype"])
    return case


def _variants(p, case):
    return dict(sliding_window=p["sliding_window"], logits_soft_cap=p["logits_soft_cap"], **case.scales())


BASE = dict(seed=0, num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=4, max_blocks=5, logits_soft_cap=None,
            pages="float", scale_dtype="float32", q_dtype="float32", pages_per_iter=4)
DECODE = dict(BASE, num_splits=2)


# Each explicit example covers several variants at once (interpret-mode compiles are what a test costs):
# W = 1, W not a multiple of the block and wider than it, W < block, W > context; both 8-bit formats with
# both scale dtypes, q in float32 and bfloat16; lengths 0, 1 and whole blocks; GQA 3:1. The generated draws
# (more under the "dev" profile) add other block sizes, head_dims, GQA ratios and combinations.
# Slow (CI time: ~30 s each): the engine runs windows, soft caps and 8-bit pages through these kernels in the
# default suite (tests/engine/test_sliding_window.py "pallas", tests/engine/test_kv_quant.py "pallas").
@pytest.mark.slow
@settings(max_examples=examples(1))
@given(variant_params(ragged=False))
@example(dict(DECODE, sliding_window=1, lengths=[0, 1, 20], pages="int8", scale_dtype="bfloat16"))
@example(dict(DECODE, sliding_window=6, lengths=[4, 5, 17], logits_soft_cap=1.5, pages="float8_e4m3fn",
              q_dtype="bfloat16", num_splits=3))
@example(dict(DECODE, sliding_window=3, lengths=[8, 20, 13], q_dtype="bfloat16", block_size=8, pages_per_iter=2))
@example(dict(DECODE, sliding_window=50, lengths=[20, 0, 7], logits_soft_cap=30.0, num_splits=None))
def test_decode_variants_match_reference(p):
    """The Triton decode kernel and the XLA path, windows / soft caps / 8-bit pages, against the reference."""
    case = _case(p)
    variants = _variants(p, case)
    want = paged_attention_reference(*case.decode_args(), **variants)
    tuning = {key: p[key] for key in ("num_splits", "pages_per_iter") if p.get(key) is not None}
    out = paged_attention(*case.decode_args(), **variants, **tuning)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, want, p["q_dtype"])
    assert_close(paged_attention_xla(*case.decode_args(), **variants,
                                     kv_chunk=p["block_size"] * p["pages_per_iter"]), want, p["q_dtype"])


RAGGED = dict(BASE, seqs=[(3, 7), (0, 0), (12, 20), (1, 13)], q_tile=2)


@pytest.mark.slow  # (CI time) see test_decode_variants_match_reference
@settings(max_examples=examples(1))
@given(variant_params(ragged=True))
@example(dict(RAGGED, sliding_window=1, pages="int8"))
@example(dict(RAGGED, sliding_window=6, logits_soft_cap=1.5, pages="float8_e4m3fn", scale_dtype="bfloat16",
              q_dtype="bfloat16", q_tile=16))
@example(dict(RAGGED, sliding_window=3, block_size=8, max_blocks=3, pages_per_iter=2, seqs=[(12, 24), (1, 9)],
              q_dtype="bfloat16", logits_soft_cap=30.0))
def test_ragged_variants_match_reference(p):
    """The Triton ragged kernel and the XLA path, against the reference."""
    case = _case(p)
    variants = _variants(p, case)
    want = ragged_paged_attention_reference(*case.ragged_args(), **variants)
    group = p["num_q_heads"] // p["num_kv_heads"]
    out = ragged_paged_attention(*case.ragged_args(), **variants, pages_per_iter=p["pages_per_iter"],
                                 block_q=max(4, MIN_DOT_DIM // next_pow2(group)))
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, want, p["q_dtype"])
    assert_close(ragged_paged_attention_xla(*case.ragged_args(), **variants, q_tile=p["q_tile"],
                                            kv_chunk=p["block_size"] * p["pages_per_iter"]), want, p["q_dtype"])


TPU = dict(target="tpu", interpret=True)


def test_tpu_kernels_run_windows_and_soft_caps():
    """The Mosaic kernels (TPU interpret mode: a DMA of a garbage table entry before the window would raise)."""
    p = dict(BASE, block_size=8, max_blocks=4, sliding_window=11, logits_soft_cap=2.0)
    decode = _case(dict(p, lengths=[0, 9, 32]))
    variants = _variants(p, decode)
    assert_close(paged_attention(*decode.decode_args(), **variants, **TPU, num_splits=2, pages_per_iter=1),
                 paged_attention_reference(*decode.decode_args(), **variants), "float32")
    ragged = _case(dict(p, seqs=[(5, 30), (1, 17), (0, 0)]))
    assert_close(ragged_paged_attention(*ragged.ragged_args(), **variants, **TPU, block_q=4, pages_per_iter=1),
                 ragged_paged_attention_reference(*ragged.ragged_args(), **variants), "float32")


def test_tpu_rejects_8bit_pages():
    case = _case(dict(DECODE, sliding_window=None, lengths=[3], pages="int8", block_size=8))
    with pytest.raises(ValueError, match="target 'tpu' does not support quantized"):
        paged_attention(*case.decode_args(), **case.scales(), **TPU)
    ragged = _case(dict(RAGGED, sliding_window=None, pages="float8_e4m3fn", block_size=8))
    with pytest.raises(ValueError, match="target 'tpu' does not support quantized"):
        ragged_paged_attention(*ragged.ragged_args(), **ragged.scales(), **TPU)


# ---- the references themselves ---------------------------------------------------------------------------


def _numpy_attention(q, keys, values, scale, cap):
    """q [Hq, D]; keys/values [n, Hkv, D] (float64) -> [Hq, D], scores soft-capped at `cap` (None: not)."""
    out = np.zeros_like(q)
    if len(keys) == 0:
        return out
    group = q.shape[0] // keys.shape[1]
    for h in range(q.shape[0]):
        s = keys[:, h // group] @ q[h] * scale
        if cap:
            s = cap * np.tanh(s / cap)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ values[:, h // group]
    return out


@settings(max_examples=examples(5))
@given(st.integers(0, 2**32 - 1), st.sampled_from([(2, 2), (4, 1)]), st.sampled_from([4, 5]),
       st.lists(st.tuples(st.integers(0, 4), st.integers(0, 15)), min_size=3, max_size=3),
       st.sampled_from([1, 3, 4, 6, 40]), st.sampled_from([None, 0.7]))
def test_references_match_numpy_loop(seed, heads, block_size, seqs, window, cap):
    """Decode and ragged references with a window and a soft cap against a numpy loop over the tokens of each
    sequence; the float pages' poison (before the window and past the length) stays out."""
    seqs = [(min(q, kv), kv) for q, kv in seqs]
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    case = build(np.random.default_rng(seed), num_q_rows=int(cu[-1]) + 1, num_q_heads=heads[0],
                 num_kv_heads=heads[1], head_dim=16, block_size=block_size, max_blocks=4,
                 kv_lens=[kv for _, kv in seqs], cu_q_lens=cu, sliding_window=window)
    q, k, v = (np.asarray(x, np.float64) for x in (case.q, case.k_pages, case.v_pages))
    tables = np.asarray(case.block_tables)
    variants = dict(sliding_window=window, logits_soft_cap=cap)
    want = np.zeros_like(q)
    for s, (q_len, kv_len) in enumerate(seqs):
        positions = np.arange(kv_len)
        first = max(0, kv_len - q_len - window + 1)  # slots before it are NaN and their table entries garbage
        keys = np.full((kv_len, k.shape[0], k.shape[3]), np.nan)
        values = np.full_like(keys, np.nan)
        for j in range(first, kv_len):
            keys[j] = k[:, tables[s, j // block_size], j % block_size]
            values[j] = v[:, tables[s, j // block_size], j % block_size]
        for i in range(q_len):
            pos = kv_len - q_len + i
            seen = (positions <= pos) & (positions > pos - window)
            want[cu[s] + i] = _numpy_attention(q[cu[s] + i], keys[seen], values[seen], 0.25, cap)
    assert_close(ragged_paged_attention_reference(*case.ragged_args(), **variants), want, "float32")
    # Decode: each sequence's last query row (a q_len-1 sequence is a decode step).
    decode_rows = [cu[s + 1] - 1 for s, (q_len, _) in enumerate(seqs) if q_len > 0]
    lengths = jnp.asarray([kv for q_len, kv in seqs if q_len > 0], jnp.int32)
    if decode_rows:
        args = (case.q[np.asarray(decode_rows)], case.k_pages, case.v_pages,
                case.block_tables[np.asarray([s for s, (q_len, _) in enumerate(seqs) if q_len > 0])], lengths)
        assert_close(paged_attention_reference(*args, **variants), want[decode_rows], "float32")


def test_window_and_cap_worked_example():
    """Keys 0..3 with logits [0, ln2, ln3, ln4] (the decode worked example): a window of 2 keeps keys 2, 3,
    so o = (3 v2 + 4 v3) / 7; a cap of 1 turns the logits into tanh of them."""
    args = _worked_example()
    scale = 1 / math.sqrt(2.0)
    values = np.array([[1, 0], [0, 2], [3, 1], [2, 4]], np.float64)
    windowed = (3 * values[2] + 4 * values[3]) / 7
    w = np.exp(np.tanh(np.log([1, 2, 3, 4])))
    capped = (w / w.sum()) @ values
    for fn in (paged_attention_reference, paged_attention_xla, paged_attention):
        np.testing.assert_allclose(np.asarray(fn(*args, scale=scale, sliding_window=2))[0, 0, :2], windowed,
                                   rtol=1e-6)
        np.testing.assert_allclose(np.asarray(fn(*args, scale=scale, logits_soft_cap=1.0))[0, 0, :2], capped,
                                   rtol=1e-6)


# ---- quantization error ----------------------------------------------------------------------------------


def _element_error_bound(x: np.ndarray, dtype) -> np.ndarray:
    """Bound on |dequantize(quantize(x)) - x| per element (x float32 [..., D]), from quantize_kv's rule
    scale = absmax / qmax:
      int8: y = round(x / scale) is off by <= 1/2, so the error is <= scale / 2 = absmax / 254;
      float8_e4m3fn (3 mantissa bits): rounding to nearest is off by <= 2^-4 |y| for normal y, and by
      <= 2^-10 (half the subnormal spacing 2^-9) below 2^-6; times scale: 2^-4 |x| + 2^-10 * absmax / 448.
    Plus float32 rounding of the divide and multiply (a few ulps: 1e-6 relative of absmax)."""
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    if jnp.dtype(dtype) == jnp.int8:
        bound = np.broadcast_to(absmax / (2 * QMAX[jnp.dtype(jnp.int8)]), x.shape)
    else:
        bound = 2.0**-4 * np.abs(x) + 2.0**-10 * absmax / QMAX[jnp.dtype(jnp.float8_e4m3fn)]
    return bound + 1e-6 * absmax


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_quantized_attention_error_is_within_the_derived_bound(dtype):
    """Attention over 8-bit pages vs over the float32 pages they came from, on random data.

    Derivation (per query head, keys j, scores s_j = scale * q.k_j, weights p_j = softmax(s)_j): with
    |k^_ji - k_ji| <= e_ji (the element bound) the scores move by at most E = max_j scale * sum_i |q_i| e_ji,
    so every weight moves by a factor in [e^-2E, e^2E] and sum_j |p^_j - p_j| <= e^2E - 1. Then
      |o^ - o| <= sum_j p^_j |v^_j - v_j| + |sum_j (p^_j - p_j) v_j|
               <= max_j ev_j + (e^2E - 1) * max_j |v_j|
    per output element (ev_j: the element bound of v_j), plus float32 accumulation rounding (1e-5).
    The bound is computed from the data, not tuned; a quantizer or kernel that drops or misapplies a scale
    is off by orders of magnitude more."""
    rng = np.random.default_rng(7)
    num_kv_heads, group, head_dim, block_size, num_blocks = 2, 3, 64, 16, 8
    k = rng.standard_normal((num_kv_heads, num_blocks, block_size, head_dim)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    q = rng.standard_normal((2, num_kv_heads * group, head_dim)).astype(np.float32)
    tables = np.arange(num_blocks, dtype=np.int32).reshape(2, num_blocks // 2)
    lengths = np.array([60, 33], np.int32)
    exact = np.asarray(paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                 jnp.asarray(tables), jnp.asarray(lengths)))
    kq, ks = quantize_kv(jnp.asarray(k), PAGE_DTYPES[dtype])
    vq, vs = quantize_kv(jnp.asarray(v), PAGE_DTYPES[dtype])
    args = (jnp.asarray(q), kq, vq, jnp.asarray(tables), jnp.asarray(lengths))
    approx = np.asarray(paged_attention_reference(*args, k_scales=ks, v_scales=vs))
    kernel = np.asarray(paged_attention(*args, k_scales=ks, v_scales=vs))
    np.testing.assert_allclose(kernel, approx, rtol=1e-5, atol=1e-5)  # same dequantized values on both sides

    ek, ev = _element_error_bound(k, dtype), _element_error_bound(v, dtype)
    scale = 1 / math.sqrt(head_dim)
    worst = 0.0
    for s in range(2):
        pos = np.arange(lengths[s])
        blocks = tables[s, pos // block_size]
        for h in range(num_kv_heads * group):
            kv_head = h // group
            keys_err = ek[kv_head, blocks, pos % block_size]  # [n, D]
            values = v[kv_head, blocks, pos % block_size]
            e = np.max(scale * np.abs(q[s, h]) @ keys_err.T)
            bound = np.max(ev[kv_head, blocks, pos % block_size]) + np.expm1(2 * e) * np.max(np.abs(values)) + 1e-5
            err = np.max(np.abs(approx[s, h] - exact[s, h]))
            assert err <= bound, (s, h, err, bound)
            worst = max(worst, err / bound)
    assert worst > 0  # quantization did change the result


def test_quantize_kv_element_error_is_within_the_bound():
    """The element bound the attention bound rests on, on values spanning many binades (fp8 subnormals)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 128)) * np.exp(rng.uniform(-8, 8, (64, 128)))).astype(np.float32)
    for dtype in ("int8", "float8_e4m3fn"):
        values, scales = quantize_kv(jnp.asarray(x), PAGE_DTYPES[dtype])
        err = np.abs(np.asarray(values, np.float32) * np.asarray(scales)[:, None] - x)
        ratio = err / _element_error_bound(x, dtype)
        assert ratio.max() <= 1, dtype
        assert ratio.max() > 0.5, dtype  # and the bound is nearly attained: not vacuous


# ---- memory: the XLA window gathers are bounded by the window ----------------------------------------------


def _temp_bytes(fn, *shapes, **kw) -> int:
    return jax.jit(lambda *a: fn(*a, **kw)).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def _paths(num_seqs: int, max_blocks: int, **kw) -> dict:
    """The temporaries of the decode and ragged XLA paths over bfloat16 pages, `max_blocks` pages a sequence."""
    f = jax.ShapeDtypeStruct
    kv = f((2, num_seqs * max_blocks, 16, 64), jnp.bfloat16)
    tables, lens = f((num_seqs, max_blocks), jnp.int32), f((num_seqs,), jnp.int32)
    q = f((num_seqs, 8, 64), jnp.bfloat16)
    return dict(decode=_temp_bytes(paged_attention_xla, q, kv, kv, tables, lens, **kw),
                ragged=_temp_bytes(ragged_paged_attention_xla, f((64, 8, 64), jnp.bfloat16), kv, kv, tables, lens,
                                   f((num_seqs + 1,), jnp.int32), **kw))


@pytest.mark.parametrize("kw", [dict(sliding_window=64), {}], ids=["window", "chunks"])
def test_xla_gathers_do_not_grow_with_the_table(kw):
    """A 64k-token table: with a window of 64 both paths gather only the window's pages, and without one they walk
    the table a key chunk at a time; either way their temporaries are about those of a 1k-token table (the gather
    of the whole table is never built, and no float32 copy of the pool either: XLA would otherwise hoist the
    widening of a bfloat16 dot's operands out of the chunk loop, onto the whole pool)."""
    short, long = _paths(4, 64, **kw), _paths(4, 4096, **kw)
    for path in short:
        assert long[path] < 2 * short[path], (path, long, short)


# ---- validation ------------------------------------------------------------------------------------------


def _args(k_dtype=jnp.float32, q_dtype=jnp.float32):
    k = jnp.zeros((2, 6, 8, 64), k_dtype)
    return (jnp.zeros((2, 4, 64), q_dtype), k, k, jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32))


SCALES = jnp.zeros((2, 6, 8), jnp.float32)


@pytest.mark.parametrize("args,kw,match", [
    (_args(), dict(sliding_window=0), "sliding_window must be None or an int >= 1"),
    (_args(), dict(sliding_window=2.0), "sliding_window must be None or an int >= 1"),
    (_args(), dict(sliding_window=True), "sliding_window must be None or an int >= 1"),
    (_args(), dict(logits_soft_cap=0.0), "logits_soft_cap must be None or a finite float > 0"),
    (_args(), dict(logits_soft_cap=-3.0), "logits_soft_cap must be None or a finite float > 0"),
    (_args(), dict(logits_soft_cap=float("inf")), "logits_soft_cap must be None or a finite float > 0"),
    (_args(), dict(logits_soft_cap=float("nan")), "logits_soft_cap must be None or a finite float > 0"),
    (_args(), dict(k_scales=SCALES, v_scales=SCALES), "k_scales is only for 8-bit pages"),
    (_args(jnp.int8), dict(v_scales=SCALES), "k_scales is required with int8 pages"),
    (_args(jnp.int8), dict(k_scales=SCALES), "v_scales is required with int8 pages"),
    (_args(jnp.int8), dict(k_scales=SCALES[:, :3], v_scales=SCALES), r"k_scales must have shape"),
    (_args(jnp.float8_e4m3fn), dict(k_scales=SCALES, v_scales=SCALES.astype(jnp.float16)),
     "v_scales must be float32 or bfloat16"),
    (_args(jnp.int8), dict(k_scales=np.zeros((2, 6, 8)), v_scales=SCALES), "k_scales must be float32"),
])
def test_variant_validation(args, kw, match):
    for fn in (paged_attention, paged_attention_reference, paged_attention_xla):
        with pytest.raises(ValueError, match=match):
            fn(*args, **kw)
    ragged_args = (*args, jnp.zeros((3,), jnp.int32))
    for fn in (ragged_paged_attention, ragged_paged_attention_reference, ragged_paged_attention_xla):
        with pytest.raises(ValueError, match=match):
            fn(*ragged_args, **kw)


def test_page_and_query_dtype_rules():
    q, k, v, tables, lengths = _args(jnp.int8)
    with pytest.raises(ValueError, match="k_pages and v_pages must share one dtype"):
        paged_attention(q, k, v.astype(jnp.float8_e4m3fn), tables, lengths, k_scales=SCALES, v_scales=SCALES)
    with pytest.raises(ValueError, match="k_pages and v_pages must share one dtype"):
        paged_attention_xla(q, k, v.astype(jnp.float32), tables, lengths, k_scales=SCALES, v_scales=SCALES)
    with pytest.raises(ValueError, match="q's dtype must be one of"):
        paged_attention(q.astype(jnp.int32), k, v, tables, lengths, k_scales=SCALES, v_scales=SCALES)
    with pytest.raises(ValueError, match="sliding_window"):  # a traced window cannot size the page ranges
        jax.jit(lambda w: paged_attention(*_args(), sliding_window=w))(4)
    # float16 q over 8-bit pages is allowed; the output is in q's dtype.
    out = paged_attention(q.astype(jnp.float16), k, v, tables, lengths, k_scales=SCALES, v_scales=SCALES)
    assert out.dtype == jnp.float16


@pytest.mark.parametrize("kw,match", [(dict(q_tile=0), "q_tile must be a positive int"),
                                      (dict(kv_chunk=0), "kv_chunk must be a positive int"),
                                      (dict(kv_chunk=16.0), "kv_chunk must be a positive int")])
def test_xla_tuning_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_xla(*_args(), jnp.zeros((3,), jnp.int32), **kw)
    if "kv_chunk" in kw:
        with pytest.raises(ValueError, match=match):
            paged_attention_xla(*_args(), **kw)
