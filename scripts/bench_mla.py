"""MLA vs GQA on this machine: prefill and decode tokens/s of a multi-head latent attention model (DeepSeek's
attention, `pagedjax.model.deepseek`, dense MLPs) against a GQA model of equal width, depth and MLP
(`pagedjax.model.llama`), both random, through the same engine, at a few batch sizes and context lengths; with
each model's KV bytes per token (from its layer specs). Every row is a ratio measured in the same run.

    python scripts/bench_mla.py                      # ~150M models, batch 1 and 16, contexts 512 and 4096
    python scripts/bench_mla.py --quick              # tiny models, seconds (the smoke test)

prefill tokens/s: a batch of `batch` prompts of `context` tokens, one sampled token each (its time is the
prefill's); decode tokens/s: the `--decode-tokens` after it, (time of prompt + N tokens - time of prompt + 1) /
(N - 1) per sequence. Each shape runs once to compile, then `--repeats` times; the best is kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.config.deepseek import DeepSeekConfig  # noqa: E402
from pagedjax.model.deepseek import init_deepseek  # noqa: E402


def models(quick: bool, dtype: str) -> dict[str, object]:
    """(name -> a model config) of equal width, depth, heads and MLP: MLA (latent 256 + rope 32, heads of 64 +
    32 / 64) and GQA (4 KV heads of 64)."""
    if quick:
        width, layers, heads, mlp, vocab, rank = 64, 2, 4, 128, 512, 32
    else:
        width, layers, heads, mlp, vocab, rank = 768, 14, 12, 2048, 32000, 256
    head = width // heads
    mla = DeepSeekConfig(vocab_size=vocab, hidden_size=width, num_layers=layers, num_heads=heads,
                         intermediate_size=mlp, kv_lora_rank=rank, qk_nope_head_dim=head, qk_rope_head_dim=head // 2,
                         v_head_dim=head, max_position_embeddings=8192, dtype=dtype)
    gqa = ModelConfig(vocab_size=vocab, hidden_size=width, num_layers=layers, num_q_heads=heads, num_kv_heads=4,
                      head_dim=head, intermediate_size=mlp, max_position_embeddings=8192, dtype=dtype,
                      tie_word_embeddings=False)
    return {"MLA": mla, "GQA-4": gqa}


def build(cfg, max_len: int, batch: int) -> LLMEngine:
    blocks = batch * (-(-max_len // 16)) + 8
    # No prefix caching: every repeat computes its whole prompt (a hit would skip the prefill being timed).
    common = dict(cache_config=CacheConfig(block_size=16, num_blocks=blocks, enable_prefix_caching=False),
                  scheduler_config=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch * 512, 512),
                                                   max_model_len=max_len))
    if isinstance(cfg, DeepSeekConfig):
        return LLMEngine(model=init_deepseek(cfg, seed=0), **common)
    return LLMEngine(cfg, **common)


def timed(engine: LLMEngine, prompts, max_tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)  # compiles this shape's programs
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best


def measure(cfg, batch: int, context: int, decode_tokens: int, repeats: int) -> dict:
    engine = build(cfg, context + decode_tokens + 1, batch)
    rng = np.random.default_rng(context)
    prompts = [rng.integers(0, engine.model_spec.vocab_size, context).tolist() for _ in range(batch)]
    prefill_s = timed(engine, prompts, 1, repeats)
    total_s = timed(engine, prompts, decode_tokens + 1, repeats)
    decode_s = total_s - prefill_s  # noise can make it <= 0 when the decode is far shorter than the prefill
    return {"prefill_tok_s": batch * context / prefill_s,
            "decode_tok_s": batch * decode_tokens / decode_s if decode_s > 0 else float("nan"),
            "kv_bytes_per_token": engine.cache_config.kv_bytes_per_token(engine.model_spec),
            "params_m": sum(x.size for x in jax.tree.leaves(engine.runner.params)) / 1e6}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="tiny models, short contexts: seconds")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.decode_tokens, args.repeats = [1], [16, 32], 4, 1
    configs = models(args.quick, args.dtype)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            results = {name: measure(cfg, batch, context, args.decode_tokens, args.repeats)
                       for name, cfg in configs.items()}
            mla, gqa = results["MLA"], results["GQA-4"]
            rows.append({"batch": batch, "context": context, **{f"{k}_{n}": v for n, r in results.items()
                                                                for k, v in r.items()},
                         "prefill_ratio": mla["prefill_tok_s"] / gqa["prefill_tok_s"],
                         "decode_ratio": mla["decode_tok_s"] / gqa["decode_tok_s"]})
    first = rows[0]
    print(f"MLA {first['params_m_MLA']:.1f} M params, {first['kv_bytes_per_token_MLA']:,} KV bytes/token; "
          f"GQA-4 {first['params_m_GQA-4']:.1f} M params, {first['kv_bytes_per_token_GQA-4']:,} KV bytes/token "
          f"({args.dtype}, {args.decode_tokens} decode tokens, best of {args.repeats})")
    header = f"{'batch':>5}{'context':>8}{'prefill MLA':>13}{'GQA':>9}{'MLA/GQA':>9}{'decode MLA':>12}{'GQA':>9}" \
             f"{'MLA/GQA':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['batch']:>5}{r['context']:>8}{r['prefill_tok_s_MLA']:>13.0f}{r['prefill_tok_s_GQA-4']:>9.0f}"
              f"{r['prefill_ratio']:>8.2f}x{r['decode_tok_s_MLA']:>12.1f}{r['decode_tok_s_GQA-4']:>9.1f}"
              f"{r['decode_ratio']:>8.2f}x")
    print("tokens/s on this machine's CPU (XLA paths); MLA decode attends in latent space (absorbed)")
    return rows


if __name__ == "__main__":
    main()
