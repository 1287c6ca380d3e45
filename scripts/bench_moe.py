"""Mixture-of-experts decode on the CPU: a Mixtral-shaped random model against dense models of equal active and of
equal total parameters, through the same engine, at batch 1 and 16.

    python scripts/bench_moe.py                   # 8 experts, top 2: ~330M parameters, ~120M active
    python scripts/bench_moe.py --quick           # a small shape, seconds
    python scripts/bench_moe.py --quantization int8,int4,fp8   # + the MoE model with quantized weights
    python scripts/bench_moe.py --memory          # weight bytes per scheme only (abstract models: no engines)

The ideal MoE decode step costs what a dense model of its *active* parameters costs (each token reads its k
experts' weights); a MoE that runs every expert costs what the dense model of its *total* parameters costs. The
table puts the MoE model between the two. `--quantization` adds the MoE model with its experts and linears
quantized (`pagedjax.model.layers.moe_quant`, `pagedjax.model.layers.quant`), and every row shows its weight
bytes. All rows come from one run, timed in interleaved rounds after a warm-up that compiles every shape (best round per
row), so the ratios hold on a noisy machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.config.moe import MoEConfig
from pagedjax.config.quant import QuantConfig
from pagedjax.model.llama import abstract_model, init_model

SHAPES = {
    # Mixtral's proportions scaled to this CPU: 8 experts, top 2, MLP width 2048 per expert.
    "mixtral-small": dict(base=ModelConfig(vocab_size=32000, hidden_size=768, num_layers=8, num_q_heads=12,
                                           num_kv_heads=4, head_dim=64, intermediate_size=2048,
                                           tie_word_embeddings=False), experts=8, top_k=2),
    # DeepSeek-V2-Lite's expert count and top-k at a third of its width: 64 experts, top 6, MLP width 512 each
    # (scripts/bench_moe_layer.py --shape deepseek-small: where "tiled" pays off).
    "deepseek-small": dict(base=ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_q_heads=16,
                                            num_kv_heads=16, head_dim=64, intermediate_size=512,
                                            tie_word_embeddings=False), experts=64, top_k=6),
    # scripts/bench_mla_hf.py's "small" DeepSeek V3's MoE layers: 16 experts of width 256, top 4, hidden 512.
    "deepseek-v3-small": dict(base=ModelConfig(vocab_size=16000, hidden_size=512, num_layers=6, num_q_heads=8,
                                               num_kv_heads=8, head_dim=64, intermediate_size=256,
                                               tie_word_embeddings=False), experts=16, top_k=4),
    "quick": dict(base=ModelConfig(vocab_size=512, hidden_size=128, num_layers=2, num_q_heads=4, num_kv_heads=2,
                                   head_dim=32, intermediate_size=256), experts=8, top_k=2),
}


def param_count(cfg: ModelConfig) -> int:
    model = init_model(cfg.replace(quantization=None), seed=0)
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def weight_bytes(cfg: ModelConfig) -> int:
    """The bytes of the model's parameters as stored (quantized values and their scales included), from its
    abstract model: nothing is allocated."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def memory_table(shape: str, schemes: list[str]) -> None:
    """Weight MiB of the shape's MoE model per scheme (the LM head float, as by default), and with the experts
    kept float too (`keep_float=("lm_head", "experts")`: the linears alone quantized)."""
    cfg = next(iter(models(shape).values()))
    base = weight_bytes(cfg)
    print(f"shape {shape}: MoE weights as stored (embeddings, router and LM head float)")
    print(f"{'scheme':24s} {'MiB':>9s} {'x fewer':>8s}")
    print(f"{'float32':24s} {base / 2**20:9.1f} {1:8.2f}")
    for scheme in schemes:
        quant = QuantConfig.parse(scheme)
        for label, q in ((scheme, quant), (f"{scheme}, experts float",
                                            dataclasses.replace(quant, keep_float=("lm_head", "experts")))):
            nbytes = weight_bytes(cfg.replace(quantization=q))
            print(f"{label:24s} {nbytes / 2**20:9.1f} {base / nbytes:8.2f}")


def models(shape: str, schemes: tuple[str, ...] = ()) -> dict[str, ModelConfig]:
    """The MoE model, its two dense yardsticks (the same attention, embeddings and LM head) and the MoE model in
    each quantization scheme of `schemes`."""
    s = SHAPES[shape]
    base, e, k = s["base"], s["experts"], s["top_k"]
    moe = MoEConfig(num_experts=e, num_experts_per_tok=k, intermediate_size=base.intermediate_size)
    return {
        f"MoE {e} experts, top {k}": dataclasses.replace(base, moe=moe),
        **{f"MoE {e} experts, top {k}, {q}": dataclasses.replace(base, moe=moe, quantization=q) for q in schemes},
        f"dense, active size (MLP width {k}x)": dataclasses.replace(base, intermediate_size=k * base.intermediate_size),
        f"dense, total size (MLP width {e}x)": dataclasses.replace(base, intermediate_size=e * base.intermediate_size),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small shape and few tokens (seconds)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="", help="comma-separated schemes (int8, int4, int4:32, fp8): rows "
                    "of the MoE model quantized")
    ap.add_argument("--memory", action="store_true", help="only the weight bytes per scheme (int8, int4, fp8 "
                    "unless --quantization), no engines")
    args = ap.parse_args(argv)
    shape = "quick" if args.quick else "mixtral-small"
    schemes = tuple(q for q in args.quantization.split(",") if q)
    if args.memory:
        memory_table(shape, list(schemes or ("int8", "int4", "fp8")))
        return
    max_tokens = 8 if args.quick else args.max_tokens
    cfgs = models(shape, schemes)
    counts = {name: param_count(cfg) for name, cfg in cfgs.items()}
    mib = {name: weight_bytes(cfg) / 2**20 for name, cfg in cfgs.items()}
    rng = np.random.default_rng(0)
    total = args.prompt_len + max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    print(f"shape {shape}, {args.prompt_len}-token prompts, {max_tokens} new tokens each, float32, "
          f"decode_steps_per_call 1, best of {args.repeats} interleaved rounds")
    print(f"{'model':42s} {'params':>8s} {'MiB':>7s} {'batch':>5s} {'tokens/s':>9s} {'MoE/this':>8s}")
    for batch in args.batch:
        prompts = rng.integers(0, 512, (batch, args.prompt_len)).tolist()
        engines = {}
        for name, cfg in cfgs.items():
            engines[name] = LLMEngine(
                model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=batch * -(-total // 16) + 8,
                                                           enable_prefix_caching=False),
                scheduler_config=SchedulerConfig(max_num_seqs=batch,
                                                 max_num_batched_tokens=max(batch * args.prompt_len, 16),
                                                 max_model_len=total), params=init_model(cfg, seed=0), backend="xla")
            engines[name].generate(prompts, params, use_tqdm=False)  # warm-up: compiles every shape
        best = dict.fromkeys(engines, np.inf)
        for _ in range(args.repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.generate(prompts, params, use_tqdm=False)
                best[name] = min(best[name], time.perf_counter() - start)
        moe_time = best[next(iter(engines))]
        for name in engines:
            print(f"{name:42s} {counts[name] / 1e6:7.0f}M {mib[name]:7.0f} {batch:5d} "
                  f"{batch * max_tokens / best[name]:9.1f} {moe_time / best[name]:8.2f}")
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
