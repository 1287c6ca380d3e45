"""Requests and their sampling parameters: plain host-side data, no JAX."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # seeds travel to the device as two uint32 halves


def is_int(value) -> bool:
    """A true integer (Python or numpy), not a bool, float or string."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value, *, lo: int | None, hi: int | None) -> None:
    if not is_int(value):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"SamplingParams.{name} must be in [{lo if lo is not None else '-inf'}, "
                         f"{hi if hi is not None else 'inf'}], got {value}")


def _check_float(name: str, value, *, lo: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be finite, got {value}")
    if lo is not None and value < lo:
        raise ValueError(f"SamplingParams.{name} must be >= {lo}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's spirit).

    temperature == 0 means greedy. top_k 0 (or -1) and top_p == 1 disable those filters. Every field is validated
    at construction (types too: no silent coercion); a bad one raises TypeError/ValueError naming it.
    `seed` makes a request's samples reproducible regardless of what it is batched with.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Every field is checked here, types included, so that a bad value fails at construction with
        # the field's name instead of on device, inside a step that also carries other requests.
        _check_int("max_tokens", self.max_tokens, lo=1, hi=INT32_MAX)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_int("top_k", self.top_k, lo=-1, hi=INT32_MAX)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=SEED_MAX)
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError("SamplingParams.stop_token_ids must be a sequence of ints, "
                            f"got {type(self.stop_token_ids).__name__}")
        stops = tuple(self.stop_token_ids)
        for t in stops:
            _check_int("stop_token_ids", t, lo=0, hi=INT32_MAX)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


@dataclass
class RequestOutput:
    """What a caller sees of a request after a step (or at the end of `generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    text: str | None = None
    error: str | None = None  # with finish_reason "error": what failed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
