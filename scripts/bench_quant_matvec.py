"""One row times one quantized kernel (batch-1 decode), formulation by formulation: what bounds the fused
matrix-vector products of `pagedjax.model.layers.quant` on XLA:CPU (its module docstring cites this table).

    python scripts/bench_quant_matvec.py                 # the 156M shape's kernels
    taskset -c 1 python scripts/bench_quant_matvec.py    # on one core: the loops' own rates, less noise
    python scripts/bench_quant_matvec.py --quick         # small kernels (seconds): the smoke test

Each row computes x `[1, in]` times a random kernel `[in, out]`, quantized by `QuantizedLinear` (int4: groups of
128), compiled with the engine's XLA options for one row of a quantized model (`runner.cpu_compiler_options`;
float32: those of a float32 model), and is first checked against the float64 product of the dequantized kernel
(float32: of the float kernel). Timed in interleaved rounds, best round; "G weights/s" is in * out over that
time (the mean of 3 calls back to back), "x int4" the ratio to the layer's own int4 product in the same run.

Rows: "float32" (XLA's dot of the float kernel), "int8" and "int4" (`QuantizedLinear` itself), then int4
formulations the layer does not use: "int4 two shifts" (each nibble sign-extended by byte shifts, `_planes`:
the layer's unpacking before 16 x q), "int4 jnp.int4" (the packed bytes bitcast to XLA's 4-bit type, converted),
"int4 group sums" (a sum per group, then the scales: a reduce), and "int4 no scales" (the layer's loop without
the group-scale multiply: not the product, not checked; the bound a per-group sum inside the loop would give).
Last, "int8 x int8 dot": the int8 kernel times the row quantized to int8 too (one scale for the row), an
int8 x int8 -> int32 dot (what llama.cpp's Q8_0 and Q4_0 products compute, with integer SIMD dot products), checked
against the float64 product of the rounded row and the dequantized kernel: whether XLA:CPU's integer dot would
be faster than converting the weights (`QuantConfig` keeps activations in the model's dtype).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_engine import SHAPES
from flax import nnx

from pagedjax.config.quant import QuantConfig
from pagedjax.model.layers.quant import QuantizedLinear, _planes, _planes16, _row_order, conversion_tie
from pagedjax.runner.runner import cpu_compiler_options

GROUP = 128
CALLS = 3  # timed back to back per round: a row's time is their mean in its best round


def _two_planes(row: jax.Array, planes: tuple, scale: jax.Array | None, factor: float) -> jax.Array:
    """The layer's one-row int4 product over given nibble planes (int8 `[out, in // 2]` each), group scales
    `[out, groups]` (None: left out) and a final factor: one product per plane, kept apart."""
    halves = row.reshape(2, -1)  # [2, in // 2]: the row gathered plane by plane
    if scale is not None:
        n_out, groups = scale.shape
        planes = [(p.astype(jnp.float32).reshape(n_out, groups, -1) * scale[:, :, None]).reshape(n_out, -1)
                  for p in planes]
    low, high = (p.astype(jnp.float32) + conversion_tie(row) for p in planes)
    y_low, y_high = jax.lax.optimization_barrier((halves[:1] @ low.T, halves[1:] @ high.T))
    return (y_low + y_high) * factor


def formulations(n_in: int) -> dict:
    """Row name -> fn(qweight, scale, x `[1, in]`) -> `[1, out]`, for the int4 formulations the layer does not use."""
    order = _row_order(n_in, GROUP)  # the layer's gathered row: low planes' inputs, then high planes'
    # Byte j of group k holds inputs k * g + j (low nibble) and k * g + g / 2 + j (high): XLA's int4 reads a
    # byte's low nibble first, so the converted kernel's input order is (group, j, nibble).
    pairs = np.arange(n_in).reshape(-1, 2, GROUP // 2).transpose(0, 2, 1).reshape(-1)

    def gathered(x, index):
        return jnp.take(x.reshape(-1), index)

    def native(q, s, x):
        n_out, groups = s.shape
        w = jax.lax.bitcast_convert_type(q, jnp.int4).astype(jnp.float32)  # [out, in // 2, 2]
        w = (w.reshape(n_out, groups, -1) * s[:, :, None]).reshape(n_out, -1) + conversion_tie(x)
        return gathered(x, pairs)[None] @ w.T

    def group_sums(q, s, x):
        n_out, groups = s.shape
        w = jnp.stack(_planes(q), 1).astype(jnp.float32) + conversion_tie(x)  # [out, plane, in // 2]
        w = w.reshape(n_out, 2, groups, -1)  # [out, plane, groups, g / 2]
        sums = (w * gathered(x, order).reshape(2, groups, -1)).sum((1, 3))  # [out, groups]
        return (sums * s).sum(-1)[None]

    return {
        "int4 two shifts": lambda q, s, x: _two_planes(gathered(x, order), _planes(q), s, 1.0),
        "int4 jnp.int4": native,
        "int4 group sums": group_sums,
        "int4 no scales": lambda q, s, x: _two_planes(gathered(x, order), _planes16(q), None, 1.0),
    }


def _int8_row(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x `[1, in]` -> (int8 `[1, in]`, its float32 scale): symmetric, one scale for the row."""
    scale = jnp.max(jnp.abs(x)) / 127.0
    return jnp.round(x / scale).astype(jnp.int8), scale


def _int8_activations(q: jax.Array, s: jax.Array, x: jax.Array) -> jax.Array:
    """The int8 kernel q `[out, in]` (scales s `[out]`) times x quantized to int8: an int32 dot, then the scales."""
    row, row_scale = _int8_row(x)
    acc = jax.lax.dot_general(row, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)  # [1, out]
    return acc.astype(jnp.float32) * (s * row_scale)


def rows_for(n_in: int, n_out: int, rng: np.random.Generator, spec) -> list[dict]:
    """Compiled, checked rows of one kernel shape: dicts of name, call (a no-argument function)."""
    kernel = jnp.asarray(rng.standard_normal((n_in, n_out)) * 0.02, jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, n_in)), jnp.float32)
    quantized = cpu_compiler_options(spec, 1, quantized=True)
    layers = {s: QuantizedLinear(kernel, quant=QuantConfig(s, group_size=GROUP if s == "int4" else None))
              for s in ("int8", "int4")}
    cases = [("float32", jax.jit(lambda k, x: x @ k), (kernel, x), cpu_compiler_options(spec, 1), kernel)]
    for scheme, layer in layers.items():
        graphdef, state = nnx.split(layer)
        leaves, treedef = jax.tree.flatten(state)  # a call passes arrays only: no module to flatten each time
        fn = jax.jit(lambda leaves, x, graphdef=graphdef, treedef=treedef: nnx.merge(
            graphdef, jax.tree.unflatten(treedef, leaves))(x))
        cases.append((scheme, fn, (leaves, x), quantized, layer.kernel()))
    int4 = layers["int4"]
    cases += [(name, jax.jit(fn), (int4.qweight[...], int4.scale[...], x), quantized, int4.kernel())
              for name, fn in formulations(n_in).items()]
    int8 = layers["int8"]
    row8, row_scale = _int8_row(x)
    cases.append(("int8 x int8 dot", jax.jit(_int8_activations), (int8.qweight[...], int8.scale[...], x), quantized,
                  int8.kernel(), np.asarray(row8, np.float64) * float(row_scale)))
    rows = []
    for name, fn, args, options, reference, *row in cases:
        exe = fn.lower(*args).compile(options)
        got = np.asarray(exe(*args), np.float64)
        if name != "int4 no scales":
            want = (row[0] if row else np.asarray(x, np.float64)) @ np.asarray(reference, np.float64)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=name)
        rows.append(dict(shape=(n_in, n_out), name=name, call=lambda exe=exe, args=args: exe(*args), times=[]))
    return rows


def time_rounds(rows: list[dict], rounds: int) -> None:
    """Append each row's time per round to its "times": rounds of one call of each row, then `CALLS` timed."""
    for _ in range(rounds):
        for r in rows:
            r["call"]().block_until_ready()  # the call before the timed ones: caches warm alike for every row
            start = time.perf_counter()
            for _ in range(CALLS):
                out = r["call"]()
            out.block_until_ready()
            r["times"].append((time.perf_counter() - start) / CALLS)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="156m", help="whose kernel shapes")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="small kernels, 2 rounds (seconds)")
    args = ap.parse_args(argv)
    spec = SHAPES[args.model]
    h, i = spec.hidden_size, spec.intermediate_size
    shapes = [(h, spec.vocab_size), (h, i), (i, h)]  # the LM head, gate / up, down
    if args.quick:
        shapes, args.rounds = [(256, 64)], 2
    rng = np.random.default_rng(0)
    rows = []
    for n_in, n_out in shapes:  # a shape's rows in rounds of their own: other shapes' bytes stay out of the caches
        mine = rows_for(n_in, n_out, rng, spec)
        time_rounds(mine, args.rounds)
        rows += mine
    print(f"one row times one kernel, {jax.default_backend()}, best of {args.rounds} interleaved rounds")
    print(f"{'kernel [in -> out]':<20}{'formulation':<18}{'us':>10}{'G weights/s':>13}{'x int4':>8}")
    for shape in shapes:
        mine = [r for r in rows if r["shape"] == shape]
        base = min(next(r for r in mine if r["name"] == "int4")["times"])
        for r in mine:
            best = min(r["times"])
            print(f"{f'[{shape[0]} -> {shape[1]}]':<20}{r['name']:<18}{best * 1e6:>10.1f}"
                  f"{shape[0] * shape[1] / best / 1e9:>13.2f}{base / best:>8.2f}")


if __name__ == "__main__":
    main()
