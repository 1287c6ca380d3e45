"""Speculative decoding, the engine's side: proposers, the inputs of a step that samples every verified position,
and the bookkeeping after it. The host decisions (what a step verifies, what it accepts, the KV rollback) are in
`pagedjax.core.speculation`; its docstring states the exactness argument.

  SpeculativeConfig(method="ngram", num_speculative_tokens=k, ...)  ->  Speculator(config)

A `Proposer` only suggests tokens: whatever it returns, the output is the non-speculative one (a wrong proposal
costs compute, never tokens). `NgramProposer` (prompt lookup) and `pagedjax.engine.draft.DraftProposer` (a draft
model, its KV in the target's blocks) are the methods; an EAGLE-style head would be another (it would also need
the step's hidden states, which this interface does not give it yet). A proposer is asked once per step for all
the speculating requests (`ProposalAsk`s), so that one on the device batches its calls.

The fused decode loop (`LLMEngine(decode_steps_per_call > 1)`) runs only in steps where no decoding request has a
proposal: verification needs the host between steps (the proposal comes from the tokens the last step accepted),
so a step with proposals runs as one ragged step of 1 + k tokens per speculating request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pagedjax.config import SchedulerConfig, SpeculativeConfig
from pagedjax.core.request import Request
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.speculation import (
    ProposalAsk,
    VerifyOutcome,
    first_rows,
    schedule_speculative,
    speculates,
    update_speculative,
)
from pagedjax.core.step_plan import StepPlan
from pagedjax.device.sampling import PenaltyMetadata, SamplingMetadata
from pagedjax.engine.inputs import (
    StepInputs,
    bucket,
    num_top_logprobs,
    pad_step,
    penalty_metadata,
    prompt_targets,
    sampling_metadata,
)
from pagedjax.engine.outputs import record_token_logprob
from pagedjax.engine.shapes import LoopShape, StepShape
from pagedjax.engine.structured import token_masks


class Proposer(Protocol):
    def propose(self, asks: list[ProposalAsk]) -> Sequence[Sequence[int]]:
        """For each ask, at most `ask.cap` (>= 1) tokens likely to follow its request's known tokens (prompt +
        outputs); empty when it has no guess."""

    def would_propose(self, request: Request) -> bool:
        """Whether a decoding request would get a proposal in the next step (asked to choose the fused decode)."""


@dataclass
class _Backoff:
    """A request's record of its last proposal and how long it holds back after proposals that all failed."""

    start: int = -1  # num_tokens when the last proposal was made (-1: none pending)
    proposal: tuple[int, ...] = ()
    wait: int = 0  # tokens it holds back after the next failure (doubles per failure, 0 after a success)
    until: int = 0  # no proposal before the request has this many tokens


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the request's last n tokens in its prompt and
    outputs, longest n first (from `max_n` down to `min_n`), and propose the up to `k` tokens that followed it.
    No occurrence: no proposal, so the request decodes one token at a time (text that does not repeat itself
    costs nothing but the search).

    Back-off: when none of a request's last proposal was accepted (its next output differs from the proposal's
    first token), it proposes nothing for its next 1, 2, 4, ... up to `MAX_BACKOFF` tokens, doubling with each
    failure in a row and reset by a proposal that got a token accepted: a verifying step costs more than a decode
    step (see README's measurements), so a request whose text has stopped repeating stops paying for it. This
    only changes what is proposed, never the output."""

    MAX_BACKOFF = 16

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, asks: list[ProposalAsk]) -> list[list[int]]:
        return [self.propose_for(ask.request, ask.cap) for ask in asks]

    def would_propose(self, request: Request) -> bool:
        return bool(self.propose_for(request, 1))

    def propose_for(self, request: Request, cap: int) -> list[int]:
        """The proposal for one request (at most `min(k, cap)` tokens), its back-off state updated."""
        state = request.proposer_state
        if state is None:
            state = request.proposer_state = _Backoff()
        n = request.num_tokens
        if 0 <= state.start < n:  # a step ran since the last proposal: was its first token accepted?
            if request.get_token_id(state.start) == state.proposal[0]:
                state.wait = 0
            else:
                state.until = n + max(state.wait, 1)
                state.wait = min(2 * max(state.wait, 1), self.MAX_BACKOFF)
            state.start = -1
        if n < state.until:
            return []
        proposal = self._lookup(request, cap)
        if proposal:
            state.start, state.proposal = n, tuple(proposal)
        return proposal

    def _lookup(self, request: Request, cap: int) -> list[int]:
        tokens = np.asarray(request.all_token_ids, np.int32)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # windows that end before the last token: each has at least one token after it
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[size - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + min(self.k, cap)].tolist()
        return []


def check_speculative_config(config) -> None:
    """TypeError unless `config` is a `SpeculativeConfig`."""
    if not isinstance(config, SpeculativeConfig):
        raise TypeError(f"speculative_config must be a SpeculativeConfig, got {type(config).__name__}")


def make_proposer(config: SpeculativeConfig, draft: Proposer | None) -> Proposer:
    """The proposer of `config.method` (`draft`: the engine's `DraftProposer` for method "draft")."""
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if draft is None:
        raise ValueError("SpeculativeConfig(method='draft') needs the engine's draft model")
    return draft


class Speculator:
    """One engine's speculative decoding: its proposer, the step inputs that sample every verified position, and
    the acceptance counters (`EngineStats.spec_*`)."""

    def __init__(self, config: SpeculativeConfig, draft: Proposer | None = None):
        check_speculative_config(config)
        self.config = config
        self.draft = draft  # the draft model's proposer (method "draft"), None otherwise
        self.proposer = make_proposer(config, draft)
        self.num_sequences = 0  # sequence-steps that verified proposals
        self.num_proposed = 0
        self.num_accepted = 0

    def stats(self) -> dict[str, int]:
        """The counters, as `EngineStats` fields."""
        return dict(spec_sequences=self.num_sequences, spec_proposed_tokens=self.num_proposed,
                    spec_accepted_tokens=self.num_accepted)

    def warmup_shapes(self, shapes: list[StepShape | LoopShape], config: SchedulerConfig) -> list[StepShape]:
        """The ragged steps of `shapes` (`LLMEngine.warmup`'s) with as many rows as a step that verifies proposals
        may sample (1 + k per sequence, within the token budget and the program's tokens: a step samples at most
        one row per token), so that they stand in for those steps too."""
        rows = bucket(min(config.max_num_seqs * (1 + self.config.num_speculative_tokens),
                          config.max_num_batched_tokens))
        return [s._replace(rows=min(rows, s.tokens)) for s in shapes
                if isinstance(s, StepShape) and s.num_rows < min(rows, s.tokens)]

    def has_proposals(self, scheduler: Scheduler) -> bool:
        """Whether some running request that decodes would get a proposal (a step that then cannot be a fused
        decode). Only asked when nothing waits and every running request decodes (the fused decode's condition)."""
        return any(speculates(r) and r.num_tokens - r.num_computed_tokens == 1
                   and scheduler.max_new_tokens_left(r) > 1 and self.proposer.would_propose(r)
                   for r in scheduler.running if not r.paused)

    def schedule(self, scheduler: Scheduler) -> StepPlan:
        return schedule_speculative(scheduler, self.proposer.propose, self.config.num_speculative_tokens)

    def finish_step(self, scheduler: Scheduler, plan: StepPlan, requests: list[Request], out,
                    before: list[int]) -> None:
        """After the device ran a plan with proposals (`StepOutputs` `out`, one row per verified position): accept,
        roll back, and record the emitted tokens' log-probabilities (each its own row's: the non-speculative
        ones)."""
        outcome: VerifyOutcome = update_speculative(scheduler, plan, out.tokens)
        self.num_sequences += outcome.num_sequences
        self.num_proposed += outcome.num_proposed
        self.num_accepted += outcome.num_accepted
        first = first_rows(plan).tolist()
        for i, r in enumerate(requests):
            for j in range(r.num_output_tokens - before[i] if r.wants_logprobs else 0):
                record_token_logprob(r, int(out.tokens[first[i] + j]), out.logprobs, (first[i] + j,))


def speculative_step_inputs(plan: StepPlan, requests: list[Request], *, vocab_size: int,
                            engine_seed: int) -> StepInputs:
    """The padded device inputs of a plan with proposals (`StepPlan.num_drafts`): one sampled row per verified
    position (`StepPlan.logits_indices`), row j of a sequence drawn as its request's output number
    `num_output_tokens + j` (the seed's key a non-speculative step would use there); penalties and token masks are
    the sequence's own (a speculating request has neither: `speculates`)."""
    first = first_rows(plan)
    seq_of_row = np.repeat(np.arange(plan.num_seqs), np.diff(first))  # i32[R]
    offset = np.arange(len(seq_of_row), dtype=np.int32) - first[seq_of_row]  # i32[R]: j within its sequence
    sampling = SamplingMetadata(*(np.asarray(a)[seq_of_row] for a in sampling_metadata(requests, engine_seed)))
    sampling = sampling._replace(step=sampling.step + offset)
    penalties = penalty_metadata(requests, vocab_size)
    if penalties is not None:
        penalties = PenaltyMetadata(*(a[seq_of_row] for a in penalties))
    mask = token_masks(requests, plan.emits_token, vocab_size)
    targets, num_prompt_top = prompt_targets(plan, requests)
    return pad_step(token_ids=plan.token_ids, positions=plan.positions, slot_mapping=plan.slot_mapping,
                    block_tables=plan.block_tables, kv_lens=plan.kv_lens, cu_q_lens=plan.cu_q_lens,
                    sampling=sampling, block_copies=plan.block_copies, penalties=penalties, prompt_targets=targets,
                    num_top_logprobs=num_top_logprobs(requests), num_prompt_top_logprobs=num_prompt_top,
                    token_mask=None if mask is None else mask[seq_of_row], logits_indices=plan.logits_indices)
