"""The recurrent-state kernels lower for their platforms, proven on a CPU-only machine with jax.export: the GPU kernels
to Triton ("cuda"), the TPU kernels to Mosaic ("tpu"), at Qwen3-Next's linear-attention shapes (16 q/k heads and 32
v heads of 128, a conv over 8192 channels, kernel 4) and a Nemotron-H-like Mamba-2 mixer (64 heads of 64, 8 groups,
state 128), in both forms, bfloat16 and float32; the state pages aliased to the output (updated in place)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from tests.kernels.test_lowering import TRITON_CALL, _export_cuda
from tests.kernels.test_tpu_lowering import TPU_CALL, export_tpu, full_precision, mosaic_modules

pytestmark = pytest.mark.kernels

f = jax.ShapeDtypeStruct
T, S, BLOCKS, MAX_BLOCKS, BLOCK = 40, 4, 16, 8, 64
STEP = (f((S, MAX_BLOCKS), jnp.int32), f((S,), jnp.int32), f((S + 1,), jnp.int32))


def _gdn(dtype, tokens=T):
    """Qwen3-Next's gated delta rule: 16 q/k heads and 32 v heads of 128."""
    return (f((tokens, 16, 128), dtype), f((tokens, 16, 128), dtype), f((tokens, 32, 128), dtype),
            f((tokens, 32), jnp.float32), f((tokens, 32), jnp.float32), f((BLOCKS, 32, 128, 128), jnp.float32), *STEP)


def _conv(dtype, tokens=T):
    """Qwen3-Next's conv before the delta rule: q, k and v channels (2 x 16 x 128 + 32 x 128), kernel 4."""
    return (f((tokens, 8192), dtype), f((8192, 4), dtype), f((BLOCKS, 8192, 3), dtype), *STEP, f((8192,), dtype))


def _ssd(dtype, tokens=T):
    """A Nemotron-H-like Mamba-2 mixer: 64 heads of 64, 8 groups, state 128."""
    return (f((tokens, 64, 64), dtype), f((tokens, 64), jnp.float32), f((64,), jnp.float32),
            f((tokens, 8, 128), dtype), f((tokens, 8, 128), dtype), f((BLOCKS, 64, 64, 128), jnp.float32), *STEP,
            f((64,), jnp.float32))


def _calls(target: str, form: str):
    """(gated delta rule, conv, SSD) as functions of arrays only, the conv's bias and the SSD's D last."""
    kw = dict(block_size=BLOCK, target=target, interpret=False)
    return (functools.partial(pk.gated_delta_rule, form=form, **kw),
            lambda x, w, p, t, n, cu, b: pk.causal_conv1d(x, w, p, t, n, cu, bias=b, activation="silu", **kw),
            lambda x, dt, a, b, c, p, t, n, cu, d: pk.mamba2_ssd(x, dt, a, b, c, p, t, n, cu, D=d, form=form, **kw))


def _aliased(exported) -> bool:
    """The kernel's custom call writes its output pages into its input pages' buffer."""
    return "output_operand_aliases" in exported.mlir_module()


FORMS = [("chunked", jnp.bfloat16), ("recurrent", jnp.float32)]


@pytest.mark.parametrize("form,dtype", FORMS, ids=["chunked-bf16", "recurrent-f32"])
def test_gpu_kernels_lower_to_triton(form, dtype):
    gdn, conv, ssd = _calls("gpu", form)
    tokens = T if form == "chunked" else S  # the recurrent form: a decode batch
    for fn, shapes, name in ((gdn, _gdn(dtype, tokens), f"gated_delta_rule_{form}"),
                             (ssd, _ssd(dtype, tokens), f"mamba2_ssd_{form}")):
        exported = _export_cuda(fn, *shapes)
        assert name in exported.mlir_module() and _aliased(exported)
    if form == "chunked":
        exported = _export_cuda(conv, *_conv(dtype))
        assert "causal_conv1d_t32_c128_silu" in exported.mlir_module() and _aliased(exported)


@pytest.mark.parametrize("form,dtype", FORMS, ids=["chunked-bf16", "recurrent-f32"])
def test_tpu_kernels_lower_to_mosaic(form, dtype):
    """The TPU kernels' Mosaic modules: pieces' metadata in SMEM, the pages in HBM (aliased), the state in a VMEM
    scratch, its DMAs started and waited on, heads parallel and pieces in order ("arbitrary"), float32 matmuls at
    full precision; pieces of one sublane tile (8 rows) for decode-shaped steps."""
    gdn, conv, ssd = _calls("tpu", form)
    tokens = T if form == "chunked" else S
    chunk = 64 if form == "chunked" else 8
    for fn, shapes, state in ((gdn, _gdn(dtype, tokens), "128x128"), (ssd, _ssd(dtype, tokens), "64x128")):
        exported = export_tpu(fn, *shapes)
        assert _aliased(exported)
        (text,) = mosaic_modules(exported)
        assert "#tpu.memory_space<smem>" in text and "#tpu.memory_space<any>" in text
        assert f"memref<{state}xf32, #tpu.memory_space<vmem>>" in text  # the state scratch
        assert f"memref<1x1x{chunk}x" in text  # one piece of one head per grid step
        assert "tpu.enqueue_dma" in text and "tpu.wait_dma" in text
        assert "#tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<arbitrary>" in text
        matmuls = [line for line in text.splitlines() if "tpu.matmul" in line]
        assert matmuls and all(full_precision(line) for line in matmuls)
    if form == "chunked":
        (text,) = mosaic_modules(export_tpu(conv, *_conv(dtype)))
        assert "memref<1x72x1024xf32, #tpu.memory_space<vmem>>" in text  # 64 rows + 3 before, 8 channel tiles
        assert text.count("#tpu.dimension_semantics<parallel>") == 2


def test_interpret_none_is_interpreted_on_cpu():
    if jax.default_backend() in ("gpu", "tpu"):
        pytest.skip("on an accelerator interpret=None compiles")
    for target, call in (("gpu", TRITON_CALL), ("tpu", TPU_CALL)):
        fn = functools.partial(pk.gated_delta_rule, block_size=BLOCK, target=target)
        assert call not in jax.jit(fn).lower(*_gdn(jnp.float32, 8)).as_text()
