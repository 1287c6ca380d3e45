"""The paged KV cache's configuration: `CacheConfig`, the KV dtypes, and the byte arithmetic of a pool.

Plain Python, no JAX: the host side (`pagedjax.core`) imports this too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedjax.config.fields import DTYPE_BYTES, check_bool, check_int, describe, dtype_bytes, option

if TYPE_CHECKING:
    from pagedjax.config.model import ModelSpec

def kv_cache_bytes(num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, bytes_per_elem: int,
                   scale_bytes: int = 0) -> int:
    """Bytes of a full-attention (MHA / GQA) KV cache for `num_tokens` tokens (`CacheConfig.kv_bytes_per_token`
    sums any model's layer specs): 2 (K and V) * L * T * Hkv * (D * bytes + scale_bytes), where
    `scale_bytes` is the size of the one scale per token and KV head that 8-bit pages carry (0 for float pages)."""
    return 2 * num_layers * num_tokens * num_kv_heads * (head_dim * bytes_per_elem + scale_bytes)


# KV cache dtypes (`CacheConfig.kv_dtype`): "auto" (the model's dtype), a float dtype, or an 8-bit format whose
# pages carry one float32 scale per token and KV head (`pallas_kernels.quant`). "fp8" is float8_e4m3fn.
KV_DTYPES: tuple[str, ...] = ("auto", *DTYPE_BYTES, "int8", "fp8")
QUANTIZED_KV_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}  # name -> the pages' array dtype
KV_SCALE_BYTES = 4  # float32 scales
# A state pool's block size the engine picks is a multiple of this many tokens: the widest chunk of the recurrent
# kernels (`pallas_kernels.recurrent`: 16-64 tokens), so that a snapshot boundary never cuts a chunk in two pieces.
STATE_BLOCK_ALIGN = 64
DEFAULT_NUM_BLOCKS = 512  # a pool's blocks when neither num_blocks nor kv_memory_bytes is given


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` physical blocks of `block_size` tokens each.

    Give either `num_blocks` or `kv_memory_bytes` (the pool is then sized from the model's shape); with neither,
    `num_blocks` defaults to DEFAULT_NUM_BLOCKS (512). A model with recurrent-state layers also has a pool of state
    snapshots (`pagedjax.config.kv_layout`): `num_state_blocks` of them (None: twice what the running sequences hold
    at once: `resolve_state_blocks`), taken out of `kv_memory_bytes` first when that sizes the pools, each the state
    after a multiple of `state_block_size` tokens (a multiple of `block_size`; None: the least at which a state
    layer's snapshot takes no more bytes than an attention layer's KV of those tokens, `resolve_pool_block_sizes`).
    Prefix hits of such a model end at a multiple of it. DeepSeek V4's windows are a pool of their own too, of
    `block_size` blocks, sized by sequences alike (`num_state_blocks` sets every such pool's size). `kv_dtype` (one
    of KV_DTYPES) is what K and V are stored in: "auto" = the model's dtype; "int8" and "fp8" (float8_e4m3fn)
    quantize each token's K and V per KV head when written, with a float32 scale beside them that `block_bytes`
    counts.
    """

    block_size: int = option(16, "tokens per KV block")
    num_blocks: int | None = option(None, f"KV blocks in the pool (default: {DEFAULT_NUM_BLOCKS})")
    kv_memory_bytes: int | None = option(None, "size the KV pool by memory instead, e.g. 64MiB")
    num_state_blocks: int | None = None
    state_block_size: int | None = None
    enable_prefix_caching: bool = option(True, "disable prefix caching")  # the flag is --no-prefix-caching
    kv_dtype: str = option("auto", "KV cache dtype: auto = the model's; int8 / fp8 (float8_e4m3fn) store K/V in 8 "
                                   "bits with a float32 scale per token and KV head, about half the bytes per token "
                                   "of bfloat16")
    hash_seed: int = 0
    kv_host_memory_bytes: int | None = option(None, "a host-memory tier of this size for prefix-cache blocks the "
                                                    "device pool evicts (loaded back on a hit), e.g. 16GiB")
    kv_disk_dir: str | None = option(None, "a disk tier in this folder under the host tier: blocks it drops are "
                                           "kept as files, found again after a restart (needs --kv-host-memory and "
                                           "--kv-disk-bytes)")
    kv_disk_bytes: int | None = option(None, "the disk tier's size, e.g. 100GiB")

    def __post_init__(self) -> None:
        owner = "CacheConfig"
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        fix("block_size", check_int(owner, "block_size", self.block_size, lo=1))
        fix("num_blocks", check_int(owner, "num_blocks", self.num_blocks, lo=1, optional=True))
        fix("kv_memory_bytes", check_int(owner, "kv_memory_bytes", self.kv_memory_bytes, lo=1, optional=True))
        fix("num_state_blocks", check_int(owner, "num_state_blocks", self.num_state_blocks, lo=1, optional=True))
        fix("state_block_size", check_int(owner, "state_block_size", self.state_block_size, lo=1, optional=True))
        if self.state_block_size is not None and self.state_block_size % self.block_size:
            raise ValueError(f"{owner}.state_block_size {self.state_block_size} must be a multiple of block_size "
                             f"{self.block_size}")
        if self.num_blocks is not None and self.kv_memory_bytes is not None:
            raise ValueError("give num_blocks or kv_memory_bytes, not both")
        check_bool(owner, "enable_prefix_caching", self.enable_prefix_caching)
        if not isinstance(self.kv_dtype, str):
            raise TypeError(f"{owner}.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {describe(self.kv_dtype)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"{owner}.kv_dtype: unsupported KV cache dtype {self.kv_dtype!r}; expected one of "
                             f"{', '.join(KV_DTYPES)}")
        fix("hash_seed", check_int(owner, "hash_seed", self.hash_seed))
        fix("kv_host_memory_bytes", check_int(owner, "kv_host_memory_bytes", self.kv_host_memory_bytes, lo=1,
                                              optional=True))
        if self.kv_host_memory_bytes is not None and not self.enable_prefix_caching:
            raise ValueError(f"{owner}.kv_host_memory_bytes: a host tier keeps prefix-cache blocks; it needs "
                             "enable_prefix_caching")
        if self.kv_disk_dir is not None:
            if not isinstance(self.kv_disk_dir, str | os.PathLike) or not os.fspath(self.kv_disk_dir):
                raise TypeError(f"{owner}.kv_disk_dir must be a folder's path (a non-empty str or path), got "
                                f"{describe(self.kv_disk_dir)}")
            fix("kv_disk_dir", os.fspath(self.kv_disk_dir))
        fix("kv_disk_bytes", check_int(owner, "kv_disk_bytes", self.kv_disk_bytes, lo=1, optional=True))
        if (self.kv_disk_dir is None) != (self.kv_disk_bytes is None):
            raise ValueError(f"{owner}: a disk tier needs both kv_disk_dir and kv_disk_bytes, got "
                             f"kv_disk_dir={self.kv_disk_dir!r}, kv_disk_bytes={self.kv_disk_bytes}")
        if self.kv_disk_dir is not None and self.kv_host_memory_bytes is None:
            raise ValueError(f"{owner}.kv_disk_dir: blocks reach the disk tier through the host tier; give "
                             "kv_host_memory_bytes too")

    # `model` below: a ModelSpec (or a ModelConfig, which has the same KV fields).
    def resolve_kv_dtype(self, model: ModelSpec) -> str:
        """The KV dtype's name for `model` ("auto" resolved to the model's dtype)."""
        return model.dtype if self.kv_dtype == "auto" else self.kv_dtype

    def kv_array_dtype(self, model: ModelSpec) -> str:
        """The pages' array dtype name for `model` (as JAX/numpy spell it: "fp8" is "float8_e4m3fn")."""
        name = self.resolve_kv_dtype(model)
        return QUANTIZED_KV_DTYPES.get(name, name)

    def _element_bytes(self, model: ModelSpec) -> tuple[int, int]:
        """(bytes per stored number, bytes per 8-bit scale) of `model`'s pages."""
        name = self.resolve_kv_dtype(model)
        return (1, KV_SCALE_BYTES) if name in QUANTIZED_KV_DTYPES else (dtype_bytes(name), 0)

    def kv_bytes_per_token(self, model: ModelSpec) -> int:
        """KV cache bytes one token takes in every layer of `model`: what each layer's spec stores per token slot
        (`ModelSpec.kv_layers`: K and V of each KV head, or one latent entry), 8-bit pages' scales included."""
        element, scale = self._element_bytes(model)
        return sum(layer.bytes_per_token(element, scale) for layer in model.kv_layers)

    def block_bytes(self, model: ModelSpec, pool: int = 0) -> int:
        """Bytes of one physical block of `model`'s pool `pool` (0: the KV pool where the model has one): its
        positions in every page array of the model's KV cache layout (`ModelSpec.kv_layout`: for a model of one KV
        cache group, K and V of every layer; with several groups, one layer of each group's share a page array,
        so a block is the bytes of the largest group's layers), with 8-bit pages their scales too; a state pool's
        block is one snapshot of every state layer."""
        return model.kv_layout.bytes_per_block(self.block_size, *self._element_bytes(model), pool=pool)

    def resolve_pool_block_sizes(self, model: ModelSpec) -> tuple[int, ...]:
        """Each of `model`'s pools' block size in tokens: `block_size` for the first; a state pool's (one snapshot
        of every state layer per block) `state_block_size`, or the least multiple of `block_size` at which one state
        layer's snapshot takes no more bytes than one attention layer's K/V of those tokens. That is how vLLM aligns
        a hybrid model's pages (it grows the attention block to a state's page instead): Qwen3.5-27B's 3 MiB
        DeltaNet state and conv window against 4 KiB of K/V per token and layer give 800 tokens at block 16, 832
        rounded up to a multiple of `STATE_BLOCK_ALIGN` (the recurrent kernels' chunks never straddle one; a state
        no larger than a KV block's K/V takes the KV block as it is). A
        cached prefix's snapshots then cost at most (state layers / attention layers) times its K/V: for a 3:1
        hybrid, about the K/V an all-attention model would hold for it."""
        pools = model.kv_layout.pools
        layers = [sum(1 for layer in model.kv_layers if layer.pool == name) for name in pools]
        sizes = [self.block_size]
        for pool in range(1, len(pools)):
            if pools[pool] != "state":  # a window pool: blocks of the KV pool's size
                sizes.append(self.block_size)
            elif self.state_block_size is not None:
                sizes.append(self.state_block_size)
            else:
                ratio = -(-self.block_bytes(model, pool) * layers[0] // (self.block_bytes(model) * layers[pool]))
                unit = self.block_size if ratio <= 1 else math.lcm(self.block_size, STATE_BLOCK_ALIGN)
                sizes.append(unit * -(-self.block_size * max(ratio, 1) // unit))
        return tuple(sizes)

    def resolve_state_blocks(self, model: ModelSpec, max_num_seqs: int, max_num_batched_tokens: int) -> tuple:
        """The sizes of `model`'s pools past the first (a state pool's snapshots, a window pool's blocks; empty for a
        model of one pool): `num_state_blocks`, or twice what running sequences hold at once, the other half for
        cached blocks. Between steps a sequence holds h blocks of B = the pool's block size (`blocks_held`: the
        snapshot its next token starts from; a window's cdiv(W - 1, B) + 1), and a step of n tokens adds at most
        cdiv(n, B) + 1 (a snapshot per boundary crossed; the window's new blocks), so a step of at most
        `max_num_seqs` sequences and `max_num_batched_tokens` tokens holds at most max_num_seqs * (h + 1) +
        cdiv(max_num_batched_tokens, B)."""
        pools, sizes = model.kv_layout.pools, self.resolve_pool_block_sizes(model)
        if self.num_state_blocks is not None:
            return (self.num_state_blocks,) * (len(sizes) - 1)
        held = [max(layer.blocks_held(sizes[p]) for layer in model.kv_layers if layer.pool == pools[p])
                for p in range(1, len(pools))]
        return tuple(2 * (max_num_seqs * (h + 1) + -(-max_num_batched_tokens // b)) for h, b in zip(held, sizes[1:],
                                                                                                   strict=True))

    def resolve_host_blocks(self, model: ModelSpec, num_blocks: int, extra_pools: tuple[int, ...] = ()
                            ) -> tuple[int, ...]:
        """Host tier slots per pool (`pagedjax.core.host_tier`; all 0 without `kv_host_memory_bytes`): the budget
        split over the pools (KV blocks, a window's, state snapshots) as the device pools (`num_blocks`, then
        `extra_pools`) split their bytes, in whole blocks of the model's full shapes (under tensor parallelism the
        host holds every device's share). ValueError when the budget holds no block of some pool."""
        return self._tier_blocks(model, (num_blocks, *extra_pools), "kv_host_memory_bytes", self.kv_host_memory_bytes)

    def resolve_disk_blocks(self, model: ModelSpec, num_blocks: int, extra_pools: tuple[int, ...] = ()
                            ) -> tuple[int, ...]:
        """Disk tier files per pool (`pagedjax.core.disk_tier`; all 0 without `kv_disk_bytes`): split as
        `resolve_host_blocks` splits the host's budget, a file per block (its bytes, plus a 48-byte header)."""
        return self._tier_blocks(model, (num_blocks, *extra_pools), "kv_disk_bytes", self.kv_disk_bytes)

    def _tier_blocks(self, model: ModelSpec, sizes: tuple[int, ...], name: str, budget: int | None
                     ) -> tuple[int, ...]:
        if budget is None:
            return (0,) * len(sizes)
        per_block = [self.block_bytes(model, p) for p in range(len(sizes))]
        device = sum(n * b for n, b in zip(sizes, per_block, strict=True))
        blocks = tuple(budget * n // device for n in sizes)
        if not all(blocks):  # a prefix hit needs every pool's blocks: a tier missing one would serve none
            p = blocks.index(0)
            raise ValueError(f"CacheConfig.{name} {budget} holds no block of pool {p} (a share of "
                             f"{budget * sizes[p] // device} bytes; one block takes {per_block[p]})")
        return blocks

    def resolve_num_blocks(self, model: ModelSpec, draft: ModelSpec | None = None,
                           extra_pools: tuple[int, ...] = ()) -> int:
        """Number of physical blocks of the first pool: as given, or as many as fit in `kv_memory_bytes` (a block
        holds a `draft` model's KV too, if given: speculative decoding's, `pagedjax.spec_decode.draft_kv`), after
        the blocks of the pools past the first (`extra_pools`: their sizes, `resolve_state_blocks`)."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_memory_bytes is None:
            return DEFAULT_NUM_BLOCKS
        budget = self.kv_memory_bytes - sum(n * self.block_bytes(model, p)
                                            for p, n in enumerate(extra_pools, start=1))
        per_block = self.block_bytes(model) + (0 if draft is None else self.block_bytes(draft))
        n = budget // per_block
        if n < 1:
            states = "" if not extra_pools else f" (after {self.kv_memory_bytes - budget} bytes of state snapshots)"
            raise ValueError(f"kv_memory_bytes={self.kv_memory_bytes} holds no block of {per_block} bytes{states}"
                             + ("" if draft is None else f" (the draft model's {self.block_bytes(draft)} included)"))
        return int(n)

    def pool_bytes(self, model: ModelSpec, extra_pools: tuple[int, ...] = ()) -> int:
        """Bytes of the whole KV pool this config gives `model` (what the engine allocates on the device), with the
        pools past the first of `extra_pools` blocks."""
        return self.resolve_num_blocks(model, extra_pools=extra_pools) * self.block_bytes(model) + sum(
            n * self.block_bytes(model, p) for p, n in enumerate(extra_pools, start=1))
