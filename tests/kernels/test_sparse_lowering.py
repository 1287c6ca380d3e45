"""The DeepSeek sparse attention kernels lower for their platforms, proven on a CPU-only machine with jax.export:
the GPU kernels to Triton ("cuda"), the TPU kernels to Mosaic ("tpu"), at DeepSeek V3.2's shapes (64 indexer heads
of 128 dims; MLA with R = 512, Dr = 64, 16 and 128 heads; index_topk 2048) in bfloat16 and float32, and on GPU
with 8-bit indexer keys and latent pages."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (
    indexer_scores,
    ragged_indexer_scores,
    ragged_sparse_mla_paged_attention,
    sparse_mla_paged_attention,
)
from tests.kernels.test_lowering import TRITON_CALL, _export_cuda
from tests.kernels.test_tpu_lowering import TPU_CALL, export_tpu, full_precision, mosaic_modules

pytestmark = pytest.mark.kernels

SCALE = 1.0 / (192 ** 0.5)
INDEX_SCALE = 1.0 / (128 ** 0.5)


def _shapes(dtype, num_heads, block_size, *, page_dtype=None, scale_dtype=jnp.float32, top_k=2048, num_seqs=4,
            num_tokens=37, num_blocks=64, max_blocks=8):
    f = jax.ShapeDtypeStruct
    page_dtype = page_dtype or dtype
    per_row = lambda rows: dict(  # noqa: E731
        q_index=f((rows, 64, 128), dtype), weights=f((rows, 64), jnp.float32), q=f((rows, num_heads, 512), dtype),
        q_rope=f((rows, num_heads, 64), dtype), indices=f((rows, top_k), jnp.int32))
    return dict(decode=per_row(num_seqs), ragged=per_row(num_tokens),
                index=f((num_blocks, block_size, 128), page_dtype), kv=f((num_blocks, block_size, 576), page_dtype),
                scales=f((num_blocks, block_size), scale_dtype), tables=f((num_seqs, max_blocks), jnp.int32),
                lens=f((num_seqs,), jnp.int32), cu=f((num_seqs + 1,), jnp.int32))


def _export_all(export, s, quantized: bool = False, index_kw=None, sparse_kw=None, **kw):
    """Exports the decode and ragged indexer and sparse MLA with `export` (in that order; `index_kw` / `sparse_kw`:
    tuning of one kind only); returns the exported modules."""
    kw = dict(kw, interpret=False)
    index_kw, sparse_kw = dict(kw, **(index_kw or {})), dict(kw, **(sparse_kw or {}))
    out = []
    for batch in ("decode", "ragged"):
        r = s[batch]
        meta = (s["tables"], s["lens"]) if batch == "decode" else (s["tables"], s["lens"], s["cu"])
        score_fn = indexer_scores if batch == "decode" else ragged_indexer_scores
        sparse_fn = sparse_mla_paged_attention if batch == "decode" else ragged_sparse_mla_paged_attention
        if quantized:
            score = lambda *a, fn=score_fn: fn(*a[:-1], scale=INDEX_SCALE, index_scales=a[-1], **index_kw)  # noqa: E731
            sparse = lambda *a, fn=sparse_fn: fn(*a[:-1], scale=SCALE, kv_scales=a[-1], **sparse_kw)  # noqa: E731
            extra = (s["scales"],)
        else:
            score = functools.partial(score_fn, scale=INDEX_SCALE, **index_kw)
            sparse = functools.partial(sparse_fn, scale=SCALE, **sparse_kw)
            extra = ()
        out.append(export(score, r["q_index"], r["weights"], s["index"], *meta, *extra))
        out.append(export(sparse, r["q"], r["q_rope"], s["kv"], *meta, r["indices"], *extra))
    return out


CONFIGS = [(jnp.bfloat16, 128, 64), (jnp.float32, 16, 16)]
IDS = [f"{jnp.dtype(d).name}-{h}heads-bs{b}" for d, h, b in CONFIGS]


@pytest.mark.parametrize("dtype,num_heads,block_size", CONFIGS, ids=IDS)
def test_gpu_kernels_lower_to_triton_at_deepseek_v32_shapes(dtype, num_heads, block_size):
    names = [exported.mlir_module() for exported in _export_all(_export_cuda, _shapes(dtype, num_heads, block_size),
                                                               target="gpu")]
    assert all(text.count(TRITON_CALL) >= 1 for text in names)
    assert "indexer_scores_q1_" in names[0] and "sparse_mla_attention_h" in names[1]


@pytest.mark.parametrize("page_dtype,scale_dtype,q_dtype", [(jnp.int8, jnp.float32, jnp.bfloat16),
                                                             (jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32)],
                         ids=["int8-f32scales-bf16", "fp8-bf16scales-f32"])
def test_gpu_kernels_lower_to_triton_with_8bit_pages(page_dtype, scale_dtype, q_dtype):
    s = _shapes(q_dtype, 16, 64, page_dtype=page_dtype, scale_dtype=scale_dtype)
    for exported in _export_all(_export_cuda, s, quantized=True, target="gpu"):
        # The kernel's name carries the page dtype (profiles tell the variants apart).
        assert re.search(rf"(indexer_scores|sparse_mla_attention)_\w+_{jnp.dtype(page_dtype).name}",
                         exported.mlir_module())


@pytest.mark.parametrize("dtype,num_heads,block_size", CONFIGS, ids=IDS)
def test_tpu_kernels_lower_to_mosaic_at_deepseek_v32_shapes(dtype, num_heads, block_size):
    for exported in _export_all(export_tpu, _shapes(dtype, num_heads, block_size), target="tpu"):
        assert TPU_CALL in exported.mlir_module()


def test_gpu_decode_splits_the_selection():
    """4 sequences x 4 head blocks (128 heads, 32 per program) are too few programs for a GPU: the default splits
    each row's 2048 selected slots (32 steps of 64)."""
    s = _shapes(jnp.bfloat16, 128, 64)
    r = s["decode"]
    fn = functools.partial(sparse_mla_paged_attention, scale=SCALE, target="gpu", interpret=False)
    text = _export_cuda(fn, r["q"], r["q_rope"], s["kv"], s["tables"], s["lens"], r["indices"]).mlir_module()
    assert "sparse_mla_attention_h32_k64_s" in text and "sparse_mla_attention_h32_k64_s1_" not in text


def test_tpu_mosaic_module_structure():
    """Indexer: the keys stay in HBM, whole pages DMA'd into double-buffered VMEM chunks, float32 matmuls at full
    precision for the head sum. Sparse MLA: the slot list copied into SMEM, one row DMA per selected slot into a
    double-buffered [2, block_k, 576] VMEM buffer, every grid dimension parallel."""
    s = _shapes(jnp.bfloat16, 16, 16)
    score, sparse = _export_all(export_tpu, s, target="tpu", index_kw=dict(pages_per_iter=2),
                                 sparse_kw=dict(block_k=128, num_splits=2))[2:]
    (text,) = mosaic_modules(score)
    assert "memref<64x16x128xbf16, #tpu.memory_space<any>>" in text
    assert "memref<2x32x128xbf16, #tpu.memory_space<vmem>>" in text  # 2 slots x 2 pages x 16 tokens
    assert "tpu.enqueue_dma" in text and "tpu.wait_dma" in text
    assert text.count("#tpu.dimension_semantics<parallel>") == 2
    assert any(full_precision(line) for line in text.splitlines() if "tpu.matmul" in line)
    (text,) = mosaic_modules(sparse)
    assert "memref<2048xi32, #tpu.memory_space<smem>>" in text  # the row's slots
    assert "memref<64x16x576xbf16, #tpu.memory_space<any>>" in text  # the latent pages stay in HBM
    assert "memref<2x128x576xbf16, #tpu.memory_space<vmem>>" in text
    assert text.count("#tpu.dimension_semantics<parallel>") == 3  # rows, head blocks, splits


def test_interpret_none_is_interpreted_on_cpu():
    if jax.default_backend() in ("gpu", "tpu"):
        pytest.skip("on an accelerator interpret=None compiles")
    s = _shapes(jnp.float32, 4, 16, top_k=16)
    r = s["decode"]
    for target, call in (("gpu", TRITON_CALL), ("tpu", TPU_CALL)):
        fn = functools.partial(indexer_scores, scale=INDEX_SCALE, target=target)
        assert call not in jax.jit(fn).lower(r["q_index"], r["weights"], s["index"], s["tables"], s["lens"]).as_text()
        fn = functools.partial(sparse_mla_paged_attention, scale=SCALE, target=target)
        assert call not in jax.jit(fn).lower(r["q"], r["q_rope"], s["kv"], s["tables"], s["lens"],
                                             r["indices"]).as_text()
