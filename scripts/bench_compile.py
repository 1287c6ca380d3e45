"""Compile seconds of an engine's step programs with and without the random draw (`StepShape.draws`): a greedy step's
program leaves out the vocabulary sort, the top-k / top-p cut and the per-row keys.

    python scripts/bench_compile.py                  # the bundled model, 3 rounds
    python scripts/bench_compile.py --rounds 5 --model DIR

Each round builds a fresh engine (the persistent compilation cache off, so every program is compiled) per variant,
greedy and drawing interleaved, and times `ModelRunner.warmup` of the same three shapes: a prefill step, a
decode-only step and an 8-step fused decode. The table gives the median seconds per variant and their ratio (one
run: this machine's speed swings, so only the ratio within a run means much).
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


def compile_seconds(model: str | None, draws: bool) -> float:
    """Seconds for a fresh engine (persistent compilation cache off) to compile and run once `shapes(draws)`."""
    from pagedjax import LLMEngine

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
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for draws in (False, True):
            times[draws].append(compile_seconds(args.model, draws))
    greedy, drawing = statistics.median(times[False]), statistics.median(times[True])
    rows = [{"programs": "greedy (draws off)", "seconds": greedy, "vs drawing": greedy / drawing},
            {"programs": "drawing (draws on)", "seconds": drawing, "vs drawing": 1.0}]
    print(f"{'programs':<20} {'compile s (median)':>18} {'vs drawing':>11}")
    for row in rows:
        print(f"{row['programs']:<20} {row['seconds']:>18.2f} {row['vs drawing']:>10.2f}x")
    return rows


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
