"""DeepSeek V4's compressed attention (`pallas_kernels.compressed`): the compressor, the indexer's scores over
compressed keys and the attention over a window plus compressed entries.

The references are transformers' definitions written out (`compress_reference`: a softmax over each window's slots;
`compressed_attention_reference`: one dense softmax over window keys, entries and the sink). The XLA paths run
paged: sequences in permuted blocks of NaN-poisoned pools, steps cut at random (prefill chunks ending anywhere,
across window and block boundaries, decode steps), idle sequences between them; lengths around the compress rate,
the window and the block size.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pallas_kernels.compressed import (
    compress_reference,
    compress_xla,
    compressed_attention_reference,
    compressed_attention_xla,
    compressed_index_scores_xla,
)
from tests.kernels.cases import examples


def _steps(rng, n: int) -> list[int]:
    """Random step sizes summing to n (1 .. 9 tokens each: decodes and chunks)."""
    out = []
    while sum(out) < n:
        out.append(int(min(rng.integers(1, 10), n - sum(out))))
    return out


@settings(max_examples=examples(5), deadline=None)
@given(seed=st.integers(0, 2 ** 16), rate=st.sampled_from([1, 2, 4]), blocks_per_state=st.integers(1, 3),
       overlap=st.booleans(), lengths=st.lists(st.integers(0, 30), min_size=1, max_size=3))
@example(seed=0, rate=4, blocks_per_state=1, overlap=True, lengths=[0, 1, 4, 8])
@example(seed=1, rate=2, blocks_per_state=2, overlap=False, lengths=[3, 16])
def test_compressor_across_steps_equals_one_softmax_per_window(seed, rate, blocks_per_state, overlap, lengths):
    """Sequences compressed step by step, their snapshots in permuted blocks of a NaN pool, give each closed window's
    entry at the row that closes it, as the whole sequence's softmax does, and no entry elsewhere."""
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
        num_tokens = len(rows) + 2  # padding rows past cu_q_lens[-1]
        kv, gate = np.zeros((num_tokens, width), np.float32), np.zeros((num_tokens, width), np.float32)
        for r, (s, p) in enumerate(rows):
            kv[r], gate[r] = data[s][0][p], data[s][1][p]
        cu = np.concatenate([[0], np.cumsum(takes)]).astype(np.int32)
        kv_lens = np.array([done[s] + takes[s] for s in range(len(lengths))], np.int32)
        entries, closes, pages = compress_xla(jnp.asarray(kv), jnp.asarray(gate), pages, jnp.asarray(tables),
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


def _paged(rng, rows_per_block: int, vectors: list[np.ndarray], num_blocks: int, max_blocks: int):
    """Each sequence's rows in permuted blocks of a NaN pool `[num_blocks, rows_per_block, D]`: (pages, tables)."""
    d = vectors[0].shape[-1]
    pages = np.full((num_blocks, rows_per_block, d), np.nan, np.float32)
    tables = rng.permutation(num_blocks)[:len(vectors) * max_blocks].reshape(len(vectors), max_blocks)
    for s, v in enumerate(vectors):
        for i, row in enumerate(v):
            pages[tables[s, i // rows_per_block], i % rows_per_block] = row
    return jnp.asarray(pages), jnp.asarray(tables.astype(np.int32))


@settings(max_examples=examples(5), deadline=None)
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
    rng = np.random.default_rng(seed)
    heads, d, block = 2, 4, 4 * rate
    keys = [rng.normal(size=(n, d)).astype(np.float32) for n in lengths]
    entries = [rng.normal(size=(n // rate, d)).astype(np.float32) for n in lengths]
    q = [rng.normal(size=(n, heads, d)).astype(np.float32) for n in lengths]
    sinks = jnp.asarray(rng.normal(size=heads).astype(np.float32))
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
    use_entries = kind != "window"
    got = np.asarray(compressed_attention_xla(
        jnp.asarray(qs), window_pages, window_tables, entry_pages if use_entries else None,
        entry_tables if use_entries else None, jnp.asarray(lengths, jnp.int32), jnp.asarray(cu),
        jnp.asarray(sel) if kind == "csa" else None, sinks, scale=0.5, sliding_window=window,
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
@given(seed=st.integers(0, 2 ** 16), rate=st.sampled_from([1, 2, 4]), n=st.integers(0, 20))
@example(seed=0, rate=4, n=3)
@example(seed=0, rate=1, n=13)  # found by the dev profile: more entries than the first harness's table held
def test_index_scores_over_closed_entries(seed, rate, n):
    """The indexer's score of entry w for the query at p is scale * sum_h w[h] relu(q[h] . k[w]) where w < (p + 1)
    / m, -inf elsewhere (float64 numpy), from paged keys in a NaN pool."""
    rng = np.random.default_rng(seed)
    hi, di, block = 3, 4, 2 * rate
    keys = rng.normal(size=(max(n // rate, 1), di)).astype(np.float32)
    pages, tables = _paged(rng, block // rate, [keys], 20, 12)
    q = rng.normal(size=(n + 1, hi, di)).astype(np.float32)
    w = rng.normal(size=(n + 1, hi)).astype(np.float32)
    got = np.asarray(compressed_index_scores_xla(jnp.asarray(q), jnp.asarray(w), pages, tables,
                                                 jnp.asarray([n], jnp.int32), jnp.asarray([0, n], jnp.int32),
                                                 scale=0.5, compress_rate=rate))
    for p in range(n):
        closed = (p + 1) // rate
        want = 0.5 * np.einsum("h,hl->l", w[p], np.maximum(q[p].astype(np.float64) @ keys[:closed].T, 0.0))
        np.testing.assert_allclose(got[p, :closed], want, rtol=1e-5, atol=1e-6)
        assert np.isneginf(got[p, closed:]).all()
    assert np.isneginf(got[n:]).all()  # the padding row sees nothing
