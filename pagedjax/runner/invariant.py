"""Batch-invariant mode (`LLMEngine(batch_invariant=True)`): a request's tokens and log-probabilities are bitwise
the same whatever else shares its steps.

Why steps differ by default: a step's program is compiled for its padded shape (tokens T, sequences S, table
width B: `pagedjax.runner.shapes`), and on XLA:CPU the same row computes to other bits in another shape. Measured
on this project's 2-core CPU (jit, float32, one row compared bitwise while the row count varies 1..512):
  - matmuls: 1 row differs from 2+ rows ([n, 256] @ [256, 768] and [256, 2048]: up to 4e-5; [n, 1024] @ [1024,
    2816]: 2e-4), and 2..32 rows differ from 64+ at hidden 256 (another kernel); bfloat16 [n, 256] @ [256, 768]
    did not vary;
  - RMSNorm over 1024 features: 4+ rows differ from 1-3 (5e-7); over 256 features it did not vary;
  - log-softmax over 2048 logits: even row counts differ from odd ones (2e-6); over 32000 it did not vary;
  - the XLA attention path: one query over 40 keys padded to 48..512 columns did not vary.
With the row count fixed (64 or 512 rows) every one of these gave a row the same bits at any position and with
any other rows' contents. So this mode runs every step on one program: the ragged step of the engine's largest
shape (T = the token budget's bucket, S = max_num_seqs', B = the longest request's), every optional part on,
prompt log-probabilities included (sampled rows' logits are then taken from the logits of all T rows, as a
scoring request's are), so decode and prefill, chunk boundaries, prefix-cache hits, preemption and forks all run
the same per-row computation. Fused decode is another program (its rows are S, not T): the mode needs
`decode_steps_per_call` 1. The price is a full-size step every time (see `scripts/bench_invariant.py`).
Only the XLA path was measured; the Pallas kernels' tilings are not covered by this mode's checks.
"""

from __future__ import annotations

import logging

from pagedjax.runner.shapes import StepShape, warmup_shapes

logger = logging.getLogger(__name__)


def invariant_shape(*, max_tokens: int, max_seqs: int, max_request_tokens: int, block_size: int,
                    backend: str) -> StepShape:
    """The one program every step of a batch-invariant engine runs on: the warm-up's ragged step with every
    optional part on, prompt log-probabilities and pooled sums included (it dominates every step but those asking
    for logits or more than `inputs.STOP_ID_WIDTHS[-1]` stop ids, which the runner refuses in this mode). On the Pallas
    backend a warning says that the invariance was checked on the XLA path only."""
    if backend != "xla":
        logger.warning("batch_invariant=True on the %r attention backend: every step runs one program, but "
                       "bitwise invariance was measured on the XLA path only (see pagedjax.runner.invariant)", backend)
    max_blocks = -(-max_request_tokens // block_size)
    shapes = warmup_shapes(max_tokens=max_tokens, max_seqs=max_seqs, max_blocks=max_blocks, block_size=block_size,
                           decode_steps=1, narrow=False)
    return next(s for s in shapes if s.prompt_targets)
