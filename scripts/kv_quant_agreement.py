"""How often greedy decoding with an 8-bit KV cache (int8, fp8) picks the tokens of the unquantized cache.

The bundled model (or --model), the same prompts and greedy settings on three engines that differ only in
`CacheConfig(kv_dtype=...)`. Per 8-bit format:

  identical      completions equal to the unquantized cache's, token for token
  prefix         generated tokens before a completion's first difference, over all generated tokens (after a
                 difference the two continue from different text, so later positions are not comparable)
  forced         teacher-forced next-token agreement: the 8-bit engine reads prompt + the unquantized
                 completion and its top-1 prediction at each generated position is compared with that token
  max |dlogp|    the largest difference in the log-probability it gives those tokens

    python scripts/kv_quant_agreement.py                   # 24 prompts x 64 tokens, XLA attention
    python scripts/kv_quant_agreement.py --quick           # 4 prompts x 16 tokens (the smoke test)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.cli.prompts import DEMO_PREFIX, DEMO_SUFFIXES  # noqa: E402

# Code prompts like the bundled model's training text: the demo's module header with each continuation, and
# short openings of common kinds of Python code.
OPENINGS = [
    "def fib(n):\n", "import os\n", "class Stack:\n", "def binary_search(items, target):\n",
    "import json\n\n\ndef load(path):\n", "for i in range(10):\n", "def main():\n", "class Node:\n    def __init__(",
    "with open(path) as f:\n", "def merge_sort(xs):\n", "import numpy as np\n\n", "try:\n",
    "def __repr__(self):\n", "@property\ndef name(self):\n", "def test_parse():\n", "if __name__ == \"__main__\":\n",
    "def read_lines(path):\n", "class Config(dict):\n", "from collections import defaultdict\n\n",
]
PROMPTS = [DEMO_PREFIX + s for s in DEMO_SUFFIXES] + OPENINGS


def engine(model, kv_dtype: str, backend: str, max_model_len: int) -> LLMEngine:
    return LLMEngine.from_pretrained(model, cache_config=CacheConfig(block_size=16, num_blocks=512,
                                                                     kv_dtype=kv_dtype),
                                     scheduler_config=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024,
                                                                      max_model_len=max_model_len),
                                     backend=backend)


def measure(args) -> list[dict]:
    prompts = PROMPTS[: args.num_prompts]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    base = engine(args.model, "auto", args.backend, 1024)
    ref = base.generate(prompts, greedy, use_tqdm=False)
    rows = []
    for kv_dtype in ("int8", "fp8"):
        quant = engine(args.model, kv_dtype, args.backend, 1024)
        outs = quant.generate(prompts, greedy, use_tqdm=False)
        identical = prefix = 0
        for r, o in zip(ref, outs, strict=True):
            identical += r.output_token_ids == o.output_token_ids
            prefix += next((i for i, (a, b) in enumerate(zip(r.output_token_ids, o.output_token_ids, strict=True))
                            if a != b), len(r.output_token_ids))
        # Teacher forcing: one prefill of prompt + reference completion, prompt log-probabilities at each position.
        forced = [list(r.prompt_token_ids) + list(r.output_token_ids) for r in ref]
        scored = quant.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                                use_tqdm=False)
        base_scored = base.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                                    use_tqdm=False)
        agree = base_agree = total = 0
        max_dlogp = 0.0
        for r, q, b in zip(ref, scored, base_scored, strict=True):
            n_prompt = len(r.prompt_token_ids)
            for pos in range(n_prompt, n_prompt + len(r.output_token_ids)):  # positions of generated tokens
                lp_q, lp_b = q.prompt_logprobs[pos], b.prompt_logprobs[pos]
                agree += lp_q.top[0][0] == lp_q.token_id
                base_agree += lp_b.top[0][0] == lp_b.token_id  # the metric's own floor: 100% up to exact ties
                total += 1
                max_dlogp = max(max_dlogp, abs(lp_q.logprob - lp_b.logprob))
        n_tokens = sum(len(r.output_token_ids) for r in ref)
        rows.append(dict(kv_dtype=kv_dtype, identical=identical, prompts=len(prompts), prefix=prefix / n_tokens,
                         forced=agree / total, base_forced=base_agree / total, max_dlogp=max_dlogp,
                         bytes_per_token=quant.stats().kv_bytes_per_token,
                         base_bytes_per_token=base.stats().kv_bytes_per_token))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint folder (default: the bundled model)")
    p.add_argument("--backend", default="xla", choices=["auto", "pallas", "xla"])
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="4 prompts x 16 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens = 4, 16
    rows = measure(args)
    print(f"{args.num_prompts} prompts x {args.max_tokens} greedy tokens, {args.backend} attention; "
          f"unquantized cache: {rows[0]['base_bytes_per_token']} KV bytes per token")
    print(f"{'kv_dtype':<9} {'bytes/token':>11} {'identical':>10} {'prefix':>8} {'forced':>8} {'max |dlogp|':>12}")
    for r in rows:
        print(f"{r['kv_dtype']:<9} {r['bytes_per_token']:>11} {r['identical']:>5}/{r['prompts']:<4} "
              f"{100 * r['prefix']:>7.1f}% {100 * r['forced']:>7.2f}% {r['max_dlogp']:>12.4f}")
    print(f"(the unquantized cache teacher-forced on its own completions: {100 * rows[0]['base_forced']:.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
