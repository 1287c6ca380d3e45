"""Configuration: frozen dataclasses for the model, the KV cache and the scheduler.

Plain Python, no JAX: the host side (`pagedjax.core`) imports this too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as a string ("float32", "bfloat16", "float16")."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}") from None


def kv_cache_bytes(num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, bytes_per_elem: int) -> int:
    """Bytes of KV cache for `num_tokens` tokens: 2 (K and V) * L * T * Hkv * D * bytes."""
    return 2 * num_layers * num_tokens * num_kv_heads * head_dim * bytes_per_elem


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder (Llama 2/3, Mistral, Qwen2 shapes)."""

    vocab_size: int = 259
    hidden_size: int = 256
    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 704
    rope_theta: float = 10000.0
    # Llama-3 style RoPE scaling: None or a dict with factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings (a tuple of pairs so the config stays hashable).
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"  # parameter and activation dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        dtype_bytes(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        if "eos_token_ids" in d:
            d["eos_token_ids"] = tuple(d["eos_token_ids"])
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple(sorted(dict(d["rope_scaling"]).items()))
        return cls(**d)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` physical blocks of `block_size` tokens each.

    Give either `num_blocks` or `kv_memory_bytes` (the pool is then sized from the model's shape);
    with neither, `num_blocks` defaults to 512.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    dtype: str | None = None  # KV dtype; None = the model's dtype
    hash_seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.kv_memory_bytes is not None:
            raise ValueError("give num_blocks or kv_memory_bytes, not both")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ValueError(f"kv_memory_bytes must be >= 1, got {self.kv_memory_bytes}")
        if self.dtype is not None:
            dtype_bytes(self.dtype)

    def resolve_num_blocks(self, model: ModelConfig) -> int:
        """Number of physical blocks: as given, or as many as fit in `kv_memory_bytes`."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_memory_bytes is None:
            return 512
        per_block = kv_cache_bytes(model.num_layers, self.block_size, model.num_kv_heads, model.head_dim,
                                   dtype_bytes(self.dtype or model.dtype))
        n = self.kv_memory_bytes // per_block
        if n < 1:
            raise ValueError(f"kv_memory_bytes={self.kv_memory_bytes} holds no block of {per_block} bytes")
        return int(n)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                             f"({self.max_num_batched_tokens} < {self.max_model_len})")
