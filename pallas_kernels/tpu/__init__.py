"""Paged-attention kernels for TPUs in Pallas Mosaic: the GPU kernels' TPU counterparts, kept in their own
package because their programming model differs (explicit HBM -> VMEM DMAs, scalar prefetch into SMEM,
(8, 128) tiling, a sequential grid per TensorCore); they share the platform-free validation (`_validate`),
tile metadata (`tiles`), reference and exact merge with the GPU kernels, and import nothing from `gpu`.

Reached through `pallas_kernels.paged_attention(..., target="tpu")` and
`pallas_kernels.ragged_paged_attention(..., target="tpu")` (target "auto" picks them on a TPU backend);
the MLA kernel (`mla`), the DeepSeek sparse attention kernels (`sparse`) and the recurrent-state layers
(`recurrent`: gated delta rule, Mamba-2 SSD, causal conv1d) likewise; `interpret=True` runs
them on any machine in Pallas's TPU interpret mode, which simulates HBM, VMEM, SMEM,
DMAs and semaphores. `_common` states the layout rules, `page_chunks` the double-buffered DMAs.

Variants: sliding windows (a program's DMAs start at the first page any of its queries can see: pages before
the window are never copied) and logit soft-capping. 8-bit (quantized) pages are not supported on TPU: the
entry points raise a ValueError for target "tpu" (no fallback).

Limits: float32 and bfloat16 only; block_size a multiple of 8 (float32) or 16 (bfloat16); the block tables
are scalar-prefetched into SMEM whole (flattened, num_seqs * max_blocks_per_seq int32 entries), and SMEM is
far smaller than VMEM. Tested in interpret mode and by exporting for platform "tpu"; not yet compiled or
timed on a TPU.
"""
