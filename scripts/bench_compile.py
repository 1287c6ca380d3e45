"""Compile seconds of an engine's step programs with and without the random draw (`StepShape.draws`): a greedy step's
program leaves out the vocabulary sort, the top-k / top-p cut and the per-row keys.

    python scripts/bench_compile.py                  # the bundled model, 3 rounds
    python scripts/bench_compile.py --rounds 5 --model DIR

Each round builds a fresh engine (the persistent compilation cache off and JAX's in-memory caches cleared, so every
program is compiled) per variant, greedy and drawing interleaved, and times `ModelRunner.warmup` of the same three
shapes: a prefill step, a decode-only step and an 8-step fused decode; then a second drawing engine of the same
model, caches not cleared: engines of one structure share their programs in a process (`runner._jitted`). The table
gives the median seconds per variant and their ratio (one run: this machine's speed swings, so only the ratio
within a run means much).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time


def shapes(draws: bool) -> list:
    """A prefill step of 64 tokens, a decode-only step of 4 sequences and an 8-step fused decode of 4, tables of 4
    blocks, no optional part."""
    from pagedjax.runner.shapes import LoopShape, StepShape

    prefill = StepShape("step", 64, (1, 4), False, False, None, None, False, None, 0, draws=draws)
    decode = StepShape("step", 4, (4, 4), True, False, None, None, False, None, 0, draws=draws)
    loop = LoopShape("decode_loop", (4, 4), 4, 8, 8, False, None, draws=draws)
    return [prefill, decode, loop]


def compile_seconds(model: str | None, draws: bool, fresh: bool = True) -> float:
    """Seconds for a new engine (persistent compilation cache off; `fresh`: JAX's in-memory caches cleared first) to
    compile and run once `shapes(draws)`."""
    import jax

    from pagedjax import LLMEngine

    if fresh:
        jax.clear_caches()
    engine = LLMEngine.from_pretrained(model, compile_cache=False)
    start = time.perf_counter()
    engine.runner.warmup(shapes(draws))
    seconds = time.perf_counter() - start
    engine.close()
    return seconds


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a pagedjax checkpoint or Hugging Face folder (default: bundled)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {"greedy": [], "drawing": [], "again": []}
    for _ in range(args.rounds):
        times["greedy"].append(compile_seconds(args.model, False))
        times["drawing"].append(compile_seconds(args.model, True))
        times["again"].append(compile_seconds(args.model, True, fresh=False))
    median = {key: statistics.median(values) for key, values in times.items()}
    rows = [{"programs": "greedy (draws off)", "seconds": median["greedy"]},
            {"programs": "drawing (draws on)", "seconds": median["drawing"]},
            {"programs": "drawing, 2nd engine", "seconds": median["again"]}]
    print(f"{'programs':<20} {'compile s (median)':>18} {'vs drawing':>11}")
    for row in rows:
        row["vs drawing"] = row["seconds"] / median["drawing"]
        print(f"{row['programs']:<20} {row['seconds']:>18.2f} {row['vs drawing']:>10.2f}x")
    return rows


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
