"""What one token slot of one layer's paged KV cache holds: the per-layer KV cache spec a model declares
(`ModelSpec.kv_layers`).

The pool is blocks of `block_size` token slots and a block table maps a sequence's logical blocks to physical
ones whatever a slot holds; prefix hashing, LRU eviction, preemption, forks and copy-on-write work on blocks, so
they work for every spec. What differs per spec is the pages' layout and the bytes a token takes, from which
the engine sizes the pool:

- `FullAttention(num_kv_heads, head_dim, sliding_window=None)`: per-KV-head K and V (MHA / GQA / MQA), pages
  `[num_kv_heads, num_blocks, block_size, head_dim]` each; with a sliding window W, the blocks behind every
  layer's window are released.
- `LatentAttention(kv_lora_rank, rope_dim)`: multi-head latent attention (MLA, DeepSeek V2/V3): one compressed
  latent c_kv and one rotary key shared by all heads per token, pages `[num_blocks, block_size,
  kv_lora_rank + rope_dim]`; attention runs in latent space over the pages as stored (the model absorbs its
  up-projections).
- `IndexedSparse(kv_lora_rank, rope_dim, index_head_dim, index_topk)`: DeepSeek sparse attention (V3.2 DSA): the
  latent entry of `LatentAttention` plus one lightning-indexer key per token in the same block (same table,
  hashes, eviction, copy-on-write), pages `[num_blocks, block_size, index_head_dim]` beside the latent ones. Per
  query the indexer scores every earlier token, keeps the top `index_topk`, and attention reads only those.

8-bit pages (`CacheConfig.kv_dtype` "int8" / "fp8") store one float32 scale per token beside each vector a slot
holds (per KV head for K and for V; per token for a latent entry), counted in `bytes_per_token`.

Plain Python, no JAX: the host side (`pagedjax.core`) sizes the pool from these too.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config.fields import check_int


@dataclass(frozen=True)
class FullAttention:
    """Per-KV-head K and V pages `[num_kv_heads, num_blocks, block_size, head_dim]`; `sliding_window` W: the query
    at position p reads keys in (p - W, p] (None: everything before it)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        fix("num_kv_heads", check_int("FullAttention", "num_kv_heads", self.num_kv_heads, lo=1))
        fix("head_dim", check_int("FullAttention", "head_dim", self.head_dim, lo=1))
        fix("sliding_window", check_int("FullAttention", "sliding_window", self.sliding_window, lo=1, optional=True))

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """K and V of every KV head, each vector with its 8-bit scale (`scale_bytes`, 0 for float pages)."""
        return 2 * self.num_kv_heads * (self.head_dim * element_bytes + scale_bytes)


@dataclass(frozen=True)
class LatentAttention:
    """One latent entry per token, `[c_kv (kv_lora_rank) | k_rope (rope_dim)]`, shared by every query head: pages
    `[num_blocks, block_size, kv_lora_rank + rope_dim]`. Latent layers read the whole context."""

    kv_lora_rank: int
    rope_dim: int

    sliding_window = None  # a latent layer reads every earlier position (not a field: MLA has no window)

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)
        fix("kv_lora_rank", check_int("LatentAttention", "kv_lora_rank", self.kv_lora_rank, lo=1))
        fix("rope_dim", check_int("LatentAttention", "rope_dim", self.rope_dim, lo=1))

    @property
    def entry_dim(self) -> int:
        """Numbers per token slot: the latent and the rotary key."""
        return self.kv_lora_rank + self.rope_dim

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """The latent entry and, for 8-bit pages, its one scale."""
        return self.entry_dim * element_bytes + scale_bytes


@dataclass(frozen=True)
class IndexedSparse:
    """A latent entry (`LatentAttention`) and an indexer key of `index_head_dim` per token; queries attend to the
    `index_topk` earlier positions the indexer scores highest (all of them while the context is no longer)."""

    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int
    index_topk: int

    sliding_window = None  # the indexer may select any earlier position

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)
        for name in ("kv_lora_rank", "rope_dim", "index_head_dim", "index_topk"):
            fix(name, check_int("IndexedSparse", name, getattr(self, name), lo=1))

    @property
    def entry_dim(self) -> int:
        """Numbers per token slot of the latent pages (the indexer key is in its own pages)."""
        return self.kv_lora_rank + self.rope_dim

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """The latent entry and the indexer key, each with its scale for 8-bit pages."""
        return (self.entry_dim + self.index_head_dim) * element_bytes + 2 * scale_bytes


KVLayerSpec = FullAttention | LatentAttention | IndexedSparse
KV_LAYER_SPECS = (FullAttention, LatentAttention, IndexedSparse)
