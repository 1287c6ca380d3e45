"""What a verifying step costs against a decode step on this machine, program by program: the runner's compiled
steps of one model timed alone (no scheduler, no host work but the call), on a KV cache holding `--context`
tokens per sequence; then the model's linears alone at the same row counts, which is where the difference is.

    python scripts/bench_verify.py                    # the 156M random-weights shape, k = 4
    python scripts/bench_verify.py --model tiny --repeats 3

Steps (batch 1 unless said):
  decode                       1 token, the decode path: what a plain decode step runs
  decode, 8 sequences          8 tokens of 8 sequences, the decode path: the cost of 8 rows through the weights
  verify k (as the engine)     1 + k tokens of one sequence through the ragged path, every position sampled, tokens
                               and rows padded as `inputs.pad_step` pads them (`fine_bucket`: 5 as 5)
  verify k, padded to 2^n      the same padded to powers of two, as the engine did before (5 tokens and rows as 8)
  verify k, sampled 1 row      the same chunk sampling only its last row (a prefill chunk's step)
  verify k, temperature 1      as the engine's, every row sampled at temperature 1 (greedy elsewhere)
  ... YNNPACK dots             as the engine's, with XLA:CPU's default dot library (the runner keeps XLA's own
                               dots for steps of <= 16 rows of float32 models of hidden size >= 1024)
Linears: every 2-D kernel of the model (each layer's projections and the LM head; not the embedding, which a step
gathers from) applied to M random rows, in one program compiled with the runner's options for M rows
(`runner.cpu_compiler_options`): the weights a step reads, without attention, norms or sampling.
Each program is compiled and run once first, then timed: best of `--repeats` rounds of `--calls` calls each,
rounds interleaved over the rows. Ratios are against the 1-row row of the same table; "cores" is process CPU time
over wall time while it ran (1.0: one core busy; it counts XLA's thread pool spinning while it waits too).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax.device.sampling import SamplingMetadata  # noqa: E402
from pagedjax.model.llama import init_model  # noqa: E402
from pagedjax.runner import runner as runner_module  # noqa: E402
from pagedjax.runner.inputs import bucket, pad_step  # noqa: E402
from pagedjax.runner.runner import ModelRunner, cpu_compiler_options  # noqa: E402
from pagedjax.runner.shapes import repad_step, step_shape  # noqa: E402
from scripts.bench_engine import SHAPES  # noqa: E402

BLOCK = 16


def step(seqs: int, q_len: int, context: int, vocab_size: int, *, rows: str, temperature: float = 0.0,
         pow2: bool = False):
    """Inputs of a step of `seqs` sequences, each `q_len` tokens after `context` cached ones. rows: "last" (one
    sampled row per sequence, its last token) or "all" (every token sampled, as a verifying step); `pow2`: tokens
    and rows padded to powers of two (the engine's padding of a verifying step before `fine_bucket`)."""
    blocks = -(-(context + q_len) // BLOCK)
    tables = np.arange(seqs * blocks, dtype=np.int32).reshape(seqs, blocks)  # i32[S, B]
    positions = np.tile(np.arange(context, context + q_len, dtype=np.int32), seqs)  # i32[T]
    seq = np.repeat(np.arange(seqs), q_len)  # i32[T]
    slots = (tables[seq, positions // BLOCK] * BLOCK + positions % BLOCK).astype(np.int32)
    cu = np.arange(seqs + 1, dtype=np.int32) * q_len
    logits_indices = None if rows == "last" else np.arange(seqs * q_len, dtype=np.int32)
    n = seqs * q_len if rows == "all" else seqs
    sampling = SamplingMetadata.from_lists([temperature] * n, [0] * n, [1.0] * n, [1] * n, [0] * n)
    inputs = pad_step(token_ids=np.ones(seqs * q_len, np.int32), positions=positions, slot_mapping=slots,
                      block_tables=tables, kv_lens=np.full(seqs, context + q_len, np.int32), cu_q_lens=cu,
                      sampling=sampling, logits_indices=logits_indices)
    if pow2:
        shape = step_shape(inputs)
        inputs = repad_step(inputs, shape._replace(tokens=bucket(shape.tokens), rows=bucket(shape.num_rows)),
                            vocab_size)
    return inputs


def best_times(calls: dict, repeats: int, per_round: int) -> dict[str, tuple[float, float]]:
    """name -> (best seconds per call, CPU seconds over wall seconds in that round) over interleaved rounds."""
    best = {name: (np.inf, 0.0) for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(per_round):
                call()
            wall = time.perf_counter() - start
            if wall / per_round < best[name][0]:
                best[name] = (wall / per_round, (time.process_time() - cpu) / wall)
    return best


def linears(model, rows: int):
    """A call of every 2-D kernel of `model` on `rows` random rows, compiled as the runner compiles a step of
    `rows` tokens."""
    kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
               if jax.tree_util.keystr(path).endswith("['kernel'].value") and leaf.ndim == 2]
    rng = np.random.default_rng(0)
    xs = {k.shape[0]: rng.standard_normal((rows, k.shape[0]), dtype=np.float32) for k in kernels}
    fn = jax.jit(lambda xs, kernels: [xs[k.shape[0]] @ k for k in kernels])
    exe = fn.lower(xs, kernels).compile(compiler_options=cpu_compiler_options(model.spec, rows))
    return lambda: jax.block_until_ready(exe(xs, kernels))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="156m")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--context", type=int, default=96, help="cached tokens per sequence")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    cfg = SHAPES[args.model]
    model = init_model(cfg, seed=0)
    q, ctx, vocab = 1 + args.k, args.context, cfg.vocab_size
    num_blocks = 8 * -(-(ctx + q) // BLOCK)
    runner = ModelRunner(model, num_blocks, BLOCK, backend="xla", compile_in_background=False)
    ynn = ModelRunner(model, num_blocks, BLOCK, backend="xla", compile_in_background=False)
    rows = {
        "decode": (runner, step(1, 1, ctx, vocab, rows="last")),
        "decode, 8 sequences": (runner, step(8, 1, ctx, vocab, rows="last")),
        f"verify k={args.k} (as the engine)": (runner, step(1, q, ctx, vocab, rows="all")),
        f"verify k={args.k}, padded to 2^n (before)": (runner, step(1, q, ctx, vocab, rows="all", pow2=True)),
        f"verify k={args.k}, sampled 1 row": (runner, step(1, q, ctx, vocab, rows="last")),
        f"verify k={args.k}, temperature 1": (runner, step(1, q, ctx, vocab, rows="all", temperature=1.0)),
        f"verify k={args.k}, YNNPACK dots": (ynn, step(1, q, ctx, vocab, rows="all")),
    }
    default_options = runner_module.cpu_compiler_options
    for r, inputs in rows.values():
        if r is ynn:  # its programs compile with XLA's defaults
            runner_module.cpu_compiler_options = lambda spec, n, quantized=False: None
        r.execute(inputs)  # compile and run once
        runner_module.cpu_compiler_options = default_options
    linear_rows = sorted({1, q, bucket(q), 8})
    calls = {name: (lambda r=r, inputs=inputs: r.execute(inputs)) for name, (r, inputs) in rows.items()}
    calls |= {f"linears, {m} rows": linears(model, m) for m in linear_rows}
    for call in calls.values():
        call()
    times = best_times(calls, args.repeats, args.calls)
    print(f"\n{args.model}, {ctx} cached tokens per sequence, k = {args.k}")
    print(f"{'step':38s} {'tokens':>6s} {'seqs':>5s} {'rows':>5s} {'ms':>8s} {'vs decode':>10s} {'cores':>6s}")
    for name, (_, inputs) in rows.items():
        t, cores = times[name]
        print(f"{name:38s} {len(inputs.token_ids):6d} {inputs.meta.kv_lens.shape[0]:5d} "
              f"{len(inputs.logits_indices):5d} {1000 * t:8.1f} {t / times['decode'][0]:9.2f}x {cores:6.2f}")
    print(f"\n{'the linears alone':38s} {'rows':>5s} {'ms':>8s} {'vs 1 row':>9s} {'cores':>6s}")
    for m in linear_rows:
        t, cores = times[f"linears, {m} rows"]
        print(f"{'':38s} {m:5d} {1000 * t:8.1f} {t / times['linears, 1 rows'][0]:8.2f}x {cores:6.2f}")


if __name__ == "__main__":
    main()
