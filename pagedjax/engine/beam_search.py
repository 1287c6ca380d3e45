"""Beam search on the paged cache: beams are forks of one another.

Each beam is a request that pauses after every token (`Request.hold`). After a step, every beam's top
`2 * beam_width` next-token log-probabilities (log-softmax of the raw logits, float32) give the candidates
`(beam, token)`, scored by the beam's cumulative log-probability plus the token's; the best `beam_width` are
kept. A kept candidate whose token is the one its beam sampled (greedy) continues that beam's request; any
other forks the beam's request with the token replaced (`Scheduler.fork`: the new token's KV is not computed
yet, so the fork shares every block, the partial last one too, and copies it on its first write). Beams
left without a kept candidate are aborted and release their blocks. Two beams with a common history share its
blocks for as long as both live.

Beam search runs alone (ValueError if other requests are in flight: its steps would advance them and drop their
outputs), and only when every beam of a batch fits the pool at its longest (held beams keep their blocks, and
nothing preempts them): prompts are batched so that they do, and a search that could never fit is refused at
the start. A failure aborts every request the search made, forks included.

With `structured` (a `StructuredOutput`), every beam keeps its own matcher: the step masks each beam's logits
with it, so its candidates (and their log-probabilities, those of the constrained distribution) are allowed
tokens only; a beam continued with another token than the one it sampled rolls its matcher back one token and
consumes the new one, and a fork starts from a copy of its source's matcher, rolled back and advanced the same
way. EOS is allowed only where the constraint is complete (so `ignore_eos` is refused with it), and a beam cut
by `max_tokens` may be an unfinished sentence, as a sampled request's is.

A candidate ending in EOS (unless `ignore_eos`) or reaching `max_tokens` (or the model's length) is complete.
A beam whose request fails a step on its own (see `LLMEngine.step`) ends the search with a RuntimeError, every
beam aborted. The search ends when no beam is live; the result is the `beam_width` best of the complete ones by
`cumulative_logprob / len(token_ids) ** length_penalty`, where `len(token_ids)` counts the generated tokens,
a final EOS included.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagedjax.config import CacheConfig, ModelSpec, SchedulerConfig
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.scheduler import Scheduler
from pagedjax.engine.generate import batch_of_loras
from pagedjax.engine.protocol import PreparedRequest
from pagedjax.outputs import BeamSearchOutput, BeamSequence, RequestOutput
from pagedjax.sampling_params import RAW_SAMPLING, BeamSearchParams, SamplingParams
from pagedjax.structured_output.manager import StructuredOutputManager


class BeamSearchEngine(Protocol):
    """What beam search drives (an `LLMEngine`): its one scheduler, whose requests it forks, holds and resumes, and
    its structured-output matchers, which it forks with them."""

    scheduler: Scheduler
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    model_spec: ModelSpec
    num_blocks: int
    tokenizer: Any
    structured: StructuredOutputManager

    def fresh_request_ids(self, prefix: str, n: int) -> list[str]: ...

    def make_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None, *,
                     cache_salt: str | None = None, lora_request=None) -> PreparedRequest: ...

    def add_prepared_request(self, prepared: PreparedRequest) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


@dataclass
class _Beam:
    tokens: list[int]
    cumulative_logprob: float
    request: Request | None  # None once complete


def beam_score(token_ids: Sequence[int], cumulative_logprob: float, length_penalty: float) -> float:
    """cumulative_logprob / len(token_ids) ** length_penalty (generated tokens, a final EOS included)."""
    return cumulative_logprob / max(1, len(token_ids)) ** length_penalty


def beam_search(engine: BeamSearchEngine, prompts: Sequence[Sequence[int] | str], params: BeamSearchParams,
                lora_request=None) -> list[BeamSearchOutput]:
    """Beam search for every prompt (see the module docstring); prompts run in batches that fit max_num_seqs.
    `lora_request`: one adapter for all prompts or one (or None) per prompt (`generate.batch_of_loras`); every
    beam keeps its prompt's."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
    width = params.beam_width
    max_seqs = engine.scheduler_config.max_num_seqs
    if width > max_seqs:
        raise ValueError(f"beam_width={width} is more than max_num_seqs={max_seqs}")
    if engine.has_unfinished_requests():  # its steps would advance them and drop their outputs
        raise ValueError(f"beam search runs alone: {engine.scheduler.num_unfinished_requests} requests are in "
                         "flight; let them finish or abort them first")
    # Beams grow by the raw log-probabilities: no model default (a temperature, a penalty) is applied.
    sampling = SamplingParams(max_tokens=params.max_tokens, logprobs=2 * width, ignore_eos=True,
                              structured=params.structured, **RAW_SAMPLING)
    ids = engine.fresh_request_ids("beam", len(prompts))
    loras = batch_of_loras(lora_request, len(prompts))
    prepared = [engine.make_request(rid, p, sampling, lora_request=lora)
                for rid, p, lora in zip(ids, prompts, loras, strict=True)]
    requests = [p.request for p in prepared]
    # Held beams keep their blocks between steps and nothing preempts them, so a batch runs only if every beam of
    # it fits at its longest at once (its last block copied on a fork's first write: one more).
    bs = engine.cache_config.block_size
    longest = max((r.num_prompt_tokens for r in requests), default=0)
    per_beam = -(-min(longest + params.max_tokens, engine.scheduler_config.max_model_len) // bs) + 1
    if width * per_beam > engine.num_blocks:
        raise ValueError(f"beam search of width {width} over {longest} prompt + {params.max_tokens} new tokens may "
                         f"hold {width} x {per_beam} blocks of {bs} tokens, more than the pool's {engine.num_blocks}; "
                         "use a larger pool, a smaller beam_width or fewer max_tokens")
    per_batch = max(1, min(max_seqs // width, engine.num_blocks // (width * per_beam)))
    outputs: list[BeamSearchOutput] = []
    for start in range(0, len(prepared), per_batch):
        outputs += _search_batch(engine, prepared[start:start + per_batch], params)
    return outputs


def _search_batch(engine: BeamSearchEngine, prepared: list[PreparedRequest], params: BeamSearchParams,
                  ) -> list[BeamSearchOutput]:
    requests = [p.request for p in prepared]
    sched = engine.scheduler
    width = params.beam_width
    eos = set(engine.model_spec.eos_token_ids)
    fork_ids = itertools.count()
    live: list[list[_Beam]] = []
    complete: list[list[_Beam]] = [[] for _ in requests]
    owned: list[Request] = []  # every request of this search, forks included: all aborted if it fails
    try:
        for p in prepared:
            r = p.request
            r.hold = True
            owned.append(r)
            engine.add_prepared_request(p)
            live.append([_Beam([], 0.0, r)])
        while any(live):
            while any(not b.request.is_finished and not b.request.paused for beams in live for b in beams):
                engine.step()
            failed = [b.request for beams in live for b in beams if b.request.status is RequestStatus.FINISHED_ERROR]
            if failed:  # a beam that broke a step on its own: its scores are unknown, so the search cannot go on
                raise RuntimeError(f"beam search: request {failed[0].request_id!r} failed: {failed[0].error}")
            for i, beams in enumerate(live):
                live[i] = _advance(engine, beams, complete[i], params, eos, fork_ids, owned)
    except BaseException:
        for r in owned:
            sched.abort(r.request_id)  # None for one that already finished
        raise
    results = []
    for r, done in zip(requests, complete, strict=True):
        done.sort(key=lambda b: -beam_score(b.tokens, b.cumulative_logprob, params.length_penalty))
        seqs = [BeamSequence(b.tokens, b.cumulative_logprob, beam_score(b.tokens, b.cumulative_logprob,
                                                                          params.length_penalty),
                             engine.tokenizer.decode(b.tokens) if engine.tokenizer is not None else None)
                for b in done[:width]]
        results.append(BeamSearchOutput(list(r.prompt_token_ids), seqs))
    return results


def _advance(engine: BeamSearchEngine, beams: list[_Beam], complete: list[_Beam], params: BeamSearchParams,
             eos: set[int], fork_ids, owned: list[Request]) -> list[_Beam]:
    """One beam step of one prompt: candidates from every beam's last log-probabilities, the best kept.

    A beam's request carries on its first kept candidate (its sampled last token replaced if the candidate's
    differs: that token's KV is not computed yet); further candidates of the same beam fork it. Beams without a
    kept candidate are aborted first, so a prompt never holds more than beam_width requests."""
    sched = engine.scheduler
    width = params.beam_width
    candidates = []
    for bi, b in enumerate(beams):
        for rank, (token, logprob) in enumerate(b.request.logprobs[-1].top):
            candidates.append((-(b.cumulative_logprob + logprob), bi, rank, token))
    candidates.sort()
    chosen = []
    for neg_score, bi, _, token in candidates[:width]:
        beam = _Beam(beams[bi].tokens + [token], -neg_score, None)
        r = beams[bi].request
        if (token in eos and not params.ignore_eos) or len(beam.tokens) >= params.max_tokens or r.is_finished:
            complete.append(beam)
        else:
            chosen.append((bi, beam))
    sources = {bi for bi, _ in chosen}
    for bi, b in enumerate(beams):
        if bi not in sources and not b.request.is_finished:
            sched.abort(b.request.request_id)
    claimed: set[int] = set()
    for bi, beam in chosen:
        r = beams[bi].request
        if bi not in claimed:
            claimed.add(bi)
            if r.output_token_ids[-1] != beam.tokens[-1]:
                sched.replace_last_token(r.request_id, beam.tokens[-1])
                if r.constrained:
                    _retarget(engine.structured.get(r), r.output_token_ids)
            beam.request = r
        else:
            child = Request(request_id=f"{r.request_id}.{next(fork_ids)}", prompt_token_ids=r.prompt_token_ids,
                            sampling_params=r.sampling_params, eos_token_ids=r.eos_token_ids,
                            cache_salt=r.cache_salt, adapter_id=r.adapter_id, images=r.images,  # r's hash keys
                            output_token_ids=list(beam.tokens), hold=True, logprobs=[], constrained=r.constrained)
            owned.append(child)
            sched.fork(r.request_id, child)
            if r.constrained:  # r's matcher is at r's tokens: same history, another last token
                _retarget(engine.structured.fork(r.request_id, child.request_id), beam.tokens)
            beam.request = child
    kept = [beam for _, beam in chosen]
    for beam in kept:
        sched.resume(beam.request.request_id)
    return kept


def _retarget(constraint, tokens: list[int]) -> None:
    """Move a matcher that consumed `tokens` but with another last token to `tokens` (its last token is one the
    beam's mask allowed, so the matcher takes it; a refusal is the library's failure and ends the search)."""
    constraint.rollback(1)
    refused = constraint.advance(tokens)
    if refused is not None:
        raise RuntimeError(f"beam search: {refused}")
