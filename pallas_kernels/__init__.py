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
    float16 and sets the output dtype. `quantize_kv` / `dequantize_kv` (module `quant`) make and read them.
`reference` holds the dense float32 oracles and an XLA gather path; `merge` the exact (m, z, u) merge.
This package imports nothing from pagedjax.

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

from pallas_kernels.gpu.paged_attention import default_num_splits, paged_attention
from pallas_kernels.gpu.ragged_attention import ragged_paged_attention
from pallas_kernels.merge import Partial, finalize, merge_and_finalize, merge_partials, merge_two
from pallas_kernels.quant import dequantize_kv, quantize_kv
from pallas_kernels.reference import (
    paged_attention_reference,
    paged_attention_xla,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
)

__all__ = [
    "Partial",
    "default_num_splits",
    "dequantize_kv",
    "finalize",
    "merge_and_finalize",
    "merge_partials",
    "merge_two",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_xla",
    "quantize_kv",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
]
