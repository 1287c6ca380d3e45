#!/usr/bin/env python3
"""Benchmark of the paged-attention kernels.

Decode (batch x context grid) and ragged prefill, one run, one table each:
  time per call, KV bytes read per second, that as % of the device copy bandwidth measured in the same
  run, and speed-ups against JAX's own Pallas paged_attention op (decode) and the XLA gather path.

On a GPU the defaults are the issue's grid: decode batch {1, 8, 64} x context {512, 4096, 32768}, bf16,
32 query heads, 8 KV heads, head_dim 128, block size 16. Elsewhere (CPU) it runs small sizes, with the
Pallas kernels in interpret mode (timings there say nothing about GPU speed). `--smoke` runs tiny sizes
once, for tests.

`--target tpu` benchmarks the TPU (Mosaic) kernels. On a TPU it times the same grid and columns, the
baseline op being JAX's own TPU paged_attention (`--jax-pages-per-block` pages per compute block); the
number to watch is decode's KV read rate as a fraction of HBM bandwidth at batch 64 x 4k context (the
ragged-paged-attention paper reports 86% on TPU7x). The knobs: `pages_per_iter` (pages per double-buffered
DMA chunk: bigger chunks mean fewer, larger DMAs in flight; default about 64 KiB of K), `num_splits`
(1 by default; more only helps a two-core chip at tiny batch), the block size (a multiple of 16 for
bfloat16) and, for ragged, `block_q`. Without a TPU it checks the TPU kernels in Pallas's TPU interpret mode
against the dense reference and prints the errors only: interpret-mode timings say nothing about a TPU.

    python scripts/bench_kernels.py                 # full table on the default device
    python scripts/bench_kernels.py --smoke         # seconds, any machine
    python scripts/bench_kernels.py --json out.json # also write the rows as JSON
    python scripts/bench_kernels.py --target tpu    # TPU kernels: timed on a TPU, checked elsewhere

A third table times decode with the attention variants against the plain kernel in the same run (on a GPU
the Pallas kernels, elsewhere the XLA path the engine runs on CPU): a sliding window (`--window`, default
4096 on a `--variant-context` of 32k tokens: a window bounds the pages read, so it should be about
context / window times faster), logit soft-capping (a tanh per score: should cost ~nothing), int8 and fp8
pages (half the bytes of bf16 pages: up to 2x faster when bandwidth-bound) and window + int8.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def _time(fn: Callable[..., jax.Array], *args, iters: int, warmup: int = 2) -> float:
    """Median seconds per call of fn(*args) (calls are dispatched back to back, then waited for). Two
    warm-up calls: JAX 0.12 retraces once after the first call of a process."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(3 if iters > 1 else 1):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def copy_bandwidth(num_bytes: int, iters: int) -> float:
    """Device copy bandwidth in bytes/s: read + write of an array of num_bytes."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 2.0)
    seconds = _time(f, x, iters=iters)
    del x
    return 2 * num_bytes / seconds


def _pool(num_kv_heads, num_blocks, block_size, head_dim, dtype, salt):
    """A cache filled on device without big temporaries (values only need to be finite)."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)

    @jax.jit
    def make():
        i = jax.lax.broadcasted_iota(jnp.int32, shape, 1) * 7 + jax.lax.broadcasted_iota(jnp.int32, shape, 3)
        return (((i + salt) % 17).astype(jnp.float32) * 0.1 - 0.8).astype(dtype)

    return make()


def _tables(rng, num_seqs, blocks_per_seq):
    perm = rng.permutation(num_seqs * blocks_per_seq).astype(np.int32)
    return jnp.asarray(perm.reshape(num_seqs, blocks_per_seq))


def _free_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    except Exception:  # CPU backends have no memory stats
        return None


def _jax_op():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_op
    return jax_op.paged_attention


def _jax_op_for(target: str, args) -> Callable[..., jax.Array]:
    """JAX's own Pallas paged_attention for the target, called with our argument order (q, k, v, tables,
    lengths). It applies no scale: callers pass a pre-scaled q."""
    if target == "gpu":
        return jax.jit(functools.partial(_jax_op(), k_splits=args.jax_k_splits))
    from jax.experimental.pallas.ops.tpu import paged_attention as tpu_op

    op = functools.partial(tpu_op, pages_per_compute_block=args.jax_pages_per_block)
    return jax.jit(lambda q, k, v, tables, lengths: op(q, k, v, lengths, tables))


def _try(fn: Callable[..., jax.Array], *args, iters: int) -> float | None:
    """`_time`, or None when this baseline cannot run at this size."""
    try:
        return _time(fn, *args, iters=iters)
    except Exception as e:  # a baseline that cannot run at this size (memory, constraints): report n/a
        print(f"  (skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]})", file=sys.stderr)
        return None


def bench_decode(args, copy_bw: float, interpret: bool, report: Callable[[dict], None]) -> None:
    rng = np.random.default_rng(0)
    dtype = DTYPES[args.dtype]
    itemsize = jnp.dtype(dtype).itemsize
    scale = 1 / math.sqrt(args.head_dim)
    ours = jax.jit(functools.partial(pk.paged_attention, scale=scale, interpret=interpret, target=args.target))
    xla = jax.jit(functools.partial(pk.paged_attention_xla, scale=scale))
    ref = jax.jit(functools.partial(pk.paged_attention_reference, scale=scale))
    for batch in args.batches:
        for context in args.contexts:
            blocks_per_seq = -(-context // args.block_size)
            num_blocks = batch * blocks_per_seq
            k = _pool(args.kv_heads, num_blocks, args.block_size, args.head_dim, dtype, 0)
            v = _pool(args.kv_heads, num_blocks, args.block_size, args.head_dim, dtype, 5)
            q = jax.random.normal(jax.random.key(1), (batch, args.q_heads, args.head_dim), dtype)
            tables = _tables(rng, batch, blocks_per_seq)
            lengths = jnp.full((batch,), context, jnp.int32)
            kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * itemsize
            t_ours = _time(ours, q, k, v, tables, lengths, iters=args.iters)
            row = dict(kernel="decode", batch=batch, context=context, ms=t_ours * 1e3,
                       gbps=kv_bytes / t_ours / 1e9, pct_copy=100 * kv_bytes / t_ours / copy_bw)
            if not interpret and not args.no_jax_op:
                op = _jax_op_for(args.target, args)
                q_scaled = (q.astype(jnp.float32) * scale).astype(dtype)
                t_op = _try(op, q_scaled, k, v, tables, lengths, iters=args.iters)
                row["vs_jax_op"] = None if t_op is None else t_op / t_ours
            free = _free_bytes()
            gathered = kv_bytes * (3 if itemsize < 4 else 2)  # gathered K/V plus float32 scores and slack
            if free is None or gathered < 0.5 * free:
                t_xla = _try(xla, q, k, v, tables, lengths, iters=args.iters)
                row["vs_xla"] = None if t_xla is None else t_xla / t_ours
            else:
                row["vs_xla"] = None
            if args.reference:
                t_ref = _try(ref, q, k, v, tables, lengths, iters=args.iters)
                row["vs_reference"] = None if t_ref is None else t_ref / t_ours
            report(row)
            del k, v


def _ragged_configs(smoke: bool, on_gpu: bool):
    """(name, [(q_len, kv_len) per sequence])."""
    if smoke:
        return [("mixed", [(1, 40), (1, 17), (16, 48), (0, 0)])]
    if not on_gpu:
        return [("prompts 2x128", [(128, 128)] * 2), ("chunks 2x64 @ 256", [(64, 256)] * 2),
                ("mixed 8 decode @ 256 + 64 prefill", [(1, 256)] * 8 + [(64, 64)])]
    return [("prompts 4x1024", [(1024, 1024)] * 4),
            ("chunks 8x256 @ 2048", [(256, 2048)] * 8),
            ("mixed 32 decode @ 4096 + 2x512 prefill", [(1, 4096)] * 32 + [(512, 512)] * 2)]


def bench_ragged(args, copy_bw: float, interpret: bool, on_gpu: bool,
                 report: Callable[[dict], None]) -> None:
    rng = np.random.default_rng(1)
    dtype = DTYPES[args.dtype]
    itemsize = jnp.dtype(dtype).itemsize
    scale = 1 / math.sqrt(args.head_dim)
    ours = jax.jit(functools.partial(pk.ragged_paged_attention, scale=scale, interpret=interpret,
                                     target=args.target))
    xla = jax.jit(functools.partial(pk.ragged_paged_attention_xla, scale=scale))
    for name, seqs in _ragged_configs(args.smoke, on_gpu):
        max_kv = max(kv for _, kv in seqs)
        blocks_per_seq = max(1, -(-max_kv // args.block_size))
        num_blocks = len(seqs) * blocks_per_seq
        k = _pool(args.kv_heads, num_blocks, args.block_size, args.head_dim, dtype, 0)
        v = _pool(args.kv_heads, num_blocks, args.block_size, args.head_dim, dtype, 5)
        cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
        q = jax.random.normal(jax.random.key(2), (int(cu[-1]), args.q_heads, args.head_dim), dtype)
        tables = _tables(rng, len(seqs), blocks_per_seq)
        kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
        cu = jnp.asarray(cu)
        kv_bytes = 2 * sum(kv for _, kv in seqs) * args.kv_heads * args.head_dim * itemsize
        # Attended (query, key) pairs, causal: 4 flops per pair per head-dim element (QK^T and PV).
        pairs = sum(sum(kv - q_len + i + 1 for i in range(q_len)) for q_len, kv in seqs)
        flops = 4 * pairs * args.q_heads * args.head_dim
        t_ours = _time(ours, q, k, v, tables, kv_lens, cu, iters=args.iters)
        row = dict(kernel="ragged", config=name, tokens=int(cu[-1]), ms=t_ours * 1e3,
                   gbps=kv_bytes / t_ours / 1e9, pct_copy=100 * kv_bytes / t_ours / copy_bw,
                   tflops=flops / t_ours / 1e12)
        t_xla = _try(xla, q, k, v, tables, kv_lens, cu, iters=args.iters)
        row["vs_xla"] = None if t_xla is None else t_xla / t_ours
        report(row)
        del k, v


def _variant_configs(window: int) -> list[tuple[str, str | None, dict]]:
    """(name, 8-bit page dtype or None, keyword arguments) of each variant row."""
    return [("plain", None, {}), (f"window {window}", None, dict(sliding_window=window)),
            ("soft cap 50", None, dict(logits_soft_cap=50.0)), ("int8 pages", "int8", {}),
            ("fp8 pages", "float8_e4m3fn", {}), (f"window {window} + int8", "int8", dict(sliding_window=window))]


def bench_variants(args, on_gpu: bool, report: Callable[[dict], None]) -> None:
    """Decode time of each variant, and the plain kernel's time over it (> 1: the variant is faster)."""
    rng = np.random.default_rng(2)
    dtype = DTYPES[args.dtype]
    scale = 1 / math.sqrt(args.head_dim)
    batch, context = args.variant_batch, args.variant_context
    blocks_per_seq = -(-context // args.block_size)
    shape = (args.kv_heads, batch * blocks_per_seq, args.block_size, args.head_dim)
    k = _pool(*shape, dtype, 0)
    v = _pool(*shape, dtype, 5)
    q = jax.random.normal(jax.random.key(3), (batch, args.q_heads, args.head_dim), dtype)
    tables = _tables(rng, batch, blocks_per_seq)
    lengths = jnp.full((batch,), context, jnp.int32)
    quantize = jax.jit(pk.quantize_kv, static_argnums=1)
    path = "pallas" if on_gpu else "xla"
    plain_ms = None
    for name, page_dtype, variants in _variant_configs(args.window):
        if page_dtype is None:
            kv = (k, v)
        else:
            (kq, ks), (vq, vs) = quantize(k, jnp.dtype(page_dtype)), quantize(v, jnp.dtype(page_dtype))
            kv = (kq, vq)
            variants = dict(variants, k_scales=ks, v_scales=vs)
        if on_gpu:
            fn = functools.partial(pk.paged_attention, scale=scale, interpret=False, **variants)
        else:
            fn = functools.partial(pk.paged_attention_xla, scale=scale, **variants)
        ms = _time(jax.jit(fn), q, *kv, tables, lengths, iters=args.iters) * 1e3
        plain_ms = plain_ms or ms
        report(dict(kernel="variant", variant=name, path=path, batch=batch, context=context, ms=ms,
                    vs_plain=plain_ms / ms))
        del kv


TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def check_tpu_interpret(args, report: Callable[[dict], None]) -> bool:
    """The TPU kernels in Pallas's TPU interpret mode against the dense float32 reference: max abs error per
    case (decode at a few lengths, one mixed ragged batch). No timings: the interpreter simulates every
    DMA and semaphore on the CPU, so its speed says nothing about a TPU."""
    rng = np.random.default_rng(3)
    dtype = DTYPES[args.dtype]
    bs = args.block_size
    contexts = [3 * bs + 1] if args.smoke else [bs - 1, 3 * bs + 1, 10 * bs]
    ok = True
    for context in contexts:
        blocks = -(-context // bs)
        k = _pool(args.kv_heads, 2 * blocks, bs, args.head_dim, dtype, 0)
        v = _pool(args.kv_heads, 2 * blocks, bs, args.head_dim, dtype, 5)
        q = jax.random.normal(jax.random.key(4), (2, args.q_heads, args.head_dim), dtype)
        tables, lengths = _tables(rng, 2, blocks), jnp.asarray([context, context // 2], jnp.int32)
        out = pk.paged_attention(q, k, v, tables, lengths, target="tpu", interpret=True, pages_per_iter=2,
                                 num_splits=2)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - pk.paged_attention_reference(
            q, k, v, tables, lengths).astype(jnp.float32))))
        ok &= err <= TOLERANCE[args.dtype]
        report(dict(kernel="decode", batch=2, context=context, max_err=err, ok=err <= TOLERANCE[args.dtype]))
    seqs = [(1, 3 * bs + 1), (bs + 3, 2 * bs + 5), (0, 0), (5, 5)]
    blocks = max(-(-kv // bs) for _, kv in seqs)
    k = _pool(args.kv_heads, len(seqs) * blocks, bs, args.head_dim, dtype, 0)
    v = _pool(args.kv_heads, len(seqs) * blocks, bs, args.head_dim, dtype, 5)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum([q for q, _ in seqs])]), jnp.int32)
    q = jax.random.normal(jax.random.key(5), (int(cu[-1]), args.q_heads, args.head_dim), dtype)
    tables, kv_lens = _tables(rng, len(seqs), blocks), jnp.asarray([kv for _, kv in seqs], jnp.int32)
    out = pk.ragged_paged_attention(q, k, v, tables, kv_lens, cu, target="tpu", interpret=True, block_q=4,
                                    pages_per_iter=1)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - pk.ragged_paged_attention_reference(
        q, k, v, tables, kv_lens, cu).astype(jnp.float32))))
    ok &= err <= TOLERANCE[args.dtype]
    report(dict(kernel="ragged", config="mixed decode + chunk + prompt", tokens=int(cu[-1]), max_err=err,
                ok=err <= TOLERANCE[args.dtype]))
    return ok


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def _format_row(r: dict) -> str:
    if "max_err" in r:  # an interpret-mode correctness row
        what = f"batch {r['batch']}, context {r['context']}" if r["kernel"] == "decode" else r["config"]
        return f"| {r['kernel']} | {what} | max abs error {r['max_err']:.2e} | {'ok' if r['ok'] else 'FAIL'} |"
    if r["kernel"] == "variant":
        return (f"| variant | {r['variant']} ({r['path']}) | {r['batch']} x {r['context']} | {r['ms']:.3f} ms | "
                f"vs_plain={r['vs_plain']:.2f} |")
    if r["kernel"] == "decode":
        head = f"| decode | {r['batch']:>5} | {r['context']:>7} |"
    else:
        head = f"| ragged | {r['config']} ({r['tokens']} tokens) |"
    cols = [_fmt(r["ms"], ".3f"), _fmt(r["gbps"], ".1f"), _fmt(r["pct_copy"], ".1f")]
    for key in ("vs_jax_op", "vs_xla", "vs_reference", "tflops"):
        if key in r:
            cols.append(f"{key}={_fmt(r[key], '.2f')}")
    return head + " " + " | ".join(cols) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one iteration (for tests)")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--iters", type=int)
    ap.add_argument("--target", choices=("auto", "gpu", "tpu"), default="auto",
                    help="kernel family: gpu (Triton) or tpu (Mosaic); auto = tpu on a TPU, gpu otherwise")
    ap.add_argument("--jax-k-splits", type=int, default=16, help="k_splits for JAX's op (must divide pages)")
    ap.add_argument("--jax-pages-per-block", type=int, default=8,
                    help="pages_per_compute_block for JAX's TPU op (must divide pages)")
    ap.add_argument("--no-jax-op", action="store_true")
    ap.add_argument("--no-ragged", action="store_true")
    ap.add_argument("--no-variants", action="store_true", help="skip the variants table")
    ap.add_argument("--window", type=int, help="sliding window of the variants table (default 4096)")
    ap.add_argument("--variant-batch", type=int, help="decode batch of the variants table (default 8)")
    ap.add_argument("--variant-context", type=int, help="context of the variants table (default 32768)")
    ap.add_argument("--reference", action="store_true", help="also time the float32 reference")
    ap.add_argument("--interpret", action="store_true", help="force the Pallas interpreter")
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = ap.parse_args(argv)

    if args.target == "auto":
        args.target = "tpu" if jax.default_backend() == "tpu" else "gpu"
    on_gpu = jax.default_backend() == args.target  # the target's own device: compiled kernels
    interpret = args.interpret or not on_gpu
    if args.smoke:
        args.batches = args.batches or [2]
        args.contexts = args.contexts or [40]
        args.q_heads, args.kv_heads, args.head_dim = 4, 2, 64
        args.iters = args.iters or 1
        args.reference = True
        args.window, args.variant_batch, args.variant_context = args.window or 16, args.variant_batch or 2, \
            args.variant_context or 64
    elif not on_gpu:  # small sizes on CPU: the XLA path and the reference, the kernels interpreted
        args.batches = args.batches or [1, 8]
        args.contexts = args.contexts or [128, 512]
        args.q_heads, args.kv_heads, args.head_dim = min(args.q_heads, 8), min(args.kv_heads, 2), 64
        args.iters = args.iters or 2
        args.reference = True
        args.window, args.variant_context = args.window or 512, args.variant_context or 4096
    args.window = args.window or 4096
    args.variant_batch = args.variant_batch or 8
    args.variant_context = args.variant_context or 32768
    args.batches = args.batches or [1, 8, 64]
    args.contexts = args.contexts or [512, 4096, 32768]
    args.iters = args.iters or 20

    device = jax.devices()[0]
    if args.target == "tpu" and interpret:
        print(f"# TPU kernels in Pallas's TPU interpret mode on {device.device_kind} ({jax.default_backend()}), "
              f"jax {jax.__version__}: correctness against the dense reference only; interpret-mode timings say "
              f"nothing about a TPU")
        rows_: list[dict] = []

        def report_check(row: dict) -> None:
            rows_.append(row)
            print(_format_row(row), flush=True)

        ok = check_tpu_interpret(args, report_check)
        if args.json:
            args.json.write_text(json.dumps(dict(device=device.device_kind, jax=jax.__version__, target="tpu",
                                                 interpret=True, rows=rows_), indent=1))
        return 0 if ok else 1
    copy_bytes = (1 << 30) if on_gpu else (1 << 24)
    copy_bw = copy_bandwidth(copy_bytes, args.iters)
    print(f"# device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"{'interpreted' if interpret else 'compiled'} kernels")
    print(f"# {args.dtype}, {args.q_heads} q heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
          f"block {args.block_size}; device copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    print("# columns: ms per call | KV GB/s | % of copy bandwidth | speed-up (their time / ours)")
    rows: list[dict] = []

    def report(row: dict) -> None:  # print and save each row as it comes: a timeout still leaves a table
        rows.append(row)
        print(_format_row(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps(dict(device=device.device_kind, jax=jax.__version__,
                                                 copy_gbps=copy_bw / 1e9, interpret=interpret,
                                                 target=args.target, rows=rows),
                                            indent=1))

    bench_decode(args, copy_bw, interpret, report)
    if not args.no_ragged:
        bench_ragged(args, copy_bw, interpret, on_gpu, report)
    if not args.no_variants:
        bench_variants(args, on_gpu and not interpret, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
