#!/usr/bin/env python
"""Rollout throughput for RL: pagedjax's Tunix rollout engine (`PagedJaxRollout`) against Tunix's own `vanilla`
engine on one model shape, GRPO groups of 8 and 16 (needs `pip install -e '.[tunix]'`).

Both run the bundled model's shape (a 4-layer Llama, hidden 256, vocab 2048) with random float32 weights: Tunix's
`VanillaRollout` over its `Llama3` (its sampler: one dense KV cache of `--cache` positions per sequence, prompts
left-padded to `max_prompt_length`, decoding the whole batch until every row ends), pagedjax over `Llama` (the
group's samples share one prefill and the prompt's blocks, continuous batching). Random weights rarely sample EOS,
so rows run to `--max-tokens`; tokens/s counts the tokens each engine returned. Each cell is the best of `--repeats`
timed calls after one warm-up call (compilation excluded). Also timed: `update_params` (pagedjax: new arrays
swapped into the engine; vanilla: its state merged) and batch-invariant mode (its token budget the batch's
sequences: every step runs at the budget) against pagedjax's default (budget 256, 8 decode steps a call).

    python scripts/bench_rollout.py                      # a table, about two minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import time

import jax
from flax import nnx

from pagedjax import CacheConfig, SchedulerConfig
from pagedjax.integrations.tunix import PagedJaxRollout, TunixPolicy, TunixTokenizer
from pagedjax.model.llama import init_model
from pagedjax.model.loading.loader import load_pretrained

try:
    from tunix.models.llama3 import model as tunix_llama
    from tunix.rl.rollout import base_rollout, vanilla_rollout
except ImportError as e:
    raise SystemExit("bench_rollout.py needs Tunix: pip install -e '.[tunix]'") from e

PROMPTS = ("def ", "import ", "class ", "    return ")


def pagedjax_rollout(cfg, tokenizer, seqs: int, args, *, invariant: bool) -> PagedJaxRollout:
    return PagedJaxRollout(
        rollout_actor=TunixPolicy(init_model(cfg, 0)), tokenizer=tokenizer, batch_invariant=invariant,
        decode_steps_per_call=1 if invariant else 8,
        cache_config=CacheConfig(block_size=16, num_blocks=seqs * (-(-(8 + args.max_tokens) // 16)) + 16),
        # batch-invariant mode runs every step at the token budget: the smallest that decodes every sequence at once
        scheduler_config=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=seqs if invariant else 256,
                                         max_model_len=8 + args.max_tokens))


def vanilla(cfg, tokenizer, args) -> vanilla_rollout.VanillaRollout:
    tcfg = tunix_llama.ModelConfig(
        num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size, num_heads=cfg.num_q_heads, head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads, rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps,
        weight_tying=cfg.tie_word_embeddings)
    model = tunix_llama.Llama3(tcfg, rngs=nnx.Rngs(0))
    return vanilla_rollout.VanillaRollout(model, tokenizer, base_rollout.CacheConfig(
        cache_size=args.cache, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))


def timed(rollout, prompts, rc, repeats: int) -> tuple[float, int]:
    """(best seconds of `repeats` calls after a warm-up, tokens returned by one call)."""
    out = rollout.generate(prompts, rc)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = rollout.generate(prompts, rc)
        best = min(best, time.perf_counter() - start)
    return best, sum(len(t) for t in out.tokens)


def update_ms(rollout, fresh_state, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        state = jax.tree.map(lambda x: x + 0, fresh_state)  # new arrays, as an optimizer step leaves
        jax.block_until_ready(state)
        start = time.perf_counter()
        rollout.update_params(state)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 16], help="samples per prompt")
    ap.add_argument("--prompts", type=int, default=4, help=f"prompts per call (at most {len(PROMPTS)})")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cache", type=int, default=64, help="vanilla's KV cache positions per sequence")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cfg, _, tok = load_pretrained(None)
    tokenizer = TunixTokenizer(tok)
    rc = base_rollout.RolloutConfig(max_tokens_to_generate=args.max_tokens, max_prompt_length=8, temperature=1.0,
                                    top_p=1.0, seed=0, eos_tokens=[tokenizer.eos_id()])
    print(f"rollouts of {args.prompts} prompts x G samples x {args.max_tokens} tokens, bundled model shape, random "
          f"weights, best of {args.repeats} (jax {jax.__version__}, {jax.devices()[0].platform})")
    print(f"{'G':>3} {'engine':<24} {'tokens':>6} {'s':>7} {'tok/s':>7} {'x vanilla':>9}")
    van = vanilla(cfg, tokenizer, args)
    for g in args.groups:
        prompts = [p for p in PROMPTS[:args.prompts] for _ in range(g)]
        base_s, base_n = timed(van, prompts, rc, args.repeats)
        rows = [("tunix vanilla", base_s, base_n)]
        for name, invariant in (("pagedjax", False), ("pagedjax batch-invariant", True)):
            rollout = pagedjax_rollout(cfg, tokenizer, len(prompts), args, invariant=invariant)
            rows.append((name, *timed(rollout, prompts, rc, args.repeats)))
        for name, s, n in rows:
            print(f"{g:>3} {name:<24} {n:>6} {s:>7.3f} {n / s:>7.0f} {(n / s) / (base_n / base_s):>8.2f}x")
    ours = pagedjax_rollout(cfg, tokenizer, 8, args, invariant=False)
    fresh = nnx.state(TunixPolicy(init_model(cfg, 1)))
    print(f"update_params (best of {args.repeats}): pagedjax {update_ms(ours, fresh, args.repeats):.2f} ms, "
          f"tunix vanilla {update_ms(van, nnx.state(van.model(), nnx.Param), args.repeats):.2f} ms")


if __name__ == "__main__":
    main()
