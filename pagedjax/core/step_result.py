"""What one step produced, as the host applies it: `StepResult`, the one result type of every kind of step.

Plain Python + numpy, no JAX. Every step (a mixed prefill/decode step, a fused decode of N steps, a speculative
verify step) returns, per sequence of its plan and in the plan's order, the tokens the device sampled for it: a
ragged list of rows. `Scheduler.update(plan, result)` applies any of them by one rule (`emitted_tokens`):

  - a sequence without proposals emits every row: one in a plain step, up to N in a fused decode, where the
    device itself fed each sampled token back as the next step's input;
  - a sequence verifying proposals d_1..d_k has k + 1 rows s_0..s_k (one per position of its query chunk) and
    emits s_0..s_a, where d_1..d_a is the longest prefix of its proposals with d_j == s_{j-1}.

Either way, each emitted token came from its predecessor fed back (the first from the sequence's last known token),
so those predecessors' KV is computed: a sequence that emits e tokens has its tokens before its last known one plus
e computed (a fused decode's sequence that ran none of its steps emits none and computes nothing). Emission stops
at the first emitted token that finishes the request (`Request.finish_status`), and nothing past it is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedjax.core.step_plan import StepPlan, first_rows


@dataclass(frozen=True)
class StepResult:
    """One step's sampled tokens, ragged by sequence: sequence s's rows are `token_ids[cu_rows[s]:cu_rows[s+1]]`.

    `logprobs` (when the step computed them) holds per row `logprob f32[R]`, `top_ids i32[R, K]` and
    `top_logprobs f32[R, K]`; `prompt_logprobs` the same per token of the plan `[T]`, at the positions whose target
    token `prompt_targets[t] >= 0` (i32[T], the prompt token after position t). `block_tables` is a fused
    decode's tables as the device left them (`[S, B]`, or `[num_groups, S, B]` with several KV cache groups; the
    host adopts the lent blocks they took).
    """

    token_ids: np.ndarray  # int32 [R]
    cu_rows: np.ndarray  # int32 [S + 1]
    logprobs: Any = None
    prompt_logprobs: Any = None
    prompt_targets: np.ndarray | None = None  # int32 [T], with prompt_logprobs
    block_tables: np.ndarray | None = None  # int32 [(num_groups,) S, B], fused decodes only
    pooled: np.ndarray | None = None  # float32 [S, hidden]: pooling requests' hidden-state sums of this step
    # a device array [>= T, hidden]: the final hidden state of each token of the plan, in its order (a runner that
    # keeps them, for an MTP head: `pagedjax.spec_decode.mtp`); opaque here, never read on the host
    hidden: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.cu_rows) - 1

    def rows(self, s: int) -> list[int]:
        """Sequence s's sampled tokens, in order."""
        return self.token_ids[self.cu_rows[s]:self.cu_rows[s + 1]].tolist()

    @classmethod
    def from_rows(cls, plan: StepPlan, sampled, logprobs=None, prompt_logprobs=None,
                  prompt_targets=None, pooled=None, hidden=None) -> StepResult:
        """The result of a ragged step (plain or verifying): `sampled` int `[>= R]`, one token per row of
        `plan.logits_indices`, which holds each sequence's rows in order; `logprobs` rows alike; `pooled` one row
        per sequence of the plan."""
        sampled = np.asarray(sampled).reshape(-1)
        cu = first_rows(plan)
        if sampled.shape[0] < cu[-1]:
            raise ValueError(f"got {sampled.shape[0]} sampled tokens for {int(cu[-1])} rows")
        if pooled is not None and np.shape(pooled)[0] != plan.num_seqs:
            raise ValueError(f"got {np.shape(pooled)[0]} pooled rows for {plan.num_seqs} sequences")
        return cls(sampled[:cu[-1]].astype(np.int32), cu, logprobs, prompt_logprobs, prompt_targets, pooled=pooled,
                   hidden=hidden)

    @classmethod
    def from_fused(cls, plan: StepPlan, sampled, block_tables, logprobs=None) -> StepResult:
        """The result of a fused decode: `sampled` int `[num_steps, >= S]` (negative: the sequence did not run that
        step), at most `plan.fused.max_new_tokens[s]` of sequence s's leading ones counted; `block_tables`
        `[(num_groups,) >= S, B]` as the device left them; `logprobs` arrays `[num_steps, S, ...]`."""
        if plan.fused is None:
            raise ValueError("from_fused needs a fused decode's plan")
        n = plan.num_seqs
        sampled = np.asarray(sampled)
        tables = np.asarray(block_tables)
        if sampled.ndim != 2 or sampled.shape[1] < n:
            raise ValueError(f"sampled_token_ids must be [num_steps, >= {n}], got {sampled.shape}")
        groups = () if plan.num_groups == 1 else (plan.num_groups,)
        if tables.ndim != len(groups) + 2 or tables.shape[:-2] != groups or tables.shape[-2] < n:
            raise ValueError(f"block_tables must be [{'num_groups, ' * bool(groups)}>= {n}, max_blocks], got "
                             f"{tables.shape}")
        columns = sampled[:, :n].T  # [S, num_steps]
        ran = np.cumprod(columns >= 0, axis=1).astype(bool)  # a sequence runs until its first skipped step
        ran &= np.arange(columns.shape[1]) < plan.fused.max_new_tokens[:, None]
        seq, step = np.nonzero(ran)  # row-major: each sequence's steps in order
        cu = np.zeros(n + 1, np.int32)
        np.cumsum(ran.sum(axis=1), out=cu[1:])
        if logprobs is not None:
            logprobs = type(logprobs)(*(a[step, seq] for a in logprobs))
        return cls(columns[seq, step].astype(np.int32), cu, logprobs, block_tables=tables[..., :n, :])


def emitted_tokens(drafts: Sequence[int], rows: Sequence[int]) -> list[int]:
    """The tokens a sequence emits from its rows (see the module docstring): every row when it verified no
    proposals; else its rows up to and including the first that differs from the proposal at its position."""
    if not drafts:
        return [int(t) for t in rows]
    if len(rows) != len(drafts) + 1:
        raise ValueError(f"{len(rows)} sampled tokens for {len(drafts)} proposals (expected one more)")
    a = 0
    while a < len(drafts) and drafts[a] == rows[a]:
        a += 1
    return [int(t) for t in rows[:a + 1]]
