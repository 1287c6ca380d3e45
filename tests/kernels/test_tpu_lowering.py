"""Both TPU kernels lower to Mosaic for TPUs, proven on a CPU-only machine with jax.export.

Lowering a Pallas TPU kernel serialises its Mosaic module into the `tpu_custom_call`; the TPU compiler
(Mosaic's layout passes, then XLA) runs only on a TPU. So beyond "it exports", the module is decoded here
and its structure checked: scalar prefetch into SMEM, the cache left in HBM, double-buffered VMEM chunks,
DMAs started and waited on, all grid dimensions parallel, float32 matmuls at full precision.
"""

from __future__ import annotations

import base64
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jaxlib.mlir import ir
from jaxlib.mlir.passmanager import PassManager
from jaxlib.mosaic.python import tpu as mosaic_tpu

from pallas_kernels import paged_attention, ragged_paged_attention

pytestmark = pytest.mark.kernels

TPU_CALL = "tpu_custom_call"


def export_tpu(fn, *shapes) -> jax.export.Exported:
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*shapes)
    assert TPU_CALL in exported.mlir_module(), "no Mosaic kernel in the exported module"
    return exported


def full_precision(matmul: str) -> bool:
    """Whether a `tpu.matmul` line of `mosaic_modules`' text contracts float32 at full precision: JAX 0.10-0.12.0
    print the attribute as `precision = #tpu.contract_precision<fp32>`, 0.12.1 as `precision = fp32`."""
    return re.search(r"precision = (#tpu\.contract_precision<)?fp32\b", matmul) is not None


def mosaic_modules(exported: jax.export.Exported) -> list[str]:
    """The Mosaic modules serialised in the exported module's TPU custom calls, as text."""
    bodies = re.findall(r"22body\\22: \\22([A-Za-z0-9+/=]+)", exported.mlir_module())
    assert bodies, "no Mosaic body in the custom call's backend config"
    texts = []
    with ir.Context() as ctx, ir.Location.unknown():
        mosaic_tpu.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        for body in bodies:
            module = ir.Module.parse(base64.b64decode(body))
            PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
            texts.append(str(module))
    return texts


def _shapes(dtype, num_q_heads, num_kv_heads, head_dim, num_seqs=4, num_tokens=37, num_blocks=64, block_size=16,
            max_blocks=8):
    f = jax.ShapeDtypeStruct
    return dict(q=f((num_seqs, num_q_heads, head_dim), dtype),
                q_ragged=f((num_tokens, num_q_heads, head_dim), dtype),
                kv=f((num_kv_heads, num_blocks, block_size, head_dim), dtype),
                tables=f((num_seqs, max_blocks), jnp.int32), lens=f((num_seqs,), jnp.int32),
                cu=f((num_seqs + 1,), jnp.int32))


# float32 and bfloat16 x head_dim 64 (padded to 128 lanes in VMEM) / 128 / 256 with GQA 4:1, then MHA, MQA
# with an odd group (7 query heads on one KV head) and head_dim 80.
CONFIGS = [(dtype, head_dim, (32, 8)) for dtype in (jnp.bfloat16, jnp.float32) for head_dim in (64, 128, 256)] + [
    (jnp.bfloat16, 128, (4, 4)), (jnp.float32, 80, (7, 1))]
IDS = [f"{jnp.dtype(d).name}-d{h}-{q}q{kv}kv" for d, h, (q, kv) in CONFIGS]


@pytest.mark.parametrize("dtype,head_dim,heads", CONFIGS, ids=IDS)
def test_both_kernels_lower_to_mosaic(dtype, head_dim, heads):
    s = _shapes(dtype, *heads, head_dim)
    for num_splits in (1, 3):
        fn = functools.partial(paged_attention, target="tpu", interpret=False, num_splits=num_splits)
        export_tpu(fn, s["q"], s["kv"], s["kv"], s["tables"], s["lens"])
    fn = functools.partial(ragged_paged_attention, target="tpu", interpret=False)
    export_tpu(fn, s["q_ragged"], s["kv"], s["kv"], s["tables"], s["lens"], s["cu"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_window_and_soft_cap_lower_to_mosaic(dtype):
    """The variants the TPU kernels run (sliding window, soft cap) export for platform "tpu" too, the soft cap
    as a tanh in the Mosaic module."""
    s = _shapes(dtype, 32, 8, 128)
    variants = dict(target="tpu", interpret=False, sliding_window=40, logits_soft_cap=50.0)
    for num_splits in (1, 3):
        exported = export_tpu(functools.partial(paged_attention, num_splits=num_splits, **variants), s["q"],
                              s["kv"], s["kv"], s["tables"], s["lens"])
        assert all("math.tanh" in text for text in mosaic_modules(exported))
    exported = export_tpu(functools.partial(ragged_paged_attention, **variants), s["q_ragged"], s["kv"], s["kv"],
                          s["tables"], s["lens"], s["cu"])
    assert all("math.tanh" in text for text in mosaic_modules(exported))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mosaic_module_structure(dtype):
    s = _shapes(dtype, 8, 2, 64)  # 4 sequences x 8 blocks of 16 tokens: tables of 32 entries
    fn = functools.partial(paged_attention, target="tpu", interpret=False, pages_per_iter=2)
    decode = export_tpu(fn, s["q"], s["kv"], s["kv"], s["tables"], s["lens"])
    fn = functools.partial(ragged_paged_attention, target="tpu", interpret=False, pages_per_iter=2)
    ragged = export_tpu(fn, s["q_ragged"], s["kv"], s["kv"], s["tables"], s["lens"], s["cu"])
    el = "f32" if dtype == jnp.float32 else "bf16"
    for exported, grid_dims in ((decode, 3), (ragged, 2)):
        (text,) = mosaic_modules(exported)
        assert "scalar_prefetch = 2" in text
        assert "memref<32xi32, #tpu.memory_space<smem>>" in text  # the block tables, flattened, in SMEM
        assert f"memref<2x64x16x64x{el}, #tpu.memory_space<any>>" in text  # K and V stay in HBM
        assert text.count(f"memref<2x32x64x{el}, #tpu.memory_space<vmem>>") >= 2  # 2 slots x 2 pages x 16
        assert "memref<2x2x!tpu.dma_semaphore" in text
        assert "tpu.enqueue_dma" in text and "tpu.wait_dma" in text
        assert text.count("#tpu.dimension_semantics<parallel>") == grid_dims
        matmuls = [line for line in text.splitlines() if "tpu.matmul" in line]
        assert matmuls
        if dtype == jnp.float32:  # a single bfloat16 pass would cost ~1e-3 relative error
            assert all(full_precision(line) for line in matmuls)


@pytest.mark.parametrize("dtype,sliding_window", [(jnp.bfloat16, 1024), (jnp.float32, None)])
def test_attend_until_lowers_to_mosaic(dtype, sliding_window):
    """The ragged kernel with per-row key bounds (bidirectional image spans) at Gemma 3 4B's attention shapes:
    each tile's walk end as a third scalar-prefetch array in SMEM, each row's bound as an int32 [rows, 1] VMEM
    block beside q's."""
    s = _shapes(dtype, 8, 4, 256)
    until = jax.ShapeDtypeStruct(s["q_ragged"].shape[:1], jnp.int32)
    fn = functools.partial(ragged_paged_attention, target="tpu", interpret=False, sliding_window=sliding_window)
    exported = export_tpu(lambda q, k, v, t, n, cu, a: fn(q, k, v, t, n, cu, attend_until=a), s["q_ragged"], s["kv"],
                          s["kv"], s["tables"], s["lens"], s["cu"], until)
    (text,) = mosaic_modules(exported)
    assert "scalar_prefetch = 3" in text
    assert re.search(r"memref<1x\d+x1xi32, #tpu.memory_space<vmem>>", text)
    assert "_until" in exported.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sinks_lower_to_mosaic(dtype):
    """Attention sinks at gpt-oss's attention shapes (64 query heads on 8 KV heads of 64, a window of 128): each
    program's rows' sinks arrive as a float32 [rows, 1] VMEM block beside q's (decode with one split: 8 query heads
    a program, a whole tile of rows; ragged: 8 heads x the tile's tokens); with splits they join after the merge."""
    s = _shapes(dtype, 64, 8, 64)
    sinks = jax.ShapeDtypeStruct((64,), jnp.float32)
    options = dict(target="tpu", interpret=False, sliding_window=128)
    rows = 16 if dtype == jnp.bfloat16 else 8  # 8 heads padded to a whole native tile
    for num_splits in (1, 3):
        fn = functools.partial(paged_attention, num_splits=num_splits, **options)
        exported = export_tpu(lambda q, k, v, t, n, sinks, fn=fn: fn(q, k, v, t, n, sinks=sinks), s["q"], s["kv"],
                              s["kv"], s["tables"], s["lens"], sinks)
        (text,) = mosaic_modules(exported)
        has_block = f"memref<1x{rows}x1xf32, #tpu.memory_space<vmem>>" in text
        assert has_block == (num_splits == 1), text[:2000]
    fn = functools.partial(ragged_paged_attention, block_q=4, **options)
    exported = export_tpu(lambda q, k, v, t, n, cu, sinks: fn(q, k, v, t, n, cu, sinks=sinks), s["q_ragged"],
                          s["kv"], s["kv"], s["tables"], s["lens"], s["cu"], sinks)
    (text,) = mosaic_modules(exported)
    assert "memref<1x32x1xf32, #tpu.memory_space<vmem>>" in text  # 8 heads x 4 tokens
    assert re.search(r"ragged_paged_attention_tpu_q4_p\d+_window_sinks", exported.mlir_module())


def test_auto_target_on_a_tpu_backend_exports_the_mosaic_kernels(monkeypatch):
    """What the engine's Pallas backend calls (target "auto", interpret None) on a TPU."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    s = _shapes(jnp.bfloat16, 8, 2, 128)
    export_tpu(paged_attention, s["q"], s["kv"], s["kv"], s["tables"], s["lens"])
    export_tpu(ragged_paged_attention, s["q_ragged"], s["kv"], s["kv"], s["tables"], s["lens"], s["cu"])


def test_interpret_none_is_interpreted_without_a_tpu():
    if jax.default_backend() == "tpu":
        pytest.skip("on a TPU interpret=None compiles")
    s = _shapes(jnp.float32, 4, 2, 64)
    fn = functools.partial(paged_attention, target="tpu")
    assert TPU_CALL not in jax.jit(fn).lower(s["q"], s["kv"], s["kv"], s["tables"], s["lens"]).as_text()
