"""Speculative decoding (n-gram prompt lookup, a draft model) against plain decoding, on the same engine, model and
prompts.

    python scripts/bench_spec.py                       # the 156M random-weights model, batch 1 and 8
    python scripts/bench_spec.py --model tiny --quick  # seconds: checks the script
    python scripts/bench_spec.py --model bundled       # the bundled trained model (2.4M parameters)
    python scripts/bench_spec.py --workload draft --max-tokens 32   # the draft rows of docs/speculative_decoding.md

Workloads (both honest about what they are; with random weights nothing here is natural text, and the bundled model
sees random token ids too):
  copy-heavy  greedy decoding of a prompt that holds a passage and ends by starting it again: a random prefix P,
              the model's own greedy continuation O of P, then P once more (P + O + P), so the output that copies
              O is the expected one. A random-weights model copies only as far as its next token depends on the
              recent tokens rather than on the whole context: the acceptance rate says how far that is;
  no-repeat   sampling at temperature 1 (seeded) after a random prompt: the output is near-uniform over the
              vocabulary and never repeats a 2-gram, so prompt lookup finds nothing and backs off (the fused decode
              then runs as without speculation);
  all-rejected  no-repeat with a proposer that always proposes k copies of token 0 (so nearly every proposal is
              rejected): the cost of verifying k tokens per step for nothing, the worst case (not prompt lookup);
  draft       greedy decoding after a random prompt, proposals from a draft model (`SpeculativeConfig(method=
              "draft")`): a small random model of the target's vocabulary (the bundled model's shape, "small"), which
              does not agree with a random target (its acceptance rate says how little), and the upper bounds: the
              target's own first 2 layers (embedding, norm and head shared) and the target itself (acceptance 1:
              what a perfect draft of the target's cost would give); and "oracle", proposals that are the plain
              run's own tokens at no cost (not a draft model: what verification alone allows), and the same with
              its verifying steps padded to powers of two, as the engine padded them before `inputs.fine_bucket`
              (5 tokens and rows as 8 for k = 4 at batch 1): the baseline of that change, in the same run.

Rows: plain decoding with 1 and with N decode steps per device call, and speculation (k proposals, N steps per
call where no request has a proposal). Each engine is warmed up (every shape compiled) by one run, then timed in
interleaved rounds (one run of each per round); a row's time is its best round. Every row's tokens must equal the
first row's (exactness: greedy tokens, and the seeded samples too).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.config import SpeculativeConfig  # noqa: E402
from pagedjax.model.llama import init_model  # noqa: E402
from pagedjax.model.loading.loader import load_for  # noqa: E402
from pagedjax.runner import inputs as inputs_module  # noqa: E402
from scripts.bench_engine import SHAPES  # noqa: E402

WORKLOADS = {
    "copy-heavy": dict(temperature=0.0),
    "no-repeat": dict(temperature=1.0, seed=1),
    "all-rejected": dict(temperature=1.0, seed=1),
    "draft": dict(temperature=0.0),
}


class AlwaysZero:
    """The all-rejected workload's proposer: k copies of token 0, whatever the request."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, asks, step=None) -> list[list[int]]:
        return [[0] * min(self.k, ask.cap) for ask in asks]

    def forget(self, live_request_ids) -> None:
        pass


class Oracle:
    """The draft workload's bound: a perfect proposer that costs nothing (the plain run's tokens of each prompt)."""

    def __init__(self, k: int, prompts, outputs):
        self.k = k
        self.known = {tuple(p): list(o) for p, o in zip(prompts, outputs, strict=True)}

    def propose(self, asks, step=None) -> list[list[int]]:
        return [self.known[tuple(a.request.prompt_token_ids)][a.request.num_output_tokens:][:min(self.k, a.cap)]
                for a in asks]

    def forget(self, live_request_ids) -> None:
        pass


@contextlib.contextmanager
def padded_to_powers_of_two():
    """Verifying steps padded as before `inputs.fine_bucket`: tokens and rows to powers of two."""
    fine = inputs_module.fine_bucket
    inputs_module.fine_bucket = inputs_module.bucket
    try:
        yield
    finally:
        inputs_module.fine_bucket = fine


def draft_models(target, cfg) -> dict:
    """The draft workload's drafts for `target` (see the module's docstring)."""
    small = init_model(SHAPES["small"].replace(vocab_size=cfg.vocab_size, dtype=cfg.dtype), seed=1)
    truncated = init_model(cfg.replace(num_layers=min(2, cfg.num_layers)), seed=1)
    for i in range(truncated.config.num_layers):
        truncated.layers[i] = target.layers[i]
    truncated.embed_tokens, truncated.norm, truncated.lm_head = target.embed_tokens, target.norm, target.lm_head
    return {"small": small, "2 layers": truncated, "= target": target}


def make_prompts(model, cfg, workload: str, batch: int, prompt_len: int, max_tokens: int) -> list[list[int]]:
    """`batch` random prompts of `prompt_len` tokens; for copy-heavy, each P becomes P + O + P (see the module's
    docstring), O its greedy continuation of `max_tokens` tokens."""
    prompts = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
    if workload != "copy-heavy":
        return prompts
    num_blocks = batch * -(-(prompt_len + max_tokens) // 16) + 8
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=num_blocks),
                       scheduler_config=SchedulerConfig(max_num_seqs=batch, max_model_len=prompt_len + max_tokens),
                       params=model, decode_steps_per_call=8)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0,
                                                   max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [p + o.output_token_ids + p for p, o in zip(prompts, outs, strict=True)]


def run(model, cfg, workload: str, batch: int, prompt_len: int, max_tokens: int, k: int, fused: int,
        repeats: int) -> list[dict]:
    prompts = make_prompts(model, cfg, workload, batch, prompt_len, max_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **WORKLOADS[workload])
    total = max(map(len, prompts)) + max_tokens
    variants = [("plain, 1 step/call", 1, None), (f"plain, {fused} steps/call", fused, None)]
    if workload == "draft":
        variants += [(f"draft {name} k={k}", fused, SpeculativeConfig(method="draft", draft_model=draft,
                                                                       num_speculative_tokens=k))
                     for name, draft in draft_models(model, cfg).items()]
        variants.append((f"oracle k={k}", fused, SpeculativeConfig(num_speculative_tokens=k)))
        variants.append((f"oracle k={k}, padded to 2^n", fused, SpeculativeConfig(num_speculative_tokens=k)))
    else:
        variants.append((f"ngram k={k}, {fused} steps/call", fused, SpeculativeConfig(num_speculative_tokens=k)))
    rows, plain = [], None  # plain: the first row's tokens (the oracle's proposals)
    budget = max(batch * (total - max_tokens), 64)
    for name, steps, spec in variants:
        engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16,
                                                                      num_blocks=batch * -(-(total + k) // 16) + 8,
                                                                      enable_prefix_caching=False),
                           scheduler_config=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget,
                                                            max_model_len=total + k), params=model,
                           decode_steps_per_call=steps, speculative_config=spec)
        if spec is not None and workload == "all-rejected":
            engine.speculator.proposer = AlwaysZero(k)
        if name.startswith("oracle"):
            engine.speculator.proposer = Oracle(k, prompts, plain)
        padding = padded_to_powers_of_two if name.endswith("2^n") else contextlib.nullcontext
        with padding():
            outs = engine.generate(prompts, params, use_tqdm=False)  # warm-up: compiles every shape of this workload
        plain = plain or [o.output_token_ids for o in outs]
        rows.append(dict(name=name, engine=engine, padding=padding, times=[]))
    for _ in range(repeats):
        for row in rows:
            before = row["engine"].stats()
            with row["padding"]():
                start = time.perf_counter()
                outs = row["engine"].generate(prompts, params, use_tqdm=False)
                row["times"].append(time.perf_counter() - start)
            after = row["engine"].stats()
            row["tokens"] = [o.output_token_ids for o in outs]
            row["proposed"] = after.spec_proposed_tokens - before.spec_proposed_tokens
            row["accepted"] = after.spec_accepted_tokens - before.spec_accepted_tokens
            row["steps"] = after.steps - before.steps
    return rows


def print_table(rows: list[dict], workload: str, batch: int, max_tokens: int) -> None:
    print(f"\n{workload}, batch {batch}, {max_tokens} new tokens each")
    print(f"{'engine':28s} {'time s':>8s} {'tok/s':>8s} {'vs plain 1':>11s} {'vs plain N':>11s} {'steps':>6s} "
          f"{'proposed':>9s} {'accepted':>9s} {'same tokens':>12s}")
    base1, base_n = rows[0], rows[1]
    for r in rows:
        t = min(r["times"])
        rate = f"{100 * r['accepted'] / r['proposed']:.0f}%" if r["proposed"] else "-"
        print(f"{r['name']:28s} {t:8.3f} {batch * max_tokens / t:8.1f} {min(base1['times']) / t:10.2f}x "
              f"{min(base_n['times']) / t:10.2f}x {r['steps']:6d} {r['proposed']:9d} {rate:>9s} "
              f"{str(r['tokens'] == base1['tokens']):>12s}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=[*sorted(SHAPES), "bundled"], default="156m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--workload", choices=sorted(WORKLOADS), nargs="+", default=list(WORKLOADS))
    p.add_argument("--prompt-len", type=int, default=16, help="random tokens per prompt (P)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="proposals per request per step")
    p.add_argument("--fused", type=int, default=8, help="decode steps per call (N)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 tokens, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.max_tokens, args.repeats = 16, 1
    if args.model == "bundled":  # the trained 2.4M-parameter model (pagedjax/assets/tiny)
        cfg, model, _ = load_for(None, None, None, None)
    else:
        cfg = SHAPES[args.model]
        model = init_model(cfg, seed=0)
    for workload in args.workload:
        for batch in args.batch:
            rows = run(model, cfg, workload, batch, args.prompt_len, args.max_tokens, args.k, args.fused,
                       args.repeats)
            print_table(rows, workload, batch, args.max_tokens)


if __name__ == "__main__":
    main()
