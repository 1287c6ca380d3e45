"""Weight-only quantization (`pagedjax.model.quant`): decode throughput, weight bytes and accuracy of float32 vs
int8 vs int4 vs fp8, all in one run.

    python scripts/bench_quant.py                   # the 156M shape, batch 1 and 16
    python scripts/bench_quant.py --quick           # a tiny model (seconds): the smoke test
    python scripts/bench_quant.py --schemes float32,int8,int4:32,int8-head,int4-head
    python scripts/bench_quant.py --formulations    # one layer, each way XLA could compute it, and its HLO

Speed: one engine per scheme over the same random model (`bench_engine.SHAPES`), greedy, fixed lengths; every
engine is warmed up (compiled) first, then timed in interleaved rounds (one run of each per round, so machine
noise hits all rows alike); a row's time is its best round, its ratio is against float32 in the same run.
"weight MB/step" is what one decode step reads (`bench_engine.decode_weight_bytes`: every parameter but the
input embedding table). A scheme name with "-head" also quantizes the LM head (kept float by default).

Accuracy: the bundled model, teacher-forced over a fixed text: the share of positions whose top-1 token is
the float32 model's, and the parameters' bytes.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_engine import SHAPES, decode_weight_bytes
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.model.checkpoint import bundled_model_path, load_checkpoint, load_checkpoint_tokenizer
from pagedjax.model.llama import init_model, model_from_state, quantize_params
from pagedjax.quant_config import QuantConfig

DEFAULT_SCHEMES = "float32,int8,int4,fp8"
TEXT = (  # a fixed text for teacher forcing: code, which the bundled model was trained on
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nclass Stack:\n"
    "    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n")


def quant_config(scheme: str) -> QuantConfig | None:
    """"float32" -> None; "int8", "int4:32", ... -> QuantConfig; a "-head" suffix quantizes the LM head too."""
    if scheme == "float32":
        return None
    name, head = scheme.removesuffix("-head"), scheme.endswith("-head")
    quant = QuantConfig.parse(name)
    return QuantConfig(quant.scheme, quant.group_size, keep_float=()) if head else quant


def quantized(cfg: ModelConfig, state, scheme: str):
    quant = quant_config(scheme)
    return (cfg, state) if quant is None else quantize_params(cfg, state, quant)


def speed(cfg: ModelConfig, schemes: list[str], batches: list[int], prompt_len: int, max_tokens: int,
          repeats: int) -> list[dict]:
    state = nnx.state(init_model(cfg, seed=0), nnx.Param)
    total, block = prompt_len + max_tokens, 16
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for scheme in schemes:
        qcfg, qstate = quantized(cfg, state, scheme)
        engine = LLMEngine(qcfg, CacheConfig(block_size=block, num_blocks=max(batches) * -(-total // block) + 8,
                                             enable_prefix_caching=False),
                           SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * prompt_len,
                                           max_model_len=total), params=qstate)
        weight_bytes = decode_weight_bytes(model_from_state(qcfg, qstate))
        for batch in batches:
            prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
            go = lambda engine=engine, prompts=prompts: engine.generate(prompts, params, use_tqdm=False)
            go()  # warm-up: compiles this batch's shapes
            rows.append(dict(scheme=scheme, batch=batch, go=go, times=[], weight_bytes=weight_bytes))
    for _ in range(repeats):
        for r in rows:
            start = time.perf_counter()
            r["go"]()
            r["times"].append(time.perf_counter() - start)
    for r in rows:
        r["tokens_per_s"] = r["batch"] * max_tokens / min(r["times"])
    return rows


def accuracy(schemes: list[str]) -> list[dict]:
    """Teacher-forced top-1 agreement with float32 on `TEXT`, and parameter bytes, on the bundled model."""
    cfg, state = load_checkpoint(bundled_model_path())
    tokens = load_checkpoint_tokenizer(bundled_model_path(), cfg).encode(TEXT)
    ids = jnp.asarray([tokens], jnp.int32)
    out, want = [], None
    for scheme in schemes:
        qcfg, qstate = quantized(cfg, state, scheme)
        graphdef, s = nnx.split(model_from_state(qcfg, qstate))
        forward = jax.jit(lambda s, t, graphdef=graphdef: nnx.merge(graphdef, s).forward_dense(t))
        top1 = np.asarray(forward(s, ids).argmax(-1))[0]
        want = top1 if want is None else want
        out.append(dict(scheme=scheme, agreement=float((top1 == want).mean()), positions=len(tokens),
                        param_bytes=sum(x.nbytes for x in jax.tree.leaves(qstate))))
    return out


def formulations(n_in: int, n_out: int, batches: list[int], repeats: int = 20) -> None:
    """One linear layer `[n_in, n_out]`, each way of computing it timed (best of `repeats` after a compile) and
    its optimized HLO searched for a float `[n_in, n_out]` buffer (the kernel converted every call)."""
    from pagedjax.model.quant import dequantize_kernel, quantize_kernel, unpack_int4

    rng = np.random.default_rng(0)
    kernel = jnp.asarray(rng.standard_normal((n_in, n_out)), jnp.float32)
    q8, s8 = quantize_kernel(kernel, QuantConfig("int8"))
    int4 = QuantConfig("int4", group_size=128)
    q4, s4 = quantize_kernel(kernel, int4)
    groups = n_in // 128

    def int4_batched(x, q, s):  # a dot per group, then scale and sum: never a float [in, out]
        w = unpack_int4(q).reshape(groups, 128, n_out).astype(x.dtype)
        part = jnp.einsum("bgk,gko->bgo", x.reshape(x.shape[0], groups, 128), w)
        return jnp.einsum("bgo,go->bo", part, s)

    ways = {
        "float32 kernel": (lambda x, w: x @ w, kernel),
        "int8: convert, dot, scale": (lambda x, q, s: (x @ q.astype(x.dtype)) * s, q8, s8),
        "int8: dot(preferred f32)": (lambda x, q, s: jax.lax.dot_general(
            x, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) * s, q8, s8),
        "int8: multiply-reduce": (lambda x, q, s: jnp.sum(x[:, :, None] * q.astype(x.dtype), axis=1) * s, q8, s8),
        "int4: dequantize, dot": (lambda x, q, s: x @ dequantize_kernel(q, s, int4), q4, s4),
        "int4: group dots, sum": (int4_batched, q4, s4),
    }
    print(f"\none layer [{n_in}, {n_out}], {jax.default_backend()}: microseconds per call (best of {repeats})")
    print(f"{'formulation':<28}" + "".join(f"{f'batch {b}':>10}" for b in batches) + f"{'float [in, out] in HLO':>24}")
    float_buffer = f"f32[{n_in},{n_out}]"
    for name, (fn, *weights) in ways.items():
        fn = jax.jit(fn)
        cells = []
        for b in batches:
            x = jnp.asarray(rng.standard_normal((b, n_in)), jnp.float32)
            fn(x, *weights).block_until_ready()
            best = np.inf
            for _ in range(repeats):
                start = time.perf_counter()
                fn(x, *weights).block_until_ready()
                best = min(best, time.perf_counter() - start)
            cells.append(f"{best * 1e6:>10.0f}")
        hlo = fn.lower(x, *weights).compile().as_text()
        converted = name != "float32 kernel" and float_buffer in hlo
        print(f"{name:<28}" + "".join(cells) + f"{'yes' if converted else 'no':>24}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="156m", help="the speed rows' model shape")
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES, help=f"comma-separated (default: {DEFAULT_SCHEMES})")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny model and workload (seconds)")
    ap.add_argument("--formulations", action="store_true",
                    help="only time the ways of computing one quantized layer of the 156M MLP ([1024, 2816])")
    args = ap.parse_args(argv)
    if args.formulations:
        formulations(1024, 2816, [int(b) for b in args.batches.split(",")])
        return
    schemes = args.schemes.split(",")
    if schemes[0] != "float32":
        ap.error("--schemes must start with float32 (the baseline of every ratio)")
    for s in schemes:
        quant_config(s)  # a bad name fails before anything runs
    cfg = SHAPES[args.model]
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        cfg = ModelConfig(vocab_size=64, hidden_size=128, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=64,
                          intermediate_size=256, tie_word_embeddings=False)
        schemes, batches, args.prompt_len, args.max_tokens, args.repeats = schemes[:3], [1, 2], 4, 4, 1
    print(f"{args.model if not args.quick else 'quick'} model, {jax.default_backend()}, prompt {args.prompt_len}, "
          f"{args.max_tokens} new tokens, best of {args.repeats}")
    rows = speed(cfg, schemes, batches, args.prompt_len, args.max_tokens, args.repeats)
    base = {r["batch"]: r for r in rows if r["scheme"] == "float32"}
    print(f"{'scheme':<12}{'batch':>6}{'tokens/s':>11}{'x float32':>11}{'weight MiB/step':>16}{'x fewer bytes':>15}")
    for r in rows:
        b = base[r["batch"]]
        speedup = r["tokens_per_s"] / b["tokens_per_s"]
        print(f"{r['scheme']:<12}{r['batch']:>6}{r['tokens_per_s']:>11.1f}{speedup:>11.2f}"
              f"{r['weight_bytes'] / 2**20:>16.1f}{b['weight_bytes'] / r['weight_bytes']:>15.2f}")
    print("\nbundled model, teacher-forced top-1 agreement with float32")
    print(f"{'scheme':<12}{'agreement':>10}{'positions':>10}{'params MiB':>11}")
    for r in accuracy(schemes):
        print(f"{r['scheme']:<12}{r['agreement']:>10.3f}{r['positions']:>10}{r['param_bytes'] / 2**20:>11.2f}")


if __name__ == "__main__":
    main()
