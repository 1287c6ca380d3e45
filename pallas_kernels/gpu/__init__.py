"""Paged-attention kernels for NVIDIA GPUs in Pallas, compiled through Triton: the decode kernel
(`paged_attention`) and the ragged prefill/decode kernel (`ragged_attention`), the MLA kernel (`mla`), the DeepSeek
sparse attention kernels (`sparse`: indexer scores, sparse MLA), the recurrent-state layers (`recurrent`: the gated
delta rule, Mamba-2's SSD scan, the causal conv1d, over paged state snapshots), with their private helpers
(`_common`: masked page-tile gathers through the block table, the online-softmax step).

Reached through `pallas_kernels.paged_attention(..., target="gpu")` and
`pallas_kernels.ragged_paged_attention(..., target="gpu")` (target "auto" picks them on any backend but a
TPU); with `interpret=True` (the default off a GPU) they run in the Pallas interpreter, on any machine.
"""
