"""Soak check (not in CI): thousands of random requests through one engine, with random aborts, injected
device faults and preemption on a small pool, checking the block invariants after every step, exactness
against a fault-free engine, and that host memory (RSS) stays flat across repeated generate() calls.

    python scripts/soak.py --minutes 10

Each round queues a batch of random requests (shared prefixes, greedy and seeded sampling, random lengths),
steps the engine, aborts some requests at random and makes some device calls raise (before the call ran,
after it ran, or after losing the donated KV cache). After every step `Scheduler.check_invariants` must hold;
at the end of a round every block must be free or cached, and every request that was neither aborted nor
failed must have exactly the output a fault-free engine gives for it. One summary line at the end; exit code
1 if anything was wrong.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time

import jax

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig

logger = logging.getLogger("soak")

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, max_position_embeddings=128)
MAX_LEN = 96


class InjectedFault(RuntimeError):
    pass


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# --variant: the model and KV cache the soak runs. "window": every layer has a sliding window (blocks out of it
# are released while requests run); "int8": 8-bit KV pages (the fault-free reference uses them too).
VARIANTS = {"plain": (CFG, "auto"), "window": (CFG.replace(sliding_windows=(6, 10)), "auto"), "int8": (CFG, "int8")}


def make_engine(block_size: int, num_blocks: int, steps: int, variant: str = "plain") -> LLMEngine:
    cfg, kv_dtype = VARIANTS[variant]
    return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                                kv_dtype=kv_dtype),
                     scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=MAX_LEN),
                     seed=3, decode_steps_per_call=steps)


def inject_faults(engine: LLMEngine, rng: random.Random, rate: float, counters: dict) -> None:
    runner = engine.runner

    def wrap(fn):
        def call(inputs, *args, **kwargs):
            if rng.random() >= rate:
                return fn(inputs, *args, **kwargs)
            mode = rng.choice(("before", "after", "lose_cache"))
            counters["faults"] += 1
            if mode == "after":
                fn(inputs, *args, **kwargs)
            elif mode == "lose_cache":
                for x in jax.tree.leaves(runner.kv_cache):
                    x.delete()
            raise InjectedFault(f"injected ({mode})")
        return call

    runner.execute = wrap(runner.execute)
    runner.execute_fused_decode = wrap(runner.execute_fused_decode)


def random_request(rng: random.Random, prefixes: list[list[int]]) -> tuple[list[int], SamplingParams]:
    prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
    prompt = prefix + [rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 40))]
    max_tokens = rng.randint(1, MAX_LEN - len(prompt))
    if rng.random() < 0.5:
        return prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)
    # a third of the sampled requests draw several samples from one prefill (forked KV, copy-on-write)
    return prompt, SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.7, 1.0]),
                                  top_k=rng.choice([0, 8]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**31),
                                  n=rng.choice([1, 1, 2, 3]))


def run_round(engine: LLMEngine, requests: dict, rng: random.Random, abort_rate: float, stats: dict) -> dict:
    """Queue `requests` (id -> (prompt, params)), step to the end with random aborts; returns finished outputs."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.scheduler.check_invariants()
        stats["steps"] += 1
        if rng.random() < abort_rate:  # a caller's request: all the samples of a multi-sample one
            live = sorted({r.group.request.request_id if r.group is not None else rid
                           for rid, r in engine.scheduler.requests.items()})
            if live and engine.abort(victim := rng.choice(live)):
                stats["aborts"] += 1
                outs[victim] = None
    return outs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--requests-per-round", type=int, default=24)
    parser.add_argument("--fault-rate", type=float, default=0.03, help="probability a device call raises")
    parser.add_argument("--abort-rate", type=float, default=0.05, help="probability of an abort per step")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=40, help="small, so preemption happens")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="plain",
                        help="window: sliding-window model; int8: 8-bit KV pages")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # injected faults log errors by design
    rng = random.Random(args.seed)
    engine = make_engine(args.block_size, args.num_blocks, args.steps, args.variant)
    reference = make_engine(args.block_size, 4 * args.num_blocks, 1, args.variant)  # roomy, fault-free, 1 step
    stats = dict(requests=0, rounds=0, steps=0, aborts=0, faults=0, errors=0, mismatches=0, leaks=0)
    inject_faults(engine, rng, args.fault_rate, stats)
    prefixes = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    deadline = time.monotonic() + 60 * args.minutes
    rss: list[float] = []
    while time.monotonic() < deadline:
        batch = {f"r{stats['requests'] + i}": random_request(rng, prefixes) for i in range(args.requests_per_round)}
        stats["requests"] += len(batch)
        outs = run_round(engine, batch, rng, args.abort_rate, stats)
        expected = dict(zip(batch, reference.generate([p for p, _ in batch.values()],
                                                      [s for _, s in batch.values()], use_tqdm=False), strict=True))
        for rid, out in outs.items():
            if out is None:
                continue
            # A sample that broke a step on its own fails alone (finish_reason "error"); the others must match. A
            # multi-sample request whose prefill failed ends with no samples.
            if not out.outputs:
                stats["errors" if out.finish_reason == "error" else "mismatches"] += 1
                continue
            for got, want in zip(out.outputs, expected[rid].outputs, strict=True):
                if got.finish_reason == "error":
                    stats["errors"] += 1
                elif got.token_ids != want.token_ids:
                    stats["mismatches"] += 1
                    logger.critical("mismatch in %s[%d]: %s != %s (%s)", rid, got.index, got.token_ids,
                                    want.token_ids, got.finish_reason)
        mem = engine.stats().scheduler.memory
        if mem.num_used_blocks or mem.num_lent_blocks or len(outs) != len(batch):
            stats["leaks"] += 1
        stats["rounds"] += 1
        rss.append(rss_mib())
    warm = rss[min(len(rss) - 1, max(1, len(rss) // 5))]  # after compilation and warm-up
    quarters = " / ".join(f"{rss[min(len(rss) - 1, len(rss) * q // 4)]:.0f}" for q in (1, 2, 3, 4))
    s = engine.stats()
    ok = not (stats["mismatches"] or stats["leaks"])
    print(f"soak: {'OK' if ok else 'FAILED'} in {args.minutes:g} min: {stats['requests']} requests, "
          f"{stats['rounds']} rounds, {stats['steps']} steps, {stats['aborts']} aborts, {stats['faults']} injected "
          f"faults ({s.failed_steps} failed steps, {stats['errors']} requests failed alone), "
          f"{s.scheduler.num_preemptions} preemptions, {s.compilations} compilations, invariants checked after "
          f"every step; {stats['mismatches']} outputs differ from fault-free, {stats['leaks']} rounds leaked blocks; "
          f"RSS {warm:.0f} MiB after warm-up -> {rss[-1]:.0f} MiB at the end (max {max(rss):.0f}; at each quarter "
          f"of the rounds {quarters} MiB)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
