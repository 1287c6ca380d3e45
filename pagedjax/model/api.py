"""The public model contract: how a JAX model of your own runs behind pagedjax's paged KV cache, scheduler,
forking, fused decode, tensor parallelism and server. The built-in models (`pagedjax.model.llama`) use exactly
this surface.

A model is an `nnx.Module` with:

    spec: ModelSpec                  what the engine sizes the KV pool, the prefix cache and window release by:
                                     vocabulary, what each layer's token slot holds (`kv_layers`: full
                                     attention K/V heads with an optional sliding window, or MLA latent
                                     entries), dtype, context length, stop tokens. Declared, never inferred
                                     from the code.
    __call__(token_ids, positions, cache) -> (hidden, cache)
                                     token_ids, positions: int32 `[T]`, a ragged batch (prefill chunks and
                                     decode tokens of many sequences, padded); cache: `PagedKVCache`. Returns
                                     hidden states `[T, hidden]` and the cache as the attention layers left it.
    compute_logits(hidden) -> logits hidden `[..., hidden]` -> float32 logits `[..., vocab_size]`.
    param_partition(names, tp)       optional, for tensor parallelism: the `PartitionSpec` of the parameter at
                                     `names` (e.g. ('blocks', 0, 'attn', 'qkv', 'kernel')) over the mesh axis
                                     `TP` of `tp` devices, or None for the default rule
                                     (`default_param_partition`). Shardings decide where XLA computes, never
                                     what: any valid one gives the same tokens.
    single_device_params(state)      optional: the parameters `nnx.State` as the model's steps take them on one
                                     device without a mesh (the runner converts once, and each
                                     `update_weights`); same function, e.g. `Llama`'s MoE experts as separate
                                     arrays on the CPU.

Each attention block calls its `PagedAttention` layer once per step, after its projections and positional
encoding:

    o, cache = self.attn(q, k, v, cache)   # q [T, Hq, D], k and v [T, Hkv, D] -> o [T, Hq, D]

which writes this step's K/V into the layer's pages (any `kv_dtype`, 8-bit scales included) and attends over
the paged cache with the engine's backend (the Pallas kernels on GPU / TPU, the XLA path on CPU), with the
layer's sliding window and soft cap, over its own heads on each device under tensor parallelism. A model with
attention sinks (gpt-oss: a learned logit per query head) passes them with the call, `self.attn(q, k, v, cache,
sinks=self.sinks)`, float `[Hq]` (split with the query heads under tensor parallelism). Positions
index the sequence (RoPE or learned embeddings alike); padding tokens (slot -1) are written nowhere. A layer
declared `LatentAttention` (MLA) calls its `PagedLatentAttention` instead, in latent space:

    o_latent, cache = self.attn(q_latent, q_rope, c_kv, k_rope, cache)   # -> o_latent [T, H, kv_lora_rank]

and one declared `IndexedSparse` (DeepSeek V3.2 sparse attention) its `PagedSparseAttention`, with the
lightning indexer's queries, per-head weights and key besides:

    o_latent, cache = self.attn(q_latent, q_rope, c_kv, k_rope, q_index, index_weights, k_index, cache)

(with `return_selection=True` also the positions it selected, which a GLM-5 "shared" layer, declared
`LatentAttention`, attends over through its `PagedSharedSparseAttention`:
`self.attn(q_latent, q_rope, c_kv, k_rope, selected, cache)`).

A KV cache kind of your own: declare a `KVCacheSpec` subclass (`pagedjax.config.kv_spec`: its page arrays in a
container of its own whose `block_axis` says where the blocks sit, its bytes per token, optionally a
`sliding_window` release rule) for the layers that use it, and have those layers read and write their pages
themselves: `cache.layer(i)` (its pages), `cache.meta_of(i)` (its KV cache group's block table and slot mapping,
`AttentionMetadata`) and `cache.with_layer(i, pages)` (the cache with layer i written). The engine sizes,
allocates, shares, forks, copies and releases its blocks like a built-in kind's (`tests/model/test_custom_kv_kind.py`).

Quantized weights: `quantize_model(model, "int8" | "int4" | "int4:32" | "fp8")` replaces the model's `nnx.Linear`
layers by `QuantizedLinear` (`pagedjax.model.layers.quant`: weight-only int8 / int4 / fp8 kernels, activations in the
model's dtype); a layer of your own may also build a `QuantizedLinear` from its float kernel. Their leaves
`qweight` and `scale` take the place of `kernel` for `param_partition` (the default rule splits them as the
kernel they stand for).

`check_model(model)` traces one small step (nothing is compiled or run) and raises a ValueError / TypeError
naming what is wrong: a missing or malformed spec, a layer writing K/V of another shape than declared, a layer
attended twice or never, a wrong return structure, logits of the wrong shape. The engine calls it on
construction. `forward_on_fresh_pages(model, token_ids)` is a model's dense logits through one step of its serving
forward over fresh pages (the reference the hybrid families' tests hold the engine to).

Images: a model whose `spec.images` is set (an `ImageSpec`, `pagedjax.config.multimodal`) also has

    encode_images(pixel_values) -> features
                                     pixel_values: float32 `[N, 3, H, W]`, (H, W) = `spec.images.image_size`, as
                                     the folder's processor makes them (`pagedjax.model.multimodal.processor`). Returns
                                     `[N, spec.images.tokens_per_image, hidden]` in the model's dtype: the rows
                                     that replace one image's placeholder embeddings (vision tower + projector).
    __call__(token_ids, positions, cache, *, images=None) -> (hidden, cache)
                                     the call above; `images` an `ImageEmbeds(embeds, index)`: token t's input
                                     embedding is replaced by `embeds[index[t]]` where `index[t] >= 0` (after the
                                     token embedding and any scaling of it, e.g. Gemma's sqrt(hidden), before the
                                     first layer), as transformers' `masked_scatter` of image features does.

The placeholders of one image are `tokens_per_image` consecutive `image_token_id`s; with
`spec.images.bidirectional` (Gemma 3) each run of consecutive placeholders attends to itself both ways.
`check_model` traces `encode_images` on one abstract image and a call with `images=`.

Hugging Face folders of a `model_type` pagedjax has no built-in model for: `ModelRegistry.register_model(
"gpt2", factory)` (`pagedjax.model.registry`: what a factory receives and returns) makes `from_pretrained` and
`--model DIR` serve them with a model of this contract.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pagedjax.config import CacheConfig, FullAttention, IndexedSparse, LatentAttention, ModelSpec
from pagedjax.config.parallel import TP
from pagedjax.device.attention import (
    AttentionMetadata,
    latent_attention,
    paged_attention,
    sparse_attend,
    sparse_attention,
    window_ahead,
)
from pagedjax.device.kv_cache import (
    PagedLayer,
    init_kv_cache,
    layer_shapes,
    token_block_size,
    write_kv,
    write_latent,
    write_sparse,
)
from pagedjax.model.layers.quant import QuantizedLinear, quantize_model
from pagedjax.model.registry import ModelRegistry
from pagedjax.parallel.attention import sharded_latent_write_and_attend, sharded_write_and_attend
from pagedjax.parallel.sharding import default_param_partition

__all__ = ["TP", "AttentionMetadata", "FullAttention", "ImageEmbeds", "IndexedSparse", "LatentAttention",
           "ModelRegistry", "ModelSpec", "PagedAttention", "PagedKVCache", "PagedLatentAttention", "PagedModel",
           "PagedSharedSparseAttention", "PagedSparseAttention", "QuantizedLinear", "check_model",
           "default_param_partition", "forward_on_fresh_pages", "model_spec", "param_partition_fn", "quantize_model"]


@runtime_checkable
class PagedModel(Protocol):
    """What the engine serves (see the module docstring)."""

    spec: ModelSpec

    def __call__(self, token_ids: jax.Array, positions: jax.Array,
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]: ...

    def compute_logits(self, hidden: jax.Array) -> jax.Array: ...


class ImageEmbeds(NamedTuple):
    """Image features in place of placeholder tokens' input embeddings (a model's `images=`, see the module
    docstring).

    embeds  `[M, hidden]`: rows of image features (`encode_images`' rows, any images, in any order; M >= 1).
    index   int32, the shape of the call's token ids (`[T]`; `[B, S]` in a dense forward): the row of `embeds` that
            replaces that token's embedding, or -1 to keep the token's own."""

    embeds: jax.Array
    index: jax.Array

    def merge(self, x: jax.Array) -> jax.Array:
        """Input embeddings x `[..., hidden]` (leading axes those of `index`) with the image rows put in, in x's
        dtype."""
        rows = jnp.take(self.embeds, jnp.maximum(self.index, 0), axis=0).astype(x.dtype)
        return jnp.where((self.index >= 0)[..., None], rows, x)


@dataclass(frozen=True)
class PagedKVCache:
    """One step's view of the paged KV cache, threaded through a model's forward: the pages, where this step's
    tokens go (`meta`), and how to attend (static: backend, decode-only, tensor-parallel mesh).

    `layers` are the cache's page arrays (slots) and `meta` holds a block table and slot mapping per KV cache group
    (`pagedjax.config.kv_layout`): layer i's pages are `layer(i)` and it attends with `meta_of(i)`, by the
    `spec`'s layout (without a spec: one group, slot i is layer i).

    Invariant: `written` names the layers whose `PagedAttention` ran in this step; each layer is written at
    most once (a second write would attend over the first's K/V at the same slots). `indexer_ties` (None until a
    sparse layer ran): the query rows, summed over the sparse layers, whose top-k cut-off fell between equal
    indexer scores (`sparse_attention`), which the engine reports.

    `block_sizes` (static): each KV cache group's block size in tokens, as the engine allocated it (a state
    group's, one snapshot per block, may be a multiple of the KV pool's: `CacheConfig.state_block_size`); None:
    the pages' own, which a state layer's pages do not show (`block_size_of`)."""

    layers: tuple[PagedLayer, ...]
    meta: AttentionMetadata
    backend: str = "xla"
    decode_only: bool = False
    mesh: Mesh | None = None
    spec: ModelSpec | None = None
    written: frozenset[int] = frozenset()
    indexer_ties: jax.Array | None = None
    block_sizes: tuple[int, ...] | None = None

    @property
    def num_layers(self) -> int:
        """The model's layers (each calls its attention once per step)."""
        return len(self.layers) if self.spec is None else self.spec.num_layers

    def _slot(self, index: int) -> int:
        return index if self.spec is None else self.spec.kv_layout.layer_slot[index]

    def layer(self, index: int) -> PagedLayer:
        """Layer `index`'s pages."""
        return self.layers[self._slot(index)]

    def block_size_of(self, index: int) -> int:
        """Tokens per block of layer `index`'s KV cache group (a state layer's: one snapshot per that many)."""
        if self.block_sizes is not None:
            return self.block_sizes[0 if self.spec is None else self.spec.kv_layout.layer_group[index]]
        size = token_block_size(self.layer(index))
        if size is None:
            raise ValueError(f"layer {index}'s pages ({type(self.layer(index)).__name__}) do not show their block "
                             "size: give PagedKVCache(block_sizes=...)")
        return size

    def meta_of(self, index: int) -> AttentionMetadata:
        """The metadata layer `index` writes and attends with: its KV cache group's."""
        return self.meta if self.spec is None else self.meta.group(self.spec.kv_layout.layer_group[index])

    def with_layer(self, index: int, layer: PagedLayer) -> PagedKVCache:
        """This cache with layer `index`'s pages replaced (and marked written)."""
        slot = self._slot(index)
        layers = self.layers[:slot] + (layer,) + self.layers[slot + 1:]
        return dataclasses.replace(self, layers=layers, written=self.written | {index})

    def with_indexer_ties(self, ties: jax.Array) -> PagedKVCache:
        """This cache with a sparse layer's tie count (int32[]) added to `indexer_ties`."""
        return dataclasses.replace(self, indexer_ties=ties if self.indexer_ties is None else self.indexer_ties + ties)


jax.tree_util.register_dataclass(PagedKVCache, data_fields=["layers", "meta", "indexer_ties"],
                                 meta_fields=["backend", "decode_only", "mesh", "spec", "written", "block_sizes"])


class PagedAttention(nnx.Module):
    """Layer `layer_index`'s paged attention: write this step's K/V, attend over the cache. No parameters.

    scale: of the scores (default head_dim ** -0.5); sliding_window W: the query at p reads keys in (p - W, p]
    (it must be the one the model's spec declares for this layer: the engine frees blocks by the spec);
    logits_soft_cap c: scores pass through c * tanh(s / c). Attention sinks (gpt-oss) are a model parameter, so
    they come with each call: `sinks=` `[num_q_heads]`, one logit per query head that joins its softmax's
    denominator and gives no value (taken in float32, neither scaled nor soft-capped). `bidirectional` (a layer of
    a `ModelSpec.bidirectional` model): each query also sees the keys after it up to the step's `attend_until`
    (its prompt's last position), with a window W only those within W - 1 positions either way."""

    def __init__(self, layer_index: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, bidirectional: bool = False):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"PagedAttention: num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.layer_index = layer_index
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.logits_soft_cap = scale, sliding_window, logits_soft_cap
        self.bidirectional = bidirectional

    def __call__(self, q: jax.Array,  # [T, Hq, D]
                 k: jax.Array,  # [T, Hkv, D]
                 v: jax.Array,  # [T, Hkv, D]
                 cache: PagedKVCache, *,
                 sinks: jax.Array | None = None) -> tuple[jax.Array, PagedKVCache]:  # [Hq], float
        """Returns (o `[T, Hq, D]` in q's dtype, the cache with this layer written)."""
        i = self.layer_index
        sinks = None if sinks is None else jnp.asarray(sinks)  # an nnx.Param too
        self._check(q, k, v, cache, sinks)
        options = dict(scale=self.scale, sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                       sinks=sinks)
        layer, meta = cache.layer(i), cache.meta_of(i)
        if self.bidirectional and self.sliding_window is not None:
            meta = window_ahead(meta, self.sliding_window)
        if cache.mesh is not None:
            o, layer = sharded_write_and_attend(q, k, v, layer, meta, mesh=cache.mesh, backend=cache.backend,
                                                decode_only=cache.decode_only, **options)
        else:
            layer = write_kv(layer, k, v, meta.slot_mapping)
            o = paged_attention(q, layer, meta, backend=cache.backend, decode_only=cache.decode_only, **options)
        # Pages may be stored in another dtype than the model computes in (bf16 or 8-bit pages under an f32
        # model): o comes back in the pages' dtype.
        return o.astype(q.dtype), cache.with_layer(i, layer)

    def _check(self, q, k, v, cache: PagedKVCache, sinks) -> None:
        i, where = self.layer_index, f"PagedAttention(layer_index={self.layer_index})"
        if not 0 <= i < cache.num_layers:
            raise ValueError(f"{where}: the cache has {cache.num_layers} layers (ModelSpec.num_layers)")
        if i in cache.written:
            raise ValueError(f"{where} ran twice in one step: each layer's attention must be called once")
        t = q.shape[0] if q.ndim else None
        want = {"q": (t, self.num_q_heads, self.head_dim), "k": (t, self.num_kv_heads, self.head_dim),
                "v": (t, self.num_kv_heads, self.head_dim)}
        for name, x in (("q", q), ("k", k), ("v", v)):
            if tuple(x.shape) != want[name]:
                raise ValueError(f"{where}: {name} has shape {tuple(x.shape)}, expected [tokens, heads, head_dim] "
                                 f"= {want[name]}")
        if sinks is not None and (tuple(sinks.shape) != (self.num_q_heads,)
                                  or not jnp.issubdtype(sinks.dtype, jnp.floating)):
            raise ValueError(f"{where}: sinks must be a float array [num_q_heads] = ({self.num_q_heads},), got "
                             f"{sinks.dtype}{list(sinks.shape)}")
        if cache.spec is not None and cache.spec.bidirectional != self.bidirectional:
            raise ValueError(f"{where}: bidirectional={self.bidirectional}, but the model's spec says "
                             f"bidirectional={cache.spec.bidirectional} (the engine schedules prompts by the spec)")
        if self.bidirectional and not cache.decode_only and cache.meta.attend_until is None:
            raise ValueError(f"{where}: a bidirectional layer's ragged step needs AttentionMetadata.attend_until "
                             "(each token's prompt's last position)")
        declared = _declared_layer(cache, i, FullAttention.kind, where)
        if declared is None:
            return
        if (self.num_kv_heads, self.head_dim) != (declared.num_kv_heads, declared.head_dim):
            raise ValueError(f"{where}: {self.num_kv_heads} KV heads of {self.head_dim}, but the model's ModelSpec "
                             f"declares {declared.num_kv_heads} of {declared.head_dim} for this layer")
        if self.num_q_heads != cache.spec.num_q_heads:
            raise ValueError(f"{where}: {self.num_q_heads} query heads, but the model's ModelSpec declares "
                             f"{cache.spec.num_q_heads}")
        if self.sliding_window != declared.sliding_window:
            raise ValueError(f"{where}: sliding_window={self.sliding_window}, but ModelSpec.sliding_windows "
                             f"declares {declared.sliding_window} for this layer (the engine frees blocks by the "
                             "declaration)")


class PagedLatentAttention(nnx.Module):
    """Layer `layer_index`'s paged multi-head latent attention (MLA, DeepSeek V2/V3), absorbed: write this step's
    latent entries `[c_kv | k_rope]` into the layer's pages (`LatentAttention` in `ModelSpec.kv_layers`) and attend
    in latent space over the pages as they are stored. No parameters: the model absorbs its key up-projection
    into the query (`q_latent[h] = W_UK[h] q_nope[h]`) and applies its value up-projection to the result.

    Head h scores token t as `scale * (q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t])`; `scale` is required (MLA's
    is 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale^2 where used, not derivable from the
    latent width)."""

    def __init__(self, layer_index: int, *, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not scale > 0:
            raise ValueError(f"PagedLatentAttention: scale must be a positive float, got {scale!r}")
        self.layer_index = layer_index
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.scale = float(scale)

    def __call__(self, q_latent: jax.Array,  # [T, H, R]
                 q_rope: jax.Array,  # [T, H, Dr], RoPE applied
                 c_kv: jax.Array,  # [T, R], the normalized latent
                 k_rope: jax.Array,  # [T, Dr], RoPE applied
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """Returns (o_latent `[T, H, R]` in q_latent's dtype, the cache with this layer written)."""
        i = self.layer_index
        self._check(q_latent, q_rope, c_kv, k_rope, cache)
        layer, meta = cache.layer(i), cache.meta_of(i)
        if cache.mesh is not None:  # query heads split over the devices, the latent pages whole on each
            o, layer, _, _ = sharded_latent_write_and_attend(q_latent, q_rope, c_kv, k_rope, layer, meta,
                                                             mesh=cache.mesh, backend=cache.backend,
                                                             decode_only=cache.decode_only, scale=self.scale)
        else:
            layer = write_latent(layer, c_kv, k_rope, meta.slot_mapping)
            o = latent_attention(q_latent, q_rope, layer, meta, backend=cache.backend, decode_only=cache.decode_only,
                                 scale=self.scale)
        return o.astype(q_latent.dtype), cache.with_layer(i, layer)

    def _check(self, q_latent, q_rope, c_kv, k_rope, cache: PagedKVCache, kind: str | None = None) -> None:
        i, where = self.layer_index, f"{type(self).__name__}(layer_index={self.layer_index})"
        if not 0 <= i < cache.num_layers:
            raise ValueError(f"{where}: the cache has {cache.num_layers} layers (ModelSpec.num_layers)")
        if i in cache.written:
            raise ValueError(f"{where} ran twice in one step: each layer's attention must be called once")
        t = q_latent.shape[0] if q_latent.ndim else None
        h, r, dr = self.num_heads, self.kv_lora_rank, self.rope_dim
        want = {"q_latent": (t, h, r), "q_rope": (t, h, dr), "c_kv": (t, r), "k_rope": (t, dr)}
        for name, x in (("q_latent", q_latent), ("q_rope", q_rope), ("c_kv", c_kv), ("k_rope", k_rope)):
            if tuple(x.shape) != want[name]:
                raise ValueError(f"{where}: {name} has shape {tuple(x.shape)}, expected {want[name]}")
        declared = _declared_layer(cache, i, kind or LatentAttention.kind, where)
        if declared is not None and (r, dr) != (declared.kv_lora_rank, declared.rope_dim):
            raise ValueError(f"{where}: kv_lora_rank {r}, rope_dim {dr}, but the model's ModelSpec declares "
                             f"{declared.kv_lora_rank}, {declared.rope_dim} for this layer")


class PagedSparseAttention(PagedLatentAttention):
    """Layer `layer_index`'s DeepSeek sparse attention (DSA, V3.2; `IndexedSparse` in `ModelSpec.kv_layers`): write
    this step's latent entries and lightning-indexer keys into the layer's pages (same slots), score every earlier
    position of each query's sequence by the indexer, keep the `index_topk` best and attend over exactly those
    (`PagedLatentAttention`'s absorbed MLA). With `index_topk` at least the context, it is that layer.

    Scores: `s[t] = index_scale * sum_h index_weights[h] * relu(q_index[h] . k_index[t])` for t at or before the
    query's position; ties go to the lower position (a query row whose cut-off fell between equal scores is
    counted in the cache's `indexer_ties`). With `return_selection`, the call returns the selection too (int32
    `[T, index_topk]` positions, -1 = none), for the layers after it that share it (`PagedSharedSparseAttention`)."""

    def __init__(self, layer_index: int, *, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                 index_n_heads: int, index_head_dim: int, index_topk: int, index_scale: float):
        super().__init__(layer_index, num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, scale=scale)
        if not isinstance(index_scale, int | float) or isinstance(index_scale, bool) or not index_scale > 0:
            raise ValueError(f"PagedSparseAttention: index_scale must be a positive float, got {index_scale!r}")
        self.index_n_heads, self.index_head_dim, self.index_topk = index_n_heads, index_head_dim, index_topk
        self.index_scale = float(index_scale)

    def __call__(self, q_latent: jax.Array,  # [T, H, R]
                 q_rope: jax.Array,  # [T, H, Dr], RoPE applied
                 c_kv: jax.Array,  # [T, R], the normalized latent
                 k_rope: jax.Array,  # [T, Dr], RoPE applied
                 q_index: jax.Array,  # [T, Hi, Di], the indexer's queries, RoPE applied
                 index_weights: jax.Array,  # f32[T, Hi], the indexer's per-head weights
                 k_index: jax.Array,  # [T, Di], the indexer key, normalized, RoPE applied
                 cache: PagedKVCache, *, return_selection: bool = False):
        """Returns (o_latent `[T, H, R]` in q_latent's dtype, the cache with this layer written), and the selection
        with `return_selection`."""
        i = self.layer_index
        self._check(q_latent, q_rope, c_kv, k_rope, cache, kind=IndexedSparse.kind)
        t, hi, di = q_latent.shape[0], self.index_n_heads, self.index_head_dim
        where = f"PagedSparseAttention(layer_index={i})"
        for name, x, want in (("q_index", q_index, (t, hi, di)), ("index_weights", index_weights, (t, hi)),
                              ("k_index", k_index, (t, di))):
            if tuple(x.shape) != want:
                raise ValueError(f"{where}: {name} has shape {tuple(x.shape)}, expected {want}")
        declared = cache.spec.kv_layers[i] if cache.spec is not None else None
        if declared is not None and (di, self.index_topk) != (declared.index_head_dim, declared.index_topk):
            raise ValueError(f"{where}: index_head_dim {di}, index_topk {self.index_topk}, but the model's ModelSpec "
                             f"declares {declared.index_head_dim}, {declared.index_topk} for this layer")
        options = dict(scale=self.scale, index_scale=self.index_scale, index_topk=self.index_topk)
        layer, meta = cache.layer(i), cache.meta_of(i)
        if cache.mesh is not None:  # query heads split over the devices; pages and the indexer whole on each
            o, layer, ties, selected = sharded_latent_write_and_attend(
                q_latent, q_rope, c_kv, k_rope, layer, meta, mesh=cache.mesh, backend=cache.backend,
                decode_only=cache.decode_only, index=(q_index, index_weights.astype(jnp.float32), k_index), **options)
        else:
            layer = write_sparse(layer, c_kv, k_rope, k_index, meta.slot_mapping)
            o, ties, selected = sparse_attention(q_latent, q_rope, q_index, index_weights, layer, meta,
                                                 backend=cache.backend, decode_only=cache.decode_only, **options)
        out = o.astype(q_latent.dtype), cache.with_layer(i, layer).with_indexer_ties(ties)
        return (*out, selected) if return_selection else out


class PagedSharedSparseAttention(PagedLatentAttention):
    """Layer `layer_index`'s shared sparse attention (GLM-5's "shared" DSA layers; `LatentAttention` in
    `ModelSpec.kv_layers`): write this step's latent entries into the layer's pages and attend over the positions
    an earlier layer's indexer selected for each query in this step (`PagedSparseAttention(...,
    return_selection=True)`), with no indexer of its own (`PagedLatentAttention`'s absorbed MLA over those only)."""

    def __call__(self, q_latent: jax.Array,  # [T, H, R]
                 q_rope: jax.Array,  # [T, H, Dr], RoPE applied
                 c_kv: jax.Array,  # [T, R], the normalized latent
                 k_rope: jax.Array,  # [T, Dr], RoPE applied
                 selected: jax.Array,  # int32[T, k], an earlier layer's selection, -1 = none
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """Returns (o_latent `[T, H, R]` in q_latent's dtype, the cache with this layer written)."""
        i = self.layer_index
        self._check(q_latent, q_rope, c_kv, k_rope, cache)
        if selected.ndim != 2 or selected.shape[0] != q_latent.shape[0]:
            raise ValueError(f"PagedSharedSparseAttention(layer_index={i}): selected has shape "
                             f"{tuple(selected.shape)}, expected ({q_latent.shape[0]}, k)")
        layer, meta = cache.layer(i), cache.meta_of(i)
        if cache.mesh is not None:
            o, layer, _, _ = sharded_latent_write_and_attend(q_latent, q_rope, c_kv, k_rope, layer, meta,
                                                             mesh=cache.mesh, backend=cache.backend,
                                                             decode_only=cache.decode_only, scale=self.scale,
                                                             selected=selected)
        else:
            layer = write_latent(layer, c_kv, k_rope, meta.slot_mapping)
            o = sparse_attend(q_latent, q_rope, layer, meta, selected, backend=cache.backend,
                              decode_only=cache.decode_only, scale=self.scale)
        return o.astype(q_latent.dtype), cache.with_layer(i, layer)


_KIND_SPECS = {spec.kind: spec.__name__ for spec in (FullAttention, LatentAttention, IndexedSparse)}


def forward_on_fresh_pages(model, token_ids: jax.Array, block_size: int | None = None) -> jax.Array:
    """A model of the contract's dense reference: whole sequences token_ids `[B, S]` -> float32 logits `[B, S,
    vocab]`, one step of its serving forward (`model(tokens, positions, cache)`, `model.compute_logits`) over fresh
    zero pages of its `spec` (every sequence from position 0, in blocks of `block_size`, default 8 or the least
    multiple of it that holds whole compressed entries (`ModelSpec.block_multiple`), a table per KV cache group
    and blocks in each pool, XLA backend). For models whose layers keep state other than K/V (a recurrent layer's
    snapshots) a forward written apart would restate them; this one serves what the engine serves, in one step."""
    b, s = token_ids.shape
    spec = model.spec
    block_size = block_size or math.lcm(8, spec.block_multiple)
    layout = spec.kv_layout
    nb = -(-s // block_size)
    groups = layout.num_groups
    blocks = groups * b * nb  # every group its own blocks, in each pool
    kv = init_kv_cache(layout, blocks, block_size, jnp.dtype(spec.dtype),
                       extra_pools=(blocks,) * (len(layout.pools) - 1))
    tables = np.arange(blocks, dtype=np.int32).reshape(groups, b, nb)
    pos = np.tile(np.arange(s, dtype=np.int32), b)
    seq = np.repeat(np.arange(b), s)
    slots = tables[:, seq, pos // block_size] * block_size + pos % block_size
    meta = AttentionMetadata(jnp.asarray(slots if groups > 1 else slots[0]),
                             jnp.asarray(tables if groups > 1 else tables[0]),
                             jnp.full((b,), s, jnp.int32), jnp.arange(b + 1, dtype=jnp.int32) * s)
    cache = PagedKVCache(kv.layers, meta, backend="xla", spec=spec, block_sizes=(block_size,) * groups)
    hidden, _ = model(token_ids.reshape(-1), jnp.asarray(pos), cache)
    return model.compute_logits(hidden).reshape(b, s, -1)


def _declared_layer(cache: PagedKVCache, index: int, kind: str, where: str):
    """Layer `index`'s declared spec (None when the cache carries no ModelSpec), which must be of `kind`."""
    if cache.spec is None:
        return None
    declared = cache.spec.kv_layers[index]
    if declared.kind != kind:
        raise ValueError(f"{where}: the model's ModelSpec declares layer {index} as {type(declared).__name__} "
                         f"(kv_layers), not {_KIND_SPECS[kind]}")
    return declared


def param_partition_fn(model, tp: int) -> Callable[[tuple, tuple], P]:
    """(names, shape) -> PartitionSpec of a parameter of `model` on `tp` devices: the model's own
    `param_partition(names, tp)` where it returns one, else `default_param_partition`. ValueError when a
    PartitionSpec does not split the parameter's shape evenly."""
    own = getattr(model, "param_partition", None)
    head_dim = model.spec.head_dim
    if head_dim is None:  # layers of several kinds (a hybrid's): its full-attention layers' head_dim, if one
        dims = {layer.kv_heads_shape[1] for layer in model.spec.kv_layers if layer.kv_heads_shape is not None}
        head_dim = dims.pop() if len(dims) == 1 else None

    def partition(names: tuple, shape: tuple) -> P:
        spec = own(names, tp) if own is not None else None
        if spec is None:
            return default_param_partition(names, shape, head_dim=head_dim, tp=tp)
        if not isinstance(spec, P):
            raise TypeError(f"{type(model).__name__}.param_partition{names!r} returned {type(spec).__name__}, "
                            "expected a jax.sharding.PartitionSpec or None")
        for axis, name in enumerate(spec):
            if name is not None and (axis >= len(shape) or shape[axis] % tp):
                raise ValueError(f"{type(model).__name__}.param_partition: {spec} splits parameter "
                                 f"{'.'.join(map(str, names))} of shape {tuple(shape)} over {tp} devices unevenly")
        return spec

    return partition


def model_spec(model) -> ModelSpec:
    """The spec of a model of the contract, its types checked (TypeError naming what is wrong); `check_model`
    checks the rest."""
    name = type(model).__name__
    if not isinstance(model, nnx.Module):
        raise TypeError(f"a model must be a flax.nnx.Module, got {name}")
    spec = getattr(model, "spec", None)
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"{name}.spec must be a pagedjax.ModelSpec (the KV layout the engine sizes the cache by), "
                        f"got {type(spec).__name__}")
    if not callable(getattr(model, "compute_logits", None)):
        raise TypeError(f"{name} has no compute_logits(hidden) -> logits method")
    return spec


def check_model(model, *, kv_dtype: str = "auto") -> ModelSpec:
    """Check that `model` keeps the contract (see the module docstring) by tracing one two-token step over a
    two-block cache of `kv_dtype` pages (`CacheConfig.kv_dtype`; abstractly: nothing is compiled or run); for a
    model with `spec.images`, also `encode_images` on one image and the step with `images=`. Returns its spec;
    TypeError / ValueError naming what is wrong."""
    spec = model_spec(model)
    name = type(model).__name__
    tokens, block_size = 2, math.lcm(4, spec.block_multiple)
    kv = jnp.dtype(CacheConfig(kv_dtype=kv_dtype).kv_array_dtype(spec))
    layout = spec.kv_layout
    layers = tuple(layer_shapes(slot, 2, block_size, kv) for slot in layout.slot_specs)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    groups = () if layout.num_groups == 1 else (layout.num_groups,)  # a table and slots per KV cache group
    # A bidirectional model's ragged steps bound each token's keys by its prompt's last position.
    meta = AttentionMetadata(i32(*groups, tokens), i32(*groups, 1, 2), i32(1), i32(2),
                             i32(tokens) if spec.bidirectional else None)
    graphdef, state = nnx.split(model)

    def step(state, layers, meta, token_ids, positions, images):
        m = nnx.merge(graphdef, state)
        cache = PagedKVCache(layers, meta, spec=spec, block_sizes=(block_size,) * layout.num_groups)
        out = m(token_ids, positions, cache) if images is None else m(token_ids, positions, cache, images=images)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], PagedKVCache)):
            raise TypeError(f"{name}.__call__ must return (hidden, cache) with the PagedKVCache it was given, as "
                            f"the attention layers left it; got {_structure(out)}")
        hidden, cache = out
        missing = sorted(set(range(spec.num_layers)) - cache.written)
        if missing:
            raise ValueError(f"{name}: ModelSpec declares {spec.num_layers} layers, but no PagedAttention ran for "
                             f"layers {missing[:8]} (each layer's attention must run once per step)")
        if not hasattr(hidden, "shape") or hidden.ndim < 1 or hidden.shape[0] != tokens:
            raise ValueError(f"{name}.__call__ must return hidden states [tokens, ...], got {_structure(hidden)} "
                             f"for {tokens} tokens")
        return m.compute_logits(hidden), cache.layers

    logits, out_layers = jax.eval_shape(step, state, layers, meta, i32(tokens), i32(tokens), None)
    if tuple(logits.shape) != (tokens, spec.vocab_size) or logits.dtype != jnp.float32:
        raise ValueError(f"{name}.compute_logits must return float32 logits [tokens, vocab_size] = "
                         f"[{tokens}, {spec.vocab_size}], got {logits.dtype}{list(logits.shape)}")
    if jax.tree.structure(out_layers) != jax.tree.structure(layers) or any(
            (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(jax.tree.leaves(out_layers),
                                                                      jax.tree.leaves(layers), strict=True)):
        raise ValueError(f"{name}: the cache came back with other pages than it was given (a model must change the "
                         "cache only through PagedAttention)")
    if spec.images is not None:
        features = _check_encode_images(model, spec, graphdef, state)
        images = ImageEmbeds(jax.ShapeDtypeStruct(features.shape[1:], features.dtype), i32(tokens))
        with_images = jax.eval_shape(step, state, layers, meta, i32(tokens), i32(tokens), images)
        if jax.tree.map(lambda a: (a.shape, a.dtype), with_images) != jax.tree.map(lambda a: (a.shape, a.dtype),
                                                                                    (logits, out_layers)):
            raise ValueError(f"{name}: a step with images= returns other shapes than one without")
    return spec


def _check_encode_images(model, spec: ModelSpec, graphdef, state) -> jax.ShapeDtypeStruct:
    """The abstract features of one image (`[1, tokens_per_image, hidden]`), after checking that `model` has
    `encode_images` and a call taking `images=`."""
    name, images = type(model).__name__, spec.images
    encode = getattr(model, "encode_images", None)
    if not callable(encode):
        raise TypeError(f"{name}: its ModelSpec declares images (spec.images), but it has no "
                        "encode_images(pixel_values) method")
    params = inspect.signature(model.__call__).parameters
    if "images" not in params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise TypeError(f"{name}: its ModelSpec declares images (spec.images), but its __call__ takes no images= "
                        "argument (pagedjax.model.api.ImageEmbeds)")
    pixels = jax.ShapeDtypeStruct((1, 3, *images.image_size), jnp.float32)
    features = jax.eval_shape(lambda state, x: nnx.merge(graphdef, state).encode_images(x), state, pixels)
    want = (1, images.tokens_per_image, spec.hidden_size or "hidden")
    ok = (hasattr(features, "shape") and features.ndim == 3 and tuple(features.shape[:2]) == want[:2]
          and (spec.hidden_size is None or features.shape[2] == spec.hidden_size))
    if not ok:
        raise ValueError(f"{name}.encode_images must return [images, tokens_per_image, hidden] = {list(want)} for one "
                         f"image of {list(pixels.shape)}, got {_structure(features)}"
                         f"{list(features.shape) if hasattr(features, 'shape') else ''}")
    if features.dtype != jnp.dtype(spec.dtype):
        raise ValueError(f"{name}.encode_images must return features in the model's dtype ({spec.dtype}), got "
                         f"{features.dtype}")
    return features


def _structure(x: Any) -> str:
    if isinstance(x, tuple):
        return f"a tuple of {len(x)} ({', '.join(type(e).__name__ for e in x)})"
    return type(x).__name__
