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
Entries, references, XLA paths and the non-absorbed oracle in `mla`; kernels in `gpu.mla` and `tpu.mla`.
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
Entries, references and XLA paths in `sparse`; kernels in `gpu.sparse` and `tpu.sparse`; the selection in `topk`.
DeepSeek V4's compressed attention (`compressed`: layouts and math there) over a window of K = V vectors
`[num_blocks, block_size, D]` and compressed entries `[num_blocks, block_size / m, D]`:

    compressed_attention(q, window_pages, window_tables, entry_pages, entry_tables, kv_lens, cu_q_lens, selected,
                         sinks, scale=..., sliding_window=..., compress_rate=...)   `gpu.compressed`; TPU: `tpu.sparse`
    compress(kv, gate, state_pages, block_tables, kv_lens, cu_q_lens, compress_rate=..., block_size=...)
        -> (entries, closes, state_pages): the compressor (`compressor`), one Pallas kernel for both targets
    compressed_index_scores(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, ...)  V3.2's indexer
with XLA paths and dense references beside them.

Recurrent-state layers (Qwen3-Next / Qwen3.5's gated DeltaNet, Mamba-2 hybrids such as Nemotron-H) over paged
state snapshots, one state per block (`[num_blocks, *state_shape]`), read and written through the block tables under
`recurrent`'s contract (the initial state from the block before a sequence's first position, a snapshot after every
block's last position and after the step's last token); each returns (out, pages) with the pages updated in place:

    gated_delta_rule(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, block_size=...)
    causal_conv1d(x, weight, conv_state_pages, block_tables, kv_lens, cu_q_lens, block_size=...)
    mamba2_ssd(x, dt, A, B, C, state_pages, block_tables, kv_lens, cu_q_lens, block_size=...)
Entries, float64 references and XLA paths in `recurrent`; kernels in `gpu.recurrent` and `tpu.recurrent`.

One module per kind (`paged`, `mla`, `sparse`, `recurrent`, `compressed`, `compressor`) holds its entry points, its
argument checks, its dense references and its XLA paths; this package re-exports their public names. An entry point
checks the arguments once (the shared checks in `_validate`), picks the kernel family (`dispatch`) and calls `gpu` or
`tpu`, which check their own tile rules and share the tile arithmetic in `tiles` (and never import each other; the
compressor's element-wise kernel body is one for both targets, its pallas_call beside it); `merge` is the exact
(m, z, u) merge. This package imports nothing from pagedjax.

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

from pallas_kernels.compressed import (
    compressed_attention,
    compressed_attention_reference,
    compressed_attention_xla,
    compressed_index_scores,
    compressed_index_scores_xla,
)
from pallas_kernels.compressor import compress, compress_reference, compress_xla
from pallas_kernels.gpu.paged_attention import default_num_splits
from pallas_kernels.merge import Partial, finalize, join_sink, merge_and_finalize, merge_partials, merge_two
from pallas_kernels.mla import (
    mla_attention_dense_reference,
    mla_paged_attention,
    mla_paged_attention_reference,
    mla_paged_attention_xla,
    ragged_mla_paged_attention,
    ragged_mla_paged_attention_reference,
    ragged_mla_paged_attention_xla,
)
from pallas_kernels.paged import (
    paged_attention,
    paged_attention_reference,
    paged_attention_xla,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)
from pallas_kernels.quant import dequantize_kv, quantize_kv
from pallas_kernels.recurrent import (
    causal_conv1d,
    causal_conv1d_reference,
    causal_conv1d_xla,
    gated_delta_rule,
    gated_delta_rule_reference,
    gated_delta_rule_xla,
    mamba2_ssd,
    mamba2_ssd_reference,
    mamba2_ssd_xla,
)
from pallas_kernels.sparse import (
    indexer_scores,
    indexer_scores_reference,
    indexer_scores_xla,
    ragged_indexer_scores,
    ragged_indexer_scores_reference,
    ragged_indexer_scores_xla,
    ragged_sparse_mla_paged_attention,
    ragged_sparse_mla_paged_attention_reference,
    ragged_sparse_mla_paged_attention_xla,
    sparse_mla_paged_attention,
    sparse_mla_paged_attention_reference,
    sparse_mla_paged_attention_xla,
)
from pallas_kernels.topk import top_k_positions, top_k_positions_and_ties

__all__ = [
    "Partial",
    "causal_conv1d",
    "causal_conv1d_reference",
    "causal_conv1d_xla",
    "compress",
    "compress_reference",
    "compress_xla",
    "compressed_attention",
    "compressed_attention_reference",
    "compressed_attention_xla",
    "compressed_index_scores",
    "compressed_index_scores_xla",
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
