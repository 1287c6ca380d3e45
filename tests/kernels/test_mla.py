"""Paged multi-head latent attention (MLA): every implementation (XLA path, GPU kernel and TPU kernel in their
interpreters) against the absorbed dense reference, on NaN-poisoned caches in permuted blocks; 8-bit pages
against the reference of the same pages; absorbed attention followed by W_UV against MLA without absorption
(the algebra); and the argument checks.

Interpreted kernels are slow, so their properties draw few, tiny examples; the XLA paths draw more.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import (
    mla_attention_dense_reference,
    mla_paged_attention,
    mla_paged_attention_reference,
    mla_paged_attention_xla,
    ragged_mla_paged_attention,
    ragged_mla_paged_attention_reference,
    ragged_mla_paged_attention_xla,
    tiles,
)
from pallas_kernels.gpu.mla import default_block_h
from pallas_kernels.quant import dequantize_kv
from pallas_kernels.tiles import MIN_DOT_DIM, next_pow2
from tests.kernels.cases import assert_close, examples
from tests.kernels.mla_cases import (
    build,
    decode_case,
    mla_params,
    quantized,
    ragged_case,
    ragged_layout,
    scatter_tables,
)

pytestmark = pytest.mark.kernels


# Every interpreted kernel compiles to about 150 memory mappings of XLA:CPU code, held while JAX caches the program:
# a long run under the dev profile passed the kernel's 65530 mappings per process (vm.max_map_count) and crashed
# inside XLA's compiler (a segfault, not an error). Past this many, JAX's caches are dropped (which unmaps them).
_MAX_MAPPINGS = 30_000


def release_compiled_programs_if_many() -> None:
    try:
        with open("/proc/self/maps") as maps:
            count = sum(1 for _ in maps)
    except OSError:  # not Linux: no such limit to watch
        return
    if count > _MAX_MAPPINGS:
        jax.clear_caches()


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    yield
    release_compiled_programs_if_many()


def _scale(p) -> float:
    return 1.0 / np.sqrt(p["rank"] + p["rope_dim"])


def _min_pages(block_size: int) -> int:
    """The smallest legal GPU tile, so a sequence spans several tiles."""
    return max(1, MIN_DOT_DIM // next_pow2(block_size))


# ---- XLA paths (the engine's CPU path): many examples -------------------------------------------------------


# kv_chunk: the XLA paths' keys a page at a time (1 rounds up to one page), a few pages, the whole table at once
@settings(max_examples=examples(20))
@given(p=mla_params(), kv_chunk=st.sampled_from((128, 1, 16)))
def test_xla_decode_matches_reference_with_nan_poisoned_unused_slots(p, kv_chunk):
    case = decode_case(p)
    expected = mla_paged_attention_reference(*case.decode_args(), scale=_scale(p))
    assert_close(mla_paged_attention_xla(*case.decode_args(), scale=_scale(p), kv_chunk=kv_chunk), expected,
                 p["dtype"])
    zero = np.asarray(case.lengths) == 0
    assert not np.asarray(expected, np.float32)[zero].any(), "length 0 must give zeros"


@settings(max_examples=examples(20))
@given(p=mla_params(), q_tile=st.sampled_from((2, 16, 1, None)), kv_chunk=st.sampled_from((128, 1, 16)))
def test_xla_ragged_matches_reference_with_nan_poisoned_unused_slots(p, q_tile, kv_chunk):
    case = ragged_case(p)
    expected = ragged_mla_paged_attention_reference(*case.ragged_args(), scale=_scale(p))
    actual = ragged_mla_paged_attention_xla(*case.ragged_args(), scale=_scale(p), q_tile=q_tile, kv_chunk=kv_chunk)
    assert_close(actual, expected, p["dtype"])
    padding = np.arange(case.q_latent.shape[0]) >= int(case.cu_q_lens[-1])
    assert not np.asarray(actual, np.float32)[padding].any(), "padding rows must be zeros"


def test_decode_is_the_last_row_of_a_ragged_prefill():
    """The two conventions agree: a decode query at position length - 1 is a prefill's last query."""
    rng = np.random.default_rng(0)
    case = build(rng, num_q_rows=1, num_heads=4, rank=32, rope_dim=16, block_size=8, max_blocks=3, kv_lens=[19])
    q_lat = jnp.asarray(rng.standard_normal((19, 4, 32)), jnp.float32).at[-1].set(case.q_latent[0])
    q_rope = jnp.asarray(rng.standard_normal((19, 4, 16)), jnp.float32).at[-1].set(case.q_rope[0])
    ragged = ragged_mla_paged_attention_reference(q_lat, q_rope, case.kv_pages, case.block_tables, case.lengths,
                                                  jnp.array([0, 19], jnp.int32), scale=0.2)
    decode = mla_paged_attention_reference(*case.decode_args(), scale=0.2)
    np.testing.assert_allclose(np.asarray(ragged[-1]), np.asarray(decode[0]), rtol=1e-6, atol=1e-6)


# ---- the kernels, interpreted: few tiny examples -------------------------------------------------------------

# Tiny shapes for the interpreters: R <= 64, a few heads.
SMALL = dict(ranks=(24, 16, 37, 64), rope_dims=(8, 16, 12), heads=(3, 16, 1, 5))


@settings(max_examples=examples(5))
@given(p=mla_params(**SMALL), num_splits=st.sampled_from((3, None, 2, 1)), min_tile=st.booleans())
def test_gpu_decode_kernel_matches_reference(p, num_splits, min_tile):
    case = decode_case(p)
    tuning = dict(num_splits=num_splits, pages_per_iter=_min_pages(p["block_size"]) if min_tile else None)
    actual = mla_paged_attention(*case.decode_args(), scale=_scale(p), target="gpu", interpret=True, **tuning)
    assert_close(actual, mla_paged_attention_reference(*case.decode_args(), scale=_scale(p)), p["dtype"])


@settings(max_examples=examples(5))
@given(p=mla_params(**SMALL), block_q=st.sampled_from((None, 4, 1, 16)))
def test_gpu_ragged_kernel_matches_reference(p, block_q):
    case = ragged_case(p)
    actual = ragged_mla_paged_attention(*case.ragged_args(), scale=_scale(p), target="gpu", interpret=True,
                                        block_q=block_q, pages_per_iter=_min_pages(p["block_size"]))
    assert_close(actual, ragged_mla_paged_attention_reference(*case.ragged_args(), scale=_scale(p)), p["dtype"])


@st.composite
def tpu_params(draw):
    """mla_params under the TPU block-size rule (a multiple of 8 for float32, of 16 for bfloat16)."""
    p = draw(mla_params(block_sizes=(8, 16), max_blocks=(3, 2), **SMALL))
    return dict(p, block_size=16) if p["dtype"] == "bfloat16" else p


@settings(max_examples=examples(4))
@given(p=tpu_params(), num_splits=st.sampled_from((2, None)), block_h=st.sampled_from((None, 2)))
def test_tpu_decode_kernel_matches_reference(p, num_splits, block_h):
    case = decode_case(p)
    actual = mla_paged_attention(*case.decode_args(), scale=_scale(p), target="tpu", interpret=True,
                                 num_splits=num_splits, block_h=block_h, pages_per_iter=1)
    assert_close(actual, mla_paged_attention_reference(*case.decode_args(), scale=_scale(p)), p["dtype"])


# (CI time: 35 s) test_absorbed_attention_then_w_uv_equals_mla_without_absorption[tpu] runs it by default.
@pytest.mark.slow
@settings(max_examples=examples(4))
@given(p=tpu_params(), block_q=st.sampled_from((2, None, 1)))
def test_tpu_ragged_kernel_matches_reference(p, block_q):
    case = ragged_case(p)
    actual = ragged_mla_paged_attention(*case.ragged_args(), scale=_scale(p), target="tpu", interpret=True,
                                        block_q=block_q, pages_per_iter=1)
    assert_close(actual, ragged_mla_paged_attention_reference(*case.ragged_args(), scale=_scale(p)), p["dtype"])


# ---- 8-bit latent pages --------------------------------------------------------------------------------------

QUANT = [(jnp.int8, jnp.float32, "float32"), (jnp.float8_e4m3fn, jnp.bfloat16, "bfloat16"),
         (jnp.int8, jnp.bfloat16, "bfloat16"), (jnp.float8_e4m3fn, jnp.float32, "float32")]
QUANT_IDS = [f"{jnp.dtype(d).name}-scales-{jnp.dtype(s).name}-q-{q}" for d, s, q in QUANT]


@pytest.mark.parametrize("page_dtype,scale_dtype,q_dtype", QUANT, ids=QUANT_IDS)
def test_8bit_pages_match_the_reference_of_the_dequantized_pages(page_dtype, scale_dtype, q_dtype):
    p = dict(seed=int(jnp.dtype(page_dtype).itemsize * 7 + len(q_dtype)), num_heads=5, rank=40, rope_dim=8,
             block_size=8, max_blocks=3, lengths=[17, 0, 24], dtype=q_dtype)
    scale = _scale(p)
    for case, args, ref, impls in (
            (decode_case(p), "decode_args", mla_paged_attention_reference,
             (mla_paged_attention_xla, functools.partial(mla_paged_attention, target="gpu", interpret=True,
                                                         num_splits=2, pages_per_iter=2))),
            (ragged_case(p), "ragged_args", ragged_mla_paged_attention_reference,
             (ragged_mla_paged_attention_xla, functools.partial(ragged_mla_paged_attention, target="gpu",
                                                                interpret=True, pages_per_iter=2)))):
        q8 = quantized(case, page_dtype, scale_dtype)
        expected = ref(*getattr(q8, args)(), scale=scale, **q8.scales())
        # The reference of 8-bit pages is the reference of their dequantized values: nothing else changes.
        float_pages = dequantize_kv(q8.kv_pages, q8.kv_scales)
        floats = dict(vars(q8), kv_pages=float_pages.astype(q8.q_latent.dtype), kv_scales=None)
        dense = ref(*getattr(type(q8)(**floats), args)(), scale=scale)
        assert_close(expected, dense, q_dtype)
        for impl in impls:
            assert_close(impl(*getattr(q8, args)(), scale=scale, **q8.scales()), expected, q_dtype)


# ---- the algebra: absorbed attention + W_UV == MLA with expanded keys and values -----------------------------


def _absorption_case(rng, *, num_heads, rank, rope_dim, nope_dim, v_dim, block_size, kv_lens, q_lens):
    """Per-sequence dense latents and rope keys scattered into random pages, DeepSeek-style projections and
    queries; returns the paged arguments, the dense pieces and the weights."""
    num_seqs = len(kv_lens)
    max_blocks = max(1, -(-max(kv_lens) // block_size))
    num_blocks = num_seqs * max_blocks + 1
    tables = scatter_tables(rng, num_seqs, max_blocks, num_blocks)
    pages = np.full((num_blocks, block_size, rank + rope_dim), np.nan, np.float32)
    c_kv = [rng.standard_normal((n, rank)).astype(np.float32) for n in kv_lens]
    k_rope = [rng.standard_normal((n, rope_dim)).astype(np.float32) for n in kv_lens]
    for s, n in enumerate(kv_lens):
        for t in range(n):
            pages[tables[s, t // block_size], t % block_size] = np.concatenate([c_kv[s][t], k_rope[s][t]])
    w_uk = rng.standard_normal((num_heads, rank, nope_dim)).astype(np.float32) / np.sqrt(rank)
    w_uv = rng.standard_normal((num_heads, rank, v_dim)).astype(np.float32) / np.sqrt(rank)
    num_tokens = sum(q_lens)
    q_nope = rng.standard_normal((num_tokens, num_heads, nope_dim)).astype(np.float32)
    q_rope = rng.standard_normal((num_tokens, num_heads, rope_dim)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return pages, tables, c_kv, k_rope, w_uk, w_uv, q_nope, q_rope, cu


@pytest.mark.parametrize("impl", ["xla", "gpu", "tpu"])
def test_absorbed_attention_then_w_uv_equals_mla_without_absorption(impl):
    rng = np.random.default_rng(43)
    kv_lens, q_lens = [21, 8, 5], [4, 8, 1]  # a prefill chunk over a cached prefix, a whole prefill, a decode
    rank, rope_dim, nope_dim = 48, 16, 24
    pages, tables, c_kv, k_rope, w_uk, w_uv, q_nope, q_rope, cu = _absorption_case(
        rng, num_heads=3, rank=rank, rope_dim=rope_dim, nope_dim=nope_dim, v_dim=20, block_size=8,
        kv_lens=kv_lens, q_lens=q_lens)
    scale = 1.0 / np.sqrt(nope_dim + rope_dim)
    q_latent = jnp.einsum("thd,hrd->thr", q_nope, w_uk, precision="highest")  # W_UK absorbed into the query
    fn = dict(xla=ragged_mla_paged_attention_xla,
              gpu=functools.partial(ragged_mla_paged_attention, target="gpu", interpret=True),
              tpu=functools.partial(ragged_mla_paged_attention, target="tpu", interpret=True))[impl]
    latent = fn(q_latent, jnp.asarray(q_rope), jnp.asarray(pages), jnp.asarray(tables),
                jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu), scale=scale)
    out = jnp.einsum("thr,hrv->thv", latent, w_uv, precision="highest")  # then W_UV
    for s in range(len(kv_lens)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        dense = mla_attention_dense_reference(q_nope[rows], q_rope[rows], c_kv[s], k_rope[s], w_uk, w_uv,
                                              scale=scale)
        np.testing.assert_allclose(np.asarray(out[rows]), np.asarray(dense), rtol=1e-4, atol=1e-5)
    # Decode (one query per sequence, at its last position) is the same algebra.
    last = cu[1:] - 1
    decode = mla_paged_attention_xla(q_latent[last], jnp.asarray(q_rope[last]), jnp.asarray(pages),
                                     jnp.asarray(tables), jnp.asarray(kv_lens, jnp.int32), scale=scale)
    np.testing.assert_allclose(np.asarray(decode), np.asarray(latent[last]), rtol=1e-5, atol=1e-6)


# ---- contract edges ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["gpu", "tpu"])
def test_empty_inputs_give_empty_or_zero_outputs(target):
    rng = np.random.default_rng(1)
    case = build(rng, num_q_rows=2, num_heads=2, rank=16, rope_dim=8, block_size=8, max_blocks=2, kv_lens=[0, 0])
    out = mla_paged_attention(*case.decode_args(), scale=0.3, target=target, interpret=True)
    assert out.shape == (2, 2, 16) and not np.asarray(out).any()
    empty = mla_paged_attention(case.q_latent[:0], case.q_rope[:0], case.kv_pages, case.block_tables[:0],
                                case.lengths[:0], scale=0.3, target=target, interpret=True)
    assert empty.shape == (0, 2, 16)
    cu, num_tokens = ragged_layout(rng, [0, 0], max_extra_rows=0)
    ragged = ragged_mla_paged_attention(jnp.zeros((3, 2, 16)), jnp.zeros((3, 2, 8)), case.kv_pages,
                                        case.block_tables, case.lengths, jnp.asarray(cu), scale=0.3, target=target,
                                        interpret=True)
    assert num_tokens == 0 and ragged.shape == (3, 2, 16) and not np.asarray(ragged).any()


def test_xla_paths_and_references_take_empty_batches():
    rng = np.random.default_rng(1)
    case = build(rng, num_q_rows=2, num_heads=2, rank=16, rope_dim=8, block_size=8, max_blocks=2, kv_lens=[3, 0])
    cu = jnp.zeros((3,), jnp.int32)
    for fn in (ragged_mla_paged_attention_xla, ragged_mla_paged_attention_reference):
        out = fn(case.q_latent[:0], case.q_rope[:0], case.kv_pages, case.block_tables, case.lengths, cu, scale=0.3)
        assert out.shape == (0, 2, 16)
    for fn in (mla_paged_attention_xla, mla_paged_attention_reference):
        out = fn(case.q_latent[:0], case.q_rope[:0], case.kv_pages, case.block_tables[:0], case.lengths[:0],
                 scale=0.3)
        assert out.shape == (0, 2, 16)


@settings(max_examples=examples(25))
@given(num_heads=st.integers(1, 256), rank=st.sampled_from((16, 37, 128, 512, 1024)), num_tokens=st.integers(1, 4096),
       num_seqs=st.integers(1, 64), given_block_q=st.sampled_from((1, 2, 8, 64)))
def test_default_gpu_tiles_are_legal_and_bounded(num_heads, rank, num_tokens, num_seqs, given_block_q):
    """The defaults (as the GPU wrappers pick them: block_h, then block_q from it; or block_h for a given block_q)
    pack heads up to a 128 x 128 float32 accumulator and always make a tl.dot-sized tile."""
    block_h = default_block_h(num_heads, rank)
    # (block_q, block_h, whether block_q was the caller's: one head per program can then still exceed the bound)
    picked = [(tiles.default_block_q(num_tokens, num_seqs, block_h, rank), block_h, False),
              (given_block_q, default_block_h(num_heads, rank, given_block_q), True)]
    for block_q, block_h, callers in picked:
        assert block_h & (block_h - 1) == 0 and block_q & (block_q - 1) == 0
        rows = block_q * block_h
        assert rows >= MIN_DOT_DIM
        assert rows == MIN_DOT_DIM or rows * next_pow2(rank) <= 128 * 128 or (callers and block_h == 1)
        assert block_h <= max(next_pow2(num_heads), MIN_DOT_DIM)
    assert default_block_h(128, 512) == 32  # DeepSeek V3 decode: 4 head blocks of 32


# ---- argument checks -----------------------------------------------------------------------------------------

def _args(**over):
    """Abstract decode arguments (R = 32, Dr = 16, 4 heads, 2 sequences), with some replaced."""
    args = dict(q_latent=jnp.zeros((2, 4, 32)), q_rope=jnp.zeros((2, 4, 16)), kv_pages=jnp.zeros((6, 8, 48)),
                block_tables=jnp.zeros((2, 3), jnp.int32), lengths=jnp.zeros((2,), jnp.int32))
    args.update(over)
    return args


BAD = [
    (dict(q_latent=jnp.zeros((2, 32))), "q_latent must be 3-D"),
    (dict(q_rope=jnp.zeros((2, 4, 16, 1))), "q_rope must be 3-D"),
    (dict(q_rope=jnp.zeros((2, 3, 16))), "agree on"),
    (dict(kv_pages=jnp.zeros((1, 6, 8, 48))), "kv_pages must be 3-D"),
    (dict(kv_pages=jnp.zeros((6, 8, 50))), r"kv_lora_rank \+ rope_dim = 32 \+ 16"),
    (dict(q_rope=jnp.zeros((2, 4, 16), jnp.bfloat16)), "q_latent and q_rope must share one dtype"),
    (dict(q_latent=jnp.zeros((2, 4, 32), jnp.int32), q_rope=jnp.zeros((2, 4, 16), jnp.int32)), "q's dtype must be"),
    (dict(kv_pages=jnp.zeros((6, 8, 48), jnp.bfloat16)), "kv_pages must be in q's dtype"),
    (dict(kv_pages=jnp.zeros((6, 8, 48), jnp.int8)), "kv_scales is required"),
    (dict(kv_scales=jnp.ones((6, 8))), "kv_scales is only for 8-bit pages"),
    (dict(kv_pages=jnp.zeros((6, 8, 48), jnp.int8), kv_scales=jnp.ones((6, 8, 1))), "kv_scales must have shape"),
    (dict(kv_pages=jnp.zeros((6, 8, 48), jnp.float8_e4m3fn), kv_scales=jnp.ones((6, 8), jnp.float16)),
     "kv_scales must be float32 or bfloat16"),
    (dict(block_tables=jnp.zeros((2, 3))), "block_tables must be int32"),
    (dict(block_tables=jnp.zeros((2, 3, 1), jnp.int32)), "block_tables must have 2 dimension"),
    (dict(block_tables=jnp.zeros((3, 3), jnp.int32)), "block_tables has 3 rows but there are 2 sequences"),
    (dict(lengths=jnp.zeros((2,))), "lengths must be int32"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), r"lengths must have shape \(2,\)"),
    (dict(scale=None), "scale must be given"),
    (dict(target="cuda"), "target must be one of"),
    (dict(num_splits=0), "num_splits must be a positive int"),
    (dict(target="gpu", block_h=24), "block_h must be a positive power of two"),
    (dict(target="gpu", block_h=8), r"block_q \* block_h must be >= 16"),
    (dict(target="gpu", pages_per_iter=3), "pages_per_iter must be a positive power of two"),
    (dict(target="gpu", pages_per_iter=1), r"pages_per_iter \* block_size must be >= 16"),
    (dict(target="tpu", kv_pages=jnp.zeros((6, 8, 48), jnp.int8), kv_scales=jnp.ones((6, 8))),
     "target 'tpu' does not support 8-bit"),
    (dict(target="tpu", q_latent=jnp.zeros((2, 4, 32), jnp.float16), q_rope=jnp.zeros((2, 4, 16), jnp.float16),
          kv_pages=jnp.zeros((6, 8, 48), jnp.float16)), "target 'tpu' supports float32 and bfloat16"),
    (dict(target="tpu", kv_pages=jnp.zeros((6, 12, 48))), "block_size to be a multiple of 8"),
    (dict(target="tpu", block_h=0), "block_h must be a positive int"),
]
BAD_IDS = [match.replace("\\", "") for _, match in BAD]
_KWARGS = ("scale", "target", "kv_scales", "num_splits", "block_h", "pages_per_iter")


@pytest.mark.parametrize("over,match", BAD, ids=BAD_IDS)
def test_bad_arguments_raise_clear_value_errors(over, match):
    args = _args(**over)
    kwargs = dict(scale=0.1, interpret=True)
    kwargs.update({key: args.pop(key) for key in _KWARGS if key in args})
    with pytest.raises(ValueError, match=match):
        mla_paged_attention(*args.values(), **kwargs)


@pytest.mark.parametrize("over,match", [b for b in BAD if not set(b[0]) & {"target", "num_splits", "block_h",
                                                                              "pages_per_iter", "lengths"}],
                         ids=[i for b, i in zip(BAD, BAD_IDS, strict=True)
                              if not set(b[0]) & {"target", "num_splits", "block_h", "pages_per_iter", "lengths"}])
def test_references_and_xla_paths_check_the_same_arguments(over, match):
    args = _args(**over)
    kwargs = dict(scale=0.1)
    kwargs.update({key: args.pop(key) for key in ("scale", "kv_scales") if key in args})
    for fn in (mla_paged_attention_reference, mla_paged_attention_xla):
        with pytest.raises(ValueError, match=match):
            fn(*args.values(), **kwargs)


def test_ragged_checks_its_metadata():
    a = _args()
    cu = jnp.zeros((3,), jnp.int32)
    for fn in (ragged_mla_paged_attention, ragged_mla_paged_attention_reference, ragged_mla_paged_attention_xla):
        with pytest.raises(ValueError, match=r"cu_q_lens must have shape \(3,\)"):
            fn(a["q_latent"], a["q_rope"], a["kv_pages"], a["block_tables"], a["lengths"], cu[:2], scale=0.1)
        with pytest.raises(ValueError, match="kv_lens must be int32"):
            fn(a["q_latent"], a["q_rope"], a["kv_pages"], a["block_tables"], a["lengths"].astype(jnp.float32), cu,
               scale=0.1)
    with pytest.raises(ValueError, match="block_q must be a positive power of two"):
        ragged_mla_paged_attention(*list(a.values())[:4], a["lengths"], cu, scale=0.1, block_q=3, interpret=True)
    with pytest.raises(ValueError, match="q_tile must be a positive int"):
        ragged_mla_paged_attention_xla(*list(a.values())[:4], a["lengths"], cu, scale=0.1, q_tile=0)
    with pytest.raises(ValueError, match="kv_chunk must be a positive int"):
        ragged_mla_paged_attention_xla(*list(a.values())[:4], a["lengths"], cu, scale=0.1, kv_chunk=0)
    with pytest.raises(ValueError, match="kv_chunk must be a positive int"):
        mla_paged_attention_xla(*list(a.values())[:4], a["lengths"], scale=0.1, kv_chunk=-1)


# ---- DeepSeek-sized, interpreted: slow ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deepseek_v3_shapes_interpreted(target, dtype):
    """R = 512, Dr = 64, 16 heads, blocks of 16: the kernels agree with the reference at the real width."""
    p = dict(seed=3, num_heads=16, rank=512, rope_dim=64, block_size=16, max_blocks=4, lengths=[64, 1, 37, 0],
             dtype=dtype)
    case = decode_case(p)
    scale = 1.0 / np.sqrt(192)
    actual = mla_paged_attention(*case.decode_args(), scale=scale, target=target, interpret=True)
    assert_close(actual, mla_paged_attention_reference(*case.decode_args(), scale=scale), dtype)
    case = ragged_case(p)
    actual = ragged_mla_paged_attention(*case.ragged_args(), scale=scale, target=target, interpret=True)
    assert_close(actual, ragged_mla_paged_attention_reference(*case.ragged_args(), scale=scale), dtype)


@pytest.mark.slow
@settings(max_examples=examples(30))
@given(p=mla_params(**SMALL), target=st.sampled_from(("gpu", "tpu")))
def test_kernels_match_reference_many_examples(p, target):
    if target == "tpu":
        p = dict(p, block_size=16)
    case = ragged_case(p)
    actual = ragged_mla_paged_attention(*case.ragged_args(), scale=_scale(p), target=target, interpret=True)
    assert_close(actual, ragged_mla_paged_attention_reference(*case.ragged_args(), scale=_scale(p)), p["dtype"])
    case = decode_case(p)
    actual = mla_paged_attention(*case.decode_args(), scale=_scale(p), target=target, interpret=True)
    assert_close(actual, mla_paged_attention_reference(*case.decode_args(), scale=_scale(p)), p["dtype"])
    release_compiled_programs_if_many()  # hundreds of examples in one test under the dev profile
