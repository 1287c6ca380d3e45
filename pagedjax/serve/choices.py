"""From the engine's cumulative `RequestOutput` snapshots to the text deltas of each choice of a response.

A request has one choice per sample (`RequestOutput.outputs`, by sample index). The engine decodes text
incrementally and, while a sample runs, shows only text that can no longer change (`pagedjax.engine.output_processor`):
so a choice's delta is simply what its text gained since the last snapshot, and the deltas of a choice
concatenate to its final text (cut at a stop string), streamed or not. Nothing is decoded here.
Log-probabilities, when asked for, travel with the delta of the snapshot that brought their tokens, and so do
the new token ids with `ChoiceTracker(token_ids=True)` (vLLM's `return_token_ids`): a choice's deltas' ids
concatenate to all the tokens it generated (those of a text cut at a stop string included, as vLLM's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedjax.outputs import RequestOutput, TokenLogprobs

logger = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """The engine finished the request with an error (or aborted it)."""


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None  # "stop" | "length" once the choice is done
    logprobs: list[TokenLogprobs] | None = None  # of the tokens new in this snapshot, when asked for
    token_ids: list[int] | None = None  # the tokens new in this snapshot, with `ChoiceTracker(token_ids=True)`


@dataclass(frozen=True)
class _Sample:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None


def _samples(out: RequestOutput) -> list[_Sample]:
    if out.outputs:
        return [_Sample(c.index, c.token_ids, c.text, c.finish_reason, c.logprobs) for c in out.outputs]
    return [_Sample(0, out.output_token_ids, out.text, out.finish_reason, None)]


class ChoiceTracker:
    """Turns each snapshot of one request into the new text (and with `token_ids`, the new token ids) of each of
    its choices."""

    def __init__(self, *, token_ids: bool = False):
        self.token_ids = token_ids
        self._sent: dict[int, str] = {}  # per sample: the text sent so far
        self._ids: dict[int, list[int]] = {}  # per sample, with token_ids: its tokens so far
        self.finish_reasons: dict[int, str] = {}
        self.num_tokens: dict[int, int] = {}  # generated tokens per sample
        self.logprobs: dict[int, list[TokenLogprobs]] = {}  # per sample, when asked for
        self._final_order: list[int] | None = None  # the finished output's samples, in its order
        self._generated = 0  # the engine's count over every sample (best_of's dropped ones included)
        self.num_cached_tokens = 0  # the prompt's tokens the prefix cache held (its prefill's, for every sample)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated for the request: by every sample, also those best_of does not return."""
        return max(self._generated, sum(self.num_tokens.values()))

    def final_choices(self) -> list[tuple[int, str, str | None, list[TokenLogprobs] | None]]:
        """(choice index, whole text, finish reason, log-probabilities or None) of the finished request, in the
        engine's final order (the n best first when it drew more samples than it returns)."""
        return [(position, self._sent[i], self.finish_reasons.get(i), self.logprobs.get(i))
                for position, i in enumerate(self._order())]

    def final_token_ids(self) -> list[list[int]]:
        """Each final choice's token ids, in `final_choices`' order (with `token_ids`)."""
        return [self._ids.get(i, []) for i in self._order()]

    def _order(self) -> list[int]:
        return self._final_order if self._final_order is not None else sorted(self._sent)

    def update(self, out: RequestOutput) -> list[ChoiceDelta]:
        """The choices' new text in this snapshot (one delta per choice that changed or finished). Raises
        RequestFailed if the engine failed or aborted the request."""
        if out.finish_reason in ("error", "abort"):
            raise RequestFailed(out.error or f"the engine ended the request ({out.finish_reason})")
        deltas = []
        self._generated = max(self._generated, getattr(out, "num_generated_tokens", 0))
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)  # known once it is scheduled
        samples = _samples(out)
        if out.finished:
            self._final_order = [s.index for s in samples]
        for s in samples:
            if s.index in self.finish_reasons:
                continue
            self.num_tokens[s.index] = len(s.token_ids)
            if s.finish_reason in ("error", "abort"):
                raise RequestFailed(out.error or f"the engine ended the request ({s.finish_reason})")
            text = self._delta(s.index, s.text or "")
            if s.finish_reason is not None:
                self.finish_reasons[s.index] = s.finish_reason
            new_logprobs = None
            if s.logprobs is not None:
                sent = self.logprobs.setdefault(s.index, [])
                new_logprobs = s.logprobs[len(sent):]
                sent.extend(new_logprobs)
            new_ids = None
            if self.token_ids:  # the engine only appends tokens (a preempted request recomputes the same ones)
                ids = self._ids.setdefault(s.index, [])
                new_ids = list(s.token_ids[len(ids):])
                ids.extend(new_ids)
            if text or s.finish_reason is not None or new_logprobs or new_ids:
                deltas.append(ChoiceDelta(s.index, text, s.finish_reason, new_logprobs, new_ids))
        return deltas

    def _delta(self, index: int, text: str) -> str:
        """What `text` adds to the text sent for sample `index` (the engine never takes text back)."""
        sent = self._sent.setdefault(index, "")
        if not text.startswith(sent):  # cannot happen for the engine's text; never resend what was sent
            logger.warning("choice %d: the engine's text no longer starts with the %d characters sent", index,
                           len(sent))
            return ""
        self._sent[index] = text
        return text[len(sent):]
