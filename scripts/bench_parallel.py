"""Tensor and data parallelism on 8 CPU devices, and what paging buys a Llama-3-70B on 8 GPUs.

Part 1 (measured): the small model (`ModelConfig()`: 4 layers, hidden 256, 8/2 heads; `--model tiny` for a
2-layer one) served by dp x tp engines on XLA:CPU's 8 host-platform devices: per-device weight and KV bytes,
compile time, generated tokens/s, and whether the greedy tokens equal the one-device run. The 8 "devices" are
threads of one CPU sharing its cores and memory bandwidth: the numbers show the overhead of sharding (the
all-reduces, the shard_map'd attention, more programs to compile), not a speed-up. On GPUs the same programs
split each step's weight reads over tp devices.

Part 2 (projected from the KV formula `kv_cache_bytes` = 2 L T Hkv D b, per device Hkv / tp heads): how many
concurrent 4k-token requests a Llama-3-70B-shaped model (80 layers, 64/8 heads, head_dim 128, bf16) fits on
8 x 141 GB GPUs (H200) at tp 8, paged (blocks of 16, each request holds what it uses) against a contiguous
reservation of max_model_len per request.

    python scripts/bench_parallel.py                  # both parts
    python scripts/bench_parallel.py --quick          # tiny model, few tokens (the smoke test)
    python scripts/bench_parallel.py --projection-only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "jax" not in sys.modules:  # the device count is fixed when JAX's CPU backend starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 10**9
MIXES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (8, 1)]  # (dp, tp)


def _device_bytes(arrays) -> int:
    """The most bytes any one device holds of `arrays`."""
    per: dict = {}
    for a in arrays:
        for s in a.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values())


def measure(args) -> list[dict]:
    import jax
    import numpy as np
    from flax import nnx

    from pagedjax import CacheConfig, ModelConfig, SamplingParams, SchedulerConfig, make_engine
    from pagedjax.model.llama import init_model
    from pagedjax.parallel import ParallelConfig

    cfg = ModelConfig() if args.model == "small" else ModelConfig(num_layers=2, hidden_size=64, head_dim=16,
                                                                  intermediate_size=128)
    state = nnx.split(init_model(cfg, 0))[1]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, reference = [], None
    for dp, tp in args.mixes:
        if dp * tp > len(jax.devices()):
            continue
        # Prefix caching off: the timed run repeats the warm-up's prompts, and hits would change its shapes.
        engine = make_engine(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=args.num_blocks,
                                                                        enable_prefix_caching=False),
                             scheduler_config=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=512,
                                                              max_model_len=512), params=state,
                             decode_steps_per_call=args.decode_steps, compile_cache=False,
                             parallel_config=None if dp * tp == 1 else ParallelConfig(tensor_parallel_size=tp,
                                                                                      data_parallel_size=dp))
        replicas = getattr(engine, "replicas", [engine])
        engine.generate(prompts, greedy, use_tqdm=False)  # warm-up: compiles every shape the timed run needs
        warm = [r.stats() for r in replicas]
        start = time.perf_counter()
        outs = engine.generate(prompts, greedy, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = [o.output_token_ids for o in outs]
        reference = reference or tokens
        stats = [r.stats() for r in replicas]
        run = replicas[0].runner
        rows.append(dict(
            dp=dp, tp=tp, weight_mb=_device_bytes(run._param_leaves) / 2**20,
            kv_mb=stats[0].kv_cache_bytes_per_device / 2**20, compile_s=sum(w.compile_s for w in warm),
            timed_compilations=sum(s.compilations - w.compilations for s, w in zip(stats, warm, strict=True)),
            tokens_per_s=len(prompts) * args.max_tokens / wall,
            same=np.mean([a == b for a, b in zip(tokens, reference, strict=True)])))
        print(f"  dp {dp} x tp {tp}: {rows[-1]['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
        if hasattr(engine, "close"):
            engine.close()
    return rows


def projection(gpu_gb: float = 141.0, num_gpus: int = 8, utilization: float = 0.9, request_len: int = 4096,
               block_size: int = 16) -> list[dict]:
    """Concurrent request_len-token requests of a Llama-3-70B shape on num_gpus GPUs, per layout."""
    from pagedjax.config import ModelConfig
    from pagedjax.config.cache import kv_cache_bytes
    from pagedjax.parallel.sharding import per_device_model

    cfg = ModelConfig(vocab_size=128256, hidden_size=8192, num_layers=80, num_q_heads=64, num_kv_heads=8,
                      head_dim=128, intermediate_size=28672, tie_word_embeddings=False, dtype="bfloat16",
                      max_position_embeddings=131072)
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    per_layer = h * d * (cfg.num_q_heads * 2 + cfg.num_kv_heads * 2) + 3 * h * i + 2 * h
    weights = (cfg.num_layers * per_layer + 2 * v * h + h) * 2  # bf16
    rows = []
    for dp, tp in [(1, 8), (2, 4)]:
        dev = per_device_model(cfg, tp)
        per_token = kv_cache_bytes(cfg.num_layers, 1, dev.num_kv_heads, d, 2)  # one device's share of a token
        kv_budget = gpu_gb * GB * utilization - weights / tp
        blocks = int(kv_budget // (per_token * block_size))
        paged = dp * (blocks // -(-request_len // block_size))
        row = dict(layout=f"dp {dp} x tp {tp}", weights_gb=weights / tp / GB, kv_gb=kv_budget / GB,
                   kv_per_token_kb=per_token / 1024, tokens=dp * blocks * block_size, paged=paged)
        for max_len in (8192, 131072):
            row[f"reserve_{max_len}"] = dp * int(kv_budget // (per_token * max_len))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["small", "tiny"], default="small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="tiny model, batch 4, 8 tokens, tp 1 and 2, dp 2 x tp 2")
    p.add_argument("--projection-only", action="store_true")
    args = p.parse_args(argv)
    args.mixes = MIXES
    if args.quick:
        args.model, args.batch, args.max_tokens, args.mixes = "tiny", 4, 8, [(1, 1), (1, 2), (2, 2)]
    if not args.projection_only:
        import jax

        print(f"## dp x tp on {len(jax.devices())} {jax.default_backend()} devices ({args.model} model, batch "
              f"{args.batch}, {args.prompt_len} + {args.max_tokens} tokens, greedy, {args.decode_steps} fused "
              f"decode steps; CPU devices share one CPU: overheads, not speed-ups)\n")
        print("| dp x tp | weights / device (MiB) | KV / device (MiB) | compile (s) | tokens/s | same tokens |")
        print("|---|---|---|---|---|---|")
        for r in measure(args):
            print(f"| {r['dp']} x {r['tp']} | {r['weight_mb']:.2f} | {r['kv_mb']:.2f} | {r['compile_s']:.1f} | "
                  f"{r['tokens_per_s']:.0f} | {r['same']:.3f} |"
                  + (f" ({r['timed_compilations']} compilations in the timed run)" if r['timed_compilations'] else ""))
        print()
    print("## Llama-3-70B shape on 8 x 141 GB (H200), 90% of memory for weights + KV, bf16, 4096-token requests\n")
    print("| layout | weights / GPU (GB) | KV / GPU (GB) | KV / token / GPU (KiB) | KV tokens in all "
          "| paged (block 16) "
          "| reserve 8k (Llama 3) | reserve 128k (Llama 3.1) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in projection():
        print(f"| {r['layout']} | {r['weights_gb']:.1f} | {r['kv_gb']:.1f} | {r['kv_per_token_kb']:.0f} | "
              f"{r['tokens']:,} | {r['paged']:,} | {r['reserve_8192']:,} | {r['reserve_131072']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
