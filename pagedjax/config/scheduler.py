"""The scheduler's configuration: `SchedulerConfig` (token budget, sequences per step, context length, image
encoder budgets).

Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedjax.config.fields import check_int, option


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step.

    `max_model_len` (prompt + output tokens of one request) defaults to None: the model's
    `max_position_embeddings`, filled in by `resolve` when the engine is built.

    Images (a vision-language model, `ModelSpec.images`), counted in feature rows (= placeholder tokens):
    `max_num_encoder_tokens` caps the images a step encodes (a request whose next image does not fit runs up to
    it, and the image waits for a later step, so a prompt of many images never stalls the others), and
    `encoder_cache_tokens` the features kept between steps (`pagedjax.core.encoder_cache`). None: the larger of
    `max_num_batched_tokens` and one image's rows, and twice that, filled in by `resolve_images`.
    """

    max_num_seqs: int = option(64, "sequences per step")
    max_num_batched_tokens: int = option(512, "tokens per step")
    max_model_len: int | None = option(None, "longest prompt + completion (default: the model's "
                                             "max_position_embeddings)")
    enable_chunked_prefill: bool = True
    max_num_encoder_tokens: int | None = None
    encoder_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_num_encoder_tokens",
                     "encoder_cache_tokens"):
            value = getattr(self, name)
            if value is None and name not in ("max_num_seqs", "max_num_batched_tokens"):
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

    def resolve_images(self, tokens_per_image: int) -> SchedulerConfig:
        """This config with the image budgets filled in for a model whose images take `tokens_per_image` rows each;
        ValueError if one image could never be encoded or kept. The encoder cache holds `encoder_cache_tokens //
        tokens_per_image` images."""
        step = self.max_num_encoder_tokens
        if step is None:
            step = max(self.max_num_batched_tokens, tokens_per_image)
        cache = self.encoder_cache_tokens if self.encoder_cache_tokens is not None else 2 * step
        for name, value in (("max_num_encoder_tokens", step), ("encoder_cache_tokens", cache)):
            if value < tokens_per_image:
                raise ValueError(f"SchedulerConfig.{name} ({value}) is below one image's {tokens_per_image} feature "
                                 "rows: no image could ever be encoded")
        return dataclasses.replace(self, max_num_encoder_tokens=step, encoder_cache_tokens=cache)
