"""One mixture-of-experts MLP layer on the CPU, each way it can be computed, against dense MLPs of its active and
total size: where `scripts/bench_moe.py`'s decode time goes, one layer at a time.

    python scripts/bench_moe_layer.py                 # the bench_moe shape: 8 experts of width 2048, top 2
    python scripts/bench_moe_layer.py --batch 1 4 16
    python scripts/bench_moe_layer.py --shape deepseek-small --batch 16 64 256 1024   # 64 experts, top 6
    python scripts/bench_moe_layer.py --shape deepseek-v3-small --batch 64 256 1024   # bench_mla_hf's: 16, top 4

Rows (float32, each jitted alone, timed in interleaved rounds after a warm-up; a row's time is its best round
and its ratio is against the dense MLP of the MoE's active size in the same run):
  dense, active size / total size   `pagedjax.model.llama.MLP` of width k x / E x the expert width
  MoE "by_pair" / "every", stacked  `MoEMLP(x, method)` (routing included) on the stacked expert weights, the
                                    form checkpoints and expert parallelism use (`pagedjax.model.layers.moe`)
  MoE "tiled" (tiles of R)          per-expert, the pairs sorted by expert in tiles of R rows, a tile per
                                    switch (the CPU's pick, `moe.cpu_method`, for many pairs of many experts;
                                    R = `moe.tile_rows`'s pick, and half and twice it)
  ... per-expert                    the same on the experts as separate arrays (`per_expert_params`), the form
                                    the engine's runner gives a single-device CPU step
  probe: every, [E, hidden, width]  every expert on every row with gate / up stacked (in, out) per expert, the
                                    layout `Experts` had before: einsums batched over the experts
  MoE <scheme> ..., per-expert      with `--quantization`: the layer with quantized experts
                                    (`pagedjax.model.layers.moe_quant`), compiled with the options the engine's runner
                                    gives quantized models; its max |err| is against the float layer (the
                                    quantization's own error)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_moe import SHAPES
from flax import nnx

from pagedjax.config.moe import MoEConfig
from pagedjax.model.layers import moe
from pagedjax.model.layers.moe import MoEMLP, per_expert_params, route
from pagedjax.model.layers.moe_quant import moe_mlp
from pagedjax.model.llama import MLP
from pagedjax.runner.runner import cpu_compiler_options


def _module_fn(module: nnx.Module, per_expert: bool = False, options: dict | None = None, **kwargs):
    """A jitted call of `module` with its weights as arguments (closed over, XLA would fold them into
    constants: per-expert constants that no branch needs to slice); `per_expert`: the experts as the engine
    holds them on one CPU device (`per_expert_params`); `options`: XLA compile options."""
    graphdef, state = nnx.split(module)
    state = per_expert_params(state) if per_expert else state
    run = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, **kwargs))
    if options is None:
        return lambda x: run(state, x)
    compiled = {}

    def call(x):
        if x.shape not in compiled:
            compiled[x.shape] = run.lower(state, x).compile(compiler_options=options)
        return compiled[x.shape](state, x)
    return call


def _stacked_in_out_every(mlp: MoEMLP):
    """Every expert on every row with gate / up as `[E, hidden, width]`, combined by the MLP's own routing."""
    weights = tuple(jnp.swapaxes(w[...], 1, 2) for w in (mlp.experts.gate_proj, mlp.experts.up_proj))
    weights += (mlp.experts.down_proj[...], mlp.gate.kernel[...])

    @jax.jit
    def run(x, gate, up, down, router):
        w, experts = route(x @ router, mlp.top_k, mlp.router, mlp.norm_topk_prob)
        combine = jnp.zeros((x.shape[0], mlp.num_experts)).at[jnp.arange(x.shape[0])[:, None], experts].add(w)
        h = jax.nn.silu(jnp.einsum("nh,ehw->enw", x, gate)) * jnp.einsum("nh,ehw->enw", x, up)
        return jnp.einsum("ne,enh->nh", combine, jnp.einsum("enw,ewh->enh", h, down))
    return lambda x: run(x, *weights)


def _tiled_fn(mlp: MoEMLP, size: int):
    """`MoEMLP(x, "tiled")` per-expert with tiles of `size` rows (`moe.tile_rows` set to return it while tracing)."""
    call = _module_fn(mlp, True, method="tiled")

    def run(x):
        pick, moe.tile_rows = moe.tile_rows, lambda *_: size
        try:
            return call(x)
        finally:
            moe.tile_rows = pick
    return run


def rows(shape: str, batch: int, schemes: tuple[str, ...] = ()) -> tuple[dict, MoEMLP]:
    """(name -> a function of x `[batch, hidden]` or None where it does not apply, the MoE layer); `schemes`: rows
    of the layer with its experts quantized so, per-expert."""
    s = SHAPES[shape]
    base, e, k = s["base"], s["experts"], s["top_k"]
    cfg = base.replace(moe=MoEConfig(num_experts=e, num_experts_per_tok=k, intermediate_size=base.intermediate_size))
    mlp = MoEMLP(cfg, jnp.float32, nnx.Rngs(0))
    dense = {f"dense, active size (width {k}x)": k, f"dense, total size (width {e}x)": e}
    out = {name: _module_fn(MLP(base.replace(intermediate_size=m * base.intermediate_size), jnp.float32,
                                nnx.Rngs(1))) for name, m in dense.items()}
    for form, per_expert in (("stacked", False), ("per-expert", True)):
        out[f'MoE "by_pair", {form}'] = _module_fn(mlp, per_expert, method="by_pair") if batch * k < e else None
        out[f'MoE "every", {form}'] = _module_fn(mlp, per_expert, method="every")
    pick = moe.tile_rows(batch * k, e)
    for size in (pick // 2, pick, 2 * pick) if batch * k >= e else ():
        out[f'MoE "tiled" (tiles of {size}){" <- pick" if size == pick else ""}'] = _tiled_fn(mlp, size)
    out["probe: every, [E, hidden, width]"] = _stacked_in_out_every(mlp)
    for scheme in schemes:
        qcfg = cfg.replace(quantization=scheme)
        qmlp = moe_mlp(qcfg, jnp.float32, nnx.Rngs(0))  # the float layer's init, quantized
        options = cpu_compiler_options(qcfg.spec, batch, quantized=True)
        out[f'MoE {scheme} "by_pair", per-expert'] = (_module_fn(qmlp, True, options, method="by_pair")
                                                       if batch * k < e else None)
        out[f'MoE {scheme} "every", per-expert'] = _module_fn(qmlp, True, options, method="every")
    return out, mlp


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--shape", choices=[s for s in SHAPES if s != "quick"], default="mixtral-small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="calls per timed round")
    ap.add_argument("--quantization", default="", help="comma-separated schemes (int8, int4, fp8): rows of the "
                    "layer with quantized experts")
    args = ap.parse_args(argv)
    schemes = tuple(q for q in args.quantization.split(",") if q)
    shape = args.shape
    print(f"shape {shape}: one layer, float32, best of {args.repeats} interleaved rounds of {args.calls} calls")
    print(f"{'computation':40s} {'batch':>5s} {'ms':>8s} {'/ active':>8s} {'max |err|':>9s}")
    for batch in args.batch:
        fns, mlp = rows(shape, batch, schemes)
        x = jax.random.normal(jax.random.key(2), (batch, mlp.experts.gate_proj.shape[2]))
        want = np.asarray(mlp.dense(x))
        live = {name: f for name, f in fns.items() if f is not None}
        errors = {}
        for name, f in live.items():  # warm-up: compiles
            y = np.asarray(f(x))
            errors[name] = float(np.abs(y - want).max()) if name.startswith(("MoE", "probe")) else None
        best = dict.fromkeys(live, np.inf)
        for _ in range(args.repeats):
            for name, f in live.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    y = f(x)
                jax.block_until_ready(y)
                best[name] = min(best[name], (time.perf_counter() - start) / args.calls)
        active = best[next(iter(live))]
        for name in fns:
            if name not in live:
                print(f"{name:40s} {batch:5d} {'-':>8s}   (batch x top-k >= experts: not used)")
                continue
            err = "" if errors[name] is None else f"{errors[name]:9.1e}"
            print(f"{name:40s} {batch:5d} {best[name] * 1e3:8.3f} {best[name] / active:8.2f} {err}")


if __name__ == "__main__":
    main()
