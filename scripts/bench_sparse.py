"""DeepSeek sparse attention's cost curve on this machine: one DSA layer's attention (the engine's CPU path, the
XLA gathers of `pallas_kernels`) split into the lightning indexer's scoring, the top-k selection and the sparse
MLA over the selected positions, against dense MLA over the whole context (what the layer is with index_topk >=
context), per decode token and over a whole prompt, at growing contexts. A table, and a log-log plot.

What the definition predicts, and what the table shows: per decode token the indexer is O(n) (it scores every
earlier key) while sparse attention is O(k), flat in n; over a prompt of n tokens the indexer is O(n^2) (every
query scores every earlier key), sparse attention O(n k) and dense attention O(n^2) with a larger constant (a
latent of kv_lora_rank + rope_dim per key and head against the indexer's index_head_dim for a few heads).

    python scripts/bench_sparse.py                       # contexts 1k..16k decode, 1k..8k prefill, plot in out/
    python scripts/bench_sparse.py --quick               # seconds: the smoke test
    python scripts/bench_sparse.py --indexer-8bit        # 8-bit indexer keys: top-k overlap with float keys

Shapes (scaled down from V3.2 so that 8k-token prefills fit this CPU): 8 heads, kv_lora_rank 128 + rope 32,
an indexer of 8 heads of 64, index_topk 256; float32, blocks of 64 tokens, one sequence.

`--indexer-8bit`: how much of the top-k selection 8-bit indexer keys keep. On random inputs of DeepSeek V3.2's
indexer shape (64 heads of 128, head weights w ~ N(0, 1) / sqrt(64), queries and keys ~ N(0, 1) per dimension,
as the keys' LayerNorm makes them; `--outlier-channels` scales a few key dimensions by 10, the case rotations
are for), per decode query: the float32 scores' top k against the top k of the same scores over 8-bit keys,
overlap = |topk(8-bit) & topk(float)| / k (mean and minimum over `--rows` queries, each over its own keys).
Every score goes through `pallas_kernels.indexer_scores_xla` (the engine's CPU path) and `top_k_positions`.
Schemes:
- int8 / fp8 keys: what pagedjax stores with `CacheConfig(kv_dtype="int8" / "fp8")`: each key quantized with one
  float32 scale (absmax / 127 or / 448, `quantize_kv`), queries float;
- fp8 q + k, rotated: what DeepSeek's reference inference code (DeepSeek-V3.2-Exp, inference/model.py,
  `Indexer.forward`) does: queries and keys multiplied by a Hadamard matrix / sqrt(128) (orthogonal: exact scores
  unchanged), then both cast to float8_e4m3 with one scale per 128 values (each key; each query head), and scored
  in fp8 (`fp8_index`); here the products are of the dequantized values, which is the same up to rounding of the
  accumulation.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pallas_kernels as pk  # noqa: E402

HEADS, RANK, ROPE, INDEX_HEADS, INDEX_DIM, TOPK, BLOCK = 8, 128, 32, 8, 64, 256, 64


def best_time(fn, *args, repeats: int) -> float:
    """Best wall time of `fn(*args)` (jitted, compiled first) over `repeats` runs, results awaited."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def layer_inputs(context: int, rows: int, topk: int, seed: int = 0):
    """One sequence of `context` cached tokens in permuted blocks, its last `rows` tokens as queries."""
    rng = np.random.default_rng(seed)
    blocks = -(-context // BLOCK)
    table = rng.permutation(blocks + 1)[:blocks].astype(np.int32)[None]
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    return dict(kv_pages=f32(blocks + 1, BLOCK, RANK + ROPE) / 4, index_pages=f32(blocks + 1, BLOCK, INDEX_DIM) / 4,
                tables=jnp.asarray(table), kv_lens=jnp.asarray([context], jnp.int32),
                cu=jnp.asarray([0, rows], jnp.int32), q_latent=f32(rows, HEADS, RANK), q_rope=f32(rows, HEADS, ROPE),
                q_index=f32(rows, INDEX_HEADS, INDEX_DIM), weights=f32(rows, INDEX_HEADS) / INDEX_HEADS ** 0.5,
                topk=topk)


def stage_times(x: dict, decode: bool, repeats: int) -> dict[str, float]:
    """Seconds of each stage (indexer, top-k, sparse MLA) and of dense MLA over the same queries."""
    scale, index_scale = (RANK + ROPE) ** -0.5, INDEX_DIM ** -0.5
    if decode:
        score = jax.jit(lambda q, w: pk.indexer_scores_xla(q, w, x["index_pages"], x["tables"], x["kv_lens"],
                                                           scale=index_scale))
        sparse = jax.jit(lambda ql, qr, idx: pk.sparse_mla_paged_attention_xla(
            ql, qr, x["kv_pages"], x["tables"], x["kv_lens"], idx, scale=scale))
        dense = jax.jit(lambda ql, qr: pk.mla_paged_attention_xla(ql, qr, x["kv_pages"], x["tables"], x["kv_lens"],
                                                                  scale=scale))
    else:
        score = jax.jit(lambda q, w: pk.ragged_indexer_scores_xla(q, w, x["index_pages"], x["tables"], x["kv_lens"],
                                                                  x["cu"], scale=index_scale))
        sparse = jax.jit(lambda ql, qr, idx: pk.ragged_sparse_mla_paged_attention_xla(
            ql, qr, x["kv_pages"], x["tables"], x["kv_lens"], x["cu"], idx, scale=scale))
        dense = jax.jit(lambda ql, qr: pk.ragged_mla_paged_attention_xla(
            ql, qr, x["kv_pages"], x["tables"], x["kv_lens"], x["cu"], scale=scale))
    top_k = jax.jit(lambda s: pk.top_k_positions(s, x["topk"]))
    # The engine's selection: the same positions, and whether each row's cut-off fell between equal scores.
    top_k_ties = jax.jit(lambda s: pk.top_k_positions_and_ties(s, x["topk"]))
    scores = score(x["q_index"], x["weights"])
    indices = top_k(scores)
    return {"indexer": best_time(score, x["q_index"], x["weights"], repeats=repeats),
            "top_k": best_time(top_k, scores, repeats=repeats),
            "top_k_ties": best_time(top_k_ties, scores, repeats=repeats),
            "sparse": best_time(sparse, x["q_latent"], x["q_rope"], indices, repeats=repeats),
            "dense": best_time(dense, x["q_latent"], x["q_rope"], repeats=repeats)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, mode in zip(axes, ("decode", "prefill"), strict=True):
        sel = [r for r in rows if r["mode"] == mode]
        n = [r["context"] for r in sel]
        for key, style in (("indexer", "o-"), ("top_k", "s-"), ("sparse", "^-"), ("sparse_total", "D-"),
                           ("dense", "x--")):
            ax.loglog(n, [r[key] * 1e3 for r in sel], style, label=key.replace("_", " "))
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per token" if mode == "decode" else "ms per prompt")
        ax.set_title(f"{mode}: DSA stages vs dense MLA (top-k {TOPK})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hadamard(n: int) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix / sqrt(n) (orthogonal); n a power of two."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def indexer_overlap(context: int, topk: int, rows: int, outlier_channels: int, seed: int = 0) -> dict[str, tuple]:
    """Scheme -> (mean, min) top-k overlap with the float keys' selection, over `rows` decode queries."""
    heads, dim, block = 64, 128, 64
    rng = np.random.default_rng([seed, context, topk, outlier_channels])
    blocks = -(-context // block)
    keys = rng.standard_normal((rows * blocks, block, dim), dtype=np.float32)
    keys[..., :outlier_channels] *= 10.0
    q = rng.standard_normal((rows, heads, dim), dtype=np.float32)
    w = jnp.asarray(rng.standard_normal((rows, heads), dtype=np.float32) / heads ** 0.5)
    tables = jnp.asarray(np.arange(rows * blocks, dtype=np.int32).reshape(rows, blocks))
    lengths = jnp.full((rows,), context, jnp.int32)
    rot = hadamard(dim)

    def select(q, pages, scales=None):
        scores = pk.indexer_scores_xla(jnp.asarray(q), w, pages, tables, lengths, scale=dim ** -0.5,
                                       index_scales=scales)
        return np.asarray(pk.top_k_positions(scores, topk))

    def fp8_roundtrip(x):
        values, scales = pk.quantize_kv(jnp.asarray(x), jnp.float8_e4m3fn)
        return pk.dequantize_kv(values, scales)

    exact = select(q, jnp.asarray(keys))
    picked = {"int8 keys": select(q, *pk.quantize_kv(jnp.asarray(keys), jnp.int8)),
              "fp8 keys": select(q, *pk.quantize_kv(jnp.asarray(keys), jnp.float8_e4m3fn)),
              "fp8 q + k, rotated": select(fp8_roundtrip(q @ rot), fp8_roundtrip(keys @ rot))}
    out = {}
    for name, sel in picked.items():
        overlap = [len(np.intersect1d(a, b)) / topk for a, b in zip(sel, exact, strict=True)]
        out[name] = (float(np.mean(overlap)), float(np.min(overlap)))
    return out


def indexer_8bit(pairs: list[tuple[int, int]], rows: int, outlier_channels: list[int]) -> list[dict]:
    results = []
    for outliers in outlier_channels:
        for topk, context in pairs:
            results.append({"topk": topk, "context": context, "outlier_channels": outliers,
                            **indexer_overlap(context, topk, rows, outliers)})
    schemes = [k for k in results[0] if k not in ("topk", "context", "outlier_channels")]
    print(f"8-bit indexer keys: top-k overlap with float32 keys, |topk(8-bit) & topk(float)| / k, mean (min) over "
          f"{rows} decode queries; 64 heads of 128, random N(0, 1) queries and keys")
    print()
    print("| top-k | context | outlier key dims (x10) | " + " | ".join(schemes) + " |")
    print("|---:|---:|---:|" + "---:|" * len(schemes))
    for r in results:
        print(f"| {r['topk']:,} | {r['context']:,} | {r['outlier_channels']} | "
              + " | ".join(f"{r[k][0]:.4f} ({r[k][1]:.4f})" for k in schemes) + " |")
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--prefill-contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--topk", type=int, default=TOPK)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plot", type=Path, default=Path("out/bench_sparse.png"))
    p.add_argument("--quick", action="store_true", help="small contexts, one repeat")
    p.add_argument("--indexer-8bit", action="store_true",
                   help="instead: the top-k overlap of 8-bit indexer keys with float keys (a table, no timing)")
    p.add_argument("--pairs", nargs="+", default=["2048:4096", "2048:8192", "2048:16384", "256:2048"],
                   metavar="TOPK:CONTEXT", help="--indexer-8bit: the (top-k, context) pairs")
    p.add_argument("--rows", type=int, default=16, help="--indexer-8bit: decode queries per pair")
    p.add_argument("--outlier-channels", type=int, nargs="+", default=[0, 4],
                   help="--indexer-8bit: key dimensions scaled by 10, one table block per value")
    args = p.parse_args(argv)
    if args.indexer_8bit:
        pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs]
        if args.quick:
            pairs, args.rows, args.outlier_channels = [(16, 64), (32, 256)], 2, [0, 4]
        return indexer_8bit(pairs, args.rows, args.outlier_channels)
    if args.quick:
        args.decode_contexts, args.prefill_contexts, args.topk, args.repeats = [64, 128], [64, 128], 16, 1
    rows = []
    for mode, contexts in (("decode", args.decode_contexts), ("prefill", args.prefill_contexts)):
        for n in contexts:
            x = layer_inputs(n, 1 if mode == "decode" else n, args.topk)
            t = stage_times(x, mode == "decode", args.repeats)
            rows.append({"mode": mode, "context": n, **t, "sparse_total": t["indexer"] + t["top_k_ties"] + t["sparse"]})
    print(f"one DSA layer, XLA paths on {jax.default_backend()}: {HEADS} heads, latent {RANK} + rope {ROPE}, indexer "
          f"{INDEX_HEADS} x {INDEX_DIM}, top-k {args.topk}, best of {args.repeats}")
    header = f"{'mode':<8}{'context':>8}{'indexer':>11}{'top-k':>10}{'+ ties':>10}{'sparse':>10}{'DSA total':>11}" \
             f"{'dense MLA':>11}{'dense/DSA':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        ms = {key: f"{r[key] * 1e3:.2f}ms" for key in ("indexer", "top_k", "top_k_ties", "sparse", "sparse_total",
                                                        "dense")}
        print(f"{r['mode']:<8}{r['context']:>8}{ms['indexer']:>11}{ms['top_k']:>10}{ms['top_k_ties']:>10}"
              f"{ms['sparse']:>10}{ms['sparse_total']:>11}{ms['dense']:>11}{r['dense'] / r['sparse_total']:>10.2f}x")
    print("+ ties: the engine's selection (top_k_positions_and_ties: the positions and whether each row's cut-off "
          "fell between equal scores)")
    for mode in ("decode", "prefill"):
        sel = [r for r in rows if r["mode"] == mode]
        if len(sel) >= 2:
            a, b = sel[0], sel[-1]
            growth = {key: np.log(b[key] / a[key]) / np.log(b["context"] / a["context"])
                      for key in ("indexer", "top_k", "sparse", "dense")}
            print(f"{mode}: time ~ n^k, k = indexer {growth['indexer']:.2f}, top-k {growth['top_k']:.2f}, sparse "
                  f"{growth['sparse']:.2f}, dense {growth['dense']:.2f} (from {a['context']} to {b['context']})")
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    return rows


if __name__ == "__main__":
    main()
