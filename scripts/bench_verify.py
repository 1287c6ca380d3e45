"""What a verifying step costs against a decode step on this machine, program by program: the runner's compiled
steps of one model timed alone (no scheduler, no host work but the call), on a KV cache holding `--context`
tokens per sequence.

    python scripts/bench_verify.py                    # the 156M random-weights shape, k = 4
    python scripts/bench_verify.py --model tiny --repeats 3

Rows (batch 1 unless said):
  decode                       1 token, the decode path: what a plain decode step runs
  decode, 8 sequences          8 tokens of 8 sequences, the decode path: the cost of 8 rows through the weights
  verify k (as the engine)     1 + k tokens of one sequence through the ragged path, every position sampled, tokens
                               and rows padded to their buckets (`inputs.pad_step` with logits_indices)
  verify k, seqs padded to rows  the same with the sequence axis padded to the rows' bucket too, as `pad_step` did
                               before (each padding sequence is a query tile of the XLA attention path)
  verify k, unpadded           1 + k tokens and rows exactly (no bucket): what the padding to 8 costs
  verify k, sampled 1 row      the same chunk sampling only its last row (a prefill chunk's step, tokens padded to
                               the same bucket)
  verify k, temperature 1      as the engine's, every row sampled at temperature 1 (greedy elsewhere)
  ... YNNPACK dots             as the engine's, with XLA:CPU's default dot library (the runner keeps XLA's own
                               dots for steps of <= 16 rows of float32 models of hidden size >= 1024)
Each program is compiled and run once first, then timed: best of `--repeats` rounds of `--calls` calls each,
rounds interleaved over the rows. Ratios are against the decode row of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax.device.sampling import SamplingMetadata  # noqa: E402
from pagedjax.engine import runner as runner_module  # noqa: E402
from pagedjax.engine.inputs import pad_rows, pad_step, pad_table  # noqa: E402
from pagedjax.engine.runner import ModelRunner  # noqa: E402
from pagedjax.model.llama import init_model  # noqa: E402
from scripts.bench_engine import SHAPES  # noqa: E402

BLOCK = 16


def step(seqs: int, q_len: int, context: int, *, rows: str, temperature: float = 0.0, pad_seqs: bool = False,
         unpadded: bool = False):
    """Inputs of a step of `seqs` sequences, each `q_len` tokens after `context` cached ones. rows: "last" (one
    sampled row per sequence, its last token) or "all" (every token sampled, as a verifying step)."""
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
    if unpadded:  # tokens and rows cut back to the step's own
        n = seqs * q_len
        inputs = dataclasses.replace(inputs, token_ids=inputs.token_ids[:n], positions=inputs.positions[:n],
                                     meta=inputs.meta._replace(slot_mapping=inputs.meta.slot_mapping[:n]),
                                     logits_indices=inputs.logits_indices[:n],
                                     sampling=type(inputs.sampling)(*(a[:n] for a in inputs.sampling)))
    if pad_seqs:  # the sequence axis padded to the rows (padding sequences: no query, nothing attended)
        m, r = inputs.meta, len(inputs.logits_indices)
        meta = m._replace(block_tables=pad_table(m.block_tables, r, m.block_tables.shape[1]),
                          kv_lens=pad_rows(m.kv_lens, r, 0), cu_q_lens=pad_rows(m.cu_q_lens, r + 1, m.cu_q_lens[-1]))
        inputs = dataclasses.replace(inputs, meta=meta)
    return inputs


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
    q, ctx = 1 + args.k, args.context
    num_blocks = 8 * -(-(ctx + q) // BLOCK)
    runner = ModelRunner(model, num_blocks, BLOCK, backend="xla", compile_in_background=False)
    ynn = ModelRunner(model, num_blocks, BLOCK, backend="xla", compile_in_background=False)
    rows = {
        "decode": (None, step(1, 1, ctx, rows="last")),
        "decode, 8 sequences": (None, step(8, 1, ctx, rows="last")),
        f"verify k={args.k} (as the engine)": (None, step(1, q, ctx, rows="all")),
        f"verify k={args.k}, seqs padded to rows": (None, step(1, q, ctx, rows="all", pad_seqs=True)),
        f"verify k={args.k}, unpadded": (None, step(1, q, ctx, rows="all", unpadded=True)),
        f"verify k={args.k}, sampled 1 row": (None, step(1, q, ctx, rows="last")),
        f"verify k={args.k}, temperature 1": (None, step(1, q, ctx, rows="all", temperature=1.0)),
        f"verify k={args.k}, YNNPACK dots": (ynn, step(1, q, ctx, rows="all")),
    }
    default_options = runner_module.cpu_compiler_options
    for r, inputs in rows.values():
        if r is ynn:  # its programs compile with XLA's defaults
            runner_module.cpu_compiler_options = lambda spec, n: None
        (r or runner).execute(inputs)  # compile and run once
        runner_module.cpu_compiler_options = default_options
    times = {name: np.inf for name in rows}
    for _ in range(args.repeats):
        for name, (r, inputs) in rows.items():
            r = r or runner
            start = time.perf_counter()
            for _ in range(args.calls):
                r.execute(inputs)
            times[name] = min(times[name], (time.perf_counter() - start) / args.calls)
    base = times["decode"]
    print(f"\n{args.model}, {ctx} cached tokens per sequence, k = {args.k}")
    print(f"{'step':38s} {'tokens':>6s} {'seqs':>5s} {'rows':>5s} {'ms':>8s} {'vs decode':>10s}")
    for name, (_, inputs) in rows.items():
        print(f"{name:38s} {len(inputs.token_ids):6d} {inputs.meta.kv_lens.shape[0]:5d} "
              f"{len(inputs.logits_indices):5d} {1000 * times[name]:8.1f} {times[name] / base:9.2f}x")


if __name__ == "__main__":
    main()
