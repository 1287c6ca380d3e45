"""TPU (Mosaic) kernels in Pallas's TPU interpret mode on CPU: properties against the dense reference, agreement
with the GPU kernels, the TPU rules and the `target=` dispatch.

The interpret mode simulates HBM, VMEM, SMEM, DMAs and semaphores strictly enough to test the kernels'
memory discipline: a DMA lands only when its semaphore is waited on, fresh VMEM holds NaN, and an
out-of-bounds read raises. The cases' pools poison every slot past a length with NaN and every table entry
past the used pages with -1 or a block id far out of range, so a kernel that copies a page past a length,
forgets a wait or computes on a buffer slot still in flight fails here.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import (
    paged,
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.gpu import paged_attention as gpu_decode
from pallas_kernels.gpu import ragged_attention as gpu_ragged
from pallas_kernels.tpu._common import default_pages_per_iter
from tests.kernels.cases import HEAD_DIMS, assert_close, boundary_lengths, build, examples, gqa_heads, relocate
from tests.scripts_module import load_script

pytestmark = pytest.mark.kernels

TPU = dict(target="tpu", interpret=True)
# The TPU block-size rule: multiples of 8 rows for float32 and of 16 for bfloat16 (weighted: repeated entries).
BLOCK_SIZES = {"float32": (8, 16, 24, 8, 32), "bfloat16": (16, 32, 16, 48)}


@st.composite
def decode_params(draw):
    dtype = draw(st.sampled_from(("float32", "bfloat16")))
    block_size = draw(st.sampled_from(BLOCK_SIZES[dtype]))
    max_blocks = draw(st.sampled_from((3, 2, 4, 1)))
    num_q_heads, num_kv_heads = draw(gqa_heads(max_q_heads=14))
    return dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        block_size=block_size,
        max_blocks=max_blocks,
        lengths=draw(boundary_lengths(draw(st.sampled_from((3, 2, 1))), block_size, max_blocks)),
        dtype=dtype,
        num_splits=draw(st.sampled_from((2, None, 3, 1))),
        pages_per_iter=draw(st.sampled_from((1, None, 2, 3))),  # 1-3 pages: sequences span several chunks
    )


def _decode_case(p, poison=True):
    return build(np.random.default_rng(p["seed"]), num_q_rows=len(p["lengths"]), num_q_heads=p["num_q_heads"],
                 num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"], block_size=p["block_size"],
                 max_blocks=p["max_blocks"], kv_lens=p["lengths"], dtype=p["dtype"], poison=poison)


def _decode_tuning(p):
    return {key: p[key] for key in ("num_splits", "pages_per_iter") if p.get(key) is not None}


EDGE = dict(seed=0, num_q_heads=14, num_kv_heads=2, head_dim=80, block_size=8, max_blocks=3, dtype="float32",
            num_splits=2, pages_per_iter=1)


# Group 7 on 2 KV heads, lengths 0 / 1 / at a block edge +- 1 / full, two splits of one-page chunks. Shared by
# the tests below (same shapes: one compile per process).
DECODE = dict(EDGE, lengths=[0, 1, 8, 9, 24])


@settings(max_examples=examples(2))
@given(decode_params())
@example(DECODE)
# bfloat16 (16-row tiles), group 3, head_dim 256 (two lane tiles), two-page chunks, default split count.
@example(dict(EDGE, num_q_heads=6, head_dim=256, block_size=16, max_blocks=3, dtype="bfloat16", num_splits=None,
              pages_per_iter=2, lengths=[16, 17, 47, 0]))
# MHA, head_dim 64 (padded to 128 lanes in VMEM only), blocks of 24, 3 splits, 3-page chunks.
@example(dict(EDGE, num_q_heads=4, num_kv_heads=4, head_dim=64, block_size=24, max_blocks=4, num_splits=3,
              pages_per_iter=3, lengths=[96, 23, 25, 49]))
def test_decode_matches_reference_with_nan_poisoned_unused_slots(p):
    case = _decode_case(p)
    out = paged_attention(*case.decode_args(), **TPU, **_decode_tuning(p))
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, paged_attention_reference(*case.decode_args()), p["dtype"])
    empty = np.asarray(p["lengths"]) == 0
    np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)  # length 0 -> exact zeros


KINDS = ("decode", "chunk", "prompt", "padding", "idle")


@st.composite
def _sequence(draw, block_size: int, cap: int):
    """(q_len, kv_len): a decode token, a prefill chunk after context, a whole prompt, padding or idle."""
    kind = draw(st.sampled_from(KINDS))
    if kind == "decode":
        return 1, draw(st.sampled_from([x for x in (block_size + 1, 1, block_size, cap) if x <= cap]))
    if kind == "chunk":
        kv = draw(st.integers(2, cap))
        return draw(st.integers(1, min(kv - 1, 20))), kv
    if kind == "prompt":
        q = draw(st.integers(1, min(cap, 20)))
        return q, q
    return 0, (0 if kind == "padding" else draw(st.integers(0, cap)))


@st.composite
def ragged_params(draw):
    dtype = draw(st.sampled_from(("float32", "bfloat16")))
    block_size = draw(st.sampled_from(BLOCK_SIZES[dtype]))
    max_blocks = draw(st.integers(1, 3))
    num_q_heads, num_kv_heads = draw(gqa_heads(max_q_heads=14))
    return dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        block_size=block_size,
        max_blocks=max_blocks,
        seqs=[draw(_sequence(block_size, block_size * max_blocks)) for _ in range(draw(st.integers(1, 4)))],
        padding_rows=draw(st.integers(0, 3)),
        dtype=dtype,
        block_q=draw(st.sampled_from((None, 4, 8, 1))),
        pages_per_iter=draw(st.sampled_from((1, None, 2))),
    )


def _ragged_case(p, poison=True):
    cu = np.concatenate([[0], np.cumsum([q for q, _ in p["seqs"]])]).astype(np.int32)
    return build(np.random.default_rng(p["seed"]), num_q_rows=int(cu[-1]) + p["padding_rows"],
                 num_q_heads=p["num_q_heads"], num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"],
                 block_size=p["block_size"], max_blocks=p["max_blocks"], kv_lens=[kv for _, kv in p["seqs"]],
                 dtype=p["dtype"], poison=poison, cu_q_lens=cu)


def _ragged_tuning(p):
    return {key: p[key] for key in ("block_q", "pages_per_iter") if p.get(key) is not None}


RAGGED_EDGE = dict(seed=0, num_q_heads=6, num_kv_heads=2, head_dim=80, block_size=8, max_blocks=3, dtype="float32",
                   padding_rows=2, block_q=4, pages_per_iter=1)


# Decode tokens at block edges, a chunk after context, a whole prompt, padding and idle sequences, 4-token
# tiles (chunks and prompts span several), one-page chunks.
RAGGED = dict(RAGGED_EDGE, seqs=[(1, 9), (5, 24), (8, 8), (0, 0), (0, 17), (1, 16)])


@settings(max_examples=examples(2))
@given(ragged_params())
@example(RAGGED)
# bfloat16, group 7 on one KV head, 8-token tiles, head_dim 128, default chunks.
@example(dict(RAGGED_EDGE, num_q_heads=7, num_kv_heads=1, head_dim=128, block_size=16, max_blocks=2,
              dtype="bfloat16", block_q=8, pages_per_iter=None, seqs=[(13, 29), (1, 32), (0, 0)], padding_rows=3))
def test_ragged_matches_reference_with_nan_poisoned_unused_slots(p):
    case = _ragged_case(p)
    out = ragged_paged_attention(*case.ragged_args(), **TPU, **_ragged_tuning(p))
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, ragged_paged_attention_reference(*case.ragged_args()), p["dtype"])
    if p["padding_rows"]:
        np.testing.assert_array_equal(np.asarray(out[-p["padding_rows"]:], np.float32), 0.0)


def test_placement_invariance_is_bit_exact():
    """The same logical cache in other physical blocks gives identical bits (same shapes: one compile)."""
    case = _decode_case(DECODE)
    moved = relocate(np.random.default_rng(1), case)
    a = paged_attention(*case.decode_args(), **TPU, **_decode_tuning(DECODE))
    b = paged_attention(*moved.decode_args(), **TPU, **_decode_tuning(DECODE))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    case = _ragged_case(RAGGED)
    moved = relocate(np.random.default_rng(2), case)
    a = ragged_paged_attention(*case.ragged_args(), **TPU, **_ragged_tuning(RAGGED))
    b = ragged_paged_attention(*moved.ragged_args(), **TPU, **_ragged_tuning(RAGGED))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_page_read_past_a_length_would_fail_the_poisoned_tests():
    """The interpret mode raises on an out-of-range DMA: put a far out-of-range block id *inside* a length
    and the kernel fails. The poisoned cases put such ids past every length, so the kernels passing them
    never copy a page past a length."""
    case = _decode_case(DECODE)
    tables = case.block_tables.at[3, 1].set(2**30)  # logical page 1 of sequence 3 (length 9) is read
    tuning = _decode_tuning(DECODE)
    try:
        with pytest.raises(Exception, match="[Oo]ut-of-bounds"):
            jax.block_until_ready(paged_attention(case.q, case.k_pages, case.v_pages, tables, case.lengths, **TPU,
                                                  **tuning))
    finally:
        pltpu.reset_tpu_interpret_mode_state()  # the interpreter's state after a failed kernel
    assert_close(paged_attention(*case.decode_args(), **TPU, **tuning),
                 paged_attention_reference(*case.decode_args()), "float32")


# ---- agreement with the GPU kernels (both interpreted) ------------------------------------------------------
#
# Bit for bit when both walk the cache in the same chunks (same splits and pages per iteration) and head_dim
# is a power of two >= 16: each program then runs the same float32 operations (q.k scores, masked max,
# exp, z and u updates, P @ V) in the same order; the GPU kernel's padded query rows are extra rows that no
# other row sees. With head_dim 80 the GPU kernel pads the contraction to 128 with zeros and XLA sums the
# padded dot in another order, and with different chunkings the online softmax rescales at other points:
# both agree to float32 rounding (on hardware, too: MXU vs tensor-core summation order).


def _gpu(**over):
    return dict(target="gpu", interpret=True, **over)


def test_decode_agrees_bit_for_bit_with_the_gpu_kernel():
    p = dict(EDGE, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, max_blocks=4, lengths=[0, 17, 64, 33])
    case = _decode_case(p)
    tuning = dict(num_splits=2, pages_per_iter=1)
    tpu = paged_attention(*case.decode_args(), **TPU, **tuning)
    gpu = paged_attention(*case.decode_args(), **_gpu(**tuning))
    np.testing.assert_array_equal(np.asarray(tpu, np.float32), np.asarray(gpu, np.float32))


def test_ragged_agrees_with_the_gpu_kernel_to_float32_rounding():
    """head_dim 80 and each kernel's default tiling (TPU chunks of 128 tokens, GPU of 64)."""
    r = dict(RAGGED_EDGE, num_q_heads=7, num_kv_heads=1, block_size=16, max_blocks=10, block_q=None,
             pages_per_iter=None, seqs=[(1, 150), (20, 160), (8, 8), (0, 0)])
    case = _ragged_case(r)
    tpu = np.asarray(ragged_paged_attention(*case.ragged_args(), **TPU))
    gpu = np.asarray(ragged_paged_attention(*case.ragged_args(), **_gpu()))
    np.testing.assert_allclose(tpu, gpu, rtol=1e-5, atol=1e-6)


# ---- the TPU rules, tuning and dispatch ----------------------------------------------------------------------


def _decode_args(dtype=jnp.float32, block_size=16, **over):
    k = jnp.zeros((2, 6, block_size, 64), dtype)
    base = dict(q=jnp.zeros((2, 4, 64), dtype), k_pages=k, v_pages=k, block_tables=jnp.zeros((2, 3), jnp.int32),
                lengths=jnp.zeros((2,), jnp.int32))
    base.update(over)
    return base


def _ragged_args(dtype=jnp.float32, block_size=16):
    k = jnp.zeros((2, 6, block_size, 64), dtype)
    return dict(q=jnp.zeros((5, 4, 64), dtype), k_pages=k, v_pages=k, block_tables=jnp.zeros((2, 3), jnp.int32),
                kv_lens=jnp.zeros((2,), jnp.int32), cu_q_lens=jnp.asarray([0, 2, 5], jnp.int32))


@pytest.mark.parametrize("dtype,block_size,match", [
    (jnp.float32, 12, "multiple of 8 for float32"),
    (jnp.bfloat16, 8, "multiple of 16 for bfloat16"),
    (jnp.float16, 16, "float32 and bfloat16"),
])
def test_tpu_layout_rules(dtype, block_size, match):
    with pytest.raises(ValueError, match=match):
        paged_attention(**_decode_args(dtype, block_size), **TPU)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(**_ragged_args(dtype, block_size), **TPU)


def test_tpu_tuning_validation():
    with pytest.raises(ValueError, match="pages_per_iter must be a positive int"):
        paged_attention(**_decode_args(), **TPU, pages_per_iter=0)
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        paged_attention(**_decode_args(), **TPU, num_splits=0)
    with pytest.raises(ValueError, match="block_q must be a positive power of two"):
        ragged_paged_attention(**_ragged_args(), **TPU, block_q=3)
    with pytest.raises(ValueError, match="pages_per_iter must be a positive int"):
        ragged_paged_attention(**_ragged_args(), **TPU, pages_per_iter=-1)
    with pytest.raises(ValueError, match="target must be one of"):
        paged_attention(**_decode_args(), target="cuda")
    with pytest.raises(ValueError, match="target must be one of"):
        ragged_paged_attention(**_ragged_args(), target=None)
    with pytest.raises(ValueError, match="needs target='tpu'"):
        paged_attention(**_decode_args(), target="gpu", interpret=pltpu.InterpretParams())


def test_default_chunk_is_about_64_kib_of_k():
    assert default_pages_per_iter(16, 256, 128, jnp.bfloat16) == 16  # 256 tokens x 128 x 2 bytes
    assert default_pages_per_iter(16, 256, 128, jnp.float32) == 8  # 128 tokens
    assert default_pages_per_iter(16, 256, 256, jnp.bfloat16) == 8
    assert default_pages_per_iter(16, 256, 64, jnp.float32) == 8  # head_dim 64 takes 128 lanes in VMEM
    assert default_pages_per_iter(16, 3, 128, jnp.bfloat16) == 3  # never wider than the table
    assert default_pages_per_iter(256, 64, 128, jnp.float32) == 1


def test_empty_inputs_give_empty_or_zero_outputs():
    assert paged_attention(**_decode_args(q=jnp.zeros((0, 4, 64)), block_tables=jnp.zeros((0, 3), jnp.int32),
                                          lengths=jnp.zeros((0,), jnp.int32)), **TPU).shape == (0, 4, 64)
    args = _ragged_args()
    args["q"] = jnp.zeros((0, 4, 64))
    assert ragged_paged_attention(**args, **TPU).shape == (0, 4, 64)


def test_auto_target_follows_the_backend(monkeypatch):
    """"auto" runs the TPU kernels on a TPU backend and the GPU kernels everywhere else (the kernels are
    replaced by recorders here: this is about the dispatch)."""
    calls = []

    def recorder(name):
        return lambda q, *args, **kwargs: calls.append(name) or jnp.zeros(q.shape, q.dtype)

    monkeypatch.setattr(gpu_decode, "_paged_attention", recorder("gpu decode"))
    monkeypatch.setattr(gpu_ragged, "_ragged_paged_attention", recorder("gpu ragged"))
    monkeypatch.setattr(paged, "paged_attention_tpu", recorder("tpu decode"))  # the paged kind's entry module
    monkeypatch.setattr(paged, "ragged_paged_attention_tpu", recorder("tpu ragged"))
    for backend in ("cpu", "gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        paged_attention(**_decode_args())
        ragged_paged_attention(**_ragged_args())
    assert calls == ["gpu decode", "gpu ragged"] * 2 + ["tpu decode", "tpu ragged"]


def test_bench_target_tpu_checks_the_kernels_without_a_tpu(tmp_path, capsys, monkeypatch):
    """scripts/bench_kernels.py --target tpu on CPU: interpret-mode errors against the reference, no timings."""
    if jax.default_backend() == "tpu":
        pytest.skip("on a TPU the benchmark times the kernels")
    bench = load_script("bench_kernels", monkeypatch)
    out = tmp_path / "bench.json"
    assert bench.main(["--target", "tpu", "--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["kernel"] for row in rows] == ["decode", "ragged"]
    assert all(row["ok"] and row["max_err"] <= 2e-2 and "ms" not in row for row in rows)
    assert "correctness against the dense reference only" in capsys.readouterr().out
