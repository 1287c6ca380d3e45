"""Exact paged-attention kernels in Pallas (Triton on NVIDIA GPUs, Mosaic on TPUs, interpreters elsewhere).

    paged_attention(q, k_pages, v_pages, block_tables, lengths)            decode: one query per sequence
    ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens)
                                                                            mixed prefill chunks + decode
Both take `target="auto" | "gpu" | "tpu"`: the GPU kernels (`pallas_kernels.gpu`) or the TPU kernels
(`pallas_kernels.tpu`); "auto" is "tpu" on a TPU backend and "gpu" otherwise. With `interpret=True` (the
default off their platform) the TPU kernels run in Pallas's TPU interpret mode, on any machine.
KV layout: `[num_kv_heads, num_blocks, block_size, head_dim]` (that of JAX's own Pallas paged-attention op).

Variants (keyword-only, on both kernels, their references and XLA paths):
  * `sliding_window=W`: a query at position p attends to keys at positions p - W < j <= p; pages wholly
    before every query's window are skipped (never loaded, their block-table entries never read);
  * `logits_soft_cap=c`: scaled scores s become c * tanh(s / c) (Gemma 2);
  * 8-bit pages: `k_pages`/`v_pages` int8 or float8_e4m3fn with `k_scales`/`v_scales`
    `[num_kv_heads, num_blocks, block_size]` (float32 or bfloat16, one per token and KV head), dequantized
    inside the kernel as `pages.astype(float32) * scales[..., None]`; q may then be float32, bfloat16 or
    float16 and sets the output dtype. `quantize_kv` / `dequantize_kv` (module `quant`) make and read them;
  * `sinks` float32 `[num_q_heads]` (gpt-oss's attention sinks): query head h's logit sink[h] joins its softmax's
    denominator and carries no value, o = sum_j exp(s_j - m) v_j / (exp(sink[h] - m) + sum_j exp(s_j - m)) with
    m = max(sink[h], max_j s_j) and s_j the scores after scale and soft cap (the sink is neither scaled nor
    capped); joined once into the exact merge of all of a query's keys (`merge.join_sink`);
  * ragged only, `attend_until` int32 `[total_q_tokens]`: query row t at position p attends to keys
    j <= max(p, attend_until[t]) (bidirectional attention among an image's tokens, Gemma 3).
Multi-head latent attention (MLA, DeepSeek V2/V3), weights absorbed by the caller, over one latent page array
`kv_pages [num_blocks, block_size, R + Dr]` (per token its latent c_kv, then its rotary key k_rope, shared by
every query head):

    mla_paged_attention(q_latent, q_rope, kv_pages, block_tables, lengths, scale=...)      decode
    ragged_mla_paged_attention(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, scale=...)
                                                                            mixed prefill chunks + decode
q_latent `[tokens, num_heads, R]`, q_rope `[tokens, num_heads, Dr]`; the output is in latent space
`[tokens, num_heads, R]` (apply W_UV after). 8-bit latent pages take `kv_scales [num_blocks, block_size]`.
Kernels in `gpu.mla` and `tpu.mla`; references, XLA paths and the non-absorbed oracle in `reference`.
DeepSeek sparse attention (DSA, V3.2) over the latent pages plus one indexer key per token, `index_pages
[num_blocks, block_size, index_head_dim]` in the same blocks (8-bit with `index_scales [num_blocks, block_size]`):

    indexer_scores(q_index, weights, index_pages, block_tables, lengths, scale=...)        decode
    ragged_indexer_scores(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, scale=...)
        -> float32 [rows, max_blocks_per_seq * block_size], s[t] = scale * sum_h w[h] relu(q_I[h] . k_I[t]), causal
    top_k_positions(scores, k)                                   -> int32 [rows, k], -1 where fewer are visible
    top_k_positions_and_ties(scores, k)       -> (the same, bool [rows]: the k-th score equals the (k+1)-th)
    sparse_mla_paged_attention(q_latent, q_rope, kv_pages, block_tables, lengths, indices, scale=...)
    ragged_sparse_mla_paged_attention(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, ...)
        -> the absorbed MLA of each row over exactly its selected positions
Kernels in `gpu.sparse` and `tpu.sparse`; references and XLA paths in `reference`, the selection in `topk`.

Recurrent-state layers (Qwen3-Next / Qwen3.5's gated DeltaNet, Mamba-2 hybrids such as Nemotron-H) over paged
state snapshots, one state per block (`[num_blocks, *state_shape]`), read and written through the block tables under
`recurrent`'s contract (the initial state from the block before a sequence's first position, a snapshot after every
block's last position and after the step's last token); each returns (out, pages) with the pages updated in place:

    gated_delta_rule(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, block_size=...)
    causal_conv1d(x, weight, conv_state_pages, block_tables, kv_lens, cu_q_lens, block_size=...)
    mamba2_ssd(x, dt, A, B, C, state_pages, block_tables, kv_lens, cu_q_lens, block_size=...)
Kernels in `gpu.recurrent` and `tpu.recurrent`; float64 references and XLA paths in `recurrent`.

`reference` holds the dense float32 oracles and an XLA gather path; `merge` the exact (m, z, u) merge.
The two entry points are defined here, above both kernel families: they check the arguments common to both
targets once (`_validate`) and dispatch to `gpu` or `tpu`, which check their own tile rules and share the tile
arithmetic in `tiles` (and never import each other). This package imports nothing from pagedjax.

Example (GQA, 8 query heads on 2 KV heads, a cache of 32 blocks of 16 tokens):

    import jax, jax.numpy as jnp
    from pallas_kernels import paged_attention

    k_pages = jax.random.normal(jax.random.key(0), (2, 32, 16, 64), jnp.bfloat16)  # [Hkv, blocks, 16, D]
    v_pages = jax.random.normal(jax.random.key(1), k_pages.shape, jnp.bfloat16)
    block_tables = jnp.array([[3, 7, 0], [12, 5, 9]], jnp.int32)  # sequence -> physical blocks
    lengths = jnp.array([20, 40], jnp.int32)                        # tokens cached per sequence
    q = jax.random.normal(jax.random.key(2), (2, 8, 64), jnp.bfloat16)
    out = jax.jit(paged_attention)(q, k_pages, v_pages, block_tables, lengths)  # [2, 8, 64] bfloat16
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _validate as V
from pallas_kernels.gpu.mla import mla_paged_attention_gpu, ragged_mla_paged_attention_gpu
from pallas_kernels.gpu.paged_attention import default_num_splits, paged_attention_gpu
from pallas_kernels.gpu.ragged_attention import ragged_paged_attention_gpu
from pallas_kernels.gpu.recurrent import causal_conv1d_gpu, gated_delta_rule_gpu, mamba2_ssd_gpu
from pallas_kernels.gpu.sparse import ragged_indexer_scores_gpu, sparse_mla_attention_gpu
from pallas_kernels.merge import Partial, finalize, join_sink, merge_and_finalize, merge_partials, merge_two
from pallas_kernels.quant import dequantize_kv, quantize_kv
from pallas_kernels.recurrent import (
    CONV_ACTIVATIONS,
    causal_conv1d_reference,
    causal_conv1d_xla,
    default_form,
    gated_delta_rule_reference,
    gated_delta_rule_xla,
    mamba2_ssd_reference,
    mamba2_ssd_xla,
)
from pallas_kernels.reference import (
    indexer_scores_reference,
    indexer_scores_xla,
    mla_attention_dense_reference,
    mla_paged_attention_reference,
    mla_paged_attention_xla,
    paged_attention_reference,
    paged_attention_xla,
    ragged_indexer_scores_reference,
    ragged_indexer_scores_xla,
    ragged_mla_paged_attention_reference,
    ragged_mla_paged_attention_xla,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
    ragged_sparse_mla_paged_attention_reference,
    ragged_sparse_mla_paged_attention_xla,
    sparse_mla_paged_attention_reference,
    sparse_mla_paged_attention_xla,
)
from pallas_kernels.tiles import sparse_slots
from pallas_kernels.topk import top_k_positions, top_k_positions_and_ties
from pallas_kernels.tpu.mla import mla_paged_attention_tpu, ragged_mla_paged_attention_tpu
from pallas_kernels.tpu.paged_attention import paged_attention_tpu
from pallas_kernels.tpu.ragged_attention import ragged_paged_attention_tpu
from pallas_kernels.tpu.recurrent import causal_conv1d_tpu, gated_delta_rule_tpu, mamba2_ssd_tpu
from pallas_kernels.tpu.sparse import ragged_indexer_scores_tpu, sparse_mla_attention_tpu

__all__ = [
    "Partial",
    "causal_conv1d",
    "causal_conv1d_reference",
    "causal_conv1d_xla",
    "default_num_splits",
    "dequantize_kv",
    "finalize",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "gated_delta_rule_xla",
    "indexer_scores",
    "indexer_scores_reference",
    "indexer_scores_xla",
    "join_sink",
    "merge_and_finalize",
    "merge_partials",
    "mamba2_ssd",
    "mamba2_ssd_reference",
    "mamba2_ssd_xla",
    "merge_two",
    "mla_attention_dense_reference",
    "mla_paged_attention",
    "mla_paged_attention_reference",
    "mla_paged_attention_xla",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_xla",
    "quantize_kv",
    "ragged_mla_paged_attention",
    "ragged_mla_paged_attention_reference",
    "ragged_indexer_scores",
    "ragged_indexer_scores_reference",
    "ragged_indexer_scores_xla",
    "ragged_mla_paged_attention_xla",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
    "ragged_sparse_mla_paged_attention",
    "ragged_sparse_mla_paged_attention_reference",
    "ragged_sparse_mla_paged_attention_xla",
    "sparse_mla_paged_attention",
    "sparse_mla_paged_attention_reference",
    "sparse_mla_paged_attention_xla",
    "top_k_positions",
    "top_k_positions_and_ties",
]

_TARGETS = ("auto", "gpu", "tpu")


def _resolve_target(target: str, interpret) -> str:
    """The kernel family a public entry point runs: "tpu" (Mosaic) or "gpu" (Triton). "auto" is "tpu" on a
    TPU backend and "gpu" everywhere else (compiled on a GPU, the Pallas interpreter on a CPU)."""
    if not isinstance(target, str) or target not in _TARGETS:
        raise ValueError(f"target must be one of {_TARGETS}, got {target!r}")
    if target == "auto":
        target = "tpu" if jax.default_backend() == "tpu" else "gpu"
    if target == "gpu" and isinstance(interpret, pltpu.InterpretParams):
        raise ValueError("interpret=InterpretParams(...) configures the TPU interpret mode; it needs target='tpu'")
    return target


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
    num_splits: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    target: str = "auto",
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention of one query token per sequence over a paged KV cache.

    Args:
      q: `[num_seqs, num_q_heads, head_dim]`, float32, bfloat16 or float16.
      k_pages, v_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`, q's dtype (the layout of JAX's
        own Pallas paged-attention op), or both int8 or both float8_e4m3fn with `k_scales`/`v_scales`.
        `num_q_heads % num_kv_heads == 0` (MHA, GQA, MQA); head_dim a multiple of 16, at most 256; any
        block_size (powers of two are fastest).
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`: logical block j of sequence s lives in
        physical block `block_tables[s, j]`. Entries past `cdiv(lengths[s], block_size)` are never read
        and may hold anything; so are those of pages wholly before a sliding window.
      lengths: int32 `[num_seqs]`: tokens in each sequence's cache (clipped to
        `[0, max_blocks_per_seq * block_size]`). Slots at or past the length are never read.
      scale: multiplies q.k; defaults to `1 / sqrt(head_dim)`. (JAX's op applies no scale.)
      interpret: run the Pallas interpreter; `None` = compiled on the target's own platform (GPU for "gpu",
        TPU for "tpu"), interpreted elsewhere. With target "tpu" it is Pallas's TPU interpret mode (DMAs
        and semaphores simulated); a `pltpu.InterpretParams` sets its options.
      num_splits: KV splits per sequence (flash-decoding), a positive int; `None` picks one from the batch
        and table shape (see `default_num_splits`; 1 on TPU). Any count works: no divisibility constraints.
      pages_per_iter: pages gathered per inner-loop iteration. GPU: a power of two with
        `pages_per_iter * next_pow2(block_size) >= 16`; `None` = about 128 tokens per iteration (see
        `gpu._common.default_pages_per_iter`). TPU: pages per double-buffered DMA chunk, any positive int;
        `None` = about 64 KiB of K per chunk (see `tpu._common.default_pages_per_iter`).
      num_warps: Triton warps per program (compiled GPU mode only).
      num_stages: Triton software-pipelining stages (compiled GPU mode only).
      target: "gpu" (Triton kernels), "tpu" (Mosaic kernels: float32 or bfloat16, block_size a multiple
        of 8 for float32 and of 16 for bfloat16), or "auto": "tpu" on a TPU backend, "gpu" otherwise.
      sliding_window: W, an int >= 1: the query (at position lengths[s] - 1) attends to the last W positions
        only. Each sequence's splits are cut over the window's pages; pages before it are never loaded.
      logits_soft_cap: c, a finite float > 0: scaled scores s become c * tanh(s / c) before the softmax.
      k_scales, v_scales: with 8-bit pages (and only then), `[num_kv_heads, num_blocks, block_size]` float32
        or bfloat16: the attended K/V are `pages.astype(float32) * scales[..., None]`, dequantized in
        registers after 8-bit loads (see `pallas_kernels.quant`).
      sinks: float32 `[num_q_heads]`, finite (gpt-oss's attention sinks): head h's softmax gets one more logit,
        sink[h], that takes weight and gives no value (see the module docstring). Joined into each query's (m, z,
        u) once, after the merge of its splits. An array input: new values recompile nothing.

    Returns:
      `[num_seqs, num_q_heads, head_dim]` in q's dtype; zeros for sequences of length 0 (with sinks too).

    Raises:
      ValueError: on malformed arguments or tuning values (shapes, dtypes, non-power-of-two tiles).
      TypeError: on an unknown keyword argument.
    """
    target = _resolve_target(target, interpret)
    num_seqs = q.shape[0] if getattr(q, "ndim", 0) == 3 else None
    _, head_dim, _, _, _, _ = V.validate_qkv(q, k_pages, v_pages, block_tables, num_q_rows=num_seqs)
    V.check_vector("lengths", lengths, num_seqs)
    sliding_window, logits_soft_cap, _ = V.validate_variants(
        k_pages, v_pages, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scales=k_scales,
        v_scales=v_scales)
    V.check_sinks(sinks, q.shape[1])
    scale = V.resolve_scale(scale, head_dim)
    V.check_positive_option("num_splits", num_splits)
    V.check_positive_int("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return paged_attention_tpu(q, k_pages, v_pages, block_tables, lengths, scale=scale, interpret=interpret,
                                   num_splits=num_splits, pages_per_iter=pages_per_iter,
                                   sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
    return paged_attention_gpu(q, k_pages, v_pages, block_tables, lengths, scale=scale, interpret=interpret,
                               num_splits=num_splits, pages_per_iter=pages_per_iter, num_warps=num_warps,
                               num_stages=num_stages, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, k_scales=k_scales, v_scales=v_scales, sinks=sinks)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
    block_q: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    target: str = "auto",
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    attend_until: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of ragged query chunks (prefill chunks and decode tokens) over a paged KV cache.

    Args:
      q: `[total_q_tokens, num_q_heads, head_dim]`, float32, bfloat16 or float16. Sequence s owns rows
        `cu_q_lens[s]:cu_q_lens[s + 1]`; rows at or past `cu_q_lens[-1]` are padding and get zeros.
      k_pages, v_pages: `[num_kv_heads, num_blocks, block_size, head_dim]` in q's dtype (or both int8 or
        both float8_e4m3fn with `k_scales`/`v_scales`), already holding the K/V of the new tokens.
        `num_q_heads % num_kv_heads == 0`; head_dim a multiple of 16, <= 256.
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`.
      kv_lens: int32 `[num_seqs]`: context length of each sequence *including* its query tokens (clipped
        to `[0, max_blocks_per_seq * block_size]`). Query i of sequence s sits at position
        `kv_lens[s] - q_len[s] + i` and attends to positions <= its own; earlier context (prefix-cached
        blocks included) is read through the block table.
      cu_q_lens: int32 `[num_seqs + 1]`, non-decreasing, cu_q_lens[0] = 0. Sequences with q_len 0
        (padding) are allowed.
      scale: multiplies q.k; defaults to `1 / sqrt(head_dim)`.
      interpret: run the Pallas interpreter; `None` = compiled on the target's own platform (GPU for "gpu",
        TPU for "tpu"), interpreted elsewhere. With target "tpu" it is Pallas's TPU interpret mode (DMAs
        and semaphores simulated); a `pltpu.InterpretParams` sets its options.
      block_q: query tokens per tile, a power of two; on GPU also `block_q * next_pow2(group) >= 16` (group =
        num_q_heads // num_kv_heads); `None` picks one from the mean query length (see `tiles.default_block_q`).
      pages_per_iter: pages gathered per inner-loop iteration. GPU: a power of two with
        `pages_per_iter * next_pow2(block_size) >= 16`; `None` = about 64 tokens per iteration. TPU: pages
        per double-buffered DMA chunk, any positive int; `None` = about 64 KiB of K per chunk.
      num_warps: Triton warps per program (compiled GPU mode only); `None` = 4, or 8 for tiles of 128 x 128
        accumulator elements and more (see `gpu.ragged_attention.default_num_warps`).
      num_stages: Triton software-pipelining stages (compiled GPU mode only).
      target: "gpu" (Triton kernels), "tpu" (Mosaic kernels: float32 or bfloat16, block_size a multiple
        of 8 for float32 and of 16 for bfloat16), or "auto": "tpu" on a TPU backend, "gpu" otherwise.
      sliding_window: W, an int >= 1: a query at position p attends to positions p - W < j <= p only. A
        tile starts its walk at the page of its first row's first visible position: pages before it are
        never loaded and their block-table entries never read (they may hold anything).
      logits_soft_cap: c, a finite float > 0: scaled scores s become c * tanh(s / c) before the softmax.
      k_scales, v_scales: with 8-bit pages (and only then), `[num_kv_heads, num_blocks, block_size]` float32
        or bfloat16: the attended K/V are `pages.astype(float32) * scales[..., None]`, dequantized in
        registers after 8-bit loads (see `pallas_kernels.quant`).
      attend_until: `None` (causal) or int32 `[total_q_tokens]`, a per-row upper bound on visible keys for
        bidirectional spans (Gemma 3 attends bidirectionally among the tokens of one image). Query row t of
        sequence s, at position p, attends to exactly the key positions j with
            j <= max(p, attend_until[t]),   j < kv_lens[s],   and with a window W also j > p - W,
        so a bound at or below p (-1, say) leaves a row causal, and a bound past the context reads nothing past
        kv_lens[s]. The window stays relative to the row's own position. For the tokens of an image at positions
        a..b give each row of it b: that is transformers' Gemma 3 mask (5.x), causal OR same-image on full-
        attention layers and window AND (causal OR same-image) on sliding ones (earlier releases OR'ed same-image
        onto causal-and-window: the same whenever the image is no longer than W). Only keys already in the cache
        are read (j < kv_lens[s]), so every row of an image must be in the call that writes its last key. A
        tile walks pages up to the largest bound of its rows; with every bound <= its row's position the result
        is bit-identical to `None`'s. The MLA and sparse variants take no bounds.
      sinks: float32 `[num_q_heads]`, finite: as for `paged_attention`, one more logit in every query row's
        softmax over the keys it sees (after the walk, before the division); a row that sees no key gets zeros.

    Returns:
      `[total_q_tokens, num_q_heads, head_dim]` in q's dtype.

    Raises:
      ValueError: on malformed arguments or tuning values (shapes, dtypes, non-power-of-two tiles).
      TypeError: on an unknown keyword argument.
    """
    target = _resolve_target(target, interpret)
    _, head_dim, _, _, _, _ = V.validate_qkv(q, k_pages, v_pages, block_tables)
    num_seqs = block_tables.shape[0]
    V.check_vector("kv_lens", kv_lens, num_seqs)
    V.check_vector("cu_q_lens", cu_q_lens, num_seqs + 1)
    sliding_window, logits_soft_cap, _ = V.validate_variants(
        k_pages, v_pages, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scales=k_scales,
        v_scales=v_scales)
    V.check_attend_until(attend_until, q.shape[0])
    V.check_sinks(sinks, q.shape[1])
    scale = V.resolve_scale(scale, head_dim)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return ragged_paged_attention_tpu(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scale=scale,
                                          interpret=interpret, block_q=block_q, pages_per_iter=pages_per_iter,
                                          sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                          attend_until=attend_until, sinks=sinks)
    return ragged_paged_attention_gpu(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scale=scale,
                                      interpret=interpret, block_q=block_q, pages_per_iter=pages_per_iter,
                                      num_warps=num_warps, num_stages=num_stages, sliding_window=sliding_window,
                                      logits_soft_cap=logits_soft_cap, k_scales=k_scales, v_scales=v_scales,
                                      attend_until=attend_until, sinks=sinks)


def mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    kv_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    num_splits: int | None = None,
    block_h: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Multi-head latent attention (MLA, DeepSeek V2/V3) decode, one query token per sequence, over a paged
    latent cache, with the up-projections absorbed by the caller.

    Head h's score against token t is `scale * (q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t])` and its output
    is `sum_t softmax_t c_kv[t]` (in latent space: the caller applies W_UV). q_latent = W_UK[h] q_nope[h].

    Args:
      q_latent: `[num_seqs, num_heads, R]` (R = kv_lora_rank, 512 in DeepSeek V3), float32, bfloat16 or
        float16.
      q_rope: `[num_seqs, num_heads, Dr]` (the rotary part, 64 in DeepSeek V3), q_latent's dtype.
      kv_pages: `[num_blocks, block_size, R + Dr]`: per token its latent c_kv, then its rotary key k_rope,
        shared by all heads. q's dtype, or int8 / float8_e4m3fn with `kv_scales`.
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`; entries past `cdiv(lengths[s], block_size)` are
        never read and may hold anything.
      lengths: int32 `[num_seqs]`: tokens cached per sequence (clipped to the table's capacity). Slots at or
        past the length are never read.
      scale: multiplies the scores, required (DeepSeek: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times
        the YaRN mscale^2 where used): a static Python float.
      kv_scales: with 8-bit pages (and only then), `[num_blocks, block_size]` float32 or bfloat16, one per
        token: the attended rows are `kv_pages.astype(float32) * kv_scales[..., None]` (`quant.quantize_kv`
        makes them), dequantized in the kernel.
      interpret: run the Pallas interpreter; `None` = compiled on the target's own platform, interpreted
        elsewhere (for "tpu": Pallas's TPU interpret mode; a `pltpu.InterpretParams` sets its options).
      target: "gpu" (Triton), "tpu" (Mosaic: float32 or bfloat16, block_size a multiple of 8 for float32 and
        of 16 for bfloat16, no 8-bit pages) or "auto": "tpu" on a TPU backend, "gpu" otherwise.
      num_splits: context splits per sequence (flash-decoding, merged exactly), a positive int; `None`: on GPU
        enough programs to fill it (`default_num_splits` over sequences x head blocks), on TPU 1.
      block_h: query heads per program; each program reads its sequence's pages once for all of them. GPU: a
        power of two >= 16 (tl.dot; padding heads are masked), `None` = all heads up to a float32 accumulator
        of 128 x 128 elements (32 heads at R = 512, see `gpu.mla.default_block_h`). TPU: any positive int,
        `None` = all heads.
      pages_per_iter: pages per inner-loop iteration (GPU: a power of two with `pages_per_iter *
        next_pow2(block_size) >= 16`; TPU: pages per double-buffered DMA chunk, any positive int); `None`
        sizes the tile from the latent width (`gpu._common.default_pages_per_iter` /
        `tpu._common.default_pages_per_iter`).
      num_warps: Triton warps per program (compiled GPU mode only); `None` = 4, or 8 for accumulators of
        128 x 128 float32 elements and more.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      `[num_seqs, num_heads, R]` in q's dtype; zeros for sequences of length 0.

    Raises:
      ValueError: on malformed arguments (ranks, R + Dr != kv_pages.shape[-1], dtypes, scales with float pages
        or none with 8-bit pages, non-int32 tables) or tuning values.
    """
    target = _resolve_target(target, interpret)
    num_seqs = q_latent.shape[0] if getattr(q_latent, "ndim", 0) == 3 else None
    V.validate_mla(q_latent, q_rope, kv_pages, block_tables, kv_scales, num_q_rows=num_seqs)
    V.check_vector("lengths", lengths, num_seqs)
    scale = V.check_mla_scale(scale)
    V.check_positive_option("num_splits", num_splits)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return mla_paged_attention_tpu(q_latent, q_rope, kv_pages, block_tables, lengths, scale=scale,
                                       interpret=interpret, num_splits=num_splits, block_h=block_h,
                                       pages_per_iter=pages_per_iter)
    return mla_paged_attention_gpu(q_latent, q_rope, kv_pages, block_tables, lengths, scale=scale,
                                   interpret=interpret, block_h=block_h, pages_per_iter=pages_per_iter,
                                   num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                                   kv_scales=kv_scales)


def ragged_mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    scale: float,
    kv_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    block_q: int | None = None,
    block_h: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Causal multi-head latent attention (MLA, absorbed) of ragged query chunks (prefill chunks and decode
    tokens of many sequences) over a paged latent cache; the conventions of `ragged_paged_attention` with the
    layout and scores of `mla_paged_attention`.

    Args:
      q_latent: `[total_q_tokens, num_heads, R]`, float32, bfloat16 or float16; sequence s owns rows
        `cu_q_lens[s]:cu_q_lens[s + 1]`, rows at or past `cu_q_lens[-1]` are padding and get zeros.
      q_rope: `[total_q_tokens, num_heads, Dr]`, q_latent's dtype.
      kv_pages: `[num_blocks, block_size, R + Dr]` (latent, then rope) in q's dtype or int8 / float8_e4m3fn
        with `kv_scales`, already holding the new tokens' rows.
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`.
      kv_lens: int32 `[num_seqs]`: context length of each sequence *including* its query tokens (clipped to
        the table's capacity). Query i of sequence s sits at position `kv_lens[s] - q_len[s] + i` and attends
        to positions <= its own.
      cu_q_lens: int32 `[num_seqs + 1]`, non-decreasing, cu_q_lens[0] = 0; sequences with q_len 0 are allowed.
      scale, kv_scales, interpret, target, block_h, pages_per_iter, num_warps, num_stages: as for
        `mla_paged_attention` (GPU block_h: a power of two with block_q * block_h >= 16).
      block_q: query tokens per tile, a power of two; `None` picks one from the mean query length, with
        block_q * block_h rows within the accumulator bound on GPU (`tiles.default_block_q`) and within 256
        rows on TPU.

    Returns:
      `[total_q_tokens, num_heads, R]` in q's dtype.

    Raises:
      ValueError: on malformed arguments or tuning values, as `mla_paged_attention`.
    """
    target = _resolve_target(target, interpret)
    V.validate_mla(q_latent, q_rope, kv_pages, block_tables, kv_scales)
    num_seqs = block_tables.shape[0]
    V.check_vector("kv_lens", kv_lens, num_seqs)
    V.check_vector("cu_q_lens", cu_q_lens, num_seqs + 1)
    scale = V.check_mla_scale(scale)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return ragged_mla_paged_attention_tpu(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens,
                                              scale=scale, interpret=interpret, block_q=block_q, block_h=block_h,
                                              pages_per_iter=pages_per_iter)
    return ragged_mla_paged_attention_gpu(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens,
                                          scale=scale, interpret=interpret, block_q=block_q, block_h=block_h,
                                          pages_per_iter=pages_per_iter, num_warps=num_warps,
                                          num_stages=num_stages, kv_scales=kv_scales)


def _indexer(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, *, scale, index_scales, interpret,
             target, block_q, pages_per_iter, num_warps, num_stages) -> jax.Array:
    """Validates an indexer call once (decode when cu_q_lens is None) and dispatches it."""
    target = _resolve_target(target, interpret)
    decode = cu_q_lens is None
    num_rows = q_index.shape[0] if decode and getattr(q_index, "ndim", 0) == 3 else None
    V.validate_indexer(q_index, weights, index_pages, block_tables, index_scales, num_q_rows=num_rows)
    if decode:
        V.check_vector("lengths", kv_lens, q_index.shape[0])
    else:
        V.check_vector("kv_lens", kv_lens, block_tables.shape[0])
        V.check_vector("cu_q_lens", cu_q_lens, block_tables.shape[0] + 1)
    scale = V.check_indexer_scale(scale)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return ragged_indexer_scores_tpu(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens,
                                         scale=scale, interpret=interpret, block_q=block_q,
                                         pages_per_iter=pages_per_iter)
    return ragged_indexer_scores_gpu(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, scale=scale,
                                     interpret=interpret, block_q=block_q, pages_per_iter=pages_per_iter,
                                     num_warps=num_warps, num_stages=num_stages, index_scales=index_scales)


def indexer_scores(
    q_index: jax.Array,
    weights: jax.Array,
    index_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    index_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """The lightning indexer of DeepSeek sparse attention (V3.2) for decode: one query row per sequence, at position
    lengths[s] - 1, scored against every cached indexer key of its sequence.

    `s[t] = scale * sum_h weights[s, h] * relu(q_index[s, h] . k_I[t])` for t < lengths[s], -inf elsewhere; k_I[t]
    is the indexer key of position t, read through the block table.

    Args:
      q_index: `[num_seqs, index_n_heads, index_head_dim]`, float32, bfloat16 or float16.
      weights: float32 `[num_seqs, index_n_heads]`, the per-head weights (DeepSeek V3.2: W_w x / sqrt(n_heads)).
      index_pages: `[num_blocks, block_size, index_head_dim]`: one key per token, shared by all indexer heads, in
        the latent pages' blocks (same block table); q_index's dtype, or int8 / float8_e4m3fn with `index_scales`.
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`; entries past `cdiv(lengths[s], block_size)` are never
        read and may hold anything.
      lengths: int32 `[num_seqs]`: tokens cached per sequence (clipped to the table's capacity); slots at or past
        the length are never read.
      scale: multiplies every score, required (DeepSeek V3.2: 1 / sqrt(index_head_dim)): a static Python float.
      index_scales: with 8-bit keys (and only then), `[num_blocks, block_size]` float32 or bfloat16, one per token:
        the keys are `index_pages.astype(float32) * index_scales[..., None]` (`quant.quantize_kv` makes them).
      interpret: run the Pallas interpreter; `None` = compiled on the target's own platform, interpreted elsewhere
        (for "tpu": Pallas's TPU interpret mode; a `pltpu.InterpretParams` sets its options).
      target: "gpu" (Triton), "tpu" (Mosaic: float32 or bfloat16, block_size a multiple of 8 for float32 and of
        16 for bfloat16, no 8-bit keys) or "auto": "tpu" on a TPU backend, "gpu" otherwise.
      pages_per_iter: pages per program (the grid is sequences x chunks of pages). GPU: a power of two with
        `pages_per_iter * next_pow2(block_size) >= 16`; TPU: any positive int. `None` sizes the chunk from
        index_head_dim (`gpu._common.default_pages_per_iter` / `tpu._common.default_pages_per_iter`).
      num_warps: Triton warps per program (compiled GPU mode only); `None` = 4.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      float32 `[num_seqs, max_blocks_per_seq * block_size]`: each row's scores over its table's positions, -inf
      where it sees nothing. 4 bytes per (row, position): 32 MiB for 512 rows over a 16k context, the scale of the
      engine's steps; `top_k_positions` selects on it.

    Raises:
      ValueError: on malformed arguments (ranks, weights' shape or dtype, index_head_dim mismatch, scales with
        float keys or none with 8-bit keys, non-int32 tables) or tuning values.
    """
    return _indexer(q_index, weights, index_pages, block_tables, lengths, None, scale=scale,
                    index_scales=index_scales, interpret=interpret, target=target, block_q=None,
                    pages_per_iter=pages_per_iter, num_warps=num_warps, num_stages=num_stages)


def ragged_indexer_scores(
    q_index: jax.Array,
    weights: jax.Array,
    index_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    scale: float,
    index_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    block_q: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """The lightning indexer of DeepSeek sparse attention (V3.2) for ragged query chunks (prefill chunks and decode
    tokens), causal; the conventions of `ragged_mla_paged_attention` with the scores of `indexer_scores`.

    Args:
      q_index: `[total_q_tokens, index_n_heads, index_head_dim]`; sequence s owns rows `cu_q_lens[s]:cu_q_lens[s +
        1]`; rows at or past `cu_q_lens[-1]` are padding (all -inf).
      weights: float32 `[total_q_tokens, index_n_heads]`.
      index_pages, index_scales, block_tables, scale, interpret, target, pages_per_iter, num_warps, num_stages: as
        for `indexer_scores`.
      kv_lens: int32 `[num_seqs]`: context length of each sequence *including* its query tokens (clipped to the
        table's capacity). Query i of sequence s sits at position `kv_lens[s] - q_len[s] + i` and scores the
        positions <= its own.
      cu_q_lens: int32 `[num_seqs + 1]`, non-decreasing, cu_q_lens[0] = 0; sequences with q_len 0 are allowed.
      block_q: query tokens per program (each program reads its chunk of keys once for all of them), a power of
        two; `None` = the mean query length rounded up to a power of two, at most 128 / next_pow2(index_n_heads)
        on GPU (`tiles.default_block_q`) and 256 / index_n_heads on TPU (`tpu.sparse.default_block_q`).

    Returns:
      float32 `[total_q_tokens, max_blocks_per_seq * block_size]`, -inf where a row sees nothing.

    Raises:
      ValueError: on malformed arguments or tuning values, as `indexer_scores`.
    """
    return _indexer(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, scale=scale,
                    index_scales=index_scales, interpret=interpret, target=target, block_q=block_q,
                    pages_per_iter=pages_per_iter, num_warps=num_warps, num_stages=num_stages)


def _sparse(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, *, scale, kv_scales, interpret,
            target, block_h, block_k, num_splits, num_warps, num_stages) -> jax.Array:
    """Validates a sparse MLA call once (decode when cu_q_lens is None), turns the selected positions into physical
    slots through the block table, and dispatches."""
    target = _resolve_target(target, interpret)
    decode = cu_q_lens is None
    num_rows = q_latent.shape[0] if decode and getattr(q_latent, "ndim", 0) == 3 else None
    V.validate_mla(q_latent, q_rope, kv_pages, block_tables, kv_scales, num_q_rows=num_rows)
    if decode:
        V.check_vector("lengths", kv_lens, q_latent.shape[0])
    else:
        V.check_vector("kv_lens", kv_lens, block_tables.shape[0])
        V.check_vector("cu_q_lens", cu_q_lens, block_tables.shape[0] + 1)
    V.validate_selection(indices, q_latent.shape[0])
    scale = V.check_mla_scale(scale)
    V.check_positive_option("num_splits", num_splits)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if 0 in (q_latent.shape[0], *block_tables.shape, kv_pages.shape[0]):  # nothing selectable: all zeros
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    slots = sparse_slots(indices, block_tables, kv_lens, cu_q_lens, block_size=kv_pages.shape[1])
    if target == "tpu":
        return sparse_mla_attention_tpu(q_latent, q_rope, kv_pages, slots, scale=scale, interpret=interpret,
                                        block_h=block_h, block_k=block_k, num_splits=num_splits)
    return sparse_mla_attention_gpu(q_latent, q_rope, kv_pages, slots, scale=scale, interpret=interpret,
                                    block_h=block_h, block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                                    num_stages=num_stages, kv_scales=kv_scales)


def sparse_mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    indices: jax.Array,
    *,
    scale: float,
    kv_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    block_h: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Sparse multi-head latent attention (DeepSeek V3.2) for decode: the absorbed MLA of `mla_paged_attention`
    over exactly the positions each sequence's query selected.

    Args:
      q_latent, q_rope, kv_pages, kv_scales, block_tables, lengths, scale: as for `mla_paged_attention`.
      indices: int32 `[num_seqs, top_k]`: the positions each query attends to (`top_k_positions` of the indexer's
        scores), -1 for none. Position p is read at block_tables[s, p // block_size], offset p % block_size; an
        entry the query does not see (negative, or >= lengths[s]) selects nothing. The selected positions of a row
        must be distinct (top-k's are): a repeated one would be counted twice.
      interpret, target: as for `mla_paged_attention` (TPU: float32 or bfloat16, any block_size, no 8-bit pages).
      block_h: query heads per program (each program gathers its row's selected page rows once for all of them).
        GPU: a power of two >= 16 (tl.dot; padding heads are masked), `None` = all heads up to a float32
        accumulator of 128 x 128 elements (`gpu.mla.default_block_h`). TPU: any positive int, `None` = all heads.
      block_k: selected positions gathered per step. GPU: a power of two >= 16, `None` = 64
        (`gpu.sparse.DEFAULT_BLOCK_K`); TPU: any positive int (one row DMA each, double-buffered), `None` = 128.
      num_splits: splits of each row's selection (flash-decoding: each split walks its share of the top_k / block_k
        steps, partials merged exactly), a positive int (at most the step count is used); `None`: on GPU enough
        programs to fill it (`default_num_splits` over rows x head blocks), on TPU 1.
      num_warps: Triton warps per program (compiled GPU mode only); `None` = 4, or 8 for accumulators of
        128 x 128 float32 elements and more.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      `[num_seqs, num_heads, R]` in q's dtype; zeros for a query that selects nothing (never NaN).

    Raises:
      ValueError: on malformed arguments (those of `mla_paged_attention`, indices not int32 `[num_seqs, top_k]`
        with top_k >= 1) or tuning values.
    """
    return _sparse(q_latent, q_rope, kv_pages, block_tables, lengths, None, indices, scale=scale,
                   kv_scales=kv_scales, interpret=interpret, target=target, block_h=block_h, block_k=block_k,
                   num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


def ragged_sparse_mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    indices: jax.Array,
    *,
    scale: float,
    kv_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    block_h: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Sparse multi-head latent attention (DeepSeek V3.2) of ragged query chunks: the absorbed MLA of
    `ragged_mla_paged_attention` with each query row attending to exactly its selected positions.

    Args:
      q_latent, q_rope, kv_pages, kv_scales, block_tables, kv_lens, cu_q_lens, scale: as for
        `ragged_mla_paged_attention` (query i of sequence s at position kv_lens[s] - q_len[s] + i; rows past
        cu_q_lens[-1] are padding and get zeros).
      indices: int32 `[total_q_tokens, top_k]`, -1 for none; an entry the row does not see (negative, past its
        position or >= kv_lens[s]) selects nothing. Distinct per row, as for `sparse_mla_paged_attention`.
      interpret, target, block_h, block_k, num_splits, num_warps, num_stages: as for
        `sparse_mla_paged_attention`.

    Returns:
      `[total_q_tokens, num_heads, R]` in q's dtype; zeros for rows selecting nothing. With every visible position
      selected (index_topk >= the context) it equals `ragged_mla_paged_attention`.

    Raises:
      ValueError: on malformed arguments or tuning values, as `sparse_mla_paged_attention`.
    """
    return _sparse(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, scale=scale,
                   kv_scales=kv_scales, interpret=interpret, target=target, block_h=block_h, block_k=block_k,
                   num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


# ---- recurrent-state layers ------------------------------------------------------------------------------------


def _tpu_has_no(name: str, value) -> None:
    if value is not None:
        raise ValueError(f"{name} tiles the GPU kernels' state columns; target 'tpu' keeps whole states in VMEM "
                         f"(leave {name} None)")


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    block_size: int,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    form: str | None = None,
    chunk_size: int = 64,
    block_v: int | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    num_warps: int | None = None,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule (Qwen3-Next / Qwen3.5 linear attention) of a ragged step over paged state snapshots.

    Per v head h (q/k head h // (Hv / Hk)), with state S `[Dk, Dv]` float32 and q, k L2-normalised, q scaled: S <-
    exp(g_t) S; u = beta_t (v_t - S^T k_t); S <- S + k_t u^T; o_t = S^T q_t (transformers'
    `torch_recurrent_gated_delta_rule`; the chunked form is its `torch_chunk_gated_delta_rule`, with pairwise decays
    summed as segments). Sequence s's rows `cu_q_lens[s]:cu_q_lens[s + 1]` sit at positions kv_lens[s] - q_len_s ...
    kv_lens[s] - 1; its initial state is read from the block of position start - 1 (zeros at position 0) and the
    state after every position that ends a block, and after its last row, is written to that position's block
    (`pallas_kernels.recurrent`'s contract: nothing else is read or written).

    Args:
      q, k: `[T, Hk, Dk]`, float32, bfloat16 or float16 (one dtype with v).
      v: `[T, Hv, Dv]`, Hv a multiple of Hk: each q/k head serves Hv / Hk consecutive v heads.
      g: float32 `[T, Hv]`, the log decay (<= 0: transformers' -exp(A_log) * softplus(a + dt_bias)).
      beta: float32 `[T, Hv]` (transformers' sigmoid(b)).
      state_pages: float32 `[num_blocks, Hv, Dk, Dv]`, one state per block; updated and returned (aliased: under
        jit with the pages donated, in place).
      block_tables: int32 `[S, max_blocks_per_seq]`; entries past a sequence's needs are never read.
      kv_lens: int32 `[S]`: positions after the step, 0 <= q_len_s <= kv_lens[s] <= max_blocks_per_seq * block_size.
      cu_q_lens: int32 `[S + 1]`, non-decreasing from 0; sequences with q_len 0 read and write nothing, rows past
        cu_q_lens[-1] are padding (zeros out).
      block_size: tokens per block of the block tables (a Python int: the pages hold one state per block).
      use_qk_l2norm: L2-normalise q and k per head (`x * rsqrt(sum(x^2) + 1e-6)`, in float32), as Qwen3-Next does.
      scale: multiplies q; defaults to Dk^-0.5.
      form: "chunked" (pieces of chunk_size rows and matmuls: prefill), "recurrent" (token by token: decode), or
        None: "recurrent" when T <= S (decode-shaped steps), else "chunked". Both compute the same function.
      chunk_size: rows per chunk of the chunked form; a chunk never crosses a block boundary (pieces end at
        multiples of chunk_size and of block_size), so block_size a multiple of chunk_size adds no pieces. GPU: a
        power of two >= 16; TPU: a multiple of 8 (decode-shaped steps run pieces of 8 rows).
      block_v: GPU only, state columns (of Dv) per program, a power of two (>= 16 for the chunked form); None: 8
        recurrent, 32 chunked (`gpu.recurrent.default_block`).
      interpret, target: as for `ragged_paged_attention` (TPU: float32 or bfloat16 inputs).
      num_warps: Triton warps per program (compiled GPU mode only); None: 1 recurrent, 4 chunked.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      (out `[T, Hv, Dv]` in q's dtype, state_pages).

    Raises:
      ValueError: on malformed arguments (shapes, dtypes, heads, block_size) or tuning values.
    """
    target = _resolve_target(target, interpret)
    block_size, scale = V.validate_gated_delta_rule(
        q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
        use_qk_l2norm=use_qk_l2norm, scale=scale, form=form, chunk_size=chunk_size)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    form = form or default_form(q.shape[0], block_tables.shape[0])
    args = (q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens)
    common = dict(block_size=block_size, use_qk_l2norm=use_qk_l2norm, scale=scale, form=form, chunk_size=chunk_size,
                  interpret=interpret)
    if target == "tpu":
        _tpu_has_no("block_v", block_v)
        return gated_delta_rule_tpu(*args, **common)
    return gated_delta_rule_gpu(*args, block_v=block_v, num_warps=num_warps, num_stages=num_stages, **common)


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    conv_state_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    block_size: int,
    bias: jax.Array | None = None,
    activation: str | None = None,
    block_t: int | None = None,
    block_c: int | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    num_warps: int | None = None,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise conv1d of a ragged step (the short convolution before Qwen3-Next's delta rule and
    Mamba-2's scan) over paged conv states.

    Per channel c: out_t = act(bias[c] + sum_i weight[c, i] x_{t-K+1+i}), inputs before a sequence's position 0
    being zeros (transformers' `causal_conv1d_fn` / `causal_conv1d_update`). The conv state after position p is the
    last K - 1 inputs `[x_{p-K+2}, ..., x_p]` (`[C, K - 1]`, oldest first); it is read and written under
    `pallas_kernels.recurrent`'s contract, as `gated_delta_rule`'s state.

    Args:
      x: `[T, C]`, float32, bfloat16 or float16.
      weight: `[C, K]`, K >= 2 (transformers' `conv1d.weight.squeeze(1)`), a float dtype.
      conv_state_pages: `[num_blocks, C, K - 1]` in x's dtype (they hold inputs), one state per block; updated and
        returned (aliased).
      block_tables, kv_lens, cu_q_lens, block_size, interpret, target: as for `gated_delta_rule` (TPU: float32 or
        bfloat16 x).
      bias: `[C]` or None, a float dtype.
      activation: None or "silu" (Qwen3-Next and Nemotron-H use "silu").
      block_t: rows per program (a piece never crosses a block boundary). GPU: a power of two, None = 32; TPU: a
        multiple of 8, None = 64.
      block_c: channels per program. GPU: a power of two, None = min(128, next_pow2(C)); TPU: a multiple of 128
        dividing C, or C; None = `tpu.recurrent.default_block_c`.
      num_warps: Triton warps per program (compiled GPU mode only), None = 4.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      (out `[T, C]` in x's dtype, computed in float32, conv_state_pages).

    Raises:
      ValueError: on malformed arguments (shapes, dtypes, K < 2, the pages' dtype, the activation) or tuning values.
    """
    target = _resolve_target(target, interpret)
    block_size = V.validate_causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens,
                                          block_size=block_size, activation=activation, activations=CONV_ACTIVATIONS)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    args = (x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens)
    common = dict(block_size=block_size, activation=activation, block_t=block_t, block_c=block_c,
                  interpret=interpret)
    if target == "tpu":
        return causal_conv1d_tpu(*args, **common)
    return causal_conv1d_gpu(*args, num_warps=num_warps, num_stages=num_stages, **common)


def mamba2_ssd(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    state_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    block_size: int,
    D: jax.Array | None = None,
    form: str | None = None,
    chunk_size: int = 64,
    block_p: int | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    num_warps: int | None = None,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """Mamba-2's SSD scan (Nemotron-H's mixer) of a ragged step over paged state snapshots.

    Per head h (B/C group h // (H / G)), with state S `[P, N]` float32: S <- exp(dt_t A_h) S + dt_t x_t B_t^T;
    y_t = S C_t + D_h x_t (transformers' `mamba2_selective_state_update`; the chunked form is `mamba2_chunk_scan`'s
    sum). States are read and written under `pallas_kernels.recurrent`'s contract, as `gated_delta_rule`'s.

    Args:
      x: `[T, H, P]`, float32, bfloat16 or float16.
      dt: float32 `[T, H]`: the time step as the scan uses it, after the caller's bias, softplus and clamp
        (transformers: `clamp(softplus(dt + dt_bias), *time_step_limit)`).
      A: float32 `[H]` (transformers' -exp(A_log)).
      B, C: `[T, G, N]` in x's dtype, H a multiple of G.
      state_pages: float32 `[num_blocks, H, P, N]`; updated and returned (aliased).
      block_tables, kv_lens, cu_q_lens, block_size, form, chunk_size, interpret, target, num_warps, num_stages: as
        for `gated_delta_rule` (the gate z and the norm after the scan are the caller's).
      D: float32 `[H]` or None: the skip connection D_h x_t.
      block_p: GPU only, state rows (of P) per program, a power of two (>= 16 for the chunked form); None: 8
        recurrent, 32 chunked.

    Returns:
      (y `[T, H, P]` in x's dtype, state_pages).

    Raises:
      ValueError: on malformed arguments (shapes, dtypes, groups, block_size) or tuning values.
    """
    target = _resolve_target(target, interpret)
    block_size = V.validate_mamba2_ssd(x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens,
                                       block_size=block_size, form=form, chunk_size=chunk_size)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    form = form or default_form(x.shape[0], block_tables.shape[0])
    args = (x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens)
    common = dict(block_size=block_size, form=form, chunk_size=chunk_size, interpret=interpret)
    if target == "tpu":
        _tpu_has_no("block_p", block_p)
        return mamba2_ssd_tpu(*args, **common)
    return mamba2_ssd_gpu(*args, block_p=block_p, num_warps=num_warps, num_stages=num_stages, **common)
