"""Absorbed vs non-absorbed MLA decode on this machine: one MLA layer's decode step, from each head's query
(q_nope, q_rope) and the paged latent cache ([c_kv | k_rope] per token) to each head's attention output (before
o_proj), computed two ways on the CPU's XLA path, float32:

- absorbed (what pagedjax serves, `PagedLatentAttention`): q_latent[h] = W_UK[h] q_nope[h], attention in latent
  space over the pages as stored (`pallas_kernels.mla_paged_attention_xla`, the engine's CPU decode path), then
  W_UV[h] on each head's latent output;
- non-absorbed: gather the sequence's pages, expand every cached token's latent per head, K[t, h] = [W_UK[h] c_kv[t]
  | k_rope[t]] and V[t, h] = W_UV[h] c_kv[t], and run standard attention. This is
  `pallas_kernels.mla.mla_attention_dense_reference` (the kernels' oracle of the absorption algebra; its
  float32 einsums at HIGHEST precision are plain float32 on a CPU), vmapped over the batch, each sequence's query
  at position length - 1: timed as it is, not a copy.

Both must give the same output: the script asserts it (float32, max |difference| <= 1e-5 of the largest value)
before timing. Each step is jitted and compiled first; then --rounds interleaved rounds (the order alternating),
each timing enough calls of each form to last ~--min-seconds, medians of the per-call times.

    python scripts/bench_mla_absorb.py                 # the 150M model's and DeepSeek V3's shapes, batches 1 4 16,
                                                       # contexts 512 4096
    python scripts/bench_mla_absorb.py --quick         # tiny shapes, seconds (the smoke test)
    python scripts/bench_mla_absorb.py --prefill 512 2048 --shapes 150m   # prefill instead (below)

--prefill P ...: one sequence's prefill of P tokens instead (nothing cached before it), the issue's choice for
prefill: absorbed as above over the chunk (the engine's ragged path, `pallas_kernels.ragged_mla_paged_attention_xla`
with its default query tiles, every token's latent written to the pages first) against expanding the chunk's own
K / V per head and running causal attention over them, as FlashMLA and vLLM do for prefill (here the dense
reference, `mla_attention_dense_reference`, with the queries at positions 0..P-1: it materializes the P x P scores
per head, so rows past --max-expanded-mib, counting those, are skipped).

Shapes: "150m" is scripts/bench_mla.py's default MLA model (12 heads, kv_lora_rank 256, rope 32, nope 64, v 64);
"v3" is DeepSeek V3's layer (128 heads, kv_lora_rank 512, rope 64, nope 128, v 128). Rows whose non-absorbed
expansion (batch x context x heads x (nope + v) float32) would exceed --max-expanded-mib are skipped and listed.
The table also gives each form's FLOPs per step (counted from the shapes), which explain the ratio: the
non-absorbed step multiplies every cached latent by W_UK and W_UV, per head, at every step.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import mla_paged_attention_xla, ragged_mla_paged_attention_xla  # noqa: E402
from pallas_kernels.mla import mla_attention_dense_reference  # noqa: E402

logger = logging.getLogger("bench_mla_absorb")  # progress; the tables are printed

BLOCK = 16
TOL = 1e-5


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    rank: int  # kv_lora_rank R
    rope: int  # qk_rope_head_dim Dr
    nope: int  # qk_nope_head_dim Dn
    v: int  # v_head_dim Dv

    @property
    def scale(self) -> float:
        return (self.nope + self.rope) ** -0.5


SHAPES = {"150m": Shape("150m", 12, 256, 32, 64, 64), "v3": Shape("v3", 128, 512, 64, 128, 128),
          "tiny": Shape("tiny", 4, 32, 8, 16, 16)}


def flops(s: Shape, batch: int, context: int) -> tuple[float, float]:
    """(absorbed, non-absorbed) multiply-add FLOPs of one decode step, counted from the shapes."""
    bh, lw = batch * s.heads, batch * s.heads * context
    absorbed = 2 * bh * s.nope * s.rank + 2 * lw * (s.rank + s.rope) * 2 + 2 * bh * s.rank * s.v
    expanded = 2 * batch * context * s.rank * s.heads * (s.nope + s.v) + 2 * lw * (s.nope + s.rope) + 2 * lw * s.v
    return absorbed, expanded


def expanded_bytes(s: Shape, batch: int, context: int) -> int:
    return batch * context * s.heads * (s.nope + s.v) * 4


def inputs(s: Shape, batch: int, context: int, seed: int = 0) -> dict:
    """Random float32 inputs of one decode step: each sequence holds `context` tokens in permuted blocks."""
    rng = np.random.default_rng(seed)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    tables = rng.permutation(num_blocks)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    return dict(q_nope=f32(batch, s.heads, s.nope), q_rope=f32(batch, s.heads, s.rope),
                kv_pages=f32(num_blocks, BLOCK, s.rank + s.rope), tables=jnp.asarray(tables),
                lengths=jnp.full((batch,), context, jnp.int32), w_uk=f32(s.heads, s.rank, s.nope) / math.sqrt(s.rank),
                w_uv=f32(s.heads, s.rank, s.v) / math.sqrt(s.rank))


def steps(s: Shape):
    """(absorbed, non-absorbed) jitted decode steps: (q_nope, q_rope, kv_pages, tables, lengths, w_uk, w_uv) ->
    `[batch, heads, v]` float32."""

    @jax.jit
    def absorbed(q_nope, q_rope, kv_pages, tables, lengths, w_uk, w_uv):
        q_latent = jnp.einsum("bhd,hrd->bhr", q_nope, w_uk)
        o_latent = mla_paged_attention_xla(q_latent, q_rope, kv_pages, tables, lengths, scale=s.scale)
        return jnp.einsum("bhr,hrv->bhv", o_latent, w_uv)

    @jax.jit
    def non_absorbed(q_nope, q_rope, kv_pages, tables, lengths, w_uk, w_uv):
        batch = tables.shape[0]
        kv = kv_pages[tables].reshape(batch, -1, s.rank + s.rope)  # each sequence's pages, in order

        def one(qn, qr, c_kv, k_rope, length):  # one sequence, its query at position length - 1
            return mla_attention_dense_reference(qn[None], qr[None], c_kv, k_rope, w_uk, w_uv, scale=s.scale,
                                                 q_positions=(length - 1)[None])[0]

        return jax.vmap(one)(q_nope, q_rope, kv[..., :s.rank], kv[..., s.rank:], lengths)

    return absorbed, non_absorbed


def per_call_seconds(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def compare(absorbed, other, args: tuple, rounds: int, min_seconds: float,
            what: str) -> tuple[float, float, float, float]:
    """(absorbed ms, other ms, median of other / absorbed per round, max relative difference) of two jitted forms of
    one computation on `args`: both compiled and checked to agree within TOL first, then timed in `rounds`
    interleaved rounds (the order alternating), each timing about `min_seconds` of calls."""
    forms = (absorbed, other)
    outs = [np.asarray(fn(*args)) for fn in forms]  # compiles
    calls = [max(1, math.ceil(min_seconds / per_call_seconds(fn, args, 1))) for fn in forms]
    err = float(np.max(np.abs(outs[0] - outs[1])) / np.max(np.abs(outs[1])))
    if not err <= TOL:
        raise AssertionError(f"{what}: the two forms differ by {err:.2e} of the largest value (> {TOL})")
    times = ([], [])
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            times[i].append(per_call_seconds(forms[i], args, calls[i]))
    ratio = statistics.median(o / a for a, o in zip(*times, strict=True))
    return 1e3 * statistics.median(times[0]), 1e3 * statistics.median(times[1]), ratio, err


def measure(s: Shape, batch: int, context: int, rounds: int, min_seconds: float) -> dict:
    x = inputs(s, batch, context)
    args = (x["q_nope"], x["q_rope"], x["kv_pages"], x["tables"], x["lengths"], x["w_uk"], x["w_uv"])
    absorbed_ms, non_absorbed_ms, ratio, err = compare(*steps(s), args, rounds, min_seconds,
                                                       f"{s.name} batch {batch} context {context}")
    f_abs, f_exp = flops(s, batch, context)
    return dict(shape=s.name, batch=batch, context=context, absorbed_ms=absorbed_ms, non_absorbed_ms=non_absorbed_ms,
                ratio=ratio, absorbed_gflop=f_abs / 1e9, non_absorbed_gflop=f_exp / 1e9, rel_err=err)


def prefill_flops(s: Shape, length: int) -> tuple[float, float]:
    """(absorbed, expanded) multiply-add FLOPs of one P-token prefill as the two forms compute it (both score every
    query against every position of the sequence and mask the future)."""
    pairs = length * length * s.heads
    absorbed = (2 * length * s.heads * s.nope * s.rank + 2 * pairs * (2 * s.rank + s.rope)
                + 2 * length * s.heads * s.rank * s.v)
    expanded = 2 * length * s.rank * s.heads * (s.nope + s.v) + 2 * pairs * (s.nope + s.rope + s.v)
    return absorbed, expanded


def prefill_bytes(s: Shape, length: int) -> int:
    """The expanded form's largest buffers: K / V per head and the scores, float32."""
    return (length * s.heads * (s.nope + s.v) + length * length * s.heads) * 4


def prefill_steps(s: Shape):
    """(absorbed, expanded) jitted prefills: (q_nope `[P, H, Dn]`, q_rope, kv_pages, tables `[1, blocks]`, w_uk,
    w_uv) -> `[P, H, v]` float32, every query at its own position (causal)."""

    @jax.jit
    def absorbed(q_nope, q_rope, kv_pages, tables, w_uk, w_uv):
        length = q_nope.shape[0]
        q_latent = jnp.einsum("thd,hrd->thr", q_nope, w_uk)
        o_latent = ragged_mla_paged_attention_xla(q_latent, q_rope, kv_pages, tables, jnp.array([length], jnp.int32),
                                                  jnp.array([0, length], jnp.int32), scale=s.scale)
        return jnp.einsum("thr,hrv->thv", o_latent, w_uv)

    @jax.jit
    def expanded(q_nope, q_rope, kv_pages, tables, w_uk, w_uv):
        length = q_nope.shape[0]
        kv = kv_pages[tables[0]].reshape(-1, s.rank + s.rope)[:length]
        return mla_attention_dense_reference(q_nope, q_rope, kv[:, :s.rank], kv[:, s.rank:], w_uk, w_uv, scale=s.scale,
                                             q_positions=jnp.arange(length, dtype=jnp.int32))

    return absorbed, expanded


def measure_prefill(s: Shape, length: int, rounds: int, min_seconds: float) -> dict:
    x = inputs(s, 1, length)
    rng = np.random.default_rng(1)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    args = (f32(length, s.heads, s.nope), f32(length, s.heads, s.rope), x["kv_pages"], x["tables"], x["w_uk"],
            x["w_uv"])
    absorbed_ms, expanded_ms, ratio, err = compare(*prefill_steps(s), args, rounds, min_seconds,
                                                   f"{s.name} prefill {length}")
    f_abs, f_exp = prefill_flops(s, length)
    return dict(shape=s.name, length=length, absorbed_ms=absorbed_ms, expanded_ms=expanded_ms, ratio=ratio,
                absorbed_gflop=f_abs / 1e9, expanded_gflop=f_exp / 1e9, rel_err=err)


def _footer(args, skipped: list[str], loads: list[float]) -> None:
    print()
    if skipped:
        print(f"skipped (over --max-expanded-mib {args.max_expanded_mib:g}): " + ", ".join(skipped))
    print("load average (1 min) at the start and after each shape: " + ", ".join(f"{x:.1f}" for x in loads))


def prefill_table(args) -> list[dict]:
    rows, skipped, loads = [], [], [os.getloadavg()[0]]
    for name in args.shapes:
        s = SHAPES[name]
        for length in args.prefill:
            mib = prefill_bytes(s, length) / 2**20
            if mib > args.max_expanded_mib:
                skipped.append(f"{name} prefill {length} ({mib:,.0f} MiB expanded)")
                continue
            rows.append(measure_prefill(s, length, args.rounds, args.min_seconds))
            logger.info("%s prefill %d done", name, length)
        loads.append(os.getloadavg()[0])
    print(f"one MLA layer's prefill of one sequence, float32, XLA on {jax.default_backend()} ({os.cpu_count()} CPUs), "
          f"median of {args.rounds} interleaved round(s); absorbed and expanded outputs agree to <= {TOL:g} (asserted)")
    print()
    print("| shape | heads | R + Dr | prompt | absorbed ms | expanded ms | expanded / absorbed | absorbed GFLOP "
          "| expanded GFLOP | max rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = SHAPES[r["shape"]]
        print(f"| {r['shape']} | {s.heads} | {s.rank} + {s.rope} | {r['length']} | {r['absorbed_ms']:.2f} | "
              f"{r['expanded_ms']:.2f} | {r['ratio']:.2f}x | {r['absorbed_gflop']:.3g} | {r['expanded_gflop']:.3g} | "
              f"{r['rel_err']:.1e} |")
    _footer(args, skipped, loads)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["150m", "v3"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (medians)")
    p.add_argument("--min-seconds", type=float, default=0.2, help="each timing repeats calls for about this long")
    p.add_argument("--max-expanded-mib", type=float, default=1024,
                   help="skip rows whose non-absorbed K/V expansion is larger (memory)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, short contexts: seconds")
    p.add_argument("--prefill", type=int, nargs="+", metavar="P",
                   help="time one sequence's prefill of P tokens (absorbed against expanded) instead of decode")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.batches, args.contexts, args.rounds, args.min_seconds = ["tiny"], [1, 3], [16, 40], 1, 0.0
        args.prefill = None if args.prefill is None else [16, 40]
    if args.prefill:
        return prefill_table(args)
    rows, skipped, loads = [], [], [os.getloadavg()[0]]
    for name in args.shapes:
        s = SHAPES[name]
        for batch in args.batches:
            for context in args.contexts:
                mib = expanded_bytes(s, batch, context) / 2**20
                if mib > args.max_expanded_mib:
                    skipped.append(f"{name} {batch}x{context} ({mib:,.0f} MiB expanded)")
                    continue
                rows.append(measure(s, batch, context, args.rounds, args.min_seconds))
                logger.info("%s batch %d context %d done", name, batch, context)
        loads.append(os.getloadavg()[0])
    print(f"one MLA layer's decode step, float32, XLA on {jax.default_backend()} ({os.cpu_count()} CPUs), median of "
          f"{args.rounds} interleaved round(s); absorbed and non-absorbed outputs agree to <= {TOL:g} (asserted)")
    print()
    print("| shape | heads | R + Dr | batch | context | absorbed ms | non-absorbed ms | non-abs / abs | absorbed GFLOP "
          "| non-absorbed GFLOP | max rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = SHAPES[r["shape"]]
        print(f"| {r['shape']} | {s.heads} | {s.rank} + {s.rope} | {r['batch']} | {r['context']} | "
              f"{r['absorbed_ms']:.3f} | {r['non_absorbed_ms']:.3f} | {r['ratio']:.1f}x | {r['absorbed_gflop']:.3g} | "
              f"{r['non_absorbed_gflop']:.3g} | {r['rel_err']:.1e} |")
    _footer(args, skipped, loads)
    return rows


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    main()
