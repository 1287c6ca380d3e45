"""The paged XLA ragged attention path (the CPU engine's) by query tile: one prefill chunk of `--rows` query rows of
one sequence over `--context` keys, float32 and bfloat16, each `q_tile` against tiles of 16 rows in the same run.

    python scripts/bench_xla_tiles.py                       # the 156M shape's heads, 512 rows over 2,048 keys
    python scripts/bench_xla_tiles.py --rows 64 --context 256 --rounds 1   # seconds (the test's)

Every tile size computes the same rows here (one sequence whose rows a power of two divides: no unused tile), so the
ratios are the cost per row of the tile's dots and passes. Rounds interleave the tile sizes; medians of the rounds'
best of `--calls` calls. The last column is `dense.default_q_tile`'s choice for this step.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

logger = logging.getLogger("bench_xla_tiles")


def case(dtype: str, rows: int, context: int, *, q_heads: int, kv_heads: int, head_dim: int, block_size: int):
    """(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens): the last `rows` positions of one sequence of
    `context` tokens, its pages permuted through a pool."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    pages = -(-context // block_size)
    k = jnp.asarray(rng.standard_normal((kv_heads, pages + 4, block_size, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((kv_heads, pages + 4, block_size, head_dim)), dtype)
    q = jnp.asarray(rng.standard_normal((rows, q_heads, head_dim)), dtype)
    tables = jnp.asarray(rng.permutation(pages + 4)[:pages][None], jnp.int32)
    return q, k, v, tables, jnp.array([context], jnp.int32), jnp.array([0, rows], jnp.int32)


def seconds(args: tuple, q_tile: int, calls: int) -> float:
    """The best of `calls` timed calls of the path at `q_tile` (after one that compiles)."""
    import jax

    from pallas_kernels import ragged_paged_attention_xla

    q, k, v, tables, kv_lens, cu = args
    fn = jax.jit(lambda q, k, v: ragged_paged_attention_xla(q, k, v, tables, kv_lens, cu, q_tile=q_tile))
    fn(q, k, v).block_until_ready()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn(q, k, v).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--tiles", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from pallas_kernels.dense import default_q_tile

    tiles = sorted(set([16, *args.tiles]))
    rows = []
    for dtype in args.dtypes:
        inputs = case(dtype, args.rows, args.context, q_heads=args.q_heads, kv_heads=args.kv_heads,
                      head_dim=args.head_dim, block_size=args.block_size)
        times: dict[int, list[float]] = {t: [] for t in tiles}
        for _ in range(args.rounds):
            for t in tiles:
                times[t].append(seconds(inputs, t, args.calls))
        base = statistics.median(times[16])
        for t in tiles:
            ms = statistics.median(times[t]) * 1e3
            rows.append({"dtype": dtype, "q_tile": t, "ms": ms, "vs_16": base * 1e3 / ms})
    default = default_q_tile(args.rows, 1)
    logger.info("%d query rows of one sequence over %d keys (%d / %d heads, head_dim %d, blocks of %d); "
                "default q_tile %d\n", args.rows, args.context, args.q_heads, args.kv_heads, args.head_dim,
                args.block_size, default)
    logger.info("| dtype | q_tile | ms a call | speed vs 16 |\n|---|---:|---:|---:|")
    for r in rows:
        mark = " (default)" if r["q_tile"] == default else ""
        logger.info("| %s | %d%s | %.1f | %.2fx |", r["dtype"], r["q_tile"], mark, r["ms"], r["vs_16"])
    return rows


if __name__ == "__main__":
    main()
