"""Attention sinks (gpt-oss): one learned logit per query head that joins each softmax's denominator and carries no
value, o = sum_j exp(s_j - m) v_j / (exp(sink - m) + sum_j exp(s_j - m)), m = max(sink, max_j s_j), the scores s_j
after scale and soft cap (transformers' `eager_attention_forward` concatenates the sink as a last logit column,
softmaxes and drops it).

The references against a float64 numpy loop that does exactly that; sinks of -1e30 against no sinks; both GPU
kernels (interpret mode on CPU, compiled on a GPU), both TPU kernels (TPU interpret mode) and both XLA paths against
the references on NaN-poisoned caches in permuted blocks, with windows, soft caps, 8-bit pages (GPU), bfloat16 and
float32, lengths 0, 1 and block multiples; validation. Lowering: tests/kernels/test_lowering.py and
test_tpu_lowering.py.
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
    join_sink,
    merge_and_finalize,
    paged_attention,
    paged_attention_reference,
    paged_attention_xla,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)
from pallas_kernels.tiles import MIN_DOT_DIM, next_pow2
from tests.kernels.cases import assert_close, boundary_lengths, build, examples, gqa_heads, quantized
from tests.kernels.test_paged_attention import _worked_example
from tests.kernels.test_variants import PAGE_DTYPES, windows

pytestmark = pytest.mark.kernels

TPU = dict(target="tpu", interpret=True)
# Sink kinds, for heads 1, 2, ...: "normal" comparable to the scores (N(0, 2); scores are about N(0, 1)); "spread"
# one of -40 (no weight), -3, 0, 2 and 12 (most of the weight: outputs shrink by ~e^-10); "huge" also +-100, past
# float32's exp range (e^88), so a sink may only be exponentiated against max(m, sink). Head 0's sink is in [1, 3]:
# it takes a visible share of every softmax (a path that ignored the sinks would fail).
SINK_KINDS = ("normal", "spread", "huge")


def _sinks(seed: int, num_q_heads: int, kind: str) -> jax.Array:
    rng = np.random.default_rng([seed, 7])
    sinks = rng.normal(0.0, 2.0, num_q_heads)
    if kind != "normal":
        choices = (-40.0, -3.0, 0.0, 2.0, 12.0) + ((-100.0, 100.0) if kind == "huge" else ())
        sinks = rng.choice(choices, num_q_heads)
    sinks[0] = rng.uniform(1.0, 3.0)
    return jnp.asarray(sinks, jnp.float32)


# ---- the references against numpy ----------------------------------------------------------------------------


def _numpy_sink_attention(q, keys, values, scale, cap, sinks):
    """q [Hq, D]; keys/values [n, Hkv, D] (float64, n may be 0); sinks [Hq] -> [Hq, D]: the sink concatenated as a
    last logit column, softmax, the column dropped."""
    out = np.zeros_like(q)
    group = q.shape[0] // keys.shape[1]
    for h in range(q.shape[0]):
        s = keys[:, h // group] @ q[h] * scale
        if cap:
            s = cap * np.tanh(s / cap)
        logits = np.concatenate([s, [sinks[h]]])
        p = np.exp(logits - logits.max())
        out[h] = (p / p.sum())[:-1] @ values[:, h // group]
    return out


@settings(max_examples=examples(3))
@given(st.integers(0, 2**32 - 1), st.sampled_from([(6, 2), (2, 2), (4, 1)]), st.sampled_from([4, 5]),
       st.lists(st.tuples(st.integers(0, 4), st.integers(0, 15)), min_size=3, max_size=3),
       st.sampled_from([None, 3, 6, 40]), st.sampled_from([None, 0.7]), st.sampled_from(SINK_KINDS))
# An idle sequence, a one-token prompt, a chunk ending at a block boundary; with the padding row (no keys: zeros).
@example(1, (6, 2), 4, [(0, 0), (1, 1), (4, 12)], None, None, "spread")
def test_references_match_numpy_float64(seed, heads, block_size, seqs, window, cap, kind):
    """Decode and ragged references with sinks (and windows, soft caps) against a float64 numpy loop over the
    tokens each query sees; a query that sees no key gets zeros, never NaN."""
    seqs = [(min(q, kv), kv) for q, kv in seqs]
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    case = build(np.random.default_rng(seed), num_q_rows=int(cu[-1]) + 1, num_q_heads=heads[0],
                 num_kv_heads=heads[1], head_dim=16, block_size=block_size, max_blocks=4,
                 kv_lens=[kv for _, kv in seqs], cu_q_lens=cu, sliding_window=window)
    sinks = _sinks(seed, heads[0], kind)
    q, k, v = (np.asarray(x, np.float64) for x in (case.q, case.k_pages, case.v_pages))
    tables = np.asarray(case.block_tables)
    variants = dict(sliding_window=window, logits_soft_cap=cap, sinks=sinks)
    want = np.zeros_like(q)  # the padding row past cu[-1] too
    sink_free = np.zeros_like(q)
    for s, (q_len, kv_len) in enumerate(seqs):
        for i in range(q_len):
            pos = kv_len - q_len + i
            seen = [j for j in range(kv_len) if j <= pos and (window is None or j > pos - window)]
            keys, values = (np.asarray([x[:, tables[s, j // block_size], j % block_size] for j in seen]).reshape(
                len(seen), x.shape[0], x.shape[3]) for x in (k, v))  # [n, Hkv, D]
            want[cu[s] + i] = _numpy_sink_attention(q[cu[s] + i], keys, values, 0.25, cap, np.asarray(sinks))
            sink_free[cu[s] + i] = _numpy_sink_attention(q[cu[s] + i], keys, values, 0.25, cap,
                                                         np.full(heads[0], -np.inf))
    if cu[-1]:  # every query sees a key: the sinks (head 0's in [1, 3]) take a visible share
        assert np.abs(want - sink_free).max() > 1e-3
    assert_close(ragged_paged_attention_reference(*case.ragged_args(), **variants), want, "float32")
    decode = [s for s, (q_len, _) in enumerate(seqs) if q_len > 0]  # each sequence's last row is a decode step
    if decode:
        rows = cu[np.asarray(decode) + 1] - 1
        lengths = jnp.asarray([seqs[s][1] for s in decode], jnp.int32)
        args = (case.q[rows], case.k_pages, case.v_pages, case.block_tables[np.asarray(decode)], lengths)
        assert_close(paged_attention_reference(*args, **variants), want[rows], "float32")


def test_worked_example_with_a_sink():
    """The PagedAttention example (logits [0, ln2, ln3, ln4], o = [1.8, 2.3]) with a sink of ln 2.5: z = 10 + 2.5
    at m = 0, so o = (v0 + 2 v1 + 3 v2 + 4 v3) / 12.5 = [1.44, 1.84]: in the decode reference (a logit column) and
    by `join_sink` after the exact merge of two blocks (keys 0, 1: m = ln 2, z = 1.5, u = [0.5, 2]; keys 2, 3:
    m = ln 4, z = 1.75, u = [4.25, 4.75])."""
    sinks = jnp.asarray([math.log(2.5)], jnp.float32)
    out = paged_attention_reference(*_worked_example(), scale=2**-0.5, sinks=sinks)
    np.testing.assert_allclose(np.asarray(out)[0, 0, :2], [1.44, 1.84], rtol=1e-6)
    m, z, u = np.log([2.0, 4.0]), np.asarray([1.5, 1.75]), np.asarray([[0.5, 2.0], [4.25, 4.75]])
    np.testing.assert_allclose(np.asarray(merge_and_finalize(m, z, u, sinks=sinks[0])), [1.44, 1.84], rtol=1e-6)
    empty = join_sink(jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros(2), sinks[0])  # no keys: zeros
    assert float(empty.z) == 1.0 and np.all(np.asarray(empty.u) == 0.0)


# ---- kernels and XLA paths against the references ----------------------------------------------------------------


@st.composite
def sink_params(draw, ragged: bool, target: str):
    dtype = draw(st.sampled_from(("float32", "bfloat16")))
    if target == "tpu":  # the TPU block-size rule: multiples of 8 rows (float32) or 16 (bfloat16)
        block_size = draw(st.sampled_from((8, 16) if dtype == "float32" else (16, 32)))
    else:
        block_size = draw(st.sampled_from((4, 8, 5, 16)))
    max_blocks = draw(st.sampled_from((3, 4, 2)))
    capacity = block_size * max_blocks
    num_q_heads, num_kv_heads = draw(gqa_heads(max_q_heads=8))
    pages = "float"
    if target == "gpu" and draw(st.integers(0, 3)) == 0:  # one draw in four: 8-bit pages (none on TPU)
        pages = draw(st.sampled_from(tuple(PAGE_DTYPES)))
    p = dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from((32, 16, 48))),
        block_size=block_size,
        max_blocks=max_blocks,
        dtype=dtype,
        pages=pages,
        sliding_window=draw(windows(block_size, capacity)),
        logits_soft_cap=draw(st.sampled_from((None, 1.5, 30.0))),
        sinks=draw(st.sampled_from(SINK_KINDS)),
        # Several tiles (GPU) or chunks (TPU) per sequence.
        pages_per_iter=(max(1, MIN_DOT_DIM // next_pow2(block_size)) if target == "gpu"
                        else draw(st.sampled_from((1, 2)))),
    )
    if ragged:
        seqs = []
        for _ in range(draw(st.integers(1, 3))):
            kv = draw(st.integers(0, capacity))
            seqs.append((draw(st.integers(0, min(kv, 12))), kv))  # decode, chunks, prompts, idle
        p["seqs"] = seqs
        p["padding_rows"] = draw(st.integers(0 if any(q for q, _ in seqs) else 1, 2))  # at least one query row
        p["q_tile"] = draw(st.sampled_from((2, 16)))  # the XLA path's query tiles
    else:
        p["lengths"] = draw(boundary_lengths(draw(st.sampled_from((3, 2))), block_size, max_blocks))
        p["num_splits"] = draw(st.sampled_from((1, 3, 2, None)))
    return p


def _case(p):
    rng = np.random.default_rng(p["seed"])
    common = dict(num_q_heads=p["num_q_heads"], num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"],
                  block_size=p["block_size"], max_blocks=p["max_blocks"], sliding_window=p["sliding_window"],
                  dtype="float32" if p["pages"] != "float" else p["dtype"])
    if "seqs" in p:
        cu = np.concatenate([[0], np.cumsum([q for q, _ in p["seqs"]])]).astype(np.int32)
        case = build(rng, num_q_rows=int(cu[-1]) + p["padding_rows"], kv_lens=[kv for _, kv in p["seqs"]],
                     cu_q_lens=cu, **common)
    else:
        case = build(rng, num_q_rows=len(p["lengths"]), kv_lens=p["lengths"], **common)
    if p["pages"] != "float":
        case = quantized(case, PAGE_DTYPES[p["pages"]], q_dtype=p["dtype"])
    return case


def _variants(p, case):
    return dict(sliding_window=p["sliding_window"], logits_soft_cap=p["logits_soft_cap"], **case.scales(),
                sinks=_sinks(p["seed"], p["num_q_heads"], p["sinks"]))


def _check_decode(p, target):
    case = _case(p)
    variants = _variants(p, case)
    want = paged_attention_reference(*case.decode_args(), **variants)
    tuning = dict(pages_per_iter=p["pages_per_iter"], **({} if p["num_splits"] is None else
                                                          dict(num_splits=p["num_splits"])))
    out = paged_attention(*case.decode_args(), **variants, **tuning, **(TPU if target == "tpu" else {}))
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, want, p["dtype"])
    np.testing.assert_array_equal(np.asarray(out, np.float32)[np.asarray(p["lengths"]) == 0], 0.0)
    if target == "gpu":
        assert_close(paged_attention_xla(*case.decode_args(), **variants,
                                         kv_chunk=p["block_size"] * p["pages_per_iter"]), want, p["dtype"])


def _check_ragged(p, target):
    case = _case(p)
    variants = _variants(p, case)
    want = ragged_paged_attention_reference(*case.ragged_args(), **variants)
    group = p["num_q_heads"] // p["num_kv_heads"]
    block_q = max(4, MIN_DOT_DIM // next_pow2(group)) if target == "gpu" else 4  # tiles of several rows
    out = ragged_paged_attention(*case.ragged_args(), **variants, block_q=block_q, pages_per_iter=p["pages_per_iter"],
                                 **(TPU if target == "tpu" else {}))
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, want, p["dtype"])
    if p["padding_rows"]:
        np.testing.assert_array_equal(np.asarray(out[-p["padding_rows"]:], np.float32), 0.0)
    if target == "gpu":
        assert_close(ragged_paged_attention_xla(*case.ragged_args(), **variants, q_tile=p["q_tile"],
                                                kv_chunk=p["block_size"] * p["pages_per_iter"]), want, p["dtype"])


BASE = dict(seed=0, num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=4, max_blocks=5, dtype="float32",
            pages="float", sliding_window=None, logits_soft_cap=None, sinks="spread", pages_per_iter=4)


DECODE_EXAMPLE = dict(BASE, lengths=[0, 1, 20], num_splits=1, sliding_window=6, logits_soft_cap=1.5, sinks="huge")


# GQA 3:1, lengths 0, 1 and whole blocks, one split (the program joins the sinks) and three (joined after the
# merge), a window not a multiple of the block with a soft cap, bfloat16 q over int8 / float8 pages. The draws (more
# under "dev") add other shapes, dtypes and variants.
@settings(max_examples=examples(1))
@given(sink_params(ragged=False, target="gpu"))
@example(DECODE_EXAMPLE)
@example(dict(BASE, lengths=[8, 12, 17], num_splits=3, pages="int8", dtype="bfloat16"))
def test_gpu_decode_and_xla_match_reference(p):
    _check_decode(p, "gpu")


RAGGED = dict(BASE, seqs=[(1, 9), (5, 20), (8, 8), (0, 0), (0, 17)], padding_rows=2, q_tile=2)


@settings(max_examples=examples(1))
@given(sink_params(ragged=True, target="gpu"))
@example(dict(RAGGED, sinks="huge"))
@example(dict(BASE, seqs=[(12, 20), (1, 1)], padding_rows=0, q_tile=16, sliding_window=5, logits_soft_cap=30.0,
              dtype="bfloat16", pages="float8_e4m3fn"))
def test_gpu_ragged_and_xla_match_reference(p):
    _check_ragged(p, "gpu")


TPU_BASE = dict(BASE, block_size=8, max_blocks=3, pages_per_iter=1)


@settings(max_examples=examples(1))
@given(sink_params(ragged=False, target="tpu"))
@example(dict(TPU_BASE, lengths=[0, 1, 8, 24], num_splits=1, sliding_window=11, logits_soft_cap=1.5))
def test_tpu_decode_matches_reference(p):
    _check_decode(p, "tpu")


@settings(max_examples=examples(1))
@given(sink_params(ragged=True, target="tpu"))
@example(dict(TPU_BASE, seqs=[(1, 9), (5, 24), (8, 8), (0, 0)], padding_rows=2, q_tile=16, sliding_window=6,
              logits_soft_cap=30.0, dtype="bfloat16", block_size=16, sinks="huge"))
def test_tpu_ragged_matches_reference(p):
    _check_ragged(p, "tpu")


def test_very_negative_sinks_give_the_sink_free_result():
    """Sinks of -1e30 weigh exp(-1e30 - m) = 0: the decode kernel and the ragged XLA path join them as z * 1 + 0
    and u * 1 (the same bits as without sinks, length 0 included); the references' extra column adds 0 to the sum
    (to float32 rounding: the sum may run in another order). The cases and variants of the first explicit examples
    above (their programs with sinks are compiled already)."""
    decode, ragged = _case(DECODE_EXAMPLE), _case(RAGGED)
    sinks = jnp.full((BASE["num_q_heads"],), -1e30, jnp.float32)
    window = dict(sliding_window=DECODE_EXAMPLE["sliding_window"], logits_soft_cap=DECODE_EXAMPLE["logits_soft_cap"])
    runs = [(paged_attention, decode.decode_args(), dict(window, num_splits=1, pages_per_iter=4)),
            (paged_attention_reference, decode.decode_args(), window),
            (ragged_paged_attention_xla, ragged.ragged_args(), dict(q_tile=2)),
            (ragged_paged_attention_reference, ragged.ragged_args(), {})]
    for fn, args, options in runs:
        with_sinks, sink_free = fn(*args, **options, sinks=sinks), fn(*args, **options)
        if fn in (paged_attention, ragged_paged_attention_xla):
            np.testing.assert_array_equal(np.asarray(with_sinks), np.asarray(sink_free))
        else:
            assert_close(with_sinks, sink_free, "float32")


# ---- validation ----------------------------------------------------------------------------------------------


def _args():
    k = jnp.zeros((2, 6, 8, 64), jnp.float32)
    return (jnp.zeros((2, 4, 64), jnp.float32), k, k, jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("sinks,match", [
    (jnp.zeros((3,), jnp.float32), r"sinks must have shape \[num_q_heads\] = \(4,\), got \(3,\)"),
    (jnp.zeros((1, 4), jnp.float32), r"sinks must have shape \[num_q_heads\]"),
    (jnp.zeros((), jnp.float32), r"sinks must have shape \[num_q_heads\]"),
    (jnp.zeros((4,), jnp.bfloat16), "sinks must be float32, got bfloat16"),
    (jnp.zeros((4,), jnp.int32), "sinks must be float32, got int32"),
    (np.zeros((4,), np.float64), "sinks must be float32, got float64"),
    ([0.0, 0.0, 0.0, 0.0], "sinks must be a float32 array"),
    (jnp.asarray([0.0, jnp.nan, 0.0, 0.0], jnp.float32), "sinks must be finite"),
    (jnp.asarray([0.0, 0.0, jnp.inf, 0.0], jnp.float32), "sinks must be finite"),
    (jnp.asarray([-jnp.inf, 0.0, 0.0, 0.0], jnp.float32), "sinks must be finite"),
])
def test_sinks_validation(sinks, match):
    args = _args()
    for fn in (paged_attention, paged_attention_reference, paged_attention_xla):
        with pytest.raises(ValueError, match=match):
            fn(*args, sinks=sinks)
    ragged_args = (*args, jnp.zeros((3,), jnp.int32))
    for fn in (ragged_paged_attention, ragged_paged_attention_reference, ragged_paged_attention_xla):
        with pytest.raises(ValueError, match=match):
            fn(*ragged_args, sinks=sinks)
    with pytest.raises(ValueError, match=match):
        paged_attention(*args, sinks=sinks, target="tpu", interpret=True)
