"""Requests and their sampling parameters: plain host-side data, no JAX."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's spirit).

    temperature == 0 means greedy. top_k <= 0 and top_p >= 1 disable those filters.
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
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be a non-negative 63-bit integer, got {self.seed}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

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

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


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
    arrival_index: int = 0
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
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
