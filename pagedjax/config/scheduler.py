"""The scheduler's configuration: `SchedulerConfig` (token budget, sequences per step, context length).

Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedjax.config.fields import check_int


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step.

    `max_model_len` (prompt + output tokens of one request) defaults to None: the model's
    `max_position_embeddings`, filled in by `resolve` when the engine is built.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            object.__setattr__(self, name, check_int("SchedulerConfig", name, value, lo=1))
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                             f"({self.max_num_batched_tokens} < {self.max_model_len})")

    def resolve(self, max_position_embeddings: int) -> SchedulerConfig:
        """This config with `max_model_len` filled in (the model's maximum when None); ValueError if it
        exceeds what the model supports."""
        if self.max_model_len is None:
            return dataclasses.replace(self, max_model_len=max_position_embeddings)
        if self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({max_position_embeddings}); lower max_model_len or leave it None")
        return self
