"""DeepSeek V4's compressed attention (`pallas_kernels.compressed`): the compressor, the indexer's scores over
compressed keys and the attention over a window plus compressed entries.

The references are transformers' definitions written out (`compress_reference`: a softmax over each window's slots;
`compressed_attention_reference`: one dense softmax over window keys, entries and the sink). The XLA paths run
paged: sequences in permuted blocks of NaN-poisoned pools, steps cut at random (prefill chunks ending anywhere,
across window and block boundaries, decode steps), idle sequences between them; lengths around the compress rate,
the window and the block size. The GPU kernel (Triton, in the Pallas interpreter) and the TPU path (in TPU
interpret mode) equal the XLA path and export for "cuda" and "tpu" at DeepSeek V4-Flash's shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from pallas_kernels.compressed import (
    compressed_attention,
    compressed_attention_reference,
    compressed_attention_xla,
    compressed_index_scores,
    compressed_index_scores_xla,
)
from pallas_kernels.compressor import compress, compress_reference, compress_xla
from tests.kernels.cases import examples
from tests.kernels.test_lowering import _export_cuda
from tests.kernels.test_tpu_lowering import export_tpu


def _steps(rng, n: int) -> list[int]:
    """Random step sizes summing to n (1 .. 9 tokens each: decodes and chunks)."""
    out = []
    while sum(out) < n:
        out.append(int(min(rng.integers(1, 10), n - sum(out))))
    return out


def _compress_steps(compress_step, seed: int, rate: int, blocks_per_state: int, overlap: bool,
                    lengths: list[int]) -> None:
    """Sequences compressed step by step by `compress_step` (compress_xla's arguments), their snapshots in permuted
    blocks of a NaN pool, give each closed window's entry at the row that closes it, as the whole sequence's softmax
    does, and no entry elsewhere."""
    rng = np.random.default_rng(seed)
    d, block = 3, rate * 2 * blocks_per_state
    width = 2 * d if overlap else d
    data = [(rng.normal(size=(n, width)).astype(np.float32), 3 * rng.normal(size=(n, width)).astype(np.float32))
            for n in lengths]
    num_blocks, max_blocks = 40, 8
    tables = rng.permutation(num_blocks)[:len(lengths) * max_blocks].reshape(len(lengths), max_blocks)
    pages = jnp.full((num_blocks, 3 if overlap else 1, 3, d), jnp.nan, jnp.float32)
    plans = [_steps(rng, n) for n in lengths]
    done, got = [0] * len(lengths), [dict() for _ in lengths]
    for step in range(max(map(len, plans))):
        takes = [plan[step] if step < len(plan) else 0 for plan in plans]  # 0: idle this step
        rows = [(s, done[s] + i) for s in range(len(lengths)) for i in range(takes[s])]
        num_tokens = 32  # one shape for every step (9 tokens x 3 sequences at most): padding rows past cu_q_lens[-1]
        kv, gate = np.zeros((num_tokens, width), np.float32), np.zeros((num_tokens, width), np.float32)
        for r, (s, p) in enumerate(rows):
            kv[r], gate[r] = data[s][0][p], data[s][1][p]
        cu = np.concatenate([[0], np.cumsum(takes)]).astype(np.int32)
        kv_lens = np.array([done[s] + takes[s] for s in range(len(lengths))], np.int32)
        entries, closes, pages = compress_step(jnp.asarray(kv), jnp.asarray(gate), pages, jnp.asarray(tables),
                                               jnp.asarray(kv_lens), jnp.asarray(cu), compress_rate=rate,
                                               block_size=block)
        entries, closes = np.asarray(entries), np.asarray(closes)
        assert not closes[len(rows):].any()
        for r, (s, p) in enumerate(rows):
            assert closes[r] == ((p + 1) % rate == 0)
            if closes[r]:
                got[s][p // rate] = entries[r]
        done = [done[s] + takes[s] for s in range(len(lengths))]
    for s, n in enumerate(lengths):
        want = np.asarray(compress_reference(*data[s], compress_rate=rate, overlap=overlap))
        assert sorted(got[s]) == list(range(n // rate))
        if n // rate:
            np.testing.assert_allclose(np.stack([got[s][w] for w in range(n // rate)]), want, rtol=1e-5, atol=1e-6)


@settings(max_examples=examples(2), deadline=None)  # (CI time) + 2 explicit examples; dev's random ones passed
@given(seed=st.integers(0, 2 ** 16), rate=st.sampled_from([1, 2, 4]), blocks_per_state=st.integers(1, 3),
       overlap=st.booleans(), lengths=st.lists(st.integers(0, 30), min_size=1, max_size=3))
@example(seed=0, rate=4, blocks_per_state=1, overlap=True, lengths=[0, 1, 4, 8])
@example(seed=1, rate=2, blocks_per_state=2, overlap=False, lengths=[3, 16])
def test_compressor_across_steps_equals_one_softmax_per_window(seed, rate, blocks_per_state, overlap, lengths):
    _compress_steps(compress_xla, seed, rate, blocks_per_state, overlap, lengths)


@pytest.mark.kernels
@pytest.mark.parametrize("target", ["gpu", "tpu"])
@settings(max_examples=examples(1), deadline=None, phases=(Phase.explicit,) if examples(1) == 1 else tuple(Phase))
@given(seed=st.integers(0, 2 ** 16), rate=st.sampled_from([1, 2, 4, 8]), blocks_per_state=st.integers(1, 3),
       overlap=st.booleans(), lengths=st.lists(st.integers(0, 30), min_size=1, max_size=3))
@example(seed=2, rate=4, blocks_per_state=1, overlap=True, lengths=[9, 0, 16])
@example(seed=3, rate=8, blocks_per_state=1, overlap=False, lengths=[17, 1])
def test_compressor_kernel_across_steps_equals_one_softmax_per_window(target, seed, rate, blocks_per_state, overlap,
                                                                      lengths):
    """The Pallas compressor (Triton in the Pallas interpreter, Mosaic in TPU interpret mode) through the same
    steps: rates that are not a whole tile (m = 1, 2 padded to 8 slots on a TPU; m = 8 on one)."""
    step = functools.partial(compress, target=target, interpret=True)
    _compress_steps(step, seed, rate, blocks_per_state, overlap, lengths)


def _paged(rng, rows_per_block: int, vectors: list[np.ndarray], num_blocks: int, max_blocks: int):
    """Each sequence's rows in permuted blocks of a NaN pool `[num_blocks, rows_per_block, D]`: (pages, tables)."""
    d = vectors[0].shape[-1]
    pages = np.full((num_blocks, rows_per_block, d), np.nan, np.float32)
    tables = rng.permutation(num_blocks)[:len(vectors) * max_blocks].reshape(len(vectors), max_blocks)
    for s, v in enumerate(vectors):
        for i, row in enumerate(v):
            pages[tables[s, i // rows_per_block], i % rows_per_block] = row
    return jnp.asarray(pages), jnp.asarray(tables.astype(np.int32))


@settings(max_examples=examples(1), deadline=None)  # (CI time) + 2 explicit examples; dev's random ones passed
@given(seed=st.integers(0, 2 ** 16), rate=st.sampled_from([1, 2, 4]), window=st.integers(1, 9),
       kind=st.sampled_from(["csa", "hca", "window"]), lengths=st.lists(st.integers(0, 24), min_size=1, max_size=3),
       q_lens=st.lists(st.integers(0, 6), min_size=3, max_size=3))
@example(seed=0, rate=4, window=8, kind="csa", lengths=[8, 1, 0], q_lens=[8, 1, 1])
@example(seed=2, rate=2, window=1, kind="hca", lengths=[16, 5], q_lens=[3, 5, 0])
def test_paged_attention_over_window_and_entries_equals_the_dense_softmax(seed, rate, window, kind, lengths,
                                                                          q_lens):
    """Ragged rows (the last q_len positions of each sequence) over paged window vectors and entries, with the
    indexer's selection (CSA, random and -1 padded, indices past the row's closed entries ignored) or every closed
    entry (HCA), equal the dense softmax of `compressed_attention_reference`, sinks included."""
    args, rows, (keys, entries, q, selected) = _ragged_case(np.random.default_rng(seed), rate, lengths, q_lens)
    qs, window_pages, window_tables, entry_pages, entry_tables, kv_lens, cu, sel, sinks = args
    use_entries = kind != "window"
    got = np.asarray(compressed_attention_xla(
        qs, window_pages, window_tables, entry_pages if use_entries else None, entry_tables if use_entries else None,
        kv_lens, cu, sel if kind == "csa" else None, sinks, scale=0.5, sliding_window=window,
        compress_rate=rate if use_entries else None))
    for s, n in enumerate(lengths):
        if not n:
            continue
        want = np.asarray(compressed_attention_reference(
            jnp.asarray(q[s]), jnp.asarray(keys[s]), jnp.asarray(entries[s]) if use_entries else None,
            jnp.asarray(selected[s]) if kind == "csa" else None, sinks, scale=0.5, sliding_window=window,
            compress_rate=rate))
        for r, (s2, p) in enumerate(rows):
            if s2 == s:
                np.testing.assert_allclose(got[r], want[p], rtol=1e-5, atol=1e-6, err_msg=f"{s}@{p}")
    assert np.isfinite(got).all()


@settings(max_examples=examples(3), deadline=None)
@given(seed=st.integers(0, 2 ** 16), rate=st.sampled_from([1, 2, 4]), n=st.integers(0, 20), m=st.integers(0, 20),
       q_tile=st.sampled_from([1, 4, 16]))
@example(seed=0, rate=4, n=3, m=9, q_tile=16)
@example(seed=0, rate=1, n=13, m=0, q_tile=4)  # found by the dev profile: more entries than the first harness's table
def test_index_scores_over_closed_entries(seed, rate, n, m, q_tile):
    """The indexer's score of entry w for the query at p is scale * sum_h w[h] relu(q[h] . k[w]) where w < (p + 1)
    / m, -inf elsewhere (float64 numpy), from paged keys in a NaN pool: two sequences, all n rows of the first and
    the last half of the second's m, in query tiles of any size."""
    rng = np.random.default_rng(seed)
    hi, di, block = 3, 4, 2 * rate
    keys = [rng.normal(size=(length // rate, di)).astype(np.float32) for length in (n, m)]
    pages, tables = _paged(rng, block // rate, keys, 40, 12)
    rows = [(0, p) for p in range(n)] + [(1, p) for p in range(m - m // 2, m)]
    q = rng.normal(size=(len(rows) + 1, hi, di)).astype(np.float32)
    w = rng.normal(size=(len(rows) + 1, hi)).astype(np.float32)
    cu = jnp.asarray([0, n, len(rows)], jnp.int32)
    got = np.asarray(compressed_index_scores_xla(jnp.asarray(q), jnp.asarray(w), pages, tables,
                                                 jnp.asarray([n, m], jnp.int32), cu, scale=0.5, compress_rate=rate,
                                                 q_tile=q_tile))
    for r, (s, p) in enumerate(rows):
        closed = (p + 1) // rate
        want = 0.5 * np.einsum("h,hl->l", w[r], np.maximum(q[r].astype(np.float64) @ keys[s][:closed].T, 0.0))
        np.testing.assert_allclose(got[r, :closed], want, rtol=1e-5, atol=1e-6)
        assert np.isneginf(got[r, closed:]).all()
    assert np.isneginf(got[len(rows):]).all()  # the padding row sees nothing


@pytest.mark.kernels
@pytest.mark.parametrize("target", ["gpu", "tpu"])
def test_index_kernel_equals_the_xla_path(target):
    """`compressed_index_scores` (V3.2's indexer kernel, each row a sequence of its own: its interpreter) gives the
    XLA path's scores on two sequences' ragged rows, with whole entry pages of 8 rows (the TPU kernel's rule)."""
    rng = np.random.default_rng(3)
    rate, rows_per_block = 2, 8
    keys = [rng.normal(size=(n // rate, 16)).astype(np.float32) for n in (37, 20)]
    pages, tables = _paged(rng, rows_per_block, keys, 12, 4)
    q = jnp.asarray(rng.normal(size=(9, 2, 16)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(9, 2)).astype(np.float32))
    args = (q, w, pages, tables, jnp.asarray([37, 20], jnp.int32), jnp.asarray([0, 3, 8], jnp.int32))
    got = compressed_index_scores(*args, scale=0.25, compress_rate=rate, target=target, interpret=True)
    want = compressed_index_scores_xla(*args, scale=0.25, compress_rate=rate)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _ragged_case(rng, rate: int, lengths: list[int], q_lens: list[int], heads: int = 2, d: int = 4):
    """(positional args of `compressed_attention*` but the options, the rows' (sequence, position), per-sequence
    keys / entries / queries / selections): sequences in permuted blocks of NaN pools, the last q_len positions of
    each as query rows, a padding row after them."""
    block = 4 * rate
    keys = [rng.normal(size=(n, d)).astype(np.float32) for n in lengths]
    entries = [rng.normal(size=(n // rate, d)).astype(np.float32) for n in lengths]
    q = [rng.normal(size=(n, heads, d)).astype(np.float32) for n in lengths]
    # Distinct entries per row (a top-k's), some past the row's closed ones, some -1.
    selected = [np.array([np.where(rng.random(3) < 0.2, -1, rng.permutation(n // rate + 3)[:3]) for _ in range(n)],
                         np.int32).reshape(n, 3) for n in lengths]
    window_pages, window_tables = _paged(rng, block, keys, 30, 7)
    entry_pages, entry_tables = _paged(rng, block // rate, entries, 30, 7)
    q_lens = [min(ql, n) for ql, n in zip(q_lens, lengths, strict=False)]
    rows = [(s, p) for s, n in enumerate(lengths) for p in range(n - q_lens[s], n)]
    qs = np.zeros((len(rows) + 1, heads, d), np.float32)
    sel = np.full((len(rows) + 1, 3), -1, np.int32)
    for r, (s, p) in enumerate(rows):
        qs[r], sel[r] = q[s][p], selected[s][p]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    sinks = jnp.asarray(rng.normal(size=heads).astype(np.float32))
    args = (jnp.asarray(qs), window_pages, window_tables, entry_pages, entry_tables, jnp.asarray(lengths, jnp.int32),
            jnp.asarray(cu), jnp.asarray(sel), sinks)
    return args, rows, (keys, entries, q, selected)


@pytest.mark.kernels
# The interpreters are slow: the ci and smoke profiles run the explicit examples only, dev random ones besides.
@settings(max_examples=examples(1), deadline=None, phases=(Phase.explicit,) if examples(1) == 1 else tuple(Phase))
@given(seed=st.integers(0, 2 ** 16), rate=st.sampled_from([2, 4]), window=st.integers(1, 9),
       kind=st.sampled_from(["csa", "hca", "window"]), lengths=st.lists(st.integers(0, 20), min_size=1, max_size=2),
       q_lens=st.lists(st.integers(0, 4), min_size=2, max_size=2), bf16=st.booleans(),
       target=st.sampled_from(["gpu", "tpu"]))
@example(seed=0, rate=4, window=8, kind="csa", lengths=[9, 0], q_lens=[4, 1], bf16=False, target="gpu")
@example(seed=1, rate=2, window=3, kind="hca", lengths=[16, 1], q_lens=[2, 1], bf16=True, target="tpu")
def test_kernels_in_their_interpreters_equal_the_xla_path(seed, rate, window, kind, lengths, q_lens, bf16, target):
    """The Triton kernel (Pallas interpreter) and the TPU path (the TPU sparse kernel's slot attention, TPU
    interpret mode) on the ragged rows of the XLA path's test: the same outputs, f32 to ~1e-5, bf16 to ~1e-2."""
    args, _, _ = _ragged_case(np.random.default_rng(seed), rate, lengths, q_lens)
    q, window_pages, window_tables, entry_pages, entry_tables, kv_lens, cu, sel, sinks = args
    if bf16:
        q, window_pages, entry_pages = (x.astype(jnp.bfloat16) for x in (q, window_pages, entry_pages))
    entries = kind != "window"
    args = (q, window_pages, window_tables, entry_pages if entries else None, entry_tables if entries else None,
            kv_lens, cu, sel if kind == "csa" else None, sinks)
    options = dict(scale=0.5, sliding_window=window, compress_rate=rate if entries else None)
    got = compressed_attention(*args, **options, target=target, interpret=True)
    want = compressed_attention_xla(*args, **options)
    tol = 2e-2 if bf16 else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_argument_checks_name_what_is_wrong():
    args, _, _ = _ragged_case(np.random.default_rng(0), 2, [5], [2])
    q, window_pages, window_tables, entry_pages, entry_tables, kv_lens, cu, sel, sinks = args
    options = dict(scale=0.5, sliding_window=4, compress_rate=2, interpret=True)
    cases = [((q, window_pages, window_tables, entry_pages, None, kv_lens, cu, sel, sinks), "together"),
             ((q, window_pages, window_tables, None, None, kv_lens, cu, sel, sinks), "selected needs entry_pages"),
             ((q, window_pages[..., :2], window_tables, entry_pages, entry_tables, kv_lens, cu, sel, sinks),
              "window_pages must be"),
             ((q, window_pages, window_tables, entry_pages, entry_tables, kv_lens, cu, sel, sinks[:1]), "sinks"),
             ((q, window_pages, window_tables.astype(jnp.float32), entry_pages, entry_tables, kv_lens, cu, sel, sinks),
              "window_tables must be int32")]
    for call_args, match in cases:
        with pytest.raises(ValueError, match=match):
            compressed_attention(*call_args, **options)
    with pytest.raises(ValueError, match="num_warps tunes the GPU kernel"):
        compressed_attention(*args, **options, target="tpu", num_warps=4)


@pytest.mark.kernels
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_kernels_export_at_v4_flash_shapes(dtype, kind, platform):
    """64 query heads of 512, window 128, blocks of 256 tokens: CSA entries (rate 4, top 512), HCA (rate 128); to
    Triton for "cuda", to Mosaic for "tpu"."""
    f = jax.ShapeDtypeStruct
    tokens, seqs, rate = 37, 4, 4 if kind == "csa" else 128
    shapes = (f((tokens, 64, 512), dtype), f((64, 256, 512), dtype), f((seqs, 8), jnp.int32),
              f((64, 256 // rate, 512), dtype), f((seqs, 8), jnp.int32), f((seqs,), jnp.int32),
              f((seqs + 1,), jnp.int32), f((tokens, 512), jnp.int32), f((64,), jnp.float32))

    def call(*a):
        selected = a[7] if kind == "csa" else None
        return compressed_attention(*a[:7], selected, a[8], scale=512 ** -0.5, sliding_window=128,
                                    compress_rate=rate, interpret=False, target="gpu" if platform == "cuda" else "tpu")

    (_export_cuda if platform == "cuda" else export_tpu)(call, *shapes)


def test_compressor_argument_checks_name_what_is_wrong():
    kv, pages = jnp.zeros((5, 8)), jnp.zeros((6, 3, 3, 4))
    tables, kv_lens, cu = jnp.zeros((2, 3), jnp.int32), jnp.array([3, 2], jnp.int32), jnp.array([0, 3, 5], jnp.int32)
    options = dict(compress_rate=2, block_size=4, interpret=True)
    cases = [((kv, kv, pages, tables, kv_lens, cu), dict(compress_rate=3), "multiple of compress_rate"),
             ((kv, kv, pages, tables, kv_lens, cu), dict(compress_rate=0), "compress_rate"),
             ((kv, kv, pages.astype(jnp.bfloat16), tables, kv_lens, cu), {}, "state_pages must be float32"),
             ((kv, kv, pages[:, :2], tables, kv_lens, cu), {}, "P = 1 .HCA. or 3"),
             ((kv[:, :4], kv[:, :4], pages, tables, kv_lens, cu), {}, r"kv must be float \[tokens, 8\]"),
             ((kv, kv[:4], pages, tables, kv_lens, cu), {}, "gate has 4 rows"),
             ((kv, kv.astype(jnp.int32), pages, tables, kv_lens, cu), {}, "gate must be float"),
             ((kv, kv, pages, tables.astype(jnp.float32), kv_lens, cu), {}, "block_tables must be int32"),
             ((kv, kv, pages, tables, kv_lens[:1], cu), {}, "kv_lens"),
             ((kv, kv, pages, tables, kv_lens, cu), dict(target="tpu", num_warps=4), "num_warps tunes the GPU"),
             ((kv, kv, pages, tables, kv_lens, cu), dict(target="tpu", block_d=3), "block_d to divide D"),
             ((kv, kv, pages, tables, kv_lens, cu), dict(target="gpu", block_d=12), "block_d"),
             ((kv, kv, pages, tables, kv_lens, cu), dict(target="cpu"), "target must be one of")]
    for args, extra, match in cases:
        with pytest.raises(ValueError, match=match):
            compress(*args, **{**options, **extra})


@pytest.mark.kernels
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_compressor_exports_at_v4_flash_shapes(kind, platform):
    """Entries of 512 (CSA rate 4, bfloat16 projections; HCA rate 128) in state blocks of 256 tokens; to Triton for
    "cuda", to Mosaic for "tpu"."""
    f = jax.ShapeDtypeStruct
    parts, rate, dtype = (3, 4, jnp.bfloat16) if kind == "csa" else (1, 128, jnp.float32)
    tokens, seqs, width = 37, 4, 512 * (2 if parts == 3 else 1)
    shapes = (f((tokens, width), dtype), f((tokens, width), dtype), f((64, parts, 3, 512), jnp.float32),
              f((seqs, 8), jnp.int32), f((seqs,), jnp.int32), f((seqs + 1,), jnp.int32))

    def call(*a):
        return compress(*a, compress_rate=rate, block_size=256, interpret=False,
                        target="gpu" if platform == "cuda" else "tpu")

    (_export_cuda if platform == "cuda" else export_tpu)(call, *shapes)
