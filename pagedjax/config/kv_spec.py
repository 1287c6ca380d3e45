"""What one layer's paged KV cache holds, and how the engine treats its blocks: the per-layer KV cache spec a model
declares (`ModelSpec.kv_layers`). **The spec owns its behaviour**: nothing outside this module asks which kind a
spec is; the engine calls these methods.

The pool is blocks of `block_size` token positions and a block table maps a sequence's logical blocks to physical
ones whatever a position holds; prefix hashing, LRU eviction, preemption, forks and copy-on-write work on blocks,
so they work for every spec. What a spec states:

  page_shapes(...)        its page arrays: `ArraySpec`s (shapes and dtypes, 8-bit scales) in the kind's container,
                          a NamedTuple whose class attribute `block_axis` says where each array keeps its blocks
                          (copy-on-write copies along it)
  bytes_per_token(...)    bytes one token position takes (`tokens_per_entry` positions share one stored entry)
  bytes_per_block(...)    bytes one block takes (block_size positions; a state's one snapshot)
  pool                    the block pool its blocks come from: "kv" (token pages, every attention kind), "state"
                          (one state snapshot per block, far larger than a block of K/V: a pool of its own, sized
                          by sequences, keeps the KV blocks small) or "window" (DeepSeek V4's windows: a few
                          blocks per sequence, each far larger than a block of the compressed entries)
  blocks_held(B)          in a pool sized by sequences, the blocks a running sequence holds between steps
  block_multiple          what the block size must be a multiple of (a compressed entry's positions)
  page_layout             the spec without its release rule: layers whose specs have equal layouts can share page
                          arrays (`pagedjax.config.kv_layout`: one array serves a layer of each KV cache group)
  release_window          its release rule: W, a query at position p reads nothing before p - W + 1, so the blocks
                          wholly before it are released (the KV cache manager frees them); None, every block is kept.
                          A sliding window's W; 2 for a recurrent state (position p reads the state after p - 1)
  kv_heads_shape          (KV heads, head_dim) of per-head K/V pages, else None
  splits_kv_heads         whether tensor parallelism splits its pages by KV heads (else each device holds them all)
  per_device(tp)          the spec as one of tp devices holds it (its heads' share; what a per-device budget counts)
  heads_axis              the axis of every page array that tensor parallelism splits by heads (None: each device
                          holds them all): 0 for full attention's KV heads, 1 (after the blocks) for a recurrent
                          state's heads and conv channels
  check_query_heads(...)  whether `num_q_heads` query heads can read it
  kind                    the name of its page kind: the device picks the attention call a probe traces by it

The kinds:
- `FullAttention(num_kv_heads, head_dim, sliding_window=None)`: per-KV-head K and V (MHA / GQA / MQA), pages
  `[num_kv_heads, num_blocks, block_size, head_dim]` each; with a sliding window W, blocks behind the window are
  released.
- `LatentAttention(kv_lora_rank, rope_dim)`: multi-head latent attention (MLA, DeepSeek V2/V3): one compressed
  latent c_kv and one rotary key shared by all heads per token, pages `[num_blocks, block_size,
  kv_lora_rank + rope_dim]`; attention runs in latent space over the pages as stored (the model absorbs its
  up-projections).
- `IndexedSparse(kv_lora_rank, rope_dim, index_head_dim, index_topk)`: DeepSeek sparse attention (V3.2 DSA): the
  latent entry of `LatentAttention` plus one lightning-indexer key per token in the same block (same table,
  hashes, eviction, copy-on-write), pages `[num_blocks, block_size, index_head_dim]` beside the latent ones. Per
  query the indexer scores every earlier token, keeps the top `index_topk`, and attention reads only those.
- `RecurrentState(state_shape, conv_shape)`: a recurrent layer (gated DeltaNet, Mamba-2) keeps no per-token
  entries but one state per sequence: a float32 recurrent state and a float32 convolution window. Its pages are
  **snapshots valid at block boundaries**: block j of a sequence holds the state after the last position of block
  j (while j is the sequence's last, partial block: its live state). A step reads the state after its first
  position's predecessor and writes the state at every block boundary it crosses and after its last token; full
  blocks are published under their hash like any block, so a prefix hit restores the snapshot at the hit's end,
  never a live state. Pages `[num_blocks, *state_shape]` and `[num_blocks, *conv_shape]` in the "state" pool.
- `SharedKVWindow(head_dim, sliding_window)`, `CompressedEntries(head_dim, compress_rate, index_head_dim)` and
  `CompressorState(head_dim, overlap, index_head_dim)`: DeepSeek V4's compressed attention (`pagedjax.config.
  deepseek_v4`): a window of one K = V vector per token; one pooled entry per `compress_rate` positions (and an
  indexer key beside it), `block_size / compress_rate` of them in each block of the tokens' table; the compressor's
  open windows as softmax partials, snapshotted per block under the recurrent states' contract ("state" pool).
A model of your own may declare a kind of its own: subclass `KVCacheSpec` (a frozen dataclass), state the methods
above, and write and read its pages in your own attention layer (`pagedjax.model.api`).

8-bit pages (`CacheConfig.kv_dtype` "int8" / "fp8") store one float32 scale per token beside each vector a slot
holds (per KV head for K and for V; per token for a latent entry), counted in `bytes_per_token`.

Plain Python, no JAX: the host side (`pagedjax.core`) sizes the pool from these too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from pagedjax.config.fields import check_int

SCALE_DTYPE = "float32"  # of 8-bit pages' scales (`config.cache.KV_SCALE_BYTES` bytes)


class ArraySpec(NamedTuple):
    """One page array's shape and dtype name (as numpy spells it: "float32", "int8", "float8_e4m3fn")."""

    shape: tuple[int, ...]
    dtype: str


# The page containers: one NamedTuple per kind, the pytree a layer's pages are (its arrays, or their `ArraySpec`s);
# `block_axis` (a class attribute, not a field) is the axis of each of its arrays that indexes blocks.
class LayerKV(NamedTuple):
    """One full-attention layer's pages. k, v: `[num_kv_heads, num_blocks, block_size, head_dim]`; k_scales,
    v_scales: float32 `[num_kv_heads, num_blocks, block_size]` when k/v hold 8-bit values
    (`pallas_kernels.quant`), else None."""

    block_axis = 1

    k: Any
    v: Any
    k_scales: Any = None
    v_scales: Any = None


class LatentKV(NamedTuple):
    """One MLA layer's pages (`LatentAttention`). pages: `[num_blocks, block_size, kv_lora_rank + rope_dim]`, per
    token its latent c_kv then its rotary key; scales: float32 `[num_blocks, block_size]` when the pages hold 8-bit
    values, else None."""

    block_axis = 0

    pages: Any
    scales: Any = None


class SparseKV(NamedTuple):
    """One DSA layer's pages (`IndexedSparse`): the latent pages of `LatentKV` and, in the same blocks, the
    indexer keys `[num_blocks, block_size, index_head_dim]`; scales: float32 `[num_blocks, block_size]` each when
    the pages hold 8-bit values, else None."""

    block_axis = 0

    pages: Any
    index_keys: Any
    scales: Any = None
    index_scales: Any = None

    @property
    def latent(self) -> LatentKV:
        return LatentKV(self.pages, self.scales)


@dataclass(frozen=True)
class KVCacheSpec:
    """The base of every KV cache spec (see the module docstring for what each states). Defaults: one entry per
    token position, every block kept, pages whole on every device."""

    kind = "custom"
    tokens_per_entry = 1  # token positions one stored entry covers
    sliding_window = None  # attention reads every earlier position
    pool = "kv"

    def page_shapes(self, num_blocks: int, block_size: int, dtype: str, *, quantized: bool = False,
                    num_kv_heads: int | None = None) -> NamedTuple:
        """The page arrays of one layer of this spec: `ArraySpec`s in the kind's container. `dtype`: the pages'
        element dtype; `quantized`: 8-bit pages, which carry float32 scales; `num_kv_heads`: per-head pages' heads
        as stored, where that differs from the spec's (tensor parallelism past the KV heads repeats each)."""
        raise TypeError(f"{type(self).__name__} must define page_shapes (pagedjax.config.kv_spec.KVCacheSpec)")

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """Bytes one token position takes in this layer's pages (8-bit scales of `scale_bytes` included)."""
        raise TypeError(f"{type(self).__name__} must define bytes_per_token (pagedjax.config.kv_spec.KVCacheSpec)")

    def bytes_per_block(self, block_size: int, element_bytes: int, scale_bytes: int = 0) -> int:
        """Bytes one block of this layer's pages takes."""
        return block_size * self.bytes_per_token(element_bytes, scale_bytes)

    @property
    def release_window(self) -> int | None:
        """Its release rule (see the module docstring): its sliding window, None for every block kept."""
        return self.sliding_window

    @property
    def page_layout(self) -> KVCacheSpec:
        """This spec without its release rule: what its page arrays depend on."""
        return self

    @property
    def kv_heads_shape(self) -> tuple[int, int] | None:
        """(KV heads, head_dim) of per-KV-head pages; None for other kinds."""
        return None

    @property
    def splits_kv_heads(self) -> bool:
        """Whether tensor parallelism splits the pages by KV heads (axis 0 of every array)."""
        return False

    @property
    def heads_axis(self) -> int | None:
        """The axis of every page array that tensor parallelism splits by heads; None: whole on every device."""
        return 0 if self.splits_kv_heads else None

    def check_tensor_parallel(self, tp: int) -> str | None:
        """Why this layer's pages cannot be split over `tp` devices by `heads_axis` (None: they can, or they are
        not split)."""
        return None

    def per_device(self, tp: int) -> KVCacheSpec:
        """This spec as each of `tp` devices holds it (what a per-device memory budget counts): itself, for pages
        whole on every device."""
        return self

    def check_query_heads(self, num_q_heads: int) -> str | None:
        """Why `num_q_heads` query heads cannot read this layer (None: they can)."""
        return None

    def blocks_held(self, block_size: int) -> int | None:
        """For a layer of a pool sized by sequences (past the first: "state", "window"), the blocks of
        `block_size` tokens a running sequence holds between steps; None for token pages sized by memory."""
        return None

    @property
    def block_multiple(self) -> int:
        """The block size must be a multiple of this (1: any block size)."""
        return 1


@dataclass(frozen=True)
class FullAttention(KVCacheSpec):
    """Per-KV-head K and V pages `[num_kv_heads, num_blocks, block_size, head_dim]`; `sliding_window` W: the query
    at position p reads keys in (p - W, p] (None: everything before it)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    kind = "full"

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        fix("num_kv_heads", check_int("FullAttention", "num_kv_heads", self.num_kv_heads, lo=1))
        fix("head_dim", check_int("FullAttention", "head_dim", self.head_dim, lo=1))
        fix("sliding_window", check_int("FullAttention", "sliding_window", self.sliding_window, lo=1, optional=True))

    def page_shapes(self, num_blocks: int, block_size: int, dtype: str, *, quantized: bool = False,
                    num_kv_heads: int | None = None) -> LayerKV:
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        pages = ArraySpec((heads, num_blocks, block_size, self.head_dim), dtype)
        scales = ArraySpec((heads, num_blocks, block_size), SCALE_DTYPE) if quantized else None
        return LayerKV(pages, pages, scales, scales)

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """K and V of every KV head, each vector with its 8-bit scale (`scale_bytes`, 0 for float pages)."""
        return 2 * self.num_kv_heads * (self.head_dim * element_bytes + scale_bytes)

    @property
    def page_layout(self) -> FullAttention:
        return dataclasses.replace(self, sliding_window=None)

    @property
    def kv_heads_shape(self) -> tuple[int, int]:
        return self.num_kv_heads, self.head_dim

    @property
    def splits_kv_heads(self) -> bool:
        return True

    def per_device(self, tp: int) -> FullAttention:
        """The KV heads one device holds: num_kv_heads / tp, or 1 (a replica) past them."""
        return dataclasses.replace(self, num_kv_heads=max(self.num_kv_heads // tp, 1))

    def check_query_heads(self, num_q_heads: int) -> str | None:
        if num_q_heads % self.num_kv_heads:
            return f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
        return None


@dataclass(frozen=True)
class LatentAttention(KVCacheSpec):
    """One latent entry per token, `[c_kv (kv_lora_rank) | k_rope (rope_dim)]`, shared by every query head: pages
    `[num_blocks, block_size, kv_lora_rank + rope_dim]`. Latent layers read the whole context."""

    kv_lora_rank: int
    rope_dim: int

    kind = "latent"

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)
        fix("kv_lora_rank", check_int("LatentAttention", "kv_lora_rank", self.kv_lora_rank, lo=1))
        fix("rope_dim", check_int("LatentAttention", "rope_dim", self.rope_dim, lo=1))

    @property
    def entry_dim(self) -> int:
        """Numbers per token slot: the latent and the rotary key."""
        return self.kv_lora_rank + self.rope_dim

    def page_shapes(self, num_blocks: int, block_size: int, dtype: str, *, quantized: bool = False,
                    num_kv_heads: int | None = None) -> LatentKV:
        scales = ArraySpec((num_blocks, block_size), SCALE_DTYPE) if quantized else None
        return LatentKV(ArraySpec((num_blocks, block_size, self.entry_dim), dtype), scales)

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """The latent entry and, for 8-bit pages, its one scale."""
        return self.entry_dim * element_bytes + scale_bytes


@dataclass(frozen=True)
class IndexedSparse(KVCacheSpec):
    """A latent entry (`LatentAttention`) and an indexer key of `index_head_dim` per token; queries attend to the
    `index_topk` earlier positions the indexer scores highest (all of them while the context is no longer)."""

    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int
    index_topk: int

    kind = "sparse"

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)
        for name in ("kv_lora_rank", "rope_dim", "index_head_dim", "index_topk"):
            fix(name, check_int("IndexedSparse", name, getattr(self, name), lo=1))

    @property
    def entry_dim(self) -> int:
        """Numbers per token slot of the latent pages (the indexer key is in its own pages)."""
        return self.kv_lora_rank + self.rope_dim

    def page_shapes(self, num_blocks: int, block_size: int, dtype: str, *, quantized: bool = False,
                    num_kv_heads: int | None = None) -> SparseKV:
        scales = ArraySpec((num_blocks, block_size), SCALE_DTYPE) if quantized else None
        pages = lambda width: ArraySpec((num_blocks, block_size, width), dtype)
        return SparseKV(pages(self.entry_dim), pages(self.index_head_dim), scales, scales)

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """The latent entry and the indexer key, each with its scale for 8-bit pages."""
        return (self.entry_dim + self.index_head_dim) * element_bytes + 2 * scale_bytes


class StatePages(NamedTuple):
    """One recurrent layer's state snapshots (`RecurrentState`): float32 `[num_blocks, *state_shape]` and
    `[num_blocks, *conv_shape]`, one state per block."""

    block_axis = 0

    recurrent: Any
    conv: Any


@dataclass(frozen=True)
class RecurrentState(KVCacheSpec):
    """A recurrent layer's per-sequence state: a float32 recurrent state of `state_shape` (gated DeltaNet: [heads,
    key dim, value dim]; Mamba-2: [heads, head dim, state size]) and a float32 convolution window of `conv_shape`
    ([channels, kernel - 1]: the inputs before the position), one snapshot per block (module docstring)."""

    state_shape: tuple[int, ...]
    conv_shape: tuple[int, ...]

    kind = "state"
    pool = "state"

    def __post_init__(self) -> None:
        for name in ("state_shape", "conv_shape"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, tuple | list) or not value:
                raise TypeError(f"RecurrentState.{name} must be a non-empty tuple of ints, got {value!r}")
            object.__setattr__(self, name, tuple(check_int("RecurrentState", f"{name}[{i}]", d, lo=1)
                                                 for i, d in enumerate(value)))

    def page_shapes(self, num_blocks: int, block_size: int, dtype: str, *, quantized: bool = False,
                    num_kv_heads: int | None = None) -> StatePages:
        """float32 whatever the KV dtype: a state is not stored 8-bit (each would need scales of its own)."""
        return StatePages(ArraySpec((num_blocks, *self.state_shape), "float32"),
                          ArraySpec((num_blocks, *self.conv_shape), "float32"))

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """0: a state does not grow with the context (its blocks are counted whole: `bytes_per_block`)."""
        return 0

    def bytes_per_block(self, block_size: int, element_bytes: int, scale_bytes: int = 0) -> int:
        """One snapshot: the recurrent state and the convolution window, float32."""
        return 4 * (math.prod(self.state_shape) + math.prod(self.conv_shape))

    @property
    def release_window(self) -> int:
        return 2  # the query at p reads the state after p - 1: blocks before that position's are released

    def blocks_held(self, block_size: int) -> int:
        return 1  # the snapshot its next token starts from

    @property
    def heads_axis(self) -> int:
        """Tensor parallelism splits the state by its heads and the conv window by its channels (axis 1 of
        both, after the blocks): each device holds the snapshots of its own heads, the layer's model computing
        them per device (`pagedjax.parallel.recurrent`)."""
        return 1

    def per_device(self, tp: int) -> RecurrentState:
        """The heads and conv channels one device holds."""
        return RecurrentState((self.state_shape[0] // tp, *self.state_shape[1:]),
                              (self.conv_shape[0] // tp, *self.conv_shape[1:]))

    def check_tensor_parallel(self, tp: int) -> str | None:
        if self.state_shape[0] % tp or self.conv_shape[0] % tp:
            return (f"tensor_parallel_size {tp} must divide a recurrent layer's {self.state_shape[0]} state heads and "
                    f"{self.conv_shape[0]} conv channels (RecurrentState): each device holds its heads' state")
        return None


class WindowKV(NamedTuple):
    """One shared-KV window layer's pages (`SharedKVWindow`): `[num_blocks, block_size, head_dim]`, one vector per
    token position, read as its key and its value."""

    block_axis = 0

    pages: Any


def _no_8bit(owner: str, quantized: bool) -> None:
    if quantized:
        raise ValueError(f"{owner} pages are not stored 8-bit: use kv_dtype 'auto' (the model's dtype) for this model")


@dataclass(frozen=True)
class SharedKVWindow(KVCacheSpec):
    """A sliding window of one vector per token shared by every query head as key and value (DeepSeek V4: K = V,
    one head of `head_dim`): pages `[num_blocks, block_size, head_dim]`; the query at p reads (p - W, p] (None:
    every earlier position)."""

    head_dim: int
    sliding_window: int | None

    kind = "shared_kv"
    # Its own pool, sized by sequences: a window's few blocks per sequence are far more bytes than a block of the
    # compressed entries beside it, so in one pool every entry block would carry a window block's bytes.
    pool = "window"

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)
        fix("head_dim", check_int("SharedKVWindow", "head_dim", self.head_dim, lo=1))
        fix("sliding_window", check_int("SharedKVWindow", "sliding_window", self.sliding_window, lo=1, optional=True))

    def page_shapes(self, num_blocks: int, block_size: int, dtype: str, *, quantized: bool = False,
                    num_kv_heads: int | None = None) -> WindowKV:
        _no_8bit("SharedKVWindow", quantized)
        return WindowKV(ArraySpec((num_blocks, block_size, self.head_dim), dtype))

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        return self.head_dim * element_bytes

    @property
    def page_layout(self) -> SharedKVWindow:
        return dataclasses.replace(self, sliding_window=None)

    def blocks_held(self, block_size: int) -> int:
        """The blocks of positions (p - W, p]."""
        return -(-(self.sliding_window - 1) // block_size) + 1


class CompressedKV(NamedTuple):
    """One compressed layer's pages (`CompressedEntries`): entries `[num_blocks, block_size / m, head_dim]` and,
    for an indexed layer, the indexer's compressed keys `[num_blocks, block_size / m, index_head_dim]` (else
    None)."""

    block_axis = 0

    entries: Any
    index_keys: Any = None


@dataclass(frozen=True)
class CompressedEntries(KVCacheSpec):
    """Compressed attention entries (DeepSeek V4's CSA and HCA): one entry of `head_dim` per `compress_rate` (m)
    token positions, entry w (positions [w m, (w + 1) m)) in the block of position w m, so that a block of
    `block_size` positions holds `block_size / m` entries under the tokens' own block table, hashes and eviction
    (`block_size` must be a multiple of m). With `index_head_dim` (CSA) each entry has an indexer key beside it.
    Every entry is kept: queries read all of them (HCA) or the indexer's choice among all of them (CSA)."""

    head_dim: int
    compress_rate: int
    index_head_dim: int | None = None

    kind = "compressed"

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)
        for name in ("head_dim", "compress_rate"):
            fix(name, check_int("CompressedEntries", name, getattr(self, name), lo=1))
        fix("index_head_dim", check_int("CompressedEntries", "index_head_dim", self.index_head_dim, lo=1,
                                        optional=True))

    @property
    def tokens_per_entry(self) -> int:
        return self.compress_rate

    @property
    def block_multiple(self) -> int:
        return self.compress_rate  # whole entries per block

    def page_shapes(self, num_blocks: int, block_size: int, dtype: str, *, quantized: bool = False,
                    num_kv_heads: int | None = None) -> CompressedKV:
        _no_8bit("CompressedEntries", quantized)
        if block_size % self.compress_rate:
            raise ValueError(f"block_size {block_size} must be a multiple of the compress rate {self.compress_rate} "
                             "(a block holds block_size / compress_rate whole entries)")
        rows = lambda width: ArraySpec((num_blocks, block_size // self.compress_rate, width), dtype)
        return CompressedKV(rows(self.head_dim), None if self.index_head_dim is None else rows(self.index_head_dim))

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """An entry's bytes over the m positions it pools, rounded up (a block's are exact: `bytes_per_block`)."""
        return -(-(self.head_dim + (self.index_head_dim or 0)) * element_bytes // self.compress_rate)

    def bytes_per_block(self, block_size: int, element_bytes: int, scale_bytes: int = 0) -> int:
        return block_size // self.compress_rate * (self.head_dim + (self.index_head_dim or 0)) * element_bytes


class CompressorPages(NamedTuple):
    """One compressed layer's compressor snapshots (`CompressorState`): float32 `[num_blocks, P, 3, head_dim]` and,
    for an indexed layer, the indexer's `[num_blocks, P, 3, index_head_dim]` (else None)."""

    block_axis = 0

    compressor: Any
    indexer: Any = None


@dataclass(frozen=True)
class CompressorState(KVCacheSpec):
    """The compressor state of a compressed layer (`CompressedEntries`), one snapshot per block like a recurrent
    state's (`RecurrentState`'s contract): the softmax partials (max, sum, weighted sum per channel: `(3, D)`
    each) of the window still open, and with `overlap` (CSA's windows of 2m at stride m) the open window's second
    series and the last closed window's carried half: P = 3 partials, else P = 1 (`pallas_kernels.compressed`).
    With `index_head_dim` the indexer's compressor keeps its own alike."""

    head_dim: int
    overlap: bool
    index_head_dim: int | None = None

    kind = "compressor"
    pool = "state"

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)
        fix("head_dim", check_int("CompressorState", "head_dim", self.head_dim, lo=1))
        fix("index_head_dim", check_int("CompressorState", "index_head_dim", self.index_head_dim, lo=1,
                                        optional=True))
        if not isinstance(self.overlap, bool):
            raise TypeError(f"CompressorState.overlap must be a bool, got {self.overlap!r}")

    @property
    def partials(self) -> int:
        return 3 if self.overlap else 1

    def page_shapes(self, num_blocks: int, block_size: int, dtype: str, *, quantized: bool = False,
                    num_kv_heads: int | None = None) -> CompressorPages:
        """float32 whatever the KV dtype (`RecurrentState`'s reason)."""
        state = lambda width: ArraySpec((num_blocks, self.partials, 3, width), "float32")
        return CompressorPages(state(self.head_dim), None if self.index_head_dim is None else
                               state(self.index_head_dim))

    def bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        return 0

    def bytes_per_block(self, block_size: int, element_bytes: int, scale_bytes: int = 0) -> int:
        return 4 * 3 * self.partials * (self.head_dim + (self.index_head_dim or 0))

    @property
    def release_window(self) -> int:
        return 2  # as a recurrent state's: the query at p reads the state after p - 1

    def blocks_held(self, block_size: int) -> int:
        return 1


KVLayerSpec = KVCacheSpec  # the type of `ModelSpec.kv_layers`' entries (any kind, built-in or a model's own)
