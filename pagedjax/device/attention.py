"""Attention over the paged KV cache: backend dispatch between the Pallas kernels and an XLA gather path.

backend "pallas": the kernels in `pallas_kernels` (compiled through Triton on GPU, Mosaic on TPU; interpret
                  mode on CPU, which is for tests only: it is far too slow to serve).
backend "xla":    `pallas_kernels`' XLA gather paths: flash attention written in XLA, pages gathered with jnp a chunk of
                  keys at a time per sequence (decode) or per tile of prefill queries, the softmax merged exactly
                  in float32; on the CPU a decode step without variants (no window, soft cap, 8-bit pages or
                  sinks) runs `pagedjax.device.cpu_attention`'s native kernel instead where it is loaded.
backend "auto":   "pallas" on GPU and TPU, "xla" elsewhere. The engine logs which one it picked.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels
from pagedjax.config.engine import BACKENDS
from pagedjax.config.kv_spec import LatentKV, LayerKV, SparseKV
from pagedjax.device import cpu_attention
from pallas_kernels.quant import is_quantized

logger = logging.getLogger(__name__)



class AttentionMetadata(NamedTuple):
    """Where a step's tokens sit in the paged cache (all int32, padded to bucket sizes).

    slot_mapping: `[num_tokens]`, -1 = padding token (not written)
    block_tables: `[num_seqs, max_blocks_per_seq]`
    kv_lens:      `[num_seqs]`, context length including this step's tokens; 0 for padding sequences
    cu_q_lens:    `[num_seqs + 1]`, query offsets; padding sequences have q_len 0
    attend_until: None (causal), or `[num_tokens]`: token t also sees the keys up to position attend_until[t]
                  where that is past its own (an image's tokens attend to each other both ways, Gemma 3;
                  full-attention layers of ragged steps only, see `pallas_kernels.ragged_paged_attention`)

    A model of several KV cache groups (`pagedjax.config.kv_layout`) has a block table and a slot mapping per
    group: `slot_mapping [num_groups, num_tokens]`, `block_tables [num_groups, num_seqs, max_blocks_per_seq]`;
    `group(g)` is one group's view, what a layer of group g attends with.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    attend_until: jax.Array | None = None

    def group(self, g: int) -> AttentionMetadata:
        """KV cache group g's metadata (a one-group metadata, tables `[num_seqs, max_blocks]`, is its own)."""
        if self.block_tables.ndim == 2:
            return self
        return self._replace(slot_mapping=self.slot_mapping[g], block_tables=self.block_tables[g])


def window_ahead(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The metadata of a layer of window W attending both ways (`ModelSpec.bidirectional`): each row's
    `attend_until` capped at W - 1 past its own position, so that the query at p sees keys j with |p - j| < W (the
    kernels' window bounds the keys behind it). Rows' positions come from the metadata: row t of sequence s sits at
    kv_lens[s] - (cu_q_lens[s + 1] - t). Padding rows keep a bound below their position (they attend to nothing)."""
    if meta.attend_until is None:  # a decode-only step: one token per sequence, its own position the bound
        return meta
    rows = jnp.arange(meta.attend_until.shape[0], dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(meta.cu_q_lens, rows, side="right") - 1, 0, meta.kv_lens.shape[0] - 1)
    position = meta.kv_lens[seq] - (meta.cu_q_lens[seq + 1] - rows)
    return meta._replace(attend_until=jnp.minimum(meta.attend_until, position + window - 1))


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    compiled = jax.default_backend() in ("gpu", "tpu")  # the kernels compile there (Triton, Mosaic)
    if backend == "auto":
        backend = "pallas" if compiled else "xla"
        logger.info("attention backend auto -> %s (JAX backend %s)", backend, jax.default_backend())
    elif backend == "pallas" and not compiled:
        logger.warning("attention backend 'pallas' without a GPU or TPU runs the kernels in interpret mode: exact but "
                       "slow, meant for tests; use 'xla' (or 'auto') to serve on %s", jax.default_backend())
    return backend


def _check_causal(meta: AttentionMetadata, kind: str) -> None:
    if meta.attend_until is not None:
        raise ValueError(f"{kind} attention is causal only: attend_until (bidirectional image tokens) is for "
                         "full-attention layers")


def paged_attention(q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
                    layer: LayerKV,  # this layer's pages, this step's K/V already written
                    meta: AttentionMetadata, *, backend: str, decode_only: bool, scale: float | None = None,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: jax.Array | None = None) -> jax.Array:  # [num_q_heads], float
    """Attention of a step's queries over one layer's paged cache.

    With `decode_only`, token i is the single query of sequence i (num_tokens == num_seqs). `sliding_window`
    W: a query at position p attends to positions (p - W, p]; `logits_soft_cap` c: scores pass through
    c * tanh(s / c); `sinks` (gpt-oss's attention sinks, one logit per query head, taken in float32): each head's
    sink joins its softmax's denominator and gives no value. Float pages meet q in their own dtype; 8-bit pages
    are dequantized by their scales inside the kernel (q keeps its dtype). Returns `[num_tokens, num_q_heads,
    head_dim]` in the dtype q was cast to.
    """
    if not is_quantized(layer.k.dtype):
        q = q.astype(layer.k.dtype)
    variants = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                    k_scales=layer.k_scales, v_scales=layer.v_scales,
                    sinks=None if sinks is None else sinks.astype(jnp.float32))
    if decode_only and meta.attend_until is not None:
        raise ValueError("attend_until is for ragged steps: a decode token attends causally")
    ragged = dict(variants, attend_until=meta.attend_until)
    if backend == "pallas":  # target "auto", interpret=None: Triton on GPU, Mosaic on TPU, interpreted elsewhere
        if decode_only:
            return pallas_kernels.paged_attention(q, layer.k, layer.v, meta.block_tables, meta.kv_lens,
                                                  interpret=None, **variants)
        return pallas_kernels.ragged_paged_attention(q, layer.k, layer.v, meta.block_tables, meta.kv_lens,
                                                     meta.cu_q_lens, interpret=None, **ragged)
    if backend == "xla":
        if decode_only and cpu_attention.supports(q, layer.k, sliding_window=sliding_window,
                                                  logits_soft_cap=logits_soft_cap, k_scales=layer.k_scales,
                                                  sinks=sinks):
            return cpu_attention.paged_decode(q, layer.k, layer.v, meta.block_tables, meta.kv_lens, scale=scale)
        if decode_only:
            return pallas_kernels.paged_attention_xla(q, layer.k, layer.v, meta.block_tables, meta.kv_lens,
                                                      **variants)
        return pallas_kernels.ragged_paged_attention_xla(q, layer.k, layer.v, meta.block_tables, meta.kv_lens,
                                                         meta.cu_q_lens, **ragged)
    raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")


def latent_attention(q_latent: jax.Array,  # [num_tokens, num_heads, kv_lora_rank]
                     q_rope: jax.Array,  # [num_tokens, num_heads, rope_dim]
                     layer: LatentKV,  # this layer's latent pages, this step's entries already written
                     meta: AttentionMetadata, *, backend: str, decode_only: bool, scale: float) -> jax.Array:
    """Multi-head latent attention (MLA, absorbed) of a step's queries over one layer's latent pages:
    head h scores token t as `scale * (q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t])` and returns the
    softmax-weighted sum of c_kv, `[num_tokens, num_heads, kv_lora_rank]` (in latent space: the model applies its
    value up-projection). `decode_only`, float / 8-bit pages and the dtype of the result: as `paged_attention`."""
    _check_causal(meta, "latent")
    if not is_quantized(layer.pages.dtype):
        q_latent, q_rope = q_latent.astype(layer.pages.dtype), q_rope.astype(layer.pages.dtype)
    args = (q_latent, q_rope, layer.pages, meta.block_tables, meta.kv_lens)
    options = dict(scale=scale, kv_scales=layer.scales)
    if backend == "pallas":
        if decode_only:
            return pallas_kernels.mla_paged_attention(*args, interpret=None, **options)
        return pallas_kernels.ragged_mla_paged_attention(*args, meta.cu_q_lens, interpret=None, **options)
    if backend == "xla":
        if decode_only:
            return pallas_kernels.mla_paged_attention_xla(*args, **options)
        return pallas_kernels.ragged_mla_paged_attention_xla(*args, meta.cu_q_lens, **options)
    raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")


def sparse_attention(q_latent: jax.Array,  # [num_tokens, num_heads, kv_lora_rank]
                     q_rope: jax.Array,  # [num_tokens, num_heads, rope_dim]
                     q_index: jax.Array,  # [num_tokens, index_n_heads, index_head_dim]
                     index_weights: jax.Array,  # f32[num_tokens, index_n_heads]
                     layer: SparseKV,  # this layer's pages, this step's entries and indexer keys already written
                     meta: AttentionMetadata, *, backend: str, decode_only: bool, scale: float, index_scale: float,
                     index_topk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """DeepSeek sparse attention (DSA, V3.2) of a step's queries over one layer's pages: the lightning indexer
    selects (`sparse_select`), the absorbed MLA of `latent_attention` runs over exactly those positions
    (`sparse_attend`). Returns (`[num_tokens, num_heads, kv_lora_rank]`, int32[]: the query rows whose cut-off fell
    between equal scores, the selection int32 `[num_tokens, index_topk]` (what a GLM-5 shared layer reads))."""
    selected, ties = sparse_select(q_index, index_weights, layer, meta, backend=backend, decode_only=decode_only,
                                   index_scale=index_scale, index_topk=index_topk)
    o = sparse_attend(q_latent, q_rope, layer, meta, selected, backend=backend, decode_only=decode_only,
                      scale=scale)
    return o, ties, selected


def sparse_select(q_index: jax.Array,  # [num_tokens, index_n_heads, index_head_dim]
                  index_weights: jax.Array,  # f32[num_tokens, index_n_heads]
                  layer: SparseKV,  # this layer's indexer keys, this step's already written
                  meta: AttentionMetadata, *, backend: str, decode_only: bool, index_scale: float,
                  index_topk: int) -> tuple[jax.Array, jax.Array]:
    """The lightning indexer's selection: it scores every earlier position of the query's sequence,
    `s[t] = index_scale * sum_h w[h] relu(q_index[h] . k_index[t])` (causal), and keeps the `index_topk` best (ties:
    the lower position). Returns (int32 `[num_tokens, index_topk]` positions, -1 = none; int32[]: the query rows
    whose cut-off fell between equal scores, where the tie rule chose: `top_k_positions_and_ties`, whose one top-k
    of index_topk + 1 costs what the plain selection does).

    The scores of a step are float32 `[num_tokens, max_blocks_per_seq * block_size]`: one row per query token
    over its sequence's table (the engine's step sizes keep that small next to the pages)."""
    _check_causal(meta, "sparse")
    if not is_quantized(layer.index_keys.dtype):
        q_index = q_index.astype(layer.index_keys.dtype)
    index_weights = index_weights.astype(jnp.float32)
    ragged = () if decode_only else (meta.cu_q_lens,)
    indexer = dict(scale=index_scale, index_scales=layer.index_scales)
    if backend == "pallas":
        score = pallas_kernels.indexer_scores if decode_only else pallas_kernels.ragged_indexer_scores
        indexer["interpret"] = None
    elif backend == "xla":
        score = pallas_kernels.indexer_scores_xla if decode_only else pallas_kernels.ragged_indexer_scores_xla
    else:
        raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")
    scores = score(q_index, index_weights, layer.index_keys, meta.block_tables, meta.kv_lens, *ragged, **indexer)
    selected, ties = pallas_kernels.top_k_positions_and_ties(scores, index_topk)  # [T, index_topk], -1 = none
    return selected, jnp.sum(ties, dtype=jnp.int32)


def sparse_attend(q_latent: jax.Array,  # [num_tokens, num_heads, kv_lora_rank]
                  q_rope: jax.Array,  # [num_tokens, num_heads, rope_dim]
                  layer: LatentKV | SparseKV,  # this layer's latent pages, this step's entries already written
                  meta: AttentionMetadata,
                  selected: jax.Array,  # int32[num_tokens, k]: positions of each query's sequence, -1 = none
                  *, backend: str, decode_only: bool, scale: float) -> jax.Array:
    """The absorbed MLA of `latent_attention` over the `selected` positions of each query's sequence only (a
    sparse layer's own selection, or a GLM-5 shared layer's: the previous indexed layer's). Returns
    `[num_tokens, num_heads, kv_lora_rank]`."""
    _check_causal(meta, "sparse")
    if not is_quantized(layer.pages.dtype):
        q_latent, q_rope = q_latent.astype(layer.pages.dtype), q_rope.astype(layer.pages.dtype)
    ragged = () if decode_only else (meta.cu_q_lens,)
    attention = dict(scale=scale, kv_scales=layer.scales)
    if backend == "pallas":
        attend = pallas_kernels.sparse_mla_paged_attention if decode_only else \
            pallas_kernels.ragged_sparse_mla_paged_attention
        attention["interpret"] = None
    elif backend == "xla":
        attend = pallas_kernels.sparse_mla_paged_attention_xla if decode_only else \
            pallas_kernels.ragged_sparse_mla_paged_attention_xla
    else:
        raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")
    return attend(q_latent, q_rope, layer.pages, meta.block_tables, meta.kv_lens, *ragged, selected, **attention)


def probe_attention(spec, layer, *, heads: int, dtype, decode_only: bool, backend: str) -> None:
    """Trace (no compile, no run) one decode or ragged attention call of `spec`'s kind over `layer`'s pages (one
    device's shapes; `heads` query heads of `dtype`), so that a combination the backend rejects fails with the
    kernels' own reason. A kind of a model's own (its layers attend by themselves) is not probed."""
    tokens = 1 if decode_only else 16
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    meta = AttentionMetadata(i32(tokens), i32(1, 2), i32(1), i32(2))
    q = lambda width, h=heads: jax.ShapeDtypeStruct((tokens, h, width), dtype)
    options = dict(backend=backend, decode_only=decode_only)
    calls = {  # the attention call of each built-in kind and its abstract query arguments
        "full": lambda: (functools.partial(paged_attention, **options), (q(spec.head_dim),)),
        "latent": lambda: (functools.partial(latent_attention, scale=1.0, **options),
                           (q(spec.kv_lora_rank), q(spec.rope_dim))),
        "sparse": lambda: (functools.partial(sparse_attention, scale=1.0, index_scale=1.0,
                                             index_topk=spec.index_topk, **options),
                           (q(spec.kv_lora_rank), q(spec.rope_dim), q(spec.index_head_dim, 1),
                            jax.ShapeDtypeStruct((tokens, 1), jnp.float32))),
    }
    if spec.kind in calls:
        attend, args = calls[spec.kind]()
        jax.eval_shape(attend, *args, layer, meta)
