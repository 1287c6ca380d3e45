"""A step's outputs, in one place: sampled tokens -> log-probabilities, text, stop strings, `RequestOutput`s.

The scheduler has already appended the step's tokens and decided every stop it can see in token ids (EOS, stop
token ids, max_tokens, the model's length). What needs text is decided here, in one place: each sequence's text
is decoded incrementally (`IncrementalText`: a few tokens per step, never the whole output again) and a stop
string is looked for only where it could newly end, in the new text plus a tail one stop string long. The hits
are returned (`OutputProcessor.find_stops`): the engine hands them to the scheduler (`Scheduler.stop_at`), which
owns the request's lists and cuts them.

While a sequence runs, `CompletionOutput.text` is the text that can no longer change: it never ends inside an
incomplete UTF-8 character, nor with a tail that could still grow into a stop string (the final text is cut
there if it does). A streaming front end sends `text[len(sent):]` and never takes anything back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pagedjax.config.pooling import DenseLayer
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.step_plan import StepPlan
from pagedjax.outputs import CompletionOutput, RequestOutput, TokenLogprobs

REPLACEMENT = "\ufffd"  # what a decoder puts where a character's bytes are incomplete


class IncrementalText:
    """The text of one growing token sequence, decoding only a window of its newest tokens per token.

    `text` is the decode of the first `read` ids. The window `[prefix, read)` is the last piece already in
    `text`, decoded again with the new ids so that a tokenizer whose decode depends on the previous token
    (leading-space handling) gives the same characters it gives in a whole decode. New text is
    taken only once it does not end in U+FFFD (the next token may complete the character). For a prefix-stable
    decode (byte-level and byte-level BPE tokenizers), `text + pending()` equals `decode(token_ids)`.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids [prefix, read) are the window decoded again before new ids
        self._read = 0  # ids before `read` are in `text`

    def append(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        ids = self.token_ids
        window = self.tokenizer.decode(ids[self._prefix:self._read])
        grown = self.tokenizer.decode(ids[self._prefix:])
        if len(grown) <= len(window) or grown.endswith(REPLACEMENT):
            return ""
        delta = grown[len(window):]
        self.text += delta
        self._prefix, self._read = self._read, len(ids)
        return delta

    def pending(self) -> str:
        """The decode of the tokens not yet in `text` (an incomplete character shows as U+FFFD)."""
        ids = self.token_ids
        return self.tokenizer.decode(ids[self._prefix:])[len(self.tokenizer.decode(ids[self._prefix:self._read])):]


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `stops` (0 if none). Looks at
    most one stop string's length back, and only where the stop's first character occurs."""
    best = 0
    for stop in stops:
        i = text.find(stop[0], max(len(text) - len(stop) + 1, 0))
        while i >= 0 and len(text) - i > best:
            if stop.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return best


class SequenceText:
    """One sequence's text and its stop-string state."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.decoded = IncrementalText(tokenizer)
        self.stops = stops
        self.longest_stop = max(map(len, stops), default=0)

    def add(self, token_id: int) -> tuple[int, str] | None:
        """Add a token; returns (position, stop string) of the first stop string its text completes."""
        text = self.decoded
        before = len(text.text)
        if not text.append(token_id) or not self.stops:
            return None
        start = max(before - self.longest_stop + 1, 0)  # a stop found now ends in the new text
        hits = [(i, stop) for stop in self.stops if (i := text.text.find(stop, start)) >= 0]
        return min(hits) if hits else None

    def safe_text(self) -> str:
        """The text that can no longer change while the sequence runs (see the module docstring)."""
        text = self.decoded.text
        return text[:len(text) - stop_prefix_len(text, self.stops)] if self.stops else text


class OutputProcessor:
    """Turns the requests a step advanced into `RequestOutput`s.

    Each sequence's text state is kept here, by request id, until the request (or its multi-sample request) is
    no longer live (`retain`). A fork (a sample, a beam) starts without one and decodes its inherited tokens once,
    and so does a sequence whose tokens changed under it (a beam's last token replaced).
    """

    def __init__(self, tokenizer, dense: tuple[DenseLayer, ...] = ()):
        self.tokenizer = tokenizer
        self.dense = dense  # the model's projections of a pooled vector (`PoolingDefaults.dense`)
        self._texts: dict[str, SequenceText] = {}

    def __len__(self) -> int:
        """Requests it keeps a text state for."""
        return len(self._texts)

    def _text_of(self, r: Request, num_known: int) -> SequenceText:
        """Its text state over its first `num_known` output tokens, made (or remade) when it has none or one
        over other tokens (a beam's last token replaced)."""
        state = self._texts.get(r.request_id)
        ids = r.output_token_ids
        if state is None or len(state.decoded.token_ids) != num_known or (
                num_known and state.decoded.token_ids[-1] != ids[num_known - 1]):
            state = self._texts[r.request_id] = SequenceText(self.tokenizer, r.sampling_params.stop)
            for t in ids[:num_known]:  # no stop string in them: they were checked when they were new
                state.decoded.append(t)
        return state

    def find_stops(self, requests: list[Request], before: list[int]) -> list[tuple[Request, int, str]]:
        """Decode the tokens each request got in this step (`before`: its output length before the step); returns
        `(request, n, stop string)` for each whose text its n-th output token completed a stop string in (the
        first one), for the scheduler to end it there (`Scheduler.stop_at`)."""
        stops = []
        if self.tokenizer is None:
            return stops
        for r, b in zip(requests, before, strict=True):
            if r.prefill_only:
                continue
            state = self._text_of(r, b)
            for m in range(b, r.num_output_tokens):
                hit = state.add(r.output_token_ids[m])
                if hit is not None:
                    stops.append((r, m + 1, hit[1]))
                    break
        return stops

    def retain(self, live_request_ids) -> None:
        """Drop the text state of every request not in `live_request_ids`."""
        for rid in [rid for rid in self._texts if rid not in live_request_ids]:
            del self._texts[rid]

    def outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """One `RequestOutput` per caller's request among `requests` (the samples of one request merge)."""
        outputs: dict[str, RequestOutput] = {}
        for r in requests:
            key = r.group.request.request_id if r.group is not None else r.request_id
            if key not in outputs:
                outputs[key] = self._output(r)
        return list(outputs.values())

    def _text(self, r: Request) -> str | None:
        if self.tokenizer is None:
            return None
        state = self._texts.get(r.request_id)
        if state is None or len(state.decoded.token_ids) != r.num_output_tokens:  # not advanced here yet
            state = self._text_of(r, r.num_output_tokens)
        if not r.is_finished:
            return state.safe_text()
        if r.stop_str is None:
            return state.decoded.text + state.decoded.pending()
        text = state.decoded.text
        end = text.find(r.stop_str)
        return text[:end + len(r.stop_str) if r.sampling_params.include_stop_str_in_output else end]

    def _completion(self, r: Request, index: int) -> CompletionOutput:
        stop_reason = r.stop_str
        if stop_reason is None and r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids:
            stop_reason = r.output_token_ids[-1]
        return CompletionOutput(index=index, token_ids=list(r.output_token_ids), text=self._text(r),
                                cumulative_logprob=r.cumulative_logprob if r.wants_logprobs else None,
                                logprobs=None if r.logprobs is None else list(r.logprobs),
                                finish_reason=r.finish_reason(), stop_reason=stop_reason)

    def _output(self, r: Request) -> RequestOutput:
        group = r.group
        if group is None:
            c = self._completion(r, 0)
            return RequestOutput(request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
                                 output_token_ids=c.token_ids, num_cached_tokens=max(r.num_cached_tokens, 0),
                                 finish_reason=c.finish_reason, text=c.text, error=r.error, outputs=[c],
                                 num_generated_tokens=len(c.token_ids),
                                 prompt_logprobs=None if r.prompt_logprobs is None else list(r.prompt_logprobs),
                                 embedding=embedding(r, self.dense) if r.pooling is not None and
                                 r.status is RequestStatus.FINISHED_STOPPED else None)
        request, params = group.request, group.request.sampling_params
        outputs = [self._completion(s, s.sample_index) for s in group.samples]
        finished = group.finished
        if finished and params.num_samples > params.n:  # the n best, best first
            outputs = sorted(outputs, key=lambda c: -c.cumulative_logprob)[:params.n]
        first = outputs[0] if outputs else None
        if not finished:
            reason = None
        elif request.is_finished:  # ended before its samples existed (aborted, or its prefill failed)
            reason = request.status.value
        else:
            reason = first.finish_reason
        errors = [s.error for s in group.samples if s.error] + ([request.error] if request.error else [])
        cached = group.samples[0].num_cached_tokens if group.samples else r.num_cached_tokens
        return RequestOutput(request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                             output_token_ids=list(first.token_ids) if first else [],
                             num_cached_tokens=max(cached, 0), finish_reason=reason,
                             text=first.text if first else None, error=errors[0] if errors else None,
                             outputs=outputs,
                             prompt_logprobs=None if group.prompt_logprobs is None else list(group.prompt_logprobs),
                             num_generated_tokens=sum(s.num_output_tokens for s in group.samples))


# ------------------------------------------------------------------------------------------- log-probabilities
def record_token_logprob(r: Request, token: int, logprobs, at: tuple[int, ...]) -> None:
    """Append output token `token`'s log-probability (and its top alternatives, if the request wants them)
    from row `at` of a step's device log-probability arrays."""
    r.output_logprobs.append(float(logprobs.logprob[at]))
    if r.logprobs is not None:
        k = r.sampling_params.logprobs or 0
        # Tokens a structured-output constraint forbade have log-probability -inf: they are no alternatives.
        top = tuple((t, lp) for t, lp in zip(logprobs.top_ids[at][:k].tolist(), logprobs.top_logprobs[at][:k].tolist(),
                                             strict=True) if lp != -math.inf)
        r.logprobs.append(TokenLogprobs(token, float(logprobs.logprob[at]), top))


def record_prompt_logprobs(plan: StepPlan, requests: list[Request], targets: np.ndarray, lps) -> None:
    """Append each prompt position's log-probability that this step computed (`targets[t] >= 0`)."""
    for i, r in enumerate(requests):
        if r.prompt_logprobs is None:
            continue
        k = r.sampling_params.prompt_logprobs or 0
        for t in range(int(plan.cu_q_lens[i]), int(plan.cu_q_lens[i + 1])):
            if targets[t] >= 0:
                r.prompt_logprobs.append(TokenLogprobs(
                    int(targets[t]), float(lps.logprob[t]),
                    tuple(zip(lps.top_ids[t, :k].tolist(), lps.top_logprobs[t, :k].tolist(), strict=True))))


# ----------------------------------------------------------------------------------------------------- pooling
def record_pooled(plan: StepPlan, requests: list[Request], pooled: np.ndarray | None) -> None:
    """Add each pooling request's hidden-state sum of this step (`pooled` f32[S, hidden]: zeros for a sequence
    that pooled no token of it; None when no token of the step was pooled) to its `pooled`, and count its positions
    computed as pooled (`pooled_upto`: a preemption's recompute does not add them again)."""
    for i, r in enumerate(requests):
        if r.pooling is None:
            continue
        if pooled is not None:
            r.pooled = pooled[i].astype(np.float32) if r.pooled is None else r.pooled + pooled[i]
        r.pooled_upto = max(r.pooled_upto, int(plan.kv_lens[i]))


def embedding(r: Request, dense: tuple[DenseLayer, ...] = ()) -> list[float]:
    """A finished pooling request's vector: its pooled sum (divided by its prompt's length for "mean") through the
    model's `dense` projections, its first `dimensions` entries, L2-normalised when asked (as torch's
    `F.normalize`: the norm at least 1e-12)."""
    p = r.pooling
    v = r.pooled / r.num_prompt_tokens if p.pooling == "mean" else r.pooled
    for layer in dense:
        v = layer(v)
    if p.dimensions is not None:
        v = v[:p.dimensions]
    if p.normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v.astype(np.float32).tolist()
