"""The engine's structured-output state: one matcher per constrained request, keyed by request id.

The scheduler knows only that a request is constrained (`Request.constrained`: it then neither fuses decode steps
nor verifies proposals); this manager owns the matchers. Before a step it fills the allowed-token masks of the
rows that sample (`masks`); after the step it advances each matcher over its request's new output tokens and
returns the requests whose matcher refused one (`advance`; the engine fails those). A sample of a multi-sample
request starts from a copy of its group's matcher, made when the sample first needs it; a beam search fork starts
from a copy of its source's (`fork`). Matchers of requests no longer live are dropped (`retain`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from pagedjax.config.structured import StructuredLimits
from pagedjax.core.request import Request
from pagedjax.sampling_params import StructuredOutput
from pagedjax.structured_output.compiler import Constraint, ConstraintCompiler
from pagedjax.structured_output.limits import check_structured
from pagedjax.structured_output.masks import token_masks


class StructuredOutputManager:
    """Matchers by request id (see the module docstring)."""

    def __init__(self, compiler: ConstraintCompiler, limits: StructuredLimits):
        self.compiler = compiler
        self.limits = limits
        self._constraints: dict[str, Constraint] = {}

    def __len__(self) -> int:
        """Requests (and multi-sample groups) it keeps a matcher for."""
        return len(self._constraints)

    def compile(self, structured: StructuredOutput) -> Constraint:
        """A fresh matcher (`ConstraintCompiler.compile`: `InvalidConstraint` if invalid), once the
        constraint is within `limits` (`LimitError`, an `InvalidRequest` naming the limit, before any native code sees
        it: the grammar library overflows its stack on some hostile constraints). A constraint the compiler keeps
        compiled passed them then: its copy is not checked again (the server compiles in its prepare stage, so
        the engine thread's own call for the request neither re-reads a 64 KiB grammar nor compiles)."""
        return self.compiler.compile(structured, check=lambda: check_structured(structured, self.limits))

    def add(self, request_id: str, constraint: Constraint) -> None:
        self._constraints[request_id] = constraint

    def get(self, request: Request) -> Constraint | None:
        """The request's matcher; a sample's is made from its group's on first use."""
        constraint = self._constraints.get(request.request_id)
        if constraint is None and request.group is not None and not request.prefill_only:
            source = self._constraints.get(request.group.request.request_id)
            if source is not None:
                constraint = self._constraints[request.request_id] = source.copy()
        return constraint

    def fork(self, source_id: str, child_id: str) -> Constraint | None:
        """A copy of `source_id`'s matcher for `child_id` (a beam's fork); None when the source has none."""
        source = self._constraints.get(source_id)
        if source is None:
            return None
        child = self._constraints[child_id] = source.copy()
        return child

    def masks(self, requests: Sequence[Request], emits_token, vocab_size: int) -> np.ndarray | None:
        """The step's allowed-token bitmask rows (`masks.token_masks`) for `requests` in plan order: constrained
        rows that sample a token get their matcher's mask; None when no such row."""
        if not self._constraints:
            return None
        matchers = [None] * len(requests)
        for i, r in enumerate(requests):
            if r.constrained and emits_token[i] and (c := self.get(r)) is not None:
                matchers[i] = c.matcher
        return token_masks(matchers, vocab_size)

    def advance(self, requests: Sequence[Request]) -> list[tuple[Request, str]]:
        """Consume each unfinished constrained request's new output tokens; returns (request, why) for those whose
        matcher refused one (their mask allowed the token, so this is the library refusing mid-generation)."""
        refused = []
        for r in requests:
            if r.constrained and not r.is_finished and (c := self.get(r)) is not None:
                why = c.advance(r.output_token_ids)
                if why is not None:
                    refused.append((r, why))
        return refused

    def retain(self, live_request_ids: Collection[str]) -> None:
        """Drop the matchers of requests (and multi-sample groups) not in `live_request_ids`."""
        for rid in [rid for rid in self._constraints if rid not in live_request_ids]:
            del self._constraints[rid]
