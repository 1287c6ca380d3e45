"""The MLA kernels lower for their platforms, proven on a CPU-only machine with jax.export: the GPU kernels to
Triton ("cuda"), the TPU kernels to Mosaic ("tpu"), at DeepSeek V3's shapes (R = 512, Dr = 64: a 576-wide
page row, no power of two) with 16 and 128 heads, blocks of 16 and 64 tokens, bfloat16 and float32, and on
GPU 8-bit pages (int8 and float8_e4m3fn, float32 and bfloat16 scales)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import mla_paged_attention, ragged_mla_paged_attention
from tests.kernels.test_lowering import TRITON_CALL, _export_cuda
from tests.kernels.test_tpu_lowering import TPU_CALL, export_tpu, full_precision, mosaic_modules

pytestmark = pytest.mark.kernels

SCALE = 1.0 / (192 ** 0.5)  # DeepSeek V3: 1 / sqrt(qk_nope_head_dim 128 + qk_rope_head_dim 64)


def _shapes(dtype, num_heads, block_size, *, rank=512, rope_dim=64, page_dtype=None, scale_dtype=jnp.float32,
            num_seqs=4, num_tokens=37, num_blocks=64, max_blocks=8):
    f = jax.ShapeDtypeStruct
    page_dtype = page_dtype or dtype
    return dict(q=f((num_seqs, num_heads, rank), dtype), q_rope=f((num_seqs, num_heads, rope_dim), dtype),
                q_ragged=f((num_tokens, num_heads, rank), dtype),
                q_rope_ragged=f((num_tokens, num_heads, rope_dim), dtype),
                kv=f((num_blocks, block_size, rank + rope_dim), page_dtype),
                scales=f((num_blocks, block_size), scale_dtype), tables=f((num_seqs, max_blocks), jnp.int32),
                lens=f((num_seqs,), jnp.int32), cu=f((num_seqs + 1,), jnp.int32))


def _export_both(export, s, quantized: bool = False, decode_splits=(1, 3), **kw):
    """Exports decode (each split count) and ragged with `export`; returns the exported modules."""
    kw = dict(kw, scale=SCALE, interpret=False)
    extra = (s["scales"],) if quantized else ()
    if quantized:
        decode = lambda q, qr, kv, t, n, sc, **o: mla_paged_attention(q, qr, kv, t, n, kv_scales=sc, **kw, **o)
        ragged = lambda q, qr, kv, t, n, cu, sc: ragged_mla_paged_attention(q, qr, kv, t, n, cu, kv_scales=sc, **kw)
    else:
        decode = lambda q, qr, kv, t, n, **o: mla_paged_attention(q, qr, kv, t, n, **kw, **o)
        ragged = lambda q, qr, kv, t, n, cu: ragged_mla_paged_attention(q, qr, kv, t, n, cu, **kw)
    out = [export(functools.partial(decode, num_splits=num_splits), s["q"], s["q_rope"], s["kv"], s["tables"],
                  s["lens"], *extra) for num_splits in decode_splits]
    out.append(export(ragged, s["q_ragged"], s["q_rope_ragged"], s["kv"], s["tables"], s["lens"], s["cu"], *extra))
    return out


CONFIGS = [(dtype, heads, block_size) for dtype in (jnp.bfloat16, jnp.float32) for heads in (16, 128)
           for block_size in (16, 64)]
IDS = [f"{jnp.dtype(d).name}-{h}heads-bs{b}" for d, h, b in CONFIGS]


@pytest.mark.parametrize("dtype,num_heads,block_size", CONFIGS, ids=IDS)
def test_gpu_kernels_lower_to_triton_at_deepseek_v3_shapes(dtype, num_heads, block_size):
    for exported in _export_both(_export_cuda, _shapes(dtype, num_heads, block_size), target="gpu"):
        assert exported.mlir_module().count(TRITON_CALL) >= 1


QUANT = [(jnp.int8, jnp.float32, jnp.bfloat16, 128, 64), (jnp.float8_e4m3fn, jnp.bfloat16, jnp.bfloat16, 16, 16),
         (jnp.int8, jnp.bfloat16, jnp.float32, 16, 64), (jnp.float8_e4m3fn, jnp.float32, jnp.float32, 128, 16)]
QUANT_IDS = [f"{jnp.dtype(p).name}-scales-{jnp.dtype(s).name}-q-{jnp.dtype(q).name}-{h}heads-bs{b}"
             for p, s, q, h, b in QUANT]


@pytest.mark.parametrize("page_dtype,scale_dtype,q_dtype,num_heads,block_size", QUANT, ids=QUANT_IDS)
def test_gpu_kernels_lower_to_triton_with_8bit_pages(page_dtype, scale_dtype, q_dtype, num_heads, block_size):
    s = _shapes(q_dtype, num_heads, block_size, page_dtype=page_dtype, scale_dtype=scale_dtype)
    for exported in _export_both(_export_cuda, s, quantized=True, target="gpu"):
        # The kernel's name carries the page dtype (profiles tell the variants apart).
        name = rf"mla_paged_attention_q\d+_h\d+_s\d+_p\d+_{jnp.dtype(page_dtype).name}"
        assert re.search(name, exported.mlir_module())


@pytest.mark.parametrize("rank,rope_dim,num_heads,block_size", [(96, 32, 5, 12), (48, 8, 1, 1), (256, 64, 40, 32)])
def test_gpu_kernels_lower_to_triton_at_other_shapes(rank, rope_dim, num_heads, block_size):
    """Non-power-of-two R, Dr < 16, odd head counts and block sizes: padded inside the kernel only."""
    s = _shapes(jnp.bfloat16, num_heads, block_size, rank=rank, rope_dim=rope_dim)
    _export_both(_export_cuda, s, target="gpu")


def test_gpu_decode_packs_heads_and_splits_the_context():
    """At DeepSeek V3's width one decode program holds 32 heads (a 32 x 512 float32 accumulator), so 128 heads
    are 4 head blocks; with 4 sequences the default splits the context to fill the GPU."""
    s = _shapes(jnp.bfloat16, 128, 64)
    text = _export_both(_export_cuda, s, decode_splits=(None,), target="gpu")[0].mlir_module()
    assert "mla_paged_attention_q1_h32_s" in text
    assert "mla_paged_attention_q1_h32_s1_" not in text


@pytest.mark.parametrize("dtype,num_heads,block_size", CONFIGS, ids=IDS)
def test_tpu_kernels_lower_to_mosaic_at_deepseek_v3_shapes(dtype, num_heads, block_size):
    for exported in _export_both(export_tpu, _shapes(dtype, num_heads, block_size), target="tpu"):
        assert TPU_CALL in exported.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_mosaic_module_structure(dtype):
    """One DMA stream of whole 576-wide page rows (the keys and the values at once), the cache left in HBM,
    double-buffered VMEM chunks, every head of a decode step in one program, all grid dimensions parallel,
    float32 matmuls at full precision."""
    s = _shapes(dtype, 16, 16)  # 4 sequences x 8 blocks of 16 tokens: tables of 32 entries
    el = "f32" if dtype == jnp.float32 else "bf16"
    rows = 16  # 16 heads x 1 token: a whole native tile for both dtypes
    for exported in _export_both(export_tpu, s, target="tpu", pages_per_iter=2):
        (text,) = mosaic_modules(exported)
        assert "scalar_prefetch = 2" in text
        assert "memref<32xi32, #tpu.memory_space<smem>>" in text  # the block tables, flattened, in SMEM
        assert f"memref<64x16x576x{el}, #tpu.memory_space<any>>" in text  # the latent pages stay in HBM
        assert f"memref<2x32x576x{el}, #tpu.memory_space<vmem>>" in text  # 2 slots x 2 pages x 16 tokens
        assert "memref<1x2x!tpu.dma_semaphore" in text  # one stream: no separate K and V copies
        assert "tpu.enqueue_dma" in text and "tpu.wait_dma" in text
        assert text.count("#tpu.dimension_semantics<parallel>") == 3
        matmuls = [line for line in text.splitlines() if "tpu.matmul" in line]
        assert matmuls
        if dtype == jnp.float32:
            assert all(full_precision(line) for line in matmuls)
    decode = export_tpu(functools.partial(mla_paged_attention, scale=SCALE, target="tpu", interpret=False),
                        s["q"], s["q_rope"], s["kv"], s["tables"], s["lens"])
    assert f"memref<1x1x{rows}x576x{el}, #tpu.memory_space<vmem>>" in mosaic_modules(decode)[0]


def test_auto_target_on_a_tpu_backend_exports_the_mosaic_kernels(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    s = _shapes(jnp.bfloat16, 16, 64)
    _export_both(export_tpu, s, decode_splits=(None,))


def test_interpret_none_is_interpreted_on_cpu():
    if jax.default_backend() in ("gpu", "tpu"):
        pytest.skip("on an accelerator interpret=None compiles")
    s = _shapes(jnp.float32, 4, 16, rank=32, rope_dim=16)
    for target, call in (("gpu", TRITON_CALL), ("tpu", TPU_CALL)):
        fn = functools.partial(mla_paged_attention, scale=SCALE, target=target)
        assert call not in jax.jit(fn).lower(s["q"], s["q_rope"], s["kv"], s["tables"], s["lens"]).as_text()
