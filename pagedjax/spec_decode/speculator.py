"""Speculative decoding, the engine's side: after each step, which requests speculate and what they propose; the
acceptance counters.

  SpeculativeConfig(method="ngram", num_speculative_tokens=k, ...)  ->  Speculator(config)
  engine loop: plan -> step -> Scheduler.update -> Speculator.propose(scheduler, step) -> next plan verifies them

A step's proposals come from that step's output: once `Scheduler.update` has applied it, every request that
speculates gets blocks for up to k more tokens (`Scheduler.reserve_draft_slots`, never preempting), the proposer
fills what it can (`pagedjax.spec_decode.proposer`), and the scheduler keeps only each row's draft token ids
(`Scheduler.set_draft_tokens`): its next plan runs each speculating request as the query chunk [t, d_1, ..., d_k]
and samples every verified position, and `Scheduler.update` accepts the longest matching prefix and rolls back
the rest (`pagedjax.core.step_result`, which states why the output is the non-speculative one, token for token).

Which requests speculate (`speculates`): a decoding request that is not a multi-sample prefill, not held (beam
search takes one token per step), has no structured-output constraint (its matcher would have to walk every
proposal) and no penalties (they count output tokens, which would differ from row to row of the chunk). Its
proposals are capped so that it never computes past max_tokens or max_model_len, by the proposer's own maximum,
by the free blocks, and, in the next plan, by the token budget.

A step with proposals is never a fused decode (verification needs the host between steps), so fused decode steps
run while no request has a proposal.
"""

from __future__ import annotations

import time

from pagedjax.config import SchedulerConfig, SpeculativeConfig
from pagedjax.core.request import Request
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.step_plan import StepPlan
from pagedjax.core.step_result import StepResult, emitted_tokens
from pagedjax.runner.inputs import bucket
from pagedjax.runner.shapes import LoopShape, StepShape
from pagedjax.spec_decode.proposer import ProposalAsk, Proposer, StepSeen, check_speculative_config, make_proposer


def speculates(request: Request) -> bool:
    """Whether a decoding request may verify proposals (see the module's docstring)."""
    return (not request.prefill_only and not request.hold and not request.constrained
            and not request.sampling_params.has_penalties)


class Speculator:
    """One engine's speculative decoding: its proposer, the proposals after each step, and the acceptance counters
    (`EngineStats.spec_*`)."""

    def __init__(self, config: SpeculativeConfig, draft: Proposer | None = None):
        check_speculative_config(config)
        self.config = config
        self.draft = draft  # the device proposer: the draft model's (method "draft") or the MTP head's ("mtp"), or None
        self.proposer = make_proposer(config, draft)
        self.num_sequences = 0  # sequence-steps that verified proposals
        self.num_proposed = 0
        self.num_accepted = 0
        self.proposer_seconds = 0.0  # wall time of the proposer's calls (`propose`)

    def stats(self) -> dict[str, int | float]:
        """The counters, as `EngineStats` fields."""
        return dict(spec_sequences=self.num_sequences, spec_proposed_tokens=self.num_proposed,
                    spec_accepted_tokens=self.num_accepted, spec_proposer_s=self.proposer_seconds)

    def warmup_shapes(self, shapes: list[StepShape | LoopShape], config: SchedulerConfig) -> list[StepShape]:
        """The ragged steps of `shapes` (`LLMEngine.warmup`'s) with as many rows as a step that verifies proposals
        may sample (1 + k per sequence, within the token budget and the program's tokens: a step samples at most
        one row per token), so that they stand in for those steps too."""
        rows = bucket(min(config.max_num_seqs * (1 + self.config.num_speculative_tokens),
                          config.max_num_batched_tokens))
        return [s._replace(rows=min(rows, s.tokens)) for s in shapes
                if isinstance(s, StepShape) and s.num_rows < min(rows, s.tokens)]

    def count(self, plan: StepPlan, result: StepResult, emitted: list[int]) -> None:
        """Count a step's verification: per sequence its proposals and how many of them the target's tokens
        verified (`emitted_tokens` before any stop: a proposal equal to the target's token is accepted even when
        that token finishes the request). `emitted`: the tokens each sequence appended; one aborted or preempted
        since its plan appended none and is not counted."""
        if plan.num_drafts is None:
            return
        cu = plan.cu_q_lens.tolist()
        for i, (d, e) in enumerate(zip(plan.num_drafts.tolist(), emitted, strict=True)):
            if d and e:
                verified = emitted_tokens(plan.token_ids[cu[i + 1] - d:cu[i + 1]].tolist(), result.rows(i))
                self.num_sequences += 1
                self.num_proposed += d
                self.num_accepted += len(verified) - 1

    def propose(self, scheduler: Scheduler, step: StepSeen | None = None) -> None:
        """After a step (`step`: the one `Scheduler.update` just applied; None for a scheduler driven without
        steps, as tests do): every running request that speculates and decodes next gets its proposals
        (`Scheduler.set_draft_tokens`), at most k and what the free blocks and its limits allow. The proposer is
        called every step, with no ask too (an MTP head takes in what the step computed)."""
        self.proposer.forget(scheduler.requests.keys())
        asks: list[ProposalAsk] = []
        for r in scheduler.running:
            if r.paused or r.num_tokens - r.num_computed_tokens != 1 or not speculates(r):
                continue
            cap = min(self.config.num_speculative_tokens, scheduler.max_new_tokens_left(r) - 1)
            reserved = scheduler.reserve_draft_slots(r, cap) if cap > 0 else None
            if reserved is not None:
                asks.append(ProposalAsk(r, *reserved))
        start = time.perf_counter()
        proposals = self.proposer.propose(asks, step)
        self.proposer_seconds += time.perf_counter() - start
        if len(proposals) != len(asks):
            raise ValueError(f"the proposer returned {len(proposals)} proposals for {len(asks)} requests")
        for ask, proposal in zip(asks, proposals, strict=True):
            if len(proposal) > ask.cap:
                raise ValueError(f"the proposer returned {len(proposal)} tokens for request "
                                 f"{ask.request.request_id!r}, at most {ask.cap} were asked for")
            scheduler.set_draft_tokens(ask.request, proposal)
