"""The bundled model's trained MTP head (`SpeculativeConfig(method="mtp")`, `scripts/train_mtp.py`) against plain
decoding and n-gram speculation, on held-out text.

    python scripts/bench_mtp.py                  # batch 1, 4, 16 at temperature 0 and 0.8
    python scripts/bench_mtp.py --quick          # seconds: checks the script

Prompts: windows of `--prompt-len` tokens from the held-out split of the text the model and its head were trained on
(the Python standard library's sources, `scripts/train_tiny.py`'s split), one per request, the same in every row.
Rows: plain decoding with 1 and with N decode steps per device call (the CLI's default N = 8), prompt-lookup n-gram
speculation and the MTP head, each with k proposals per step. Each engine is warmed up by one run, then the rows are
timed in interleaved rounds; a row's time is its best round. Every row's tokens must equal the first row's (greedy,
and seeded samples at temperature > 0: speculation is exact). Columns: generated tokens/s, its ratio to plain
decoding with N steps per call, the share of proposals accepted, tokens per verifying step of a sequence (1 +
accepted), and the proposer's share of the run's time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import load_corpus, model_dir_corpus_tokenizer  # noqa: E402

from pagedjax import LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.config import (
    ModelConfig,  # noqa: E402
    SpeculativeConfig,  # noqa: E402
)
from pagedjax.model.loading.checkpoint import bundled_model_path, read_checkpoint_metadata  # noqa: E402


def heldout_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    path = bundled_model_path()
    cfg = ModelConfig.from_dict(read_checkpoint_metadata(path)["model_config"])
    tokens = load_corpus(tokenizer=model_dir_corpus_tokenizer(path, cfg)).heldout
    starts = np.random.default_rng(seed).integers(0, len(tokens) - length, num)
    return [tokens[s:s + length].astype(np.int64).tolist() for s in starts]


def engines(args) -> dict[str, LLMEngine]:
    sched = SchedulerConfig(max_num_seqs=max(args.batch), max_num_batched_tokens=512, max_model_len=512)
    make = lambda fused, spec=None: LLMEngine.from_pretrained(None, scheduler_config=sched, decode_steps_per_call=fused,
                                                              speculative_config=spec)
    rows = {"plain, 1 step/call": make(1), f"plain, {args.fused} steps/call": make(args.fused)}
    for k in args.k:
        rows[f"n-gram k={k}"] = make(args.fused, SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=2))
    for k in args.k:
        rows[f"MTP k={k}"] = make(args.fused, SpeculativeConfig(method="mtp", num_speculative_tokens=k))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--fused", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="batch 1, greedy, k 3, 16 tokens, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.temperature, args.k, args.max_tokens, args.repeats = [1], [0.0], [3], 16, 1
    rows = engines(args)
    prompts = heldout_prompts(max(args.batch), args.prompt_len, seed=0)
    for batch in args.batch:
        for temperature in args.temperature:
            params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, seed=1,
                                    max_tokens=args.max_tokens, ignore_eos=True)
            best, outputs, stats = {}, {}, {}
            for engine in rows.values():  # warm-up: every shape compiled
                engine.generate(prompts[:batch], params, use_tqdm=False)
            for _ in range(args.repeats):
                for name, engine in rows.items():
                    before = engine.stats()
                    start = time.perf_counter()
                    outs = engine.generate(prompts[:batch], params, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    after = engine.stats()
                    outputs[name] = [o.outputs[0].token_ids for o in outs]
                    if seconds < best.get(name, np.inf):
                        best[name] = seconds
                        stats[name] = (after.spec_proposed_tokens - before.spec_proposed_tokens,
                                       after.spec_accepted_tokens - before.spec_accepted_tokens,
                                       after.spec_sequences - before.spec_sequences,
                                       after.spec_proposer_s - before.spec_proposer_s)
            first = next(iter(outputs.values()))
            for name, out in outputs.items():
                if out != first:
                    raise SystemExit(f"{name}: tokens differ from the first row's (speculation must be exact)")
            tokens = batch * args.max_tokens
            base = best[f"plain, {args.fused} steps/call"]
            print(f"\nbatch {batch}, temperature {temperature}, {args.prompt_len}-token held-out prompts, "
                  f"{args.max_tokens} new tokens each; best of {args.repeats} rounds\n")
            print("| row | tokens/s | vs plain N | proposals accepted | tokens per verifying step | proposer time |")
            print("|---|---|---|---|---|---|")
            for name, seconds in best.items():
                proposed, accepted, seqs, proposer_s = stats[name]
                rate = f"{accepted / proposed:.0%} of {proposed}" if proposed else "-"
                per_step = f"{1 + accepted / seqs:.2f}" if seqs else "-"
                share = f"{proposer_s / seconds:.0%}" if proposed else "-"
                print(f"| {name} | {tokens / seconds:.1f} | {base / seconds:.2f}x | {rate} | {per_step} | {share} |")


if __name__ == "__main__":
    main()
