"""The int8 x int8 -> int32 product of W8A8 (`pagedjax.device.int8_matmul`) on the CPU: the native kernel against
XLA's own int8 dot (YNNPACK's for several rows, a loop XLA emits for one) and the float32 dot of the same shape,
row count by row count: where the kernel pays, and so `int8_matmul`'s `native_max_rows`.

    python scripts/bench_int8_matmul.py                  # the 156M shape's kernels, 1 - 64 rows
    python scripts/bench_int8_matmul.py --quick          # small kernels (seconds): the smoke test

Each row multiplies x `[m, in]` by a random kernel `[out, in]` (the layout `QuantizedLinear` stores), every
program compiled with the engine's XLA options for a quantized model (`runner.cpu_compiler_options`); the
native and XLA results are checked equal (both exact). Timed in interleaved rounds (one call of each per round
after a warm-up, each the mean of `--calls` calls back to back), best round; "x xla" is XLA's int8 time over
the kernel's (above 1: the kernel is faster).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_engine import SHAPES

from pagedjax.device.int8_matmul import int8_matmul_reference, native_call, native_status
from pagedjax.runner.runner import cpu_compiler_options


def _compile(fn, *args, spec_rows: int):
    options = cpu_compiler_options(SHAPES["156m"].spec, spec_rows, quantized=True)
    return jax.jit(fn).lower(*args).compile(compiler_options=options)


def _time(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,6,8,16,64", help="comma-separated row counts m")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (best taken)")
    ap.add_argument("--calls", type=int, default=20, help="calls per timing")
    ap.add_argument("--quick", action="store_true", help="small kernels, 2 rounds: the smoke test")
    args = ap.parse_args(argv)
    status = native_status()
    if not status.loaded:
        raise SystemExit(f"the native kernel is not loaded: {status.reason}")
    cfg = SHAPES["156m"]
    shapes = {"q/o_proj": (cfg.hidden_size, cfg.hidden_size), "gate/up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size), "lm_head": (cfg.hidden_size, cfg.vocab_size)}
    if args.quick:
        shapes = {"small": (256, 384)}
        args.repeats, args.calls = 2, 3
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    cases = []
    for name, (n_in, n_out) in shapes.items():
        w = jnp.asarray(rng.integers(-127, 128, (n_out, n_in)), jnp.int8)
        wf = jnp.asarray(rng.standard_normal((n_out, n_in)), jnp.float32)
        for m in rows:
            x = jnp.asarray(rng.integers(-127, 128, (m, n_in)), jnp.int8)
            xf = jnp.asarray(rng.standard_normal((m, n_in)), jnp.float32)
            native = _compile(lambda a, b: native_call(status.target, a, b), x, w, spec_rows=m)
            xla = _compile(int8_matmul_reference, x, w, spec_rows=m)
            flt = _compile(lambda a, b: a @ b.T, xf, wf, spec_rows=m)
            np.testing.assert_array_equal(np.asarray(native(x, w)), np.asarray(xla(x, w)), err_msg=f"{name} m={m}")
            flt(xf, wf).block_until_ready()
            cases.append((name, m, n_in, n_out, [(native, (x, w)), (xla, (x, w)), (flt, (xf, wf))]))
    best = {id(c): [float("inf")] * 3 for c in cases}
    for _ in range(args.repeats):
        for case in cases:
            for i, (fn, fargs) in enumerate(case[4]):
                best[id(case)][i] = min(best[id(case)][i], _time(fn, fargs, args.calls))
    load = os.getloadavg()[0]
    print(f"int8 x int8 -> int32 products on the CPU ({status.isa} kernel), best of "
          f"{args.repeats} rounds of {args.calls} calls; load average {load:.2f}")
    print(f"{'kernel':<13} {'rows':>4} {'in x out':>12} {'native us':>10} {'GMAC/s':>7} {'xla int8 us':>12} "
          f"{'x xla':>6} {'f32 dot us':>11} {'x f32':>6}")
    for case in cases:
        name, m, n_in, n_out, _ = case
        t_native, t_xla, t_float = best[id(case)]
        print(f"{name:<13} {m:>4} {f'{n_in} x {n_out}':>12} {t_native * 1e6:>10.1f} "
              f"{m * n_in * n_out / t_native / 1e9:>7.1f} {t_xla * 1e6:>12.1f} {t_xla / t_native:>6.2f} "
              f"{t_float * 1e6:>11.1f} {t_float / t_native:>6.2f}")


if __name__ == "__main__":
    main()
