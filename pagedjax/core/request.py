"""The scheduler's request state (`Request`, `RequestStatus`, multi-sample groups): plain host-side data, no JAX."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedjax.core.images import ImageInput
from pagedjax.outputs import TokenLogprobs
from pagedjax.pooling_params import PoolingParams
from pagedjax.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken; recomputes its tokens
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step that ran it alone failed; `Request.error` says how

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    Invariant: `num_computed_tokens <= num_tokens`; the KV of tokens [0, num_computed_tokens) is in
    the cache blocks the KV cache manager holds for this request.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None  # tenants with different salts never share prefix blocks
    adapter_id: str | None = None  # part of every block hash: blocks of different adapters never match
    # The prompt's images in prompt order (`pagedjax.core.images`): each one's content hash is part of the hash of
    # every block its placeholder tokens touch, and its features replace those tokens' embeddings.
    images: tuple[ImageInput, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hits when first scheduled; -1 until then
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # A step that ran it with other requests failed: it runs alone in its next step, which clears the flag
    # on success and fails the request (FINISHED_ERROR) otherwise. See `Scheduler.fail_step`.
    suspect: bool = False
    error: str | None = None  # why it finished with FINISHED_ERROR
    # Chained hashes of this request's full blocks (prompt + outputs), filled lazily by the KV cache
    # manager that owns it; tokens only ever get appended, so computed hashes stay valid (also across a
    # preemption, when they let the request find its own released blocks in the prefix cache).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # Several samples of one prompt (SamplingParams.best_of / n) and beam search run as requests that fork
    # from one another; see `Scheduler.fork`. A `prefill_only` request computes its tokens, samples nothing
    # and is then forked into its group's samples.
    group_id: str | None = None  # the caller's request id, for a sample of a multi-sample request
    sample_index: int = 0  # which sample of its group (its seed is the group's seed + sample_index)
    prefill_only: bool = False
    hold: bool = False  # pause after each sampled token until `Scheduler.resume` (beam search)
    paused: bool = False  # held: running with its blocks, not scheduled
    logprobs: list[TokenLogprobs] | None = None  # per output token, when SamplingParams.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (None for the first)
    group: SampleGroup | None = field(default=None, repr=False)  # its multi-sample request, if any
    output_logprobs: list[float] = field(default_factory=list, repr=False)  # per output token
    stop_str: str | None = None  # the stop string that finished it, if any
    # Its outputs are masked by a structured-output matcher the engine keeps (`pagedjax.structured_output`): it
    # needs the host before every token, so it neither fuses decode steps nor verifies proposals.
    constrained: bool = False
    # Speculative decoding's proposed tokens after its last token, set between steps (`Scheduler.set_draft_tokens`)
    # and verified by its next step; its blocks cover them meanwhile.
    draft_token_ids: list[int] = field(default_factory=list, repr=False)
    # A pooling request (an embedding: `pagedjax.pooling_params`, its fields set) samples nothing and finishes when
    # its prompt is computed. `pooled` (float32 [hidden], numpy) sums the last layer's hidden states its pooling
    # takes, of its prompt positions [0, pooled_upto): a position recomputed after a preemption is not added again.
    pooling: PoolingParams | None = None
    pooled: object = field(default=None, repr=False)
    pooled_upto: int = 0

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the log-probabilities of its output tokens."""
        return float(sum(self.output_logprobs))

    @property
    def wants_logprobs(self) -> bool:
        """Whether its sampled tokens need their log-probabilities: it asked for them, or it is a sample of a
        request that keeps the best n of best_of by cumulative log-probability. Steps with no such request
        compute none (the decode step stays lean)."""
        if self.prefill_only:
            return False
        if self.logprobs is not None:
            return True
        params = self.group.request.sampling_params if self.group is not None else self.sampling_params
        return params.num_samples > params.n

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def get_token_id(self, index: int) -> int:
        """Token `index` (>= 0) of prompt + outputs."""
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end this request (its stop ids, plus EOS unless ignore_eos)."""
        ids = set(self.sampling_params.stop_token_ids)
        if not self.sampling_params.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)

    def finish_status(self, token: int, num_output_tokens: int, num_tokens: int,
                      max_model_len: int) -> RequestStatus | None:
        """The one token-level stop rule: the status this request reaches by emitting `token` as its
        `num_output_tokens`-th output, making `num_tokens` in all (None: it goes on). Stop strings need text: the
        output processor finds those."""
        if token in self.stop_ids:
            return RequestStatus.FINISHED_STOPPED
        max_tokens = self.sampling_params.max_tokens  # None: the rest of the context (the engine sets it first)
        if (max_tokens is not None and num_output_tokens >= max_tokens) or num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


@dataclass(eq=False)
class SampleGroup:
    """The samples of one multi-sample request (SamplingParams.best_of / n > 1).

    `request` is the caller's request: it is never scheduled itself. Its prompt but the last token is prefilled
    once by a `prefill_only` request (same id); then `samples` (index order) fork from it and each computes the
    last prompt token and its outputs like a single request.
    """

    request: Request
    samples: list[Request] = field(default_factory=list)  # empty until the prefill is done
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def sample_ids(self) -> list[str]:
        return [sample_id(self.request.request_id, i) for i in range(self.request.sampling_params.num_samples)]

    @property
    def finished(self) -> bool:
        """Every sample finished, or the request ended before it had samples (aborted, or its prefill failed:
        `request.status` says which)."""
        return self.request.is_finished or (bool(self.samples) and all(s.is_finished for s in self.samples))


class RequestIds:
    """The one scheme of the ids an engine makes for its own requests (`generate`, beam search, the CLI's
    prompts): `<prefix>-<batch>-<i>`, `batch` counting the batches asked for, skipping any id `in_use` says is
    taken (a `'` is appended). Deterministic, because an unseeded request's seed derives from its id. A
    server's response ids are random instead (`pagedjax.serve`), and a sample's id derives from its request's
    (`sample_id`)."""

    def __init__(self):
        self._batches = 0

    def fresh(self, prefix: str, n: int, in_use: Callable[[str], bool]) -> list[str]:
        self._batches += 1
        ids = []
        for i in range(n):
            rid = f"{prefix}-{self._batches}-{i}"
            while in_use(rid):
                rid += "'"
            ids.append(rid)
        return ids


def sample_id(request_id: str, index: int) -> str:
    """The id of sample `index` of a multi-sample request."""
    return f"{request_id}[{index}]"


def make_sample(group: SampleGroup, index: int) -> Request:
    """Sample `index` of a multi-sample request: a single request of the same prompt with seed + index."""
    r = group.request
    p = r.sampling_params
    params = dataclasses.replace(p, n=1, best_of=None, prompt_logprobs=None,
                                 seed=None if p.seed is None else p.seed + index)
    return Request(request_id=sample_id(r.request_id, index), prompt_token_ids=r.prompt_token_ids,
                   sampling_params=params, eos_token_ids=r.eos_token_ids, cache_salt=r.cache_salt,
                   adapter_id=r.adapter_id, images=r.images, group=group, sample_index=index,
                   logprobs=[] if params.logprobs is not None else None,
                   constrained=r.constrained)
