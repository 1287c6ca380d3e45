"""KV cache bytes per token and sequences per pool at long contexts: DeepSeek V4 (compressed attention) against
DeepSeek V3.2 (MLA + indexer keys) and a GQA-8 model, as the engine allocates them.

For each model and context n, one request of n tokens is run through the engine's own block accounting (the host
side, no JAX: `KVCacheManager` over the model's `ModelSpec.kv_layout`, its pools sized as `CacheConfig` sizes them)
in prefill chunks, releasing out-of-window blocks as the scheduler does; the blocks it holds at the end, times
each pool's bytes per block (`CacheConfig.block_bytes`), are the sequence's KV bytes. The same number is computed
from the specs alone (every layer's bytes per token times n, a window layer's window, a state's snapshots) and
the two must agree to within a block per group (asserted). "per token" is that over n; "seqs / 80 GiB" how many
such sequences an 80 GiB pool holds.

Shapes (bfloat16 pages, blocks of 256 tokens: a multiple of V4's HCA rate, 128):
  DeepSeek V4-Flash  transformers' DeepseekV4Config defaults: 43 layers (2 HCA, then CSA / HCA alternating), one
                     K = V head of 512, window 128, CSA rate 4 with 128-dim indexer keys, HCA rate 128;
  DeepSeek V3.2      61 layers of MLA latents (512 + 64) and 128-dim indexer keys (IndexedSparse);
  GQA-8              64 layers of 8 KV heads of 128 (a 70B-class dense model).

    python scripts/bench_kv_bytes.py             # 8k, 128k, 1M
    python scripts/bench_kv_bytes.py --quick     # 8k only (CI smoke)
"""

from __future__ import annotations

import argparse
import logging

from pagedjax.config import CacheConfig, FullAttention, IndexedSparse, ModelSpec
from pagedjax.config.deepseek_v4 import CSA, HCA, DeepSeekV4Config
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.request import Request

logger = logging.getLogger("bench_kv_bytes")
BLOCK = 256
POOL_BYTES = 80 * 2 ** 30
CHUNK = 8192


def v4_flash() -> ModelSpec:
    layers = 43
    kinds = tuple([HCA] * 2 + [CSA if i % 2 else HCA for i in range(layers - 2)])
    return DeepSeekV4Config(
        vocab_size=129280, hidden_size=4096, num_layers=layers, num_heads=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, layer_types=kinds,
        mlp_layer_types=("hash_moe",) * 3 + ("moe",) * (layers - 3), csa_rate=4, hca_rate=128, index_n_heads=64,
        index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, num_experts=256,
        num_experts_per_tok=6, moe_intermediate_size=2048, n_shared_experts=1, routed_scaling_factor=1.5,
        scoring_func="sqrtsoftplus", swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
        max_position_embeddings=1 << 20, dtype="bfloat16").spec


def v32() -> ModelSpec:
    return ModelSpec(vocab_size=129280, num_layers=61, num_q_heads=128, dtype="bfloat16",
                     max_position_embeddings=1 << 20, kv_layers=(IndexedSparse(512, 64, 128, 2048),) * 61)


def gqa8() -> ModelSpec:
    return ModelSpec(vocab_size=128256, num_layers=64, num_q_heads=64, dtype="bfloat16",
                     max_position_embeddings=1 << 20, kv_layers=(FullAttention(8, 128),) * 64)


def allocated_bytes(spec: ModelSpec, n: int) -> int:
    """The bytes the engine's block accounting holds for one request of n tokens, prefilled in chunks."""
    cache = CacheConfig(block_size=BLOCK, num_blocks=n // BLOCK + 64)
    layout = spec.kv_layout
    sizes = cache.resolve_pool_block_sizes(spec)
    extra = tuple(n // sizes[p] + 64 for p in range(1, len(layout.pools)))
    manager = KVCacheManager.from_config(cache, cache.num_blocks, group_windows=layout.windows,
                                         group_pools=layout.group_pools, extra_pools=extra, pool_block_sizes=sizes)
    request = Request("r", [1] * n)
    while request.num_computed_tokens < n:
        step = min(CHUNK, n - request.num_computed_tokens)
        if manager.allocate_slots(request, step) is None:
            raise RuntimeError(f"the pool ran out at {request.num_computed_tokens} tokens")
        request.num_computed_tokens += step
        manager.cache_blocks(request)
        manager.release_out_of_window(request)
    held = [listed - released for listed, released in zip(manager.per_group(manager.num_held_blocks("r")),
                                                           manager.per_group(manager.num_released_blocks("r")),
                                                           strict=True)]
    bytes_per_block = [cache.block_bytes(spec, pool) for pool in range(len(layout.pools))]
    return sum(count * bytes_per_block[layout.groups[g].pool] for g, count in enumerate(held))


def spec_bytes(spec: ModelSpec, n: int) -> int:
    """The same from the specs: every kept position's bytes, a window's W positions, a state's two snapshots."""
    total = 0
    for layer in spec.kv_layers:
        if layer.pool == "state":
            total += 2 * layer.bytes_per_block(BLOCK, 2)
        elif layer.release_window is not None:
            total += min(n, layer.release_window) * layer.bytes_per_token(2)
        else:
            total += layer.bytes_per_block(n, 2) if n % getattr(layer, "tokens_per_entry", 1) == 0 else \
                n * layer.bytes_per_token(2)
    return total


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    contexts = [8 << 10] if args.quick else [8 << 10, 128 << 10, 1 << 20]
    models = {"DeepSeek V4-Flash": v4_flash(), "DeepSeek V3.2": v32(), "GQA-8 (64 layers)": gqa8()}
    rows = [f"| {'model':<18} | {'context':>8} | {'KV / token':>11} | {'KV / sequence':>13} | {'seqs / 80 GiB':>13} "
            f"| {'spec formula':>12} |", "|" + "|".join("-" * w for w in (20, 10, 13, 15, 15, 14)) + "|"]
    for name, spec in models.items():
        groups = spec.kv_layout.num_groups
        for n in contexts:
            got = allocated_bytes(spec, n)
            want = spec_bytes(spec, n)
            slack = groups * max(spec.kv_layout.bytes_per_block(BLOCK, 2, pool=p)
                                 for p in range(len(spec.kv_layout.pools)))
            assert abs(got - want) <= slack, (name, n, got, want)
            rows.append(f"| {name:<18} | {n // 1024:>7}k | {got / n / 1024:>7.1f} KiB | {got / 2 ** 30:>9.2f} GiB "
                        f"| {POOL_BYTES // got:>13} | {want / n / 1024:>8.1f} KiB |")
    logger.info("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
