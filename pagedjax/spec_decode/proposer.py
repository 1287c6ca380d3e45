"""The one interface of a speculative proposer, and the n-gram (prompt lookup) proposer.

A proposer only suggests tokens: whatever it returns, the output is the non-speculative one (a wrong proposal
costs compute, never tokens; `pagedjax.core.step_result` states the acceptance rule). It is asked once per step,
after the step, for all the requests that speculate (`ProposalAsk`s; none, some steps), with the step itself
(`StepSeen`: an MTP head reads the target's hidden states of every request the step ran), so that one on the device
batches its calls; its per-request state is its own, keyed by request id (`forget` drops what is no longer live).
Adding a proposer is one new file with a class of this interface, and one line in `make_proposer`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from pagedjax.config import SpeculativeConfig
from pagedjax.core.request import Request
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.step_plan import StepPlan
from pagedjax.core.step_result import StepResult


class ProposalAsk(NamedTuple):
    """One request a proposer is asked for at most `cap` (>= 1) tokens to follow its known tokens."""

    request: Request
    cap: int
    block_ids: tuple[int, ...]  # the request's blocks (logical order): they cover its tokens and `cap` more
    # each block's allocation count (`Scheduler.draft_blocks`; empty: not known): a block id seen again with
    # another count was given to another holder in between
    block_allocations: tuple[int, ...] = ()


class StepSeen(NamedTuple):
    """The step just applied (`Scheduler.update` ran): its plan, its result and the scheduler (its requests now)."""

    plan: StepPlan
    result: StepResult
    scheduler: Scheduler


class Proposer(Protocol):
    def propose(self, asks: list[ProposalAsk], step: StepSeen | None) -> Sequence[Sequence[int]]:
        """For each ask, at most `ask.cap` tokens likely to follow its request's known tokens (prompt + outputs);
        empty when it has no guess. `step`: the step after which it is asked (None: not known)."""

    def forget(self, live_request_ids: Collection[str]) -> None:
        """Drop the state of every request not in `live_request_ids`."""


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
    step (see docs/speculative_decoding.md), so a request whose text has stopped repeating stops paying for it. This
    only changes what is proposed, never the output."""

    MAX_BACKOFF = 16

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._backoff: dict[str, _Backoff] = {}  # by request id

    def propose(self, asks: list[ProposalAsk], step: StepSeen | None) -> list[list[int]]:
        return [self.propose_for(ask.request, ask.cap) for ask in asks]

    def forget(self, live_request_ids: Collection[str]) -> None:
        for rid in [rid for rid in self._backoff if rid not in live_request_ids]:
            del self._backoff[rid]

    def propose_for(self, request: Request, cap: int) -> list[int]:
        """The proposal for one request (at most `min(k, cap)` tokens), its back-off state updated."""
        state = self._backoff.setdefault(request.request_id, _Backoff())
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
    """The proposer of `config.method` (`draft`: the engine's device proposer, a `DraftProposer` for method "draft"
    or an `MTPProposer` for "mtp")."""
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if draft is None:
        raise ValueError(f"SpeculativeConfig(method={config.method!r}) needs the engine's device proposer")
    return draft
