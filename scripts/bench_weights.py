#!/usr/bin/env python
"""The training loop's engine operations, timed: `update_weights`, `sleep` and `wake` (`pagedjax.runner.weights`)
against what a loop without them does, building a fresh engine with the new weights.

    python scripts/bench_weights.py                  # the 156M shape (623 MB of float32 weights)
    python scripts/bench_weights.py --model small

All rows come from one run on one machine. "fresh engine" is `LLMEngine(model_config=cfg, params=new)` and the same
short generate (its programs come from JAX's persistent compilation cache, filled by the first engine, as in a loop
that rebuilds its engine every step). "device_put + update_weights" is the cost when the new weights start on
the host (numpy): `jax.device_put`, then the in-place update (on the CPU, device_put may alias an aligned numpy
buffer instead of copying it). Each row is the best of --repeats. The process's resident memory before and
after `sleep` (Linux: /proc/self/statm) shows whether the KV pool's bytes really went back.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
from bench_engine import SHAPES
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.model.llama import init_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


def best(fn, repeats: int) -> tuple[float, object]:
    """(the fastest of `repeats` calls' seconds, the last call's result)."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def rss_bytes() -> int | None:
    """The process's resident memory now (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="156m")
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV pool blocks of 16 tokens")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = SHAPES[args.model]

    def make(params) -> LLMEngine:
        return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=args.num_blocks),
                         scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
                         params=params)

    def generate(engine: LLMEngine):
        return [o.output_token_ids for o in engine.generate(PROMPTS, PARAMS, use_tqdm=False)]

    old, new = (nnx.split(init_model(cfg, seed))[1] for seed in (0, 1))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(new))
    engine = make(old)
    generate(engine)  # compiles the programs (and fills the persistent compilation cache)
    compilations = engine.stats().compilations
    rows = []

    fresh_s, fresh_tokens = best(lambda: generate(make(new)), args.repeats)
    rows.append(("fresh engine with the new weights + generate", fresh_s))
    update_s, _ = best(lambda: engine.update_weights(new), args.repeats)
    rows.append(("update_weights (in place, no copy)", update_s))
    host = jax.tree.map(np.asarray, new)
    put_s, _ = best(lambda: engine.update_weights(jax.block_until_ready(jax.device_put(host))), args.repeats)
    rows.append(("device_put of numpy weights + update_weights", put_s))
    engine.update_weights(new)
    gen_s, tokens = best(lambda: generate(engine), args.repeats)
    rows.append(("generate after update_weights", gen_s))
    assert tokens == fresh_tokens, "the updated engine must generate what a fresh one does"
    rss_awake = rss_bytes()
    freed = engine.sleep()
    rss_asleep = rss_bytes()
    assert engine.sleep() == 0  # already asleep: nothing more to free
    wake_s = engine.wake()
    rows.append(("wake (re-create the KV pool)", wake_s))
    gen_after_wake_s, tokens = best(lambda: generate(engine), 1)
    rows.append(("generate after wake", gen_after_wake_s))
    assert tokens == fresh_tokens and engine.stats().compilations == compilations, "nothing recompiled"

    print(f"model {args.model}: {nbytes / 2**20:.0f} MiB of weights; KV pool {args.num_blocks} blocks x 16 "
          f"tokens; {jax.default_backend()}")
    rss = "" if rss_awake is None else f" (resident memory -{(rss_awake - rss_asleep) / 2**20:.1f} MiB)"
    print(f"sleep freed {freed / 2**20:.1f} MiB per device{rss}; recompilations after update and wake: "
          f"{engine.stats().compilations - compilations}; same tokens as the fresh engine: True")
    print(f"| {'operation':<46} | {'seconds':>8} | {'vs fresh engine':>15} |")
    print(f"|{'-' * 48}|{'-' * 10}|{'-' * 17}|")
    for name, seconds in rows:
        print(f"| {name:<46} | {seconds:>8.4f} | {fresh_s / seconds:>14.1f}x |")


if __name__ == "__main__":
    main()
