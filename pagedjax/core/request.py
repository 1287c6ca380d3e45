"""Requests and their sampling parameters: plain host-side data, no JAX."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedjax.config import check_int

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # seeds travel to the device as two uint32 halves


def _check_int(name: str, value, *, lo: int | None, hi: int | None) -> None:
    check_int("SamplingParams", name, value, lo=lo, hi=hi)


def _check_float(name: str, value, *, lo: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be finite, got {value}")
    if lo is not None and value < lo:
        raise ValueError(f"SamplingParams.{name} must be >= {lo}, got {value}")


MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's API allows
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text; exactly one kind is given:

    json         a JSON schema (a dict, or its JSON text): the output is one JSON value valid under it
    json_object  True: the output is any JSON object
    regex        the output matches this regular expression (whole)
    choice       the output is one of these strings
    grammar      the output is a sentence of this Lark-syntax grammar (llguidance's dialect; `start` rule)

    Each generated token is sampled from the tokens that keep the output a prefix of something the constraint
    allows (EOS only where it is complete). The schema is stored as canonical JSON text (hashable)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        owner = "StructuredOutput"
        if self.json is not None:
            import json as jsonlib

            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except ValueError as e:
                    raise ValueError(f"{owner}.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise TypeError(f"{owner}.json must be a JSON schema (a dict or its JSON text), got "
                                f"{type(schema).__name__}")
            object.__setattr__(self, "json", jsonlib.dumps(schema, sort_keys=True, separators=(",", ":")))
        if not isinstance(self.json_object, bool):
            raise TypeError(f"{owner}.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"{owner}.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else self.choice
            if not hasattr(choice, "__iter__") or isinstance(choice, bytes):
                raise TypeError(f"{owner}.choice must be a sequence of strings, got {type(choice).__name__}")
            choice = tuple(choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"{owner}.choice must hold one or more non-empty strings, got {choice!r}")
            object.__setattr__(self, "choice", choice)
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{owner}: give exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's / OpenAI's semantics).

    temperature == 0 means greedy. top_k 0 (or -1), top_p == 1 and min_p == 0 disable those filters.
    `seed` makes a request's samples reproducible regardless of what it is batched with.

    Several samples: `best_of` samples (default `n`) are drawn from one prefill of the prompt (the KV cache is
    forked, see `Scheduler`); sample i uses seed `seed + i`, so it equals a single request with that seed. The
    output holds the `n` samples with the highest cumulative log-probability (all of them, in index order,
    when best_of == n).

    Log-probabilities are log-softmax (float32) of the model's raw logits, before temperature, filters or
    penalties: `logprobs=k` returns, for each generated token, its log-probability and the k most likely
    alternatives; `prompt_logprobs=k` the same for every prompt token after the first (such a request does not
    take prefix-cache hits: its prompt is recomputed so that every position has logits).

    Penalties (OpenAI semantics, applied to the logits before sampling, greedy included): `presence_penalty`
    is subtracted once from every token that occurs in the output so far, `frequency_penalty` once per
    occurrence; `repetition_penalty` (CTRL / Hugging Face) divides positive logits and multiplies negative ones of
    every token seen in the prompt or the output. `min_tokens`: stop ids and EOS cannot be sampled before that
    many outputs. `stop`: strings that end the output (host-side, on the detokenized text; needs a tokenizer):
    the text is cut before the stop string unless `include_stop_str_in_output`. `structured`: a
    `StructuredOutput` (JSON schema, regex, choice, grammar; needs a tokenizer): tokens the constraint does not
    allow next are masked out of the logits before anything else, so log-probabilities reflect it too.

    Every field is validated at construction (types too: no silent coercion); a bad one raises
    TypeError/ValueError naming it.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Every field is checked here, types included, so that a bad value fails at construction with
        # the field's name instead of on device, inside a step that also carries other requests.
        _check_int("max_tokens", self.max_tokens, lo=1, hi=INT32_MAX)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_int("top_k", self.top_k, lo=-1, hi=INT32_MAX)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        _check_int("n", self.n, lo=1, hi=INT32_MAX)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, lo=self.n, hi=INT32_MAX)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=SEED_MAX - (self.num_samples - 1))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lo=0, hi=MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_int("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens)
        object.__setattr__(self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "stop", _str_tuple("stop", self.stop))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise TypeError(f"SamplingParams.structured must be a StructuredOutput, got "
                            f"{type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Samples drawn: best_of (default n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)


def _int_tuple(name: str, value) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"SamplingParams.{name} must be a sequence of ints, got {type(value).__name__}")
    out = tuple(value)
    for t in out:
        _check_int(name, t, lo=0, hi=INT32_MAX)
    return tuple(int(t) for t in out)


def _str_tuple(name: str, value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, bytes) or not hasattr(value, "__iter__"):
        raise TypeError(f"SamplingParams.{name} must be a string or a sequence of strings, got "
                        f"{type(value).__name__}")
    out = tuple(value)
    for s in out:
        if not isinstance(s, str) or not s:
            raise ValueError(f"SamplingParams.{name} must hold non-empty strings, got {s!r}")
    return out


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities: the token there and the `top` most likely tokens, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    # The engine's incremental text of its outputs (`pagedjax.engine.outputs`); opaque here, and it lives and
    # dies with the request, so nothing of a forgotten request stays behind.
    text_state: Any = field(default=None, repr=False, compare=False)
    # The engine's matcher of SamplingParams.structured (`pagedjax.engine.structured`), at the state after its
    # outputs so far; opaque here: a fork gets `constraint.copy()`.
    constraint: Any = field(default=None, repr=False, compare=False)
    # The speculative proposer's state for this request (`pagedjax.engine.speculative`); opaque here, and a fork
    # starts without one.
    proposer_state: Any = field(default=None, repr=False, compare=False)

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

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end this request (its stop ids, plus EOS unless ignore_eos)."""
        ids = set(self.sampling_params.stop_token_ids)
        if not self.sampling_params.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)

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


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int  # the sample's index (its seed is the request's seed + index)
    token_ids: list[int]
    text: str | None
    cumulative_logprob: float | None  # None unless log-probabilities were computed (logprobs set, or best_of > n)
    logprobs: list[TokenLogprobs] | None  # per token, when SamplingParams.logprobs is set
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    """What a caller sees of a request after a step (or at the end of `generate`).

    `outputs` holds one `CompletionOutput` per sample (the n best when best_of > n, best first; otherwise in
    index order). The single-sample fields (`output_token_ids`, `text`, `finish_reason`) describe `outputs[0]`;
    `finish_reason` is None until every sample finished.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    text: str | None = None
    error: str | None = None  # with finish_reason "error": what failed
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_generated_tokens: int = 0  # by every sample, those best_of drops included (what the request cost)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
