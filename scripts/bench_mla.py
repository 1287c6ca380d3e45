"""MLA vs GQA on this machine: prefill and decode tokens/s of a multi-head latent attention model (DeepSeek's
attention, `pagedjax.model.families.deepseek`, dense MLPs) against a GQA model of equal width, depth and MLP
(`pagedjax.model.llama`), both random, through the same engine, at a few batch sizes and context lengths; with
each model's KV bytes per token (from its layer specs). Every ratio is measured in the same run, in interleaved
rounds (the two models alternate, the order rotating per round), medians.

    python scripts/bench_mla.py                      # ~150M models, batch 1 and 16, contexts 512 and 4096
    python scripts/bench_mla.py --width 256 --layers 4 --batches 1 8 --contexts 512 2048   # 19M models
    python scripts/bench_mla.py --quick              # tiny models, seconds (the smoke test)

One measurement (a round of one model at one row): `batch` prompts of `context` random tokens are added and the
engine stepped until every sequence has its first token: that time is the prefill (prefill tokens/s = batch x
context / it; with --max-batched-tokens per step, sequences whose prompt is done decode alongside the others'
later chunks, under 1% of a step's tokens); then the engine is stepped, every sequence decoding, until each has
produced --decode-tokens more: decode tokens/s = the tokens produced / that time (one pass, no difference of two
runs). Then the requests are aborted. Each row runs once per model untimed first (compiles its step shapes).

Rows whose prefill would be too slow for a CPU (batch x context > --max-prefill-tokens, default 8192: 16 x 4096
tokens of a 150M model are ~2e13 FLOPs, many minutes per model and round on 2 cores) are measured over one prompt
forked `batch` times (greedy samples of `SamplingParams(n=batch)`): the prefill column is that one prompt's
(batch 1, marked "1 (forked)"), the decode column the `batch` samples', which share the prompt's blocks, so a
gather reads the same pages `batch` times and caches may favour it. `--fill fork` measures every row this way,
to compare with distinct prompts where both fit.

Expected time on an idle 2-core machine (from CPU times measured under load): the default ~10 minutes (per model
and round: 1 x 4096 prefill ~30 s MLA / ~15 s GQA, 16 x 512 ~20 s / ~11 s, each 16 x 4096 fork fill as 1 x 4096);
the 19M command above ~1-2 minutes.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.config.deepseek import DeepSeekConfig  # noqa: E402
from pagedjax.model.families.deepseek import init_deepseek  # noqa: E402

logger = logging.getLogger("bench_mla")  # progress; the tables are printed


def models(quick: bool, dtype: str, width: int = 768, layers: int = 14) -> dict[str, object]:
    """(name -> a model config) of equal width, depth, heads (of 64) and MLP (8/3 the width): MLA (latent
    width / 3 + rope 32, heads of 64 + 32 / 64) and GQA (4 KV heads of 64). The default is ~150M parameters."""
    if quick:
        width, layers, heads, mlp, vocab, rank = 64, 2, 4, 128, 512, 32
    else:
        heads, mlp, vocab, rank = width // 64, width * 8 // 3, 32000, width // 3
    head = width // heads
    mla = DeepSeekConfig(vocab_size=vocab, hidden_size=width, num_layers=layers, num_heads=heads,
                         intermediate_size=mlp, kv_lora_rank=rank, qk_nope_head_dim=head, qk_rope_head_dim=head // 2,
                         v_head_dim=head, max_position_embeddings=8192, dtype=dtype)
    gqa = ModelConfig(vocab_size=vocab, hidden_size=width, num_layers=layers, num_q_heads=heads, num_kv_heads=4,
                      head_dim=head, intermediate_size=mlp, max_position_embeddings=8192, dtype=dtype,
                      tie_word_embeddings=False)
    return {"MLA": mla, "GQA-4": gqa}


def build(cfg, max_len: int, batch: int, max_batched_tokens: int, steps_per_call: int) -> LLMEngine:
    blocks = batch * (-(-max_len // 16)) + 8
    # No prefix caching: every round computes its whole prompt (a hit would skip the prefill being timed).
    common = dict(cache_config=CacheConfig(block_size=16, num_blocks=blocks, enable_prefix_caching=False),
                  scheduler_config=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max_batched_tokens,
                                                   max_model_len=max_len),
                  decode_steps_per_call=steps_per_call)
    if isinstance(cfg, DeepSeekConfig):
        return LLMEngine(model=init_deepseek(cfg, seed=0), **common)
    return LLMEngine(model_config=cfg, **common)


def _produced(outs, counts: dict[str, int]) -> None:
    """Record each request's tokens so far (every sample's) from a step's outputs."""
    for o in outs:
        counts[o.request_id] = sum(len(c.token_ids) for c in o.outputs) if o.outputs else len(o.output_token_ids)


def run_once(engine: LLMEngine, prompts: list[list[int]], samples: int, decode_tokens: int,
             max_tokens: int, tag: str) -> tuple[float, float, int]:
    """(prefill seconds, decode seconds, decode tokens): add the prompts (each with `samples` greedy samples), step
    until every sample has a token (the prefill), then until each has `decode_tokens` more (the decode); abort."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=samples)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    counts = dict.fromkeys(ids, 0)
    start = time.perf_counter()
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    while min(counts.values()) < samples:
        _produced(engine.step(), counts)
    prefill_s = time.perf_counter() - start
    first = dict(counts)
    start = time.perf_counter()
    while min(counts[r] - first[r] for r in ids) < samples * decode_tokens:
        _produced(engine.step(), counts)
        if any(counts[r] >= samples * max_tokens for r in ids):
            raise RuntimeError("a request ran out of max_tokens before the decode was measured")
    decode_s = time.perf_counter() - start
    tokens = sum(counts[r] - first[r] for r in ids)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return prefill_s, decode_s, tokens


@dataclass
class Row:
    """One (batch, context) row: how it is measured, and each model's times per round."""

    batch: int
    context: int
    fork: bool  # one prompt forked `batch` times (its prefill, then the samples' decode)
    prefill_s: dict[str, list[float]] = field(default_factory=dict)
    decode_tok_s: dict[str, list[float]] = field(default_factory=dict)


    @property
    def prefill_batch(self) -> int:
        return 1 if self.fork else self.batch


def plan_row(batch: int, context: int, max_prefill_tokens: int, fill: str) -> Row:
    return Row(batch, context, fork=fill == "fork" or batch * context > max_prefill_tokens)


def max_tokens_for(row: Row, decode_tokens: int, max_batched_tokens: int, steps_per_call: int) -> int:
    """A request's max_tokens in `row`: the timed decode tokens plus what a sequence may get before the decode is
    timed (one per prefill step at most) and a fused call's overshoot."""
    return decode_tokens + -(-row.batch * row.context // max_batched_tokens) + 2 * steps_per_call + 8


def measure_row(engines: dict[str, LLMEngine], row: Row, decode_tokens: int, rounds: int,
                max_tokens: int) -> dict[str, int]:
    """Run `row` on every engine: one untimed warm-up each (compiles the row's step shapes), then `rounds`
    interleaved rounds, the order rotating. Returns per model the programs compiled during the timed rounds."""
    rng = np.random.default_rng([row.batch, row.context])
    vocab = next(iter(engines.values())).model_spec.vocab_size

    def prompts(n: int) -> list[list[int]]:
        return rng.integers(3, vocab, (n, row.context)).tolist()

    def one(engine: LLMEngine, tag: str) -> tuple[float, float]:
        """(prefill seconds, decode tokens/s) of one round."""
        prefill_s, decode_s, tokens = run_once(engine, prompts(row.prefill_batch), row.batch // row.prefill_batch,
                                               decode_tokens, max_tokens, tag)
        return prefill_s, tokens / decode_s

    compiled = {}
    for name, engine in engines.items():
        one(engine, f"warm-{row.batch}x{row.context}-{name}")
        compiled[name] = engine.stats().compilations
        row.prefill_s[name], row.decode_tok_s[name] = [], []
    names = list(engines)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            prefill_s, decode_tok_s = one(engines[name], f"r{r}-{row.batch}x{row.context}-{name}")
            row.prefill_s[name].append(prefill_s)
            row.decode_tok_s[name].append(decode_tok_s)
        logger.info("batch %d context %d: round %d/%d done", row.batch, row.context, r + 1, rounds)
    for name, engine in engines.items():
        compiled[name] = engine.stats().compilations - compiled[name]
        if engine.stats().scheduler.num_preemptions:
            raise RuntimeError(f"{name} preempted a sequence: the pool is too small for the row")
    return compiled


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--decode-tokens", type=int, default=32, help="decode tokens timed per sequence")
    p.add_argument("--rounds", "--repeats", type=int, default=3, dest="rounds",
                   help="interleaved timed rounds per row (medians); --repeats is the former name")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--width", type=int, default=768, help="hidden size (heads of 64)")
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="the engine's token budget per step")
    p.add_argument("--decode-steps-per-call", type=int, default=8, help="fused decode steps per device call")
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="rows with batch x context above this run one prompt forked batch times")
    p.add_argument("--fill", choices=["distinct", "fork"], default="distinct",
                   help="decode over distinct prompts (rows within the budget) or one prompt forked (every row)")
    p.add_argument("--quick", action="store_true", help="tiny models, short contexts: seconds")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.decode_tokens, args.rounds = [1, 2], [16], 4, 1
        args.max_batched_tokens, args.decode_steps_per_call, args.max_prefill_tokens = 32, 2, 16
    configs = models(args.quick, args.dtype, args.width, args.layers)
    plans = [plan_row(b, c, args.max_prefill_tokens, args.fill) for b in args.batches for c in args.contexts]
    max_tokens = max(max_tokens_for(r, args.decode_tokens, args.max_batched_tokens, args.decode_steps_per_call)
                     for r in plans)
    # One engine per model for every row, its pool sized for the largest (no preemption).
    engines = {name: build(cfg, max(args.contexts) + max_tokens, max(args.batches), args.max_batched_tokens,
                           args.decode_steps_per_call) for name, cfg in configs.items()}
    info = {name: {"kv_bytes_per_token": e.cache_config.kv_bytes_per_token(e.model_spec),
                   "params_m": sum(x.size for x in jax.tree.leaves(e.runner.params)) / 1e6}
            for name, e in engines.items()}
    rows, loads = [], [os.getloadavg()[0]]
    for row in plans:
        compiled = measure_row(engines, row, args.decode_tokens, args.rounds, max_tokens)
        loads.append(os.getloadavg()[0])
        out = {"batch": row.batch, "context": row.context, "prefill_batch": row.prefill_batch, "fork": row.fork}
        for name in configs:
            out[f"prefill_tok_s_{name}"] = row.prefill_batch * row.context / statistics.median(row.prefill_s[name])
            out[f"decode_tok_s_{name}"] = statistics.median(row.decode_tok_s[name])
            out[f"compilations_{name}"] = compiled[name]
            out.update({f"{k}_{name}": v for k, v in info[name].items()})
        # Medians of the per-round ratios: in each round the two models ran back to back.
        out["prefill_ratio"] = statistics.median(
            g / m for m, g in zip(row.prefill_s["MLA"], row.prefill_s["GQA-4"], strict=True))
        out["decode_ratio"] = statistics.median(
            m / g for m, g in zip(row.decode_tok_s["MLA"], row.decode_tok_s["GQA-4"], strict=True))
        rows.append(out)
    print_table(rows, args, loads)
    return rows


def print_table(rows: list[dict], args, loads: list[float]) -> None:
    first = rows[0]
    print(f"MLA {first['params_m_MLA']:.1f} M params, {first['kv_bytes_per_token_MLA']:,} KV bytes/token; "
          f"GQA-4 {first['params_m_GQA-4']:.1f} M params, {first['kv_bytes_per_token_GQA-4']:,} KV bytes/token "
          f"({args.dtype}, {args.decode_tokens} decode tokens per sequence, {args.decode_steps_per_call}-step fused "
          f"decode, {args.max_batched_tokens} tokens per step, median of {args.rounds} interleaved round(s))")
    print()
    print("| batch | context | prefill batch | prefill MLA tok/s | GQA tok/s | MLA/GQA | decode fill "
          "| decode MLA tok/s | GQA tok/s | MLA/GQA |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        pb = "1 (forked)" if r["fork"] else f"{r['batch']}"
        fill = f"{r['batch']} forks of 1" if r["fork"] else "distinct"
        print(f"| {r['batch']} | {r['context']} | {pb} | {r['prefill_tok_s_MLA']:,.0f} | "
              f"{r['prefill_tok_s_GQA-4']:,.0f} | {r['prefill_ratio']:.2f}x | {fill} | {r['decode_tok_s_MLA']:,.1f} | "
              f"{r['decode_tok_s_GQA-4']:,.1f} | {r['decode_ratio']:.2f}x |")
    print()
    print("tokens/s on this machine's CPU (XLA paths); MLA attends in latent space (absorbed). MLA/GQA: median of "
          "the per-round ratios.")
    compiled = [f"{n} {r['batch']}x{r['context']}: {r[f'compilations_{n}']}" for r in rows for n in ("MLA", "GQA-4")
                if r[f"compilations_{n}"]]
    if compiled:
        print("programs compiled during timed rounds (their time is in the numbers): " + ", ".join(compiled))
    print(f"load average (1 min, {os.cpu_count()} CPUs) at the start and after each row: "
          + ", ".join(f"{x:.1f}" for x in loads))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    main()
