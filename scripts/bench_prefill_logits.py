"""What leaving the LM head out of steps that emit no token saves: a long prompt's first chunk and a step of
embeddings, each timed as its own program with sampling on (what every step computed before) and off
(`StepShape.sample`), interleaved in one run on the same engine.

    python scripts/bench_prefill_logits.py [--model PATH] [--chunk 512] [--seqs 1 8] [--repeats 20]

The bundled model by default (vocabulary 4,096); a Hugging Face folder with a large vocabulary (Qwen3's 151,936)
shows more. Each row: the step's tokens and sequences, the median ms of its device call with sampling on and off, and
on / off. The steps are built by the engine itself (`LLMEngine.step_inputs` of a scheduled plan); only their
`samples` flag differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax import LLMEngine, PoolingParams, SamplingParams, SchedulerConfig  # noqa: E402


def step_of(engine: LLMEngine, kind: str, num_seqs: int, chunk: int, rng):
    """The inputs of a step that emits no token, as the engine builds them: a long prompt's first chunk ("prefill":
    one prompt of 2 x `chunk` tokens) or `num_seqs` embeddings of `chunk / num_seqs` tokens each ("embed"); the
    scheduler's state is rolled back after (the plan cancelled, the requests aborted)."""
    vocab = engine.model_spec.vocab_size
    ids = [f"b{i}" for i in range(1 if kind == "prefill" else num_seqs)]
    for rid in ids:
        if kind == "prefill":
            engine.add_request(rid, rng.integers(0, vocab, 2 * chunk).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=1))
        else:
            engine.add_request(rid, rng.integers(0, vocab, chunk // num_seqs).tolist(), pooling=PoolingParams())
    plan = engine.scheduler.schedule()
    inputs = engine.step_inputs(plan)
    engine.scheduler.cancel(plan)
    for rid in ids:
        engine.abort(rid)
    return inputs


def time_step(engine: LLMEngine, inputs, repeats: int) -> float:
    engine.runner.execute(inputs)  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.runner.execute(inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: the bundled model)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per step (the token budget)")
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 8], help="embeddings per step")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    engine = LLMEngine.from_pretrained(args.model, scheduler_config=SchedulerConfig(
        max_num_batched_tokens=args.chunk, max_num_seqs=max(args.seqs), max_model_len=4 * args.chunk))
    spec = engine.model_spec
    print(f"\nsteps that emit no token, sampling on vs off ({args.model or 'the bundled model'}: vocabulary "
          f"{spec.vocab_size:,}, hidden {spec.hidden_size}; median of {args.repeats})")
    print(f"{'step':<8} | {'tokens':>6} | {'seqs':>4} | {'on ms':>8} | {'off ms':>8} | {'on / off':>8}")
    rng = np.random.default_rng(0)
    for kind, n in [("prefill", 1)] + [("embed", n) for n in args.seqs]:
        off = step_of(engine, kind, n, args.chunk, rng)
        assert not off.samples, "a step that emits no token"
        on = dataclasses.replace(off, samples=True)
        rows = []
        for _ in range(2):  # interleaved: on, off, on, off
            rows.append((time_step(engine, on, args.repeats), time_step(engine, off, args.repeats)))
        t_on, t_off = min(r[0] for r in rows), min(r[1] for r in rows)
        print(f"{kind:<8} | {len(off.token_ids):>6} | {n:>4} | {1e3 * t_on:>8.2f} | {1e3 * t_off:>8.2f} | "
              f"{t_on / t_off:>7.2f}x")


if __name__ == "__main__":
    main()
