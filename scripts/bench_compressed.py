"""Compressed attention's cost curve on this machine (DeepSeek V4), next to DeepSeek V3.2's sparse attention (DSA)
and dense MLA: one layer's attention through the engine's CPU path (the XLA gathers of `pallas_kernels`), per decode
token and per prefill chunk, at growing contexts, with each curve's growth exponent (the slope of log time over log
context between the first and the last context). A table.

What the definitions predict: per decode token dense MLA is O(n); DSA's indexer scores every earlier token, O(n),
and its attention is O(k); V4's CSA indexer scores every compressed entry, O(n / m), and its attention reads the
window and k entries, O(W + k); HCA reads the window and every entry, O(W + n / m'); the window alone is O(W). A
prefill chunk of c rows at the end of an n-token prompt costs c times that (a whole prompt: the sum over its chunks,
O(n^2) for dense and the indexers, O(n (W + k)) for CSA's attention).

    python scripts/bench_compressed.py               # contexts 1k..64k
    python scripts/bench_compressed.py --quick       # seconds: the smoke test
    python scripts/bench_compressed.py --engine      # tiny models end to end through LLMEngine, contexts 1k..16k

`--engine`: a tiny model of each kind (2 layers, hidden 256, 8 heads, 4 experts of 256 top 2; V4 one CSA and one
HCA layer, V3.2 both layers DSA, dense MLA the same without the indexer; the layer shapes above) served by the
engine on this CPU (XLA backend, blocks of 128, prefill chunks of 2048, one sequence, prefix caching off): a whole
prompt's prefill, and decode per token (64 tokens after it, less the prefill), each the best of 2 after a warm-up
request of the same shape.

Shapes (scaled down so that 64k contexts fit this CPU): 8 query heads; V4 one K = V head of 128 (32 rotary), window
128, CSA rate 4 with an indexer of 8 heads of 64 keeping 256, HCA rate 128; V3.2 a latent of 128 + 32, the same
indexer and top-k; float32, blocks of 128 tokens, one sequence; prefill chunks of 256 rows.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_sparse import best_time  # noqa: E402  (this folder: the script's own)

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import compressed as ck  # noqa: E402

logger = logging.getLogger("bench_compressed")
HEADS, DIM, WINDOW, CSA, HCA = 8, 128, 128, 4, 128
RANK, ROPE, INDEX_HEADS, INDEX_DIM, TOPK, BLOCK, CHUNK = 128, 32, 8, 64, 256, 128, 256
DECODE = 64  # `--engine`: decode tokens timed after the prefill


def layer_times(context: int, rows: int, repeats: int) -> dict[str, float]:
    """Seconds of each layer kind's attention for the last `rows` queries of one `context`-token sequence."""
    rng = np.random.default_rng(0)
    blocks = -(-context // BLOCK)
    table = jnp.asarray(rng.permutation(blocks + 1)[:blocks].astype(np.int32)[None])
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32) / 4)  # noqa: E731
    kv_lens, cu = jnp.asarray([context], jnp.int32), jnp.asarray([0, rows], jnp.int32)
    window, q = f32(blocks + 1, BLOCK, DIM), f32(rows, HEADS, DIM)
    csa, csa_keys, hca = f32(blocks + 1, BLOCK // CSA, DIM), f32(blocks + 1, BLOCK // CSA, INDEX_DIM), \
        f32(blocks + 1, BLOCK // HCA, DIM)
    q_index, weights = f32(rows, INDEX_HEADS, INDEX_DIM), f32(rows, INDEX_HEADS)
    sinks = jnp.zeros((HEADS,), jnp.float32)
    attend = lambda pages, rate, selected: ck.compressed_attention_xla(  # noqa: E731
        q, window, table, pages, None if pages is None else table, kv_lens, cu, selected, sinks, scale=DIM ** -0.5,
        sliding_window=WINDOW, compress_rate=rate)

    @jax.jit
    def v4_csa():
        scores = ck.compressed_index_scores_xla(q_index, weights, csa_keys, table, kv_lens, cu,
                                                scale=INDEX_DIM ** -0.5, compress_rate=CSA)
        return attend(csa, CSA, pk.top_k_positions_and_ties(scores, TOPK)[0])

    latent, index_pages = f32(blocks + 1, BLOCK, RANK + ROPE), f32(blocks + 1, BLOCK, INDEX_DIM)
    q_latent, q_rope = f32(rows, HEADS, RANK), f32(rows, HEADS, ROPE)
    scale = (RANK + ROPE) ** -0.5

    @jax.jit
    def dsa():
        scores = pk.ragged_indexer_scores_xla(q_index, weights, index_pages, table, kv_lens, cu,
                                              scale=INDEX_DIM ** -0.5)
        selected = pk.top_k_positions_and_ties(scores, TOPK)[0]
        return pk.ragged_sparse_mla_paged_attention_xla(q_latent, q_rope, latent, table, kv_lens, cu, selected,
                                                        scale=scale)

    programs = {"V4 window only": jax.jit(lambda: attend(None, None, None)), "V4 CSA": v4_csa,
                "V4 HCA": jax.jit(lambda: attend(hca, HCA, None)), "V3.2 DSA": dsa,
                "dense MLA": jax.jit(lambda: pk.ragged_mla_paged_attention_xla(q_latent, q_rope, latent, table,
                                                                               kv_lens, cu, scale=scale))}
    return {name: best_time(fn, repeats=repeats) for name, fn in programs.items()}


def tiny_models() -> dict:
    """name -> a function building the tiny model of that kind (`--engine`)."""
    from pagedjax.config.deepseek import DeepSeekConfig
    from pagedjax.config.deepseek_v4 import CSA as CSA_LAYER
    from pagedjax.config.deepseek_v4 import HCA as HCA_LAYER
    from pagedjax.config.deepseek_v4 import DeepSeekV4Config
    from pagedjax.model.families.deepseek import init_deepseek
    from pagedjax.model.families.deepseek_v4 import init_deepseek_v4

    v4 = DeepSeekV4Config(
        vocab_size=512, hidden_size=256, num_layers=2, num_heads=HEADS, head_dim=DIM, rope_dim=ROPE, q_lora_rank=128,
        o_groups=2, o_lora_rank=128, sliding_window=WINDOW, layer_types=(CSA_LAYER, HCA_LAYER),
        mlp_layer_types=("moe", "moe"), csa_rate=CSA, hca_rate=HCA, index_n_heads=INDEX_HEADS,
        index_head_dim=INDEX_DIM, index_topk=TOPK, hc_mult=2, hc_sinkhorn_iters=20, hc_eps=1e-6, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=256, n_shared_experts=1, routed_scaling_factor=1.0,
        scoring_func="sqrtsoftplus", swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
        max_position_embeddings=1 << 17)
    mla = DeepSeekConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=HEADS, intermediate_size=512,
                         kv_lora_rank=RANK, qk_nope_head_dim=64, qk_rope_head_dim=ROPE, v_head_dim=64, q_lora_rank=128,
                         max_position_embeddings=1 << 17,
                         moe=dict(num_experts=4, num_experts_per_tok=2, intermediate_size=256, num_shared_experts=1,
                                  first_k_dense_replace=0))
    dsa = mla.replace(indexer=dict(num_heads=INDEX_HEADS, head_dim=INDEX_DIM, topk=TOPK))
    return {"V4 (CSA + HCA)": lambda: init_deepseek_v4(v4), "V3.2 DSA": lambda: init_deepseek(dsa),
            "dense MLA": lambda: init_deepseek(mla)}


def engine_times(build, context: int) -> tuple[float, float]:
    """(seconds of one prompt's prefill, seconds per decode token) of a tiny model at `context` (`--engine`)."""
    from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig

    engine = LLMEngine(model=build(), backend="xla", compile_cache=False,
                       cache_config=CacheConfig(block_size=BLOCK, num_blocks=2 * (context // BLOCK) + 16,
                                                enable_prefix_caching=False),
                       scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048,
                                                        max_model_len=context + DECODE + 8))
    rng = np.random.default_rng(context)
    prompt = lambda: rng.integers(3, 500, context).tolist()  # noqa: E731

    def timed(new: int) -> float:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            engine.generate([prompt()], params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return best

    timed(DECODE + 1)  # compiles every program these requests run
    prefill = timed(1)
    return prefill, (timed(DECODE + 1) - prefill) / DECODE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="contexts 1k and 4k, one repeat")
    parser.add_argument("--engine", action="store_true", help="tiny models end to end (contexts 1k..16k)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.engine:
        contexts = [1024, 4096] if args.quick else [1024, 4096, 16384]
        times = {name: {n: engine_times(build, n) for n in contexts} for name, build in tiny_models().items()}
        lines = []
        for mode, index in (("whole-prompt prefill (s)", 0), ("decode (ms per token)", 1)):
            lines += ["", f"{mode}, tiny models end to end, {jax.default_backend()}:", "",
                      "| model | " + " | ".join(f"{n // 1024}k" for n in contexts) + " | growth exponent |",
                      "|---|" + "---:|" * (len(contexts) + 1)]
            for name, by_n in times.items():
                t = [by_n[n][index] for n in contexts]
                slope = math.log(t[-1] / t[0]) / math.log(contexts[-1] / contexts[0])
                scale = 1.0 if index == 0 else 1e3
                lines.append(f"| {name} | " + " | ".join(f"{x * scale:.3f}" for x in t) + f" | {slope:.2f} |")
        logger.info("\n".join(lines))
        return
    contexts = [1024, 4096] if args.quick else args.contexts
    repeats = 1 if args.quick else args.repeats
    lines = []
    for mode, rows in (("decode (ms per token)", 1), (f"prefill chunk of {CHUNK} rows (ms)", CHUNK)):
        times = {n: layer_times(n, rows, repeats) for n in contexts}
        names = list(times[contexts[0]])
        lines += ["", f"{mode}, one layer, {jax.default_backend()}:", "",
                  "| layer | " + " | ".join(f"{n // 1024}k" for n in contexts) + " | growth exponent |",
                  "|---|" + "---:|" * (len(contexts) + 1)]
        for name in names:
            t = [times[n][name] for n in contexts]
            slope = math.log(t[-1] / t[0]) / math.log(contexts[-1] / contexts[0])
            lines.append(f"| {name} | " + " | ".join(f"{x * 1e3:.3f}" for x in t) + f" | {slope:.2f} |")
    logger.info("\n".join(lines))


if __name__ == "__main__":
    main()
