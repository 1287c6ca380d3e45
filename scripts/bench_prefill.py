#!/usr/bin/env python
"""Time to first token of a long prompt, and decode rates, by model dtype and token budget (issue 64's prefill
rows, pagedjax alone): the 156M Llama shape at random weights, greedy.

Per row: the time to first token of one `--prompt`-token prompt (the prefill, chunked by the budget), then decode
rates at batch 1 (32 -> 64 tokens) and batch 16 (64 -> 64), and batch 8 of `--long-prompt`-token prompts -> 64
(tokens/s over the whole call, prefill included), each the best of `--repeats` after a warm-up that compiles.
Rows differ in `--dtypes` (the weights' and activations' dtype: on a CPU with AMX or avx512_bf16, XLA's bfloat16
dots run several times faster than float32 ones at many rows, and slower at one) and `--budgets`
(`max_num_batched_tokens`: the prefill's chunk). Ratios are to the first row, measured in the same run.

    python scripts/bench_prefill.py                         # float32 and bfloat16 at budget 512, a few minutes
    python scripts/bench_prefill.py --budgets 256 512 1024  # the chunk size
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.model.llama import init_model

SHAPES = {"156m": ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_q_heads=16, num_kv_heads=4,
                               head_dim=64, intermediate_size=2816, tie_word_embeddings=False),
          "tiny": ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                              intermediate_size=128)}  # the smoke test's


def measure(dtype: str, budget: int, args) -> tuple[float, float, float, float]:
    """(seconds to the first token of the long prompt, batch-1 tokens/s, batch-16 tokens/s, batch-8 long-context
    tokens/s)."""
    cfg = SHAPES[args.shape].replace(dtype=dtype)
    context = max(args.prompt, args.long_prompt, 64) + 64  # the long prompt (+ its first token), 64 + 64, ...
    blocks = -(-context // 16)
    long_blocks = 8 * -(-(args.long_prompt + 64) // 16)
    engine = LLMEngine(model_config=cfg, params=nnx.state(init_model(cfg, 0)),
                       cache_config=CacheConfig(block_size=16, num_blocks=max(blocks, 16 * 8, long_blocks) + 16),
                       scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget,
                                                        max_model_len=context))
    rng = np.random.default_rng(0)

    def seconds(batch: int, prompt: int, tokens: int) -> float:
        prompts = [rng.integers(3, cfg.vocab_size, prompt).tolist() for _ in range(batch)]
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
        return time.perf_counter() - start

    best = lambda *shape: min(seconds(*shape) for _ in range(args.repeats))
    long = (8, args.long_prompt, 64)
    for shape in ((1, args.prompt, 1), (1, 32, 64), (16, 64, 64), long):  # compile every program first
        seconds(*shape)
    return best(1, args.prompt, 1), 64 / best(1, 32, 64), 16 * 64 / best(16, 64, 64), 8 * 64 / best(*long)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512])
    ap.add_argument("--prompt", type=int, default=2048, help="the long prompt's tokens")
    ap.add_argument("--long-prompt", type=int, default=1024,
                    help="batch 8's prompts (then 64 new tokens each): the long-context column")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="156m")
    args = ap.parse_args(argv)
    print(f"{args.shape} Llama shape, random weights, greedy; best of {args.repeats} (jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind})")
    print(f"{'dtype':<9} {'budget':>6} {'TTFT ' + str(args.prompt) + ' s':>11} {'x':>6} {'b1 tok/s':>9} {'x':>6} "
          f"{'b16 tok/s':>9} {'x':>6} {'b8 long tok/s':>13} {'x':>6}")
    base = None
    for dtype in args.dtypes:
        for budget in args.budgets:
            ttft, b1, b16, b8 = measure(dtype, budget, args)
            base = base or (ttft, b1, b16, b8)
            print(f"{dtype:<9} {budget:>6} {ttft:>11.3f} {base[0] / ttft:>5.2f}x {b1:>9.1f} {b1 / base[1]:>5.2f}x "
                  f"{b16:>9.1f} {b16 / base[2]:>5.2f}x {b8:>13.1f} {b8 / base[3]:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
