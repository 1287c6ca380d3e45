"""Multi-LoRA serving (`pagedjax.lora`): decode throughput at batch 16 with 0, 1, 4 and 8 distinct adapters of rank
16 against the base model alone, in one run; device bytes per adapter; adapter swap time.

    python scripts/bench_lora.py              # the 156M shape (`bench_engine.SHAPES`)
    python scripts/bench_lora.py --quick      # a tiny model (seconds): the smoke test
    python scripts/bench_lora.py --forms      # the forms of the per-token product alone (one layer's linears)

Rows: "base" is an engine without LoRA; the others an engine with `lora_config=LoRAConfig(max_loras=4)` (rows of
up to 4 adapters) or 8 (more), every linear targeted, whose 16 requests are spread round-robin over k random
adapters (k = 0: LoRA on, every request on the base model). The grouped product's cost grows with the slots
(`pagedjax.model.layers.lora`), so an engine serves with no more slots than it needs. Every engine is warmed up
(one untimed round) first, then timed in interleaved rounds (one run of each row per round, fresh random prompts
each time, so no prefix-cache hit and machine noise hits all rows alike); a row's time is its best round (prefill
included), its ratio against "base" in the same run; "CPU" the same by the process's CPU time, which a machine
shared with other work moves far less than wall time (`vs base (CPU)` is the column to compare across runs
there). The adapter swap is one slot's write
(`ModelRunner.set_lora_slot`, waited for) plus building its zero-padded arrays on the host; best of 5.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_engine import SHAPES
from safetensors.numpy import save_file

from pagedjax import CacheConfig, LLMEngine, LoRARequest, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.config import LoRAConfig
from pagedjax.model.layers.lora import (
    ATTENTION_MODULES,
    TARGET_MODULES,
    gathered_delta,
    grouped_delta,
    lora_weights_nbytes,
    selected_delta,
    target_shapes,
)

RANK = 16


def write_random_adapter(folder: Path, cfg: ModelConfig, seed: int, rank: int = RANK) -> Path:
    """A PEFT folder of an all-linear adapter with random A and B."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(cfg.num_layers):
        for module, (n_in, n_out) in target_shapes(cfg).items():
            key = f"base_model.model.model.layers.{i}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / math.sqrt(n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": "all-linear", "bias": "none"}))
    return folder


def _engine(cfg: ModelConfig, batch: int, max_len: int, decode_steps: int, max_loras: int | None) -> LLMEngine:
    return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16,
                                                                num_blocks=batch * (-(-max_len // 16)) + 16),
                     scheduler_config=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch),
                                                      max_model_len=max_len),
                     decode_steps_per_call=decode_steps,
                     lora_config=None if max_loras is None else LoRAConfig(max_loras=max_loras, max_lora_rank=RANK))


def throughput(args) -> None:
    cfg = SHAPES["tiny" if args.quick else args.model]
    max_len = args.prompt_len + args.max_tokens
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(Path(tmp) / f"a{i}", cfg, seed=i)))
                    for i in range(8)]
        engines = {None: _engine(cfg, args.batch, max_len, args.decode_steps, None)}
        rows = {"base": (engines[None], None)}
        for k in args.adapters:
            slots = 4 if k <= 4 else 8
            if slots not in engines:
                engines[slots] = _engine(cfg, args.batch, max_len, args.decode_steps, slots)
            rows[f"{k} adapters" if k != 1 else "1 adapter"] = (
                engines[slots], [adapters[i % k] if k else None for i in range(args.batch)])

        def run(engine, loras) -> tuple[float, float]:
            """(wall, process CPU) seconds of one batch."""
            prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
            start, start_cpu = time.perf_counter(), time.process_time()
            out = engine.generate(prompts, params, use_tqdm=False, lora_request=loras)
            assert sum(len(o.outputs[0].token_ids) for o in out) == args.batch * args.max_tokens
            return time.perf_counter() - start, time.process_time() - start_cpu

        for engine, loras in rows.values():  # warm-up: compiles, adapters into their slots
            run(engine, loras)
        best = {name: math.inf for name in rows}
        best_cpu = dict(best)
        for _ in range(args.rounds):
            for name, (engine, loras) in rows.items():
                wall, cpu = run(engine, loras)
                best[name], best_cpu[name] = min(best[name], wall), min(best_cpu[name], cpu)
        tokens = args.batch * args.max_tokens
        print(f"\n{args.model if not args.quick else 'tiny'}: batch {args.batch}, prompt {args.prompt_len}, "
              f"{args.max_tokens} new tokens, decode_steps_per_call {args.decode_steps}, rank {RANK}, "
              f"best of {args.rounds} rounds, {jax.default_backend()}")
        print(f"| {'row':<12} | max_loras | tokens/s | vs base | CPU s | vs base (CPU) |")
        print(f"|{'-' * 14}|----------:|---------:|--------:|------:|--------------:|")
        for name, (engine, _) in rows.items():
            slots = "-" if engine.lora is None else engine.lora.config.max_loras
            print(f"| {name:<12} | {slots:>9} | {tokens / best[name]:8.1f} | {best['base'] / best[name]:6.2f}x | "
                  f"{best_cpu[name]:5.2f} | {best_cpu['base'] / best_cpu[name]:12.3f}x |")
        served = next(e for e in engines.values() if e.lora is not None)
        runner, manager = served.runner, served.lora
        host = manager.host_adapter("1")
        swaps = []
        for _ in range(5):
            start = time.perf_counter()
            a, b = host.slot_arrays(target_shapes(cfg), cfg.num_layers, RANK)
            runner.set_lora_slot(1, a, b, host.scale)
            jax.block_until_ready(runner.lora_weights)
            swaps.append(time.perf_counter() - start)
        print(f"\ndevice bytes per adapter slot (rank {RANK}, all 7 linears): "
              f"{lora_weights_nbytes(cfg, RANK) / 2**20:.2f} MiB; host adapter {host.nbytes / 2**20:.2f} MiB; "
              f"swap (host arrays + slot write): {min(swaps) * 1e3:.1f} ms")


def forms(args) -> None:
    """One layer's 7 target linears at `--batch` tokens: the base products alone, and with each form of the delta,
    timed in interleaved rounds (machine noise hits all alike): median wall and process CPU time (the CPU time
    moves less on a machine shared with other work)."""
    cfg = SHAPES["tiny" if args.quick else args.model]
    shapes = target_shapes(cfg)
    rng = np.random.default_rng(0)
    print(f"\none layer of {args.model if not args.quick else 'tiny'}: 7 linears, {args.batch} tokens, rank {RANK}, "
          f"random slots, median of 30, {jax.default_backend()}")
    for n in (5, 9):
        ws = {m: tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
                       for s in ((i, o), (i, n, RANK), (n, RANK, o))) for m, (i, o) in shapes.items()}
        xs = {m: jnp.asarray(rng.standard_normal((args.batch, i)), jnp.float32) for m, (i, _) in shapes.items()}
        scales, slots = jnp.ones((n,), jnp.float32), jnp.asarray(rng.integers(0, n, args.batch), jnp.int32)
        fns = {}
        for name, delta in (("base", None), ("gathered", gathered_delta), ("selected", selected_delta),
                            ("grouped", grouped_delta)):
            def layer(xs, ws, slots, delta=delta, scales=scales):
                out = []
                for m in TARGET_MODULES:
                    w, a, b = ws[m]
                    y = xs[m] @ w
                    out.append(y if delta is None else y + delta(xs[m], a, b, scales, slots))
                return out
            fns[name] = jax.jit(layer)
            jax.block_until_ready(fns[name](xs, ws, slots))
        wall, cpu = {name: [] for name in fns}, {name: [] for name in fns}
        for _ in range(30):
            for name, fn in fns.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                jax.block_until_ready(fn(xs, ws, slots))
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
        for name in fns:
            wall_ms, cpu_ms = np.median(wall[name]) * 1e3, np.median(cpu[name]) * 1e3
            print(f"  {n} slots  {name:<9} {wall_ms:7.2f} ms  (CPU {cpu_ms:7.2f})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="156m", choices=sorted(SHAPES))
    ap.add_argument("--quick", action="store_true", help="the tiny model, short runs")
    ap.add_argument("--forms", action="store_true", help="only the per-token product's forms")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--adapters", default="0,1,4,8", help="distinct adapters per row (at most 8)")
    args = ap.parse_args(argv)
    args.adapters = [int(k) for k in args.adapters.split(",")]
    if any(not 0 <= k <= 8 for k in args.adapters):
        ap.error("--adapters: each count in [0, 8]")
    if args.quick:
        args.max_tokens, args.rounds = min(args.max_tokens, 16), 1
    logging.basicConfig(level=logging.WARNING)
    if args.forms:
        forms(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
