"""DeepSeek sparse attention (DSA, V3.2): the lightning indexer's scores, the top-k selection and the sparse MLA.

The references are checked once against the definition written out in float64 numpy (full scores, top-k, dense
softmax masked to the selection); every implementation (XLA paths, GPU and TPU kernels in their interpreters)
against the references on NaN-poisoned caches in permuted blocks, with lengths 0, 1 and block multiples; with
index_topk >= the context the sparse attention equals dense MLA; and the argument checks.

Interpreted kernels are slow, so their properties draw few, tiny examples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels import (
    indexer_scores,
    indexer_scores_reference,
    indexer_scores_xla,
    ragged_indexer_scores,
    ragged_indexer_scores_reference,
    ragged_indexer_scores_xla,
    ragged_mla_paged_attention_reference,
    ragged_sparse_mla_paged_attention,
    ragged_sparse_mla_paged_attention_reference,
    ragged_sparse_mla_paged_attention_xla,
    sparse_mla_paged_attention,
    sparse_mla_paged_attention_reference,
    sparse_mla_paged_attention_xla,
    top_k_positions,
    top_k_positions_and_ties,
)
from pallas_kernels.quant import dequantize_kv
from tests.kernels.cases import assert_close, boundary_lengths, examples
from tests.kernels.mla_cases import quantized as quantized_latents
from tests.kernels.sparse_cases import build_dsa, mixed_selection, quantized_keys, row_sequences, visible_ends

pytestmark = pytest.mark.kernels

INDEX_SCALE = 0.25


def _scale(p) -> float:
    return 1.0 / np.sqrt(p["rank"] + p["rope_dim"])


def _case(p):
    return build_dsa(np.random.default_rng(p["seed"]), num_heads=p["num_heads"], rank=p["rank"],
                     rope_dim=p["rope_dim"], index_heads=p["index_heads"], index_dim=p["index_dim"],
                     block_size=p["block_size"], max_blocks=p["max_blocks"], kv_lens=p["lengths"], dtype=p["dtype"],
                     ragged=p["ragged"])


def _scores(case, fn_decode, fn_ragged, **kw):
    fn = fn_decode if case.decode else fn_ragged
    return fn(*case.index_args(), scale=INDEX_SCALE, **case.index_kwargs(), **kw)


def _sparse(case, indices, fn_decode, fn_ragged, scale, **kw):
    fn = fn_decode if case.decode else fn_ragged
    return fn(*case.sparse_args(indices), scale=scale, **case.mla.scales(), **kw)


def _reference_scores(case):
    return _scores(case, indexer_scores_reference, ragged_indexer_scores_reference)


def _reference_attention(case, indices, scale):
    return _sparse(case, indices, sparse_mla_paged_attention_reference, ragged_sparse_mla_paged_attention_reference,
                   scale)


def assert_scores_close(actual, expected, dtype: str):
    """Same -inf pattern (what a row sees), the finite scores within the dtype's tolerance."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    assert not np.isnan(actual).any(), "scores have NaN"
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert_close(actual[finite], expected[finite], dtype)


def _dense_mla_indices(case) -> np.ndarray:
    """Every position of the table, in order: index_topk >= the context selects all a row sees."""
    cap = case.mla.block_tables.shape[1] * case.mla.kv_pages.shape[1]
    return jnp.asarray(np.broadcast_to(np.arange(cap, dtype=np.int32), (case.q_index.shape[0], cap)))


# ---- the definition, in float64 numpy -----------------------------------------------------------------------


def numpy_dsa(case, top_k: int, scale: float):
    """(scores, selection, attention output) of the definition, per row, in float64: full scores over the row's
    visible positions, the top_k highest (lower position first on ties), softmax over exactly those."""
    m = case.mla
    tables, block_size = np.asarray(m.block_tables), m.kv_pages.shape[1]
    keys = np.asarray(case.index_pages, np.float64)
    if case.index_scales is not None:
        keys = np.asarray(dequantize_kv(case.index_pages, case.index_scales), np.float64)
    latents = np.asarray(jnp.asarray(m.kv_pages, jnp.float32), np.float64)
    q_index, w = np.asarray(jnp.asarray(case.q_index, jnp.float32), np.float64), np.asarray(case.weights, np.float64)
    q = np.concatenate([np.asarray(jnp.asarray(m.q_latent, jnp.float32)), np.asarray(jnp.asarray(m.q_rope,
                                                                                                 jnp.float32))], -1)
    rank = m.q_latent.shape[-1]
    cap = tables.shape[1] * block_size
    rows = q.shape[0]
    scores = np.full((rows, cap), -np.inf)
    selection = np.full((rows, top_k), -1, np.int64)
    out = np.zeros((rows, q.shape[1], rank))
    for r, (seq, end) in enumerate(zip(row_sequences(case), visible_ends(case), strict=True)):
        pos = np.arange(end)
        blocks, offsets = tables[seq, pos // block_size], pos % block_size
        for t, b, o in zip(pos, blocks, offsets, strict=True):
            scores[r, t] = scale_index(q_index[r], w[r], keys[b, o])
        order = sorted(pos, key=lambda t: (-scores[r, t], t))[:top_k]
        selection[r, : len(order)] = order
        if order:
            kv = latents[tables[seq, np.array(order) // block_size], np.array(order) % block_size]
            s = q[r].astype(np.float64) @ kv.T * scale
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[r] = (p / p.sum(axis=-1, keepdims=True)) @ kv[:, :rank]
    return scores, selection, out


def scale_index(q_index, w, key):
    return INDEX_SCALE * float(np.sum(w * np.maximum(q_index @ key, 0.0)))


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "decode"])
def test_references_are_the_definition(ragged):
    p = dict(seed=5, num_heads=3, rank=24, rope_dim=8, index_heads=3, index_dim=16, block_size=4, max_blocks=3,
             lengths=[12, 0, 5, 1], dtype="float32", ragged=ragged)
    case = _case(p)
    top_k = 4
    scores, selection, out = numpy_dsa(case, top_k, _scale(p))
    ref_scores = _reference_scores(case)
    assert_scores_close(ref_scores, scores, "float32")
    indices = top_k_positions(ref_scores, top_k)
    np.testing.assert_array_equal(np.asarray(indices), selection)
    attention = _reference_attention(case, indices, _scale(p))
    np.testing.assert_allclose(np.asarray(attention), out, rtol=1e-5, atol=1e-5)
    empty = (selection < 0).all(axis=1)
    assert empty.any() or ragged  # decode: the length-0 sequence
    assert not np.asarray(attention)[empty].any(), "rows selecting nothing must give zeros"


# ---- top-k selection --------------------------------------------------------------------------------------


def test_top_k_pads_with_minus_one_and_lower_positions_win_ties():
    scores = jnp.array([[1.0, 3.0, 3.0, -jnp.inf, 0.5], [-jnp.inf] * 5, [2.0, 2.0, 2.0, 2.0, 2.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(top_k_positions(scores, 3)), [[1, 2, 0], [-1, -1, -1], [0, 1, 2]])
    # k past the width: every visible position, then -1
    np.testing.assert_array_equal(np.asarray(top_k_positions(scores, 7)),
                                  [[1, 2, 0, 4, -1, -1, -1], [-1] * 7, [0, 1, 2, 3, 4, -1, -1]])
    assert top_k_positions(scores, 2).dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(top_k_positions(jnp.zeros((2, 0), jnp.float32), 2)), [[-1, -1]] * 2)


def test_top_k_tells_the_rows_whose_cut_off_fell_between_equal_scores():
    """A tie at the k-th place (the k-th score equals the first one left out) is where the tie rule, not the
    scores, chose: flagged per row. Ties above the cut-off, a row that sees at most k positions, and -inf (unseen)
    positions are not."""
    scores = jnp.array([[1.0, 3.0, 3.0, -jnp.inf, 0.5],  # 3, 3 both kept at k = 2: no tie at the cut-off
                        [-jnp.inf] * 5,  # sees nothing
                        [2.0, 2.0, 2.0, 2.0, 2.0],  # every score equal: a tie wherever the cut-off falls
                        [0.0, -jnp.inf, 0.0, -jnp.inf, -jnp.inf],  # two visible positions: none left out at k = 2
                        [5.0, 1.0, 4.0, 1.0, 0.0]], jnp.float32)  # the 3rd and 4th equal: a tie at k = 3 only
    for k, ties in ((2, [False, False, True, False, False]), (3, [False, False, True, False, True]),
                    (5, [False] * 5), (7, [False] * 5)):
        positions, tied = top_k_positions_and_ties(scores, k)
        np.testing.assert_array_equal(np.asarray(positions), np.asarray(top_k_positions(scores, k)))
        assert np.asarray(tied).tolist() == ties, k


def test_the_tie_check_keeps_xlas_top_k():
    """XLA:CPU runs `lax.top_k` as its TopK unless the values are read past the prefix the positions use: the tie
    check reads them by a reduction, so its program keeps TopK as the plain selection's does (reading column k
    made it sort whole rows: 30x slower at 16k positions, scripts/bench_sparse.py)."""
    if jax.default_backend() != "cpu":
        pytest.skip("XLA:CPU's TopK")
    scores = jnp.zeros((2, 4096), jnp.float32)
    for select in (top_k_positions, top_k_positions_and_ties):
        program = jax.jit(lambda s, select=select: select(s, 256)).lower(scores).compile().as_text()
        assert "TopK" in program and " sort(" not in program, select.__name__


@pytest.mark.parametrize("scores,k,match", [
    (jnp.zeros((2, 4)), 0, "k must be an int >= 1"),
    (jnp.zeros((2, 4)), 2.0, "k must be an int >= 1"),
    (jnp.zeros((2, 4), jnp.bfloat16), 2, "scores must be float32"),
    (jnp.zeros((4,)), 2, "scores must be 2-D"),
    ([[0.0]], 1, "scores must be a float32 array"),
], ids=["k0", "float-k", "bf16", "1d", "list"])
def test_top_k_checks_its_arguments(scores, k, match):
    with pytest.raises(ValueError, match=match):
        top_k_positions(scores, k)


# ---- XLA paths (the engine's CPU path) ----------------------------------------------------------------------


@st.composite
def dsa_params(draw, block_sizes=(4, 8, 5, 16), max_blocks=(3, 2, 1), dtypes=("float32", "bfloat16"),
               tpu: bool = False):
    """Shapes and lengths of one case (lengths mostly at or next to a block boundary, 0 and 1 included), decode or
    ragged. `tpu`: the TPU block-size rule (8 for float32, 16 for bfloat16)."""
    dtype = draw(st.sampled_from(dtypes))
    block_size = (16 if dtype == "bfloat16" else 8) if tpu else draw(st.sampled_from(block_sizes))
    width = draw(st.sampled_from(max_blocks))
    num_seqs = draw(st.sampled_from((3, 2, 1)))
    return dict(seed=draw(st.integers(0, 2**32 - 1)), num_heads=draw(st.sampled_from((3, 1, 5))),
                rank=draw(st.sampled_from((24, 16, 37))), rope_dim=draw(st.sampled_from((8, 12))),
                index_heads=draw(st.sampled_from((3, 1, 4))), index_dim=draw(st.sampled_from((16, 24, 8))),
                block_size=block_size, max_blocks=width, lengths=draw(boundary_lengths(num_seqs, block_size, width)),
                dtype=dtype, ragged=draw(st.booleans()))


@settings(max_examples=examples(4), deadline=None)
@given(p=dsa_params(), q_tile=st.sampled_from((16, 1, 3)))
def test_xla_paths_match_references(p, q_tile):
    case = _case(p)
    expected = _reference_scores(case)
    ragged_kw = {} if case.decode else dict(q_tile=q_tile)
    assert_scores_close(_scores(case, indexer_scores_xla, ragged_indexer_scores_xla, **ragged_kw), expected,
                        p["dtype"])
    rng = np.random.default_rng(p["seed"] + 1)
    for indices in (top_k_positions(expected, 3), mixed_selection(rng, case, 5)):
        actual = _sparse(case, indices, sparse_mla_paged_attention_xla, ragged_sparse_mla_paged_attention_xla,
                         _scale(p))
        assert_close(actual, _reference_attention(case, indices, _scale(p)), p["dtype"])


@settings(max_examples=examples(3), deadline=None)
@given(p=dsa_params())
def test_sparse_with_every_position_selected_is_dense_mla(p):
    case = _case(dict(p, ragged=True))
    indices = _dense_mla_indices(case)
    dense = ragged_mla_paged_attention_reference(*case.mla.ragged_args(), scale=_scale(p))
    for fn in (ragged_sparse_mla_paged_attention_reference, ragged_sparse_mla_paged_attention_xla):
        assert_close(fn(*case.sparse_args(indices), scale=_scale(p)), dense, p["dtype"])


# ---- the kernels, interpreted: few tiny examples -------------------------------------------------------------


def _check_kernels(p, target: str, top_k: int, **tuning):
    """The target's indexer against the reference; its sparse MLA on the reference's top-k, and on every position
    (= dense MLA) for ragged cases."""
    case = _case(p)
    expected = _reference_scores(case)
    index_tuning = {k: v for k, v in tuning.items() if k == "pages_per_iter" or (k == "block_q" and not case.decode)}
    scores = _scores(case, indexer_scores, ragged_indexer_scores, target=target, interpret=True, **index_tuning)
    assert_scores_close(scores, expected, p["dtype"])
    indices = top_k_positions(expected, top_k)
    sparse_tuning = {k: v for k, v in tuning.items() if k in ("block_k", "num_splits")}
    actual = _sparse(case, indices, sparse_mla_paged_attention, ragged_sparse_mla_paged_attention, _scale(p),
                     target=target, interpret=True, **sparse_tuning)
    assert_close(actual, _reference_attention(case, indices, _scale(p)), p["dtype"])
    if not case.decode:
        all_positions = _dense_mla_indices(case)
        actual = ragged_sparse_mla_paged_attention(*case.sparse_args(all_positions), scale=_scale(p), target=target,
                                                   interpret=True, **sparse_tuning)
        assert_close(actual, ragged_mla_paged_attention_reference(*case.mla.ragged_args(), scale=_scale(p)),
                     p["dtype"])


# Each target runs both dtypes and both batch kinds, in two of their four combinations.
@pytest.mark.parametrize("dtype,ragged", [("float32", True), ("bfloat16", False)], ids=["f32-ragged", "bf16-decode"])
@settings(max_examples=examples(1), deadline=None)
@given(p=dsa_params(), top_k=st.sampled_from((20, 5)), block_q=st.sampled_from((2, None)),
       num_splits=st.sampled_from((3, None, 1)))
# Found by a random run: blocks of 5 (16 // 5 = 3 pages per iteration was passed, not a power of two), empty sequences.
@example(p=dict(seed=0, num_heads=3, rank=24, rope_dim=8, index_heads=3, index_dim=16, block_size=5, max_blocks=3,
                lengths=[0, 0], dtype="float32", ragged=False), top_k=20, block_q=2, num_splits=3)
def test_gpu_kernels_match_references(dtype, ragged, p, top_k, block_q, num_splits):
    p = dict(p, dtype=dtype, ragged=ragged)
    # Pages per iteration: a power of two (Triton's block shapes), up to 16 tokens (blocks of 5: 2 pages).
    pages = max(1, 16 // p["block_size"])
    _check_kernels(p, "gpu", top_k, block_q=block_q, block_k=16, num_splits=num_splits,
                   pages_per_iter=1 << (pages.bit_length() - 1))


@pytest.mark.parametrize("dtype,ragged", [("bfloat16", True), ("float32", False)], ids=["bf16-ragged", "f32-decode"])
@settings(max_examples=examples(1), deadline=None)
@given(data=st.data(), top_k=st.sampled_from((5, 2)), block_q=st.sampled_from((2, None)),
       num_splits=st.sampled_from((2, None)))
def test_tpu_kernels_match_references(dtype, ragged, data, top_k, block_q, num_splits):
    # Drawn for this dtype: its TPU block size decides the lengths' block boundaries.
    p = dict(data.draw(dsa_params(max_blocks=(2, 1), dtypes=(dtype,), tpu=True), label="p"), ragged=ragged)
    _check_kernels(p, "tpu", top_k, block_q=block_q, block_k=4, num_splits=num_splits, pages_per_iter=1)


# ---- 8-bit indexer keys and latent pages (GPU kernels, references and XLA paths) ------------------------------


@pytest.mark.parametrize("page_dtype,scale_dtype,q_dtype", [(jnp.int8, jnp.float32, "float32"),
                                                             (jnp.float8_e4m3fn, jnp.bfloat16, "bfloat16")],
                         ids=["int8-f32scales-f32", "fp8-bf16scales-bf16"])
def test_8bit_pages_match_the_reference_of_the_same_pages(page_dtype, scale_dtype, q_dtype):
    p = dict(seed=11, num_heads=3, rank=24, rope_dim=8, index_heads=2, index_dim=16, block_size=8, max_blocks=2,
             lengths=[9, 0, 16], dtype=q_dtype, ragged=True)
    case = quantized_keys(_case(p), page_dtype, scale_dtype)
    case.mla = quantized_latents(case.mla, page_dtype, scale_dtype)
    expected = _reference_scores(case)
    # the reference of 8-bit keys is the definition on the dequantized keys
    assert_scores_close(expected, numpy_dsa(case, 1, _scale(p))[0], "float32")
    for fn in (ragged_indexer_scores_xla, ragged_indexer_scores):
        kw = dict(target="gpu", interpret=True) if fn is ragged_indexer_scores else {}
        assert_scores_close(fn(*case.index_args(), scale=INDEX_SCALE, **case.index_kwargs(), **kw), expected,
                            q_dtype)
    indices = top_k_positions(expected, 6)
    reference = _reference_attention(case, indices, _scale(p))
    assert_close(ragged_sparse_mla_paged_attention_xla(*case.sparse_args(indices), scale=_scale(p),
                                                       **case.mla.scales()), reference, q_dtype)
    assert_close(ragged_sparse_mla_paged_attention(*case.sparse_args(indices), scale=_scale(p), **case.mla.scales(),
                                                   target="gpu", interpret=True, block_k=16), reference, q_dtype)


# ---- argument checks ---------------------------------------------------------------------------------------


def _index_args(**over):
    """Abstract decode indexer arguments (2 indexer heads of 16 dims, 2 sequences), with some replaced."""
    args = dict(q_index=jnp.zeros((2, 2, 16)), weights=jnp.zeros((2, 2)), index_pages=jnp.zeros((6, 8, 16)),
                block_tables=jnp.zeros((2, 3), jnp.int32), lengths=jnp.zeros((2,), jnp.int32))
    args.update(over)
    return args


INDEX_BAD = [
    (dict(q_index=jnp.zeros((2, 16))), "q_index must be 3-D"),
    (dict(weights=jnp.zeros((2, 3))), r"weights must have shape \[tokens, index_n_heads\] = \(2, 2\)"),
    (dict(weights=jnp.zeros((2, 2), jnp.bfloat16)), "weights must be float32"),
    (dict(index_pages=jnp.zeros((6, 8))), "index_pages must be 3-D"),
    (dict(index_pages=jnp.zeros((6, 8, 24))), "index_head_dim = 16"),
    (dict(q_index=jnp.zeros((2, 2, 16), jnp.int32)), "q_index's dtype must be"),
    (dict(index_pages=jnp.zeros((6, 8, 16), jnp.bfloat16)), "index_pages must be in q_index's dtype"),
    (dict(index_pages=jnp.zeros((6, 8, 16), jnp.int8)), "index_scales is required"),
    (dict(index_scales=jnp.ones((6, 8))), "index_scales is only for 8-bit pages"),
    (dict(index_pages=jnp.zeros((6, 8, 16), jnp.int8), index_scales=jnp.ones((6, 4))),
     "index_scales must have shape"),
    (dict(block_tables=jnp.zeros((2, 3))), "block_tables must be int32"),
    (dict(block_tables=jnp.zeros((3, 3), jnp.int32)), "block_tables has 3 rows but there are 2 sequences"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), r"lengths must have shape \(2,\)"),
    (dict(scale=None), "scale must be given"),
    (dict(target="cuda"), "target must be one of"),
    (dict(num_warps=0), "num_warps must be a positive int"),
    (dict(target="gpu", pages_per_iter=3), "pages_per_iter must be a positive power of two"),
    (dict(target="gpu", pages_per_iter=1), r"pages_per_iter \* block_size must be >= 16"),
    (dict(target="tpu", index_pages=jnp.zeros((6, 8, 16), jnp.int8), index_scales=jnp.ones((6, 8))),
     "target 'tpu' does not support 8-bit"),
    (dict(target="tpu", q_index=jnp.zeros((2, 2, 16), jnp.float16), index_pages=jnp.zeros((6, 8, 16), jnp.float16)),
     "target 'tpu' supports float32 and bfloat16"),
    (dict(target="tpu", index_pages=jnp.zeros((6, 12, 16))), "block_size to be a multiple of 8"),
    (dict(target="tpu", pages_per_iter=0), "pages_per_iter must be a positive int"),
]
_INDEX_KWARGS = ("scale", "target", "index_scales", "num_warps", "pages_per_iter")
_TUNING = {"target", "num_warps", "pages_per_iter", "block_h", "block_k", "num_splits"}


def _split(args: dict, keys) -> tuple[list, dict]:
    kwargs = {key: args.pop(key) for key in keys if key in args}
    return list(args.values()), kwargs


@pytest.mark.parametrize("over,match", INDEX_BAD, ids=[m.replace("\\", "") for _, m in INDEX_BAD])
def test_indexer_arguments_raise_clear_value_errors(over, match):
    args, kwargs = _split(_index_args(**dict(dict(scale=0.1), **over)), _INDEX_KWARGS)
    with pytest.raises(ValueError, match=match):
        indexer_scores(*args, interpret=True, **kwargs)
    if set(over) & _TUNING:
        return
    for fn in (indexer_scores_reference, indexer_scores_xla):
        with pytest.raises(ValueError, match=match):
            fn(*args, **kwargs)
    if "lengths" in over or "block_tables" in over and "3 rows" in match:
        return  # the ragged calls take kv_lens per table row
    cu = jnp.array([0, 1, 2], jnp.int32)
    for fn in (ragged_indexer_scores, ragged_indexer_scores_reference, ragged_indexer_scores_xla):
        with pytest.raises(ValueError, match=match):
            fn(*args, cu, **kwargs)


def _sparse_args(**over):
    """Abstract decode sparse MLA arguments (R = 32, Dr = 16, 4 heads, 2 sequences, top_k 5)."""
    args = dict(q_latent=jnp.zeros((2, 4, 32)), q_rope=jnp.zeros((2, 4, 16)), kv_pages=jnp.zeros((6, 8, 48)),
                block_tables=jnp.zeros((2, 3), jnp.int32), lengths=jnp.zeros((2,), jnp.int32),
                indices=jnp.zeros((2, 5), jnp.int32))
    args.update(over)
    return args


SPARSE_BAD = [
    (dict(indices=jnp.zeros((2, 5))), "indices must be int32"),
    (dict(indices=jnp.zeros((2, 5, 1), jnp.int32)), "indices must have 2 dimension"),
    (dict(indices=jnp.zeros((3, 5), jnp.int32)), r"indices must have one row per query row \(2\)"),
    (dict(indices=jnp.zeros((2, 0), jnp.int32)), r"at least one position per row \(top_k >= 1\)"),
    (dict(kv_pages=jnp.zeros((6, 8, 50))), r"kv_lora_rank \+ rope_dim = 32 \+ 16"),
    (dict(kv_pages=jnp.zeros((6, 8, 48), jnp.int8)), "kv_scales is required"),
    (dict(lengths=jnp.zeros((2,))), "lengths must be int32"),
    (dict(scale=None), "scale must be given"),
    (dict(num_splits=0), "num_splits must be a positive int"),
    (dict(target="gpu", block_h=8), "block_h must be >= 16"),
    (dict(target="gpu", block_k=24), "block_k must be a positive power of two"),
    (dict(target="gpu", block_k=8), "block_k must be >= 16"),
    (dict(target="tpu", block_k=0), "block_k must be a positive int"),
    (dict(target="tpu", kv_pages=jnp.zeros((6, 8, 48), jnp.int8), kv_scales=jnp.ones((6, 8))),
     "target 'tpu' does not support 8-bit"),
]
_SPARSE_KWARGS = ("scale", "target", "kv_scales", "block_h", "block_k", "num_splits")


@pytest.mark.parametrize("over,match", SPARSE_BAD, ids=[m.replace("\\", "") for _, m in SPARSE_BAD])
def test_sparse_arguments_raise_clear_value_errors(over, match):
    args, kwargs = _split(_sparse_args(**dict(dict(scale=0.1), **over)), _SPARSE_KWARGS)
    with pytest.raises(ValueError, match=match):
        sparse_mla_paged_attention(*args, interpret=True, **kwargs)
    if set(over) & _TUNING:
        return
    for fn in (sparse_mla_paged_attention_reference, sparse_mla_paged_attention_xla):
        with pytest.raises(ValueError, match=match):
            fn(*args, **kwargs)
    if "lengths" in over:
        return
    cu = jnp.array([0, 1, 2], jnp.int32)
    ragged = args[:5] + [cu] + args[5:]
    for fn in (ragged_sparse_mla_paged_attention, ragged_sparse_mla_paged_attention_reference,
               ragged_sparse_mla_paged_attention_xla):
        with pytest.raises(ValueError, match=match):
            fn(*ragged, **kwargs)


def test_ragged_calls_check_their_metadata():
    a = _index_args()
    s = _sparse_args()
    for bad_cu, match in ((jnp.zeros((2,), jnp.int32), r"cu_q_lens must have shape \(3,\)"),
                          (jnp.zeros((3,)), "cu_q_lens must be int32")):
        for fn in (ragged_indexer_scores, ragged_indexer_scores_reference, ragged_indexer_scores_xla):
            with pytest.raises(ValueError, match=match):
                fn(*list(a.values()), bad_cu, scale=0.1)
        for fn in (ragged_sparse_mla_paged_attention, ragged_sparse_mla_paged_attention_reference,
                   ragged_sparse_mla_paged_attention_xla):
            with pytest.raises(ValueError, match=match):
                fn(*list(s.values())[:5], bad_cu, s["indices"], scale=0.1)
    cu = jnp.array([0, 1, 2], jnp.int32)
    with pytest.raises(ValueError, match="block_q must be a positive power of two"):
        ragged_indexer_scores(*list(a.values()), cu, scale=0.1, block_q=3, interpret=True)
    with pytest.raises(ValueError, match="q_tile must be a positive int"):
        ragged_indexer_scores_xla(*list(a.values()), cu, scale=0.1, q_tile=0)


def test_empty_inputs():
    """No query rows, or no table: scores all -inf (of the table's width), attention all zeros."""
    a = _index_args(q_index=jnp.zeros((2, 2, 16)), block_tables=jnp.zeros((2, 0), jnp.int32))
    for fn in (indexer_scores, indexer_scores_reference, indexer_scores_xla):
        kw = dict(interpret=True) if fn is indexer_scores else {}
        out = fn(*a.values(), scale=0.1, **kw)
        assert out.shape == (2, 0) and out.dtype == jnp.float32
    s = _sparse_args(block_tables=jnp.zeros((2, 0), jnp.int32))
    for fn in (sparse_mla_paged_attention, sparse_mla_paged_attention_reference, sparse_mla_paged_attention_xla):
        kw = dict(interpret=True) if fn is sparse_mla_paged_attention else {}
        out = fn(*s.values(), scale=0.1, **kw)
        assert out.shape == (2, 4, 32) and not out.any()
