#!/usr/bin/env python
"""What batch-invariant mode costs (`LLMEngine(batch_invariant=True)`, `pagedjax.runner.invariant`): generation
throughput against the default mode at batch 1 and 16, on the bundled model.

    python scripts/bench_invariant.py
    python scripts/bench_invariant.py --max-model-len 256 --budgets 64 512

Every engine generates the same greedy batch (prompts of --prompt-len tokens, --max-tokens each), timed after a
warm-up run that compiles its programs; best of --repeats. In the mode every step runs on one program of the
engine's largest shape, so its cost follows the token budget (`max_num_batched_tokens`, the rows of every step)
and `max_model_len` (the block-table width its attention reads), not the batch: each budget is a row. "same" says
whether the greedy tokens equal the default mode's (they may differ only at a near tie: other rounding).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.model.loading.loader import load_pretrained


def timed(engine: LLMEngine, prompts, params, repeats: int) -> tuple[float, list[list[int]]]:
    """(the fastest run's generated tokens per second, the tokens)."""
    engine.generate(prompts, params, use_tqdm=False)  # compiles
    best, tokens = np.inf, []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
        tokens = [o.output_token_ids for o in outs]
    return sum(map(len, tokens)) / best, tokens


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 512], help="max_num_batched_tokens of the rows")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    cfg, params, _ = load_pretrained(None)
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def make(budget: int, invariant: bool) -> LLMEngine:
        return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=256),
                         scheduler_config=SchedulerConfig(max_num_seqs=max(args.batches), max_num_batched_tokens=budget,
                                                          max_model_len=args.max_model_len), params=params,
                         batch_invariant=invariant)

    print(f"bundled model, prompts of {args.prompt_len} tokens, {args.max_tokens} generated each, max_model_len "
          f"{args.max_model_len}; tokens/s (x the default mode at the same budget)")
    print(f"| {'batch':>5} | {'budget':>6} | {'default':>8} | {'batch-invariant':>15} | {'ratio':>6} | same |")
    print("|-------|--------|----------|-----------------|--------|------|")
    for batch in args.batches:
        prompts = [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(batch)]
        for budget in args.budgets:
            default, base_tokens = timed(make(budget, False), prompts, sampling, args.repeats)
            invariant, tokens = timed(make(budget, True), prompts, sampling, args.repeats)
            print(f"| {batch:>5} | {budget:>6} | {default:>8.0f} | {invariant:>15.0f} | {invariant / default:>5.2f}x "
                  f"| {'yes' if tokens == base_tokens else 'no':>4} |", flush=True)


if __name__ == "__main__":
    main()
