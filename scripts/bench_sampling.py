"""The sampler's cost on this machine: `pagedjax.device.sampling.sample` over a 32k vocabulary, per kind of row.

    python scripts/bench_sampling.py [--vocab 32000] [--batch 1 16]

Rows: greedy, temperature only (no sort: every filter off), and temperature with top-k / top-p / min-p (a
vocabulary sort per row). Timed in interleaved rounds after compiling, best round per row, in one run; the last
column is each row's time over the temperature-only row's.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.device.sampling import SamplingMetadata, sample

KINDS = {  # name -> (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature 1.0": (1.0, 0, 1.0, 0.0),
    "+ top_k 50": (1.0, 50, 1.0, 0.0),
    "+ top_p 0.9": (1.0, 0, 0.9, 0.0),
    "+ min_p 0.05": (1.0, 0, 1.0, 0.05),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    fn = jax.jit(sample)
    print(f"vocab {args.vocab}, {jax.default_backend()}, best of {args.rounds} interleaved rounds")
    print(f"{'batch':>5s} {'rows':18s} {'ms/step':>8s} {'x temp.':>8s}")
    for batch in args.batch:
        logits = jax.random.normal(jax.random.key(0), (batch, args.vocab), jnp.float32) * 3
        metas = {name: SamplingMetadata.from_lists([t] * batch, [k] * batch, [p] * batch, list(range(batch)),
                                                   [0] * batch, [m] * batch)
                 for name, (t, k, p, m) in KINDS.items()}
        for meta in metas.values():
            fn(logits, meta).block_until_ready()  # compile
        best = dict.fromkeys(metas, np.inf)
        for _ in range(args.rounds):
            for name, meta in metas.items():
                start = time.perf_counter()
                fn(logits, meta).block_until_ready()
                best[name] = min(best[name], time.perf_counter() - start)
        for name in metas:
            print(f"{batch:5d} {name:18s} {best[name] * 1e3:8.2f} {best[name] / best['temperature 1.0']:8.2f}")


if __name__ == "__main__":
    main()
