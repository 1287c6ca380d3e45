"""`attend_until`: a per-row upper bound on the keys of the ragged kernels (bidirectional attention among the
tokens of an image, Gemma 3).

Rule: query row t of sequence s at position p sees the keys j with j <= max(p, attend_until[t]), j < kv_lens[s]
and, with a window W, j > p - W. The cases put "images" (spans of rows, each row's bound the span's last position)
inside prefill chunks beside decode rows, or arbitrary bounds on every row (below, at and past each position and
the context); rows outside spans get bounds at or below their position (their own, -1, int32's minimum, anything
in between), which must change nothing. The numpy oracle of the reference is transformers' mask, window AND
(causal OR same-image), built from image group ids rather than from the bounds. Every path (the XLA path, the GPU
kernel and the TPU kernel, both interpreted) is held against the reference on the cases' NaN-poisoned caches, and
against itself without `attend_until`: with every bound at or below its row's position, bit for bit.

CI time: by default each kernel is interpreted on one case (the GPU kernel on a second, int8 pages with arbitrary
bounds) and the worked example; the generated kernel cases are `slow`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference, ragged_paged_attention_xla
from pallas_kernels.tiles import MIN_DOT_DIM, next_pow2, tile_bounds, tile_metadata
from tests.kernels.cases import assert_close, build, examples, gqa_heads, quantized
from tests.kernels.test_paged_attention import _worked_example

pytestmark = pytest.mark.kernels

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
# Block sizes per path (the TPU rule: multiples of 8 rows for float32, 16 for bfloat16), weighted by repetition.
BLOCK_SIZES = {"xla": (8, 5, 4, 16), "gpu": (8, 5, 4, 16), "tpu": (8, 16, 8)}


@st.composite
def chunk_spans(draw, q_len: int):
    """Up to three disjoint spans (first, last) of a chunk's rows, in order: at its start, in its middle, ending at
    its last row, of one row; adjacent ones too (two images back to back)."""
    spans, start = [], 0
    for _ in range(draw(st.integers(0, 3))):
        if start >= q_len:
            break
        first = min(q_len - 1, start + draw(st.sampled_from((0, 1)) | st.integers(0, q_len)))
        last = min(q_len - 1, first + draw(st.sampled_from((0, q_len)) | st.integers(0, q_len)))
        spans.append((first, last))
        start = last + 1
    return spans


@st.composite
def bound_params(draw, path: str):
    dtype = draw(st.sampled_from(("float32", "bfloat16")))
    block_size = draw(st.sampled_from(BLOCK_SIZES[path]))
    if path == "tpu" and dtype == "bfloat16":
        block_size = 16
    max_blocks = draw(st.integers(2, 4))
    capacity = block_size * max_blocks
    num_q_heads, num_kv_heads = draw(gqa_heads(max_q_heads=8))
    seqs = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("chunk", "decode", "prompt", "chunk")))
        if kind == "decode":
            seqs.append((1, draw(st.integers(1, capacity)), []))
            continue
        if kind == "prompt":
            kv = q_len = draw(st.integers(1, min(capacity, 16)))
        else:  # a chunk after cached context
            kv = draw(st.integers(2, capacity))
            q_len = draw(st.integers(1, min(kv - 1, 16)))
        seqs.append((q_len, kv, draw(chunk_spans(q_len))))
    return dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from((32, 16, 64))),
        block_size=block_size,
        max_blocks=max_blocks,
        seqs=seqs,
        bounds=draw(st.sampled_from(("spans", "spans", "any"))),
        padding_rows=draw(st.integers(0, 2)),
        dtype=dtype,
        pages=draw(st.sampled_from(("float", "int8"))) if path != "tpu" else "float",
        sliding_window=draw(st.sampled_from((None, 3, 1, block_size + 3, 4 * capacity))),
        logits_soft_cap=draw(st.sampled_from((None, 1.5, 30.0))),
        block_q=draw(st.sampled_from((4, 8, 16))),
        pages_per_iter=draw(st.sampled_from((1, 2))),
    )


@dataclasses.dataclass
class BoundCase:
    case: object  # cases.Case
    attend_until: jax.Array  # int32 [rows]
    positions: np.ndarray  # int32 [rows], -1 for padding rows
    groups: list  # per sequence, int [kv_len]: the image of each position (-1: text)


def _make(p) -> BoundCase:
    rng = np.random.default_rng(p["seed"])
    cu = np.concatenate([[0], np.cumsum([q for q, _, _ in p["seqs"]])]).astype(np.int32)
    kv_lens = [kv for _, kv, _ in p["seqs"]]
    quant = p["pages"] != "float"
    case = build(rng, num_q_rows=int(cu[-1]) + p["padding_rows"], num_q_heads=p["num_q_heads"],
                 num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"], block_size=p["block_size"],
                 max_blocks=p["max_blocks"], kv_lens=kv_lens, dtype="float32" if quant else p["dtype"],
                 cu_q_lens=cu, sliding_window=p["sliding_window"])
    if quant:
        case = quantized(case, jnp.int8, q_dtype=p["dtype"])
    rows = case.q.shape[0]
    positions = np.full(rows, -1, np.int64)
    until = rng.choice([INT32_MAX, INT32_MIN, 0, 10**6], rows).astype(np.int64)  # padding rows: anything
    groups = []
    for s, (q_len, kv, spans) in enumerate(p["seqs"]):
        pos = kv - q_len + np.arange(q_len)
        positions[cu[s]:cu[s + 1]] = pos
        group = np.full(kv, -1)
        if p["bounds"] == "any":  # below, at and past the position, past the context
            options = [pos - 2, pos, rng.integers(pos, kv + 3), np.full(q_len, INT32_MAX), np.full(q_len, kv - 1)]
            until[cu[s]:cu[s + 1]] = np.choose(rng.integers(0, len(options), q_len), options)
        else:  # images: each span's rows bound at its last position; other rows at or below their position
            options = [pos, np.full(q_len, -1), np.full(q_len, INT32_MIN), rng.integers(0, pos + 1)]
            until[cu[s]:cu[s + 1]] = np.choose(rng.integers(0, len(options), q_len), options)
            for g, (first, last) in enumerate(spans):
                group[pos[first]:pos[last] + 1] = g
                until[cu[s] + first:cu[s] + last + 1] = pos[last]
        groups.append(group)
    return BoundCase(case, jnp.asarray(until, jnp.int32), positions.astype(np.int32), groups)


def _variants(p, bc: BoundCase) -> dict:
    return dict(sliding_window=p["sliding_window"], logits_soft_cap=p["logits_soft_cap"], **bc.case.scales())


def _gpu_tuning(p) -> dict:
    group = p["num_q_heads"] // p["num_kv_heads"]
    return dict(block_q=max(p["block_q"], MIN_DOT_DIM // next_pow2(group)),
                pages_per_iter=max(p["pages_per_iter"], MIN_DOT_DIM // next_pow2(p["block_size"])))


def _run(path: str, p, bc: BoundCase, **kw):
    args, variants = bc.case.ragged_args(), _variants(p, bc)
    if path == "xla":
        return ragged_paged_attention_xla(*args, **variants, q_tile=p["block_q"],
                                          kv_chunk=p["block_size"] * p["pages_per_iter"], **kw)
    if path == "gpu":
        return ragged_paged_attention(*args, **variants, target="gpu", interpret=True, **_gpu_tuning(p), **kw)
    return ragged_paged_attention(*args, **variants, target="tpu", interpret=True, block_q=p["block_q"],
                                  pages_per_iter=p["pages_per_iter"], **kw)


def _check(path: str, p):
    """The path against the reference with the case's bounds, and (for span cases) with the bounds of the rows
    outside spans only: bit for bit what it computes without attend_until."""
    bc = _make(p)
    want = ragged_paged_attention_reference(*bc.case.ragged_args(), **_variants(p, bc), attend_until=bc.attend_until)
    out = _run(path, p, bc, attend_until=bc.attend_until)
    assert out.shape == bc.case.q.shape and out.dtype == bc.case.q.dtype
    assert_close(out, want, p["dtype"])
    if p["padding_rows"]:
        np.testing.assert_array_equal(np.asarray(out[-p["padding_rows"]:], np.float32), 0.0)
    causal = np.where(np.asarray(bc.attend_until) <= bc.positions, bc.attend_until, bc.positions)
    np.testing.assert_array_equal(np.asarray(_run(path, p, bc, attend_until=jnp.asarray(causal)), np.float32),
                                  np.asarray(_run(path, p, bc), np.float32))


# Three sequences: a 12-token chunk after 8 cached tokens with an image at its start (one row), one in its middle
# crossing tiles of 4 and 8 rows and pages of 8 tokens, and one ending at its last row; a decode row whose bound
# is int32's max; a whole prompt that is one image but for its first and last tokens. Windows of 6 (shorter than
# the middle image: the window cuts it behind each row, never ahead).
CASE = dict(seed=5, num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=8, max_blocks=4,
            seqs=[(12, 20, [(0, 0), (2, 8), (10, 11)]), (1, 9, []), (16, 16, [(1, 14)])], bounds="spans",
            padding_rows=2, dtype="float32", pages="float", sliding_window=6, logits_soft_cap=None, block_q=4,
            pages_per_iter=1)
ANY = dict(CASE, bounds="any", seed=11, sliding_window=None, logits_soft_cap=30.0, dtype="bfloat16")
INT8 = dict(CASE, pages="int8", block_size=5, dtype="bfloat16", sliding_window=None, logits_soft_cap=1.5)


# ---- the reference: the rule, and transformers' same-image mask -----------------------------------------------


def _numpy_reference(p, bc: BoundCase, same_image: bool) -> np.ndarray:
    """float64 attention per row over the keys the rule lets it see: from the bounds, or (same_image) from the
    image groups as transformers builds Gemma 3's mask: j > p - W and (j <= p or the same image)."""
    q, k, v = (np.asarray(x, np.float64) for x in (bc.case.q, bc.case.k_pages, bc.case.v_pages))
    tables, until = np.asarray(bc.case.block_tables), np.asarray(bc.attend_until, np.int64)
    window, cap, block_size = p["sliding_window"], p["logits_soft_cap"], p["block_size"]
    scale = 1 / np.sqrt(p["head_dim"])
    group = q.shape[1] // k.shape[0]
    out = np.zeros_like(q)
    row = 0
    for s, (q_len, kv, _) in enumerate(p["seqs"]):
        j = np.arange(kv)
        for i in range(q_len):
            pos = kv - q_len + i
            if same_image:
                g = bc.groups[s]
                seen = (j <= pos) | ((g == g[pos]) & (g[pos] >= 0))
            else:
                seen = j <= max(pos, until[row])
            if window is not None:
                seen &= j > pos - window
            keys = j[seen]
            blocks, slots = tables[s, keys // block_size], keys % block_size
            for h in range(q.shape[1]):
                kk, vv = k[h // group, blocks, slots], v[h // group, blocks, slots]
                logits = kk @ q[row, h] * scale
                if cap:
                    logits = cap * np.tanh(logits / cap)
                w = np.exp(logits - logits.max())
                out[row, h] = w @ vv / w.sum()
            row += 1
    return out


@settings(max_examples=examples(4))
@given(bound_params("xla"))
@example(CASE)
@example(dict(ANY, dtype="float32", sliding_window=3))
def test_reference_is_the_rule_and_the_same_image_mask(p):
    p = dict(p, pages="float", dtype="float32")
    bc = _make(p)
    got = ragged_paged_attention_reference(*bc.case.ragged_args(), **_variants(p, bc), attend_until=bc.attend_until)
    assert_close(got, _numpy_reference(p, bc, same_image=False), "float32")
    if p["bounds"] == "spans":
        assert_close(got, _numpy_reference(p, bc, same_image=True), "float32")


def test_worked_example_an_image_of_two_tokens():
    """The PagedAttention example's four keys (logits [0, ln2, ln3, ln4] for its query) as a 4-token prompt whose
    tokens 1 and 2 are an image: row 1 sees keys 0..2, weights 1 : 2 : 3, o = (1 * v0 + 2 * v1 + 3 * v2) / 6;
    row 0 (text) sees key 0 only, and row 3 all four."""
    q, k, v, tables, _ = _worked_example()
    args = (jnp.tile(q, (4, 1, 1)), k, v, tables, jnp.asarray([4], jnp.int32), jnp.asarray([0, 4], jnp.int32))
    until = jnp.asarray([-1, 2, 2, 3], jnp.int32)
    values = np.array([[1, 0], [0, 2], [3, 1], [2, 4]], np.float64)
    want = [values[0], (values[0] + 2 * values[1] + 3 * values[2]) / 6, (values[:3].T @ [1, 2, 3]) / 6,
            (values.T @ [1, 2, 3, 4]) / 10]
    for fn, kw in ((ragged_paged_attention_reference, {}), (ragged_paged_attention_xla, {}),
                   (ragged_paged_attention, dict(interpret=True))):
        out = np.asarray(fn(*args, scale=2**-0.5, attend_until=until, **kw))
        np.testing.assert_allclose(out[:, 0, :2], want, rtol=1e-6, err_msg=fn.__name__)


# ---- the XLA path (the CPU engine's) ---------------------------------------------------------------------------


@settings(max_examples=examples(2))
@given(bound_params("xla"))
@example(CASE)
@example(ANY)
@example(INT8)
def test_xla_path_matches_reference(p):
    _check("xla", p)


# ---- the kernels, interpreted: one case each by default, generated ones in the slow run -----------------------


@pytest.mark.parametrize("path", ["gpu", "tpu"])
def test_kernels_match_reference(path):
    _check(path, CASE)


def test_gpu_kernel_with_int8_pages_and_any_bounds():
    _check("gpu", dict(INT8, bounds="any"))


@pytest.mark.slow
@settings(max_examples=examples(10))
@given(bound_params("gpu"))
@example(ANY)
def test_gpu_kernel_matches_reference_generated(p):
    _check("gpu", p)


@pytest.mark.slow
@settings(max_examples=examples(10))
@given(bound_params("tpu"))
@example(dict(ANY, block_size=16))
def test_tpu_kernel_matches_reference_generated(p):
    _check("tpu", p)


# ---- tile bounds, validation ------------------------------------------------------------------------------------


_metadata = jax.jit(tile_metadata, static_argnums=(2, 3, 4))
_bounds = jax.jit(tile_bounds, static_argnums=2)


@settings(max_examples=examples(10))
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 5)), min_size=1, max_size=4),
       st.sampled_from([1, 4, 8]), st.integers(0, 2**32 - 1))
def test_tile_bounds_reach_every_rows_bound(seqs, block_q, seed):
    """Each tile walks to the largest bound of its rows (clipped to the context), whichever row holds it; with
    bounds at the positions that is the causal end the kernels compute without attend_until."""
    rng = np.random.default_rng(seed)
    q_lens = np.array([q for q, _ in seqs])
    kv = q_lens + np.array([c for _, c in seqs])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = 96  # fixed, so few shapes compile; rows past cu[-1] are padding
    until = rng.choice([INT32_MIN, -1, 3, 17, INT32_MAX], num_tokens).astype(np.int32)
    meta = _metadata(jnp.asarray(kv, jnp.int32), jnp.asarray(cu), num_tokens, block_q, 10_000)
    last, ends = (np.asarray(x) for x in _bounds(meta, jnp.asarray(until), block_q))
    meta = np.asarray(meta)
    for t, (_, row0, rows, pos0, kv_len) in enumerate(meta):
        pos = pos0 + np.arange(rows)
        want = np.maximum(pos, until[row0:row0 + rows].astype(np.int64))
        np.testing.assert_array_equal(last[t, :rows], want)
        assert ends[t] == (np.clip(want.max() + 1, 0, kv_len) if rows else 0)  # padding rows: negative positions
    positions = np.full(num_tokens, -1, np.int32)
    for s in range(len(seqs)):
        positions[cu[s]:cu[s + 1]] = kv[s] - q_lens[s] + np.arange(q_lens[s])
    _, ends = _bounds(jnp.asarray(meta), jnp.asarray(positions), block_q)
    causal = np.where(meta[:, 2] > 0, np.clip(meta[:, 3] + meta[:, 2], 0, meta[:, 4]), 0)
    np.testing.assert_array_equal(np.asarray(ends), causal)


def _args():
    k = jnp.zeros((2, 6, 8, 64), jnp.float32)
    return (jnp.zeros((5, 4, 64), jnp.float32), k, k, jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32),
            jnp.asarray([0, 2, 5], jnp.int32))


@pytest.mark.parametrize("until,match", [
    (jnp.zeros((5,), jnp.float32), "attend_until must be int32"),
    (jnp.zeros((4,), jnp.int32), r"attend_until must have shape \(5,\)"),
    (jnp.zeros((5, 1), jnp.int32), "attend_until must have 1 dimension"),
    ([0, 1, 2, 3, 4], "attend_until must be an int32 array"),
])
def test_validation(until, match):
    for fn in (ragged_paged_attention, ragged_paged_attention_reference, ragged_paged_attention_xla):
        with pytest.raises(ValueError, match=match):
            fn(*_args(), attend_until=until)
