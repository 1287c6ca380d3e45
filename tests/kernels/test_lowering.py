"""Both kernels lower to Triton for NVIDIA GPUs, proven on a CPU-only machine with jax.export."""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import paged_attention, ragged_paged_attention
from tests.kernels.cases import abstract_gpu

pytestmark = pytest.mark.kernels

TRITON_CALL = "__gpu$xla.gpu.triton"


def _export_cuda(fn, *shapes):
    with warnings.catch_warnings():  # JAX 0.12 deprecates the Pallas Triton backend (still supported)
        warnings.simplefilter("ignore", DeprecationWarning)
        with abstract_gpu():
            exported = jax.export.export(
                jax.jit(fn), platforms=["cuda"],
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*shapes)
    text = exported.mlir_module()
    assert TRITON_CALL in text, "no Triton kernel in the exported module"
    return exported


def _shapes(dtype, num_q_heads, num_kv_heads, head_dim, num_seqs=4, num_tokens=37, num_blocks=64,
            block_size=16, max_blocks=8):
    f = jax.ShapeDtypeStruct
    return dict(q=f((num_seqs, num_q_heads, head_dim), dtype),
                q_ragged=f((num_tokens, num_q_heads, head_dim), dtype),
                kv=f((num_kv_heads, num_blocks, block_size, head_dim), dtype),
                tables=f((num_seqs, max_blocks), jnp.int32), lens=f((num_seqs,), jnp.int32),
                cu=f((num_seqs + 1,), jnp.int32))


DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
# Every dtype x head_dim 64/80/128 with GQA 4:1, plus MHA and MQA (8 query heads on one KV head).
CONFIGS = [(dtype, head_dim, (32, 8)) for dtype in DTYPES for head_dim in (64, 80, 128)] + [
    (jnp.bfloat16, 128, (4, 4)), (jnp.float16, 80, (8, 1)), (jnp.float32, 64, (8, 1))]
IDS = [f"{jnp.dtype(d).name}-d{h}-{q}q{kv}kv" for d, h, (q, kv) in CONFIGS]


@pytest.mark.parametrize("dtype,head_dim,heads", CONFIGS, ids=IDS)
def test_decode_lowers_to_triton(dtype, head_dim, heads):
    s = _shapes(dtype, *heads, head_dim)
    for num_splits in (1, 3):
        fn = functools.partial(paged_attention, interpret=False, num_splits=num_splits)
        _export_cuda(fn, s["q"], s["kv"], s["kv"], s["tables"], s["lens"])


@pytest.mark.parametrize("dtype,head_dim,heads", CONFIGS, ids=IDS)
def test_ragged_lowers_to_triton(dtype, head_dim, heads):
    s = _shapes(dtype, *heads, head_dim)
    fn = functools.partial(ragged_paged_attention, interpret=False)
    _export_cuda(fn, s["q_ragged"], s["kv"], s["kv"], s["tables"], s["lens"], s["cu"])


@pytest.mark.parametrize("head_dim,block_size", [(96, 8), (256, 32), (16, 12), (112, 1)])
def test_other_shapes_lower_to_triton(head_dim, block_size):
    s = _shapes(jnp.bfloat16, 6, 2, head_dim, block_size=block_size)
    _export_cuda(functools.partial(paged_attention, interpret=False), s["q"], s["kv"], s["kv"], s["tables"],
                 s["lens"])
    _export_cuda(functools.partial(ragged_paged_attention, interpret=False, block_q=16), s["q_ragged"], s["kv"],
                 s["kv"], s["tables"], s["lens"], s["cu"])


# The variants (issue 15): window + soft cap in float pages, and 8-bit pages (both formats, both scale dtypes).
VARIANTS = [
    (jnp.bfloat16, jnp.bfloat16, jnp.float32, dict(sliding_window=100, logits_soft_cap=50.0)),
    (jnp.float32, jnp.float32, jnp.float32, dict(sliding_window=40, logits_soft_cap=30.0)),
    (jnp.bfloat16, jnp.int8, jnp.float32, dict(sliding_window=100)),
    (jnp.bfloat16, jnp.float8_e4m3fn, jnp.bfloat16, dict(logits_soft_cap=50.0, sliding_window=7)),
    (jnp.float32, jnp.int8, jnp.bfloat16, {}),
]
VARIANT_IDS = [f"q-{jnp.dtype(q).name}-kv-{jnp.dtype(kv).name}-{'-'.join(v) or 'plain'}" for q, kv, _, v in VARIANTS]


@pytest.mark.parametrize("q_dtype,kv_dtype,scale_dtype,variants", VARIANTS, ids=VARIANT_IDS)
def test_variants_lower_to_triton(q_dtype, kv_dtype, scale_dtype, variants):
    s = _shapes(q_dtype, 32, 8, 128)
    kv = jax.ShapeDtypeStruct(s["kv"].shape, kv_dtype)
    scales = jax.ShapeDtypeStruct(s["kv"].shape[:3], scale_dtype)
    kw = dict(variants, interpret=False)
    if kv_dtype in (jnp.int8, jnp.float8_e4m3fn):
        decode = lambda q, k, v, t, n, ks, vs, **o: paged_attention(q, k, v, t, n, k_scales=ks, v_scales=vs, **kw, **o)
        ragged = lambda q, k, v, t, n, cu, ks, vs: ragged_paged_attention(q, k, v, t, n, cu, k_scales=ks,
                                                                          v_scales=vs, **kw)
        extra = (scales, scales)
    else:
        decode = lambda q, k, v, t, n, **o: paged_attention(q, k, v, t, n, **kw, **o)
        ragged = lambda q, k, v, t, n, cu: ragged_paged_attention(q, k, v, t, n, cu, **kw)
        extra = ()
    for num_splits in (1, 3):
        _export_cuda(functools.partial(decode, num_splits=num_splits), s["q"], kv, kv, s["tables"], s["lens"], *extra)
    _export_cuda(ragged, s["q_ragged"], kv, kv, s["tables"], s["lens"], s["cu"], *extra)


@pytest.mark.parametrize("kv_dtype,sliding_window", [(jnp.bfloat16, 1024), (jnp.int8, None)])
def test_attend_until_lowers_to_triton(kv_dtype, sliding_window):
    """The ragged kernel with per-row key bounds (bidirectional image spans) at Gemma 3 4B's attention shapes (8
    query heads on 4 KV heads of 256, its sliding window): its own kernel, named for the variant."""
    s = _shapes(jnp.bfloat16, 8, 4, 256)
    kv = jax.ShapeDtypeStruct(s["kv"].shape, kv_dtype)
    until = jax.ShapeDtypeStruct(s["q_ragged"].shape[:1], jnp.int32)
    scales = jax.ShapeDtypeStruct(s["kv"].shape[:3], jnp.float32) if kv_dtype == jnp.int8 else None

    def fn(q, k, v, tables, lens, cu, attend_until, k_scales=None, v_scales=None):
        return ragged_paged_attention(q, k, v, tables, lens, cu, attend_until=attend_until, interpret=False,
                                      sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales)

    extra = () if scales is None else (scales, scales)
    exported = _export_cuda(fn, s["q_ragged"], kv, kv, s["tables"], s["lens"], s["cu"], until, *extra)
    assert "_until" in exported.mlir_module()


@pytest.mark.parametrize("dtype,kv_dtype,variants", [
    (jnp.bfloat16, jnp.bfloat16, dict(sliding_window=128)),  # gpt-oss: sinks on every layer, windows on half
    (jnp.float32, jnp.int8, dict(logits_soft_cap=30.0)),
], ids=["bf16-window", "f32-int8-softcap"])
def test_sinks_lower_to_triton(dtype, kv_dtype, variants):
    """Attention sinks at gpt-oss's attention shapes (64 query heads on 8 KV heads of 64): the kernels that join
    them (decode with one split, ragged) are named for them; with splits the sinks join after the merge, outside."""
    s = _shapes(dtype, 64, 8, 64)
    kv = jax.ShapeDtypeStruct(s["kv"].shape, kv_dtype)
    scales = jax.ShapeDtypeStruct(s["kv"].shape[:3], jnp.float32) if kv_dtype == jnp.int8 else None
    sinks = jax.ShapeDtypeStruct((64,), jnp.float32)
    extra = () if scales is None else (scales, scales)

    def decode(q, k, v, tables, lens, sinks, k_scales=None, v_scales=None, *, num_splits):
        return paged_attention(q, k, v, tables, lens, sinks=sinks, k_scales=k_scales, v_scales=v_scales,
                               num_splits=num_splits, interpret=False, **variants)

    def ragged(q, k, v, tables, lens, cu, sinks, k_scales=None, v_scales=None):
        return ragged_paged_attention(q, k, v, tables, lens, cu, sinks=sinks, k_scales=k_scales, v_scales=v_scales,
                                      interpret=False, **variants)

    def kernel_names(exported):
        return set(re.findall(r'name = "((?:ragged_)?paged_attention_\w+)"', exported.mlir_module()))

    for num_splits in (1, 3):
        exported = _export_cuda(functools.partial(decode, num_splits=num_splits), s["q"], kv, kv, s["tables"],
                                s["lens"], sinks, *extra)
        (name,) = kernel_names(exported)
        assert name.endswith("_sinks") == (num_splits == 1), name
    exported = _export_cuda(ragged, s["q_ragged"], kv, kv, s["tables"], s["lens"], s["cu"], sinks, *extra)
    (name,) = kernel_names(exported)
    assert name.endswith("_sinks"), name


def test_interpret_none_is_interpreted_on_cpu():
    s = _shapes(jnp.float32, 4, 2, 64)
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU interpret=None compiles")
    text = jax.jit(paged_attention).lower(s["q"], s["kv"], s["kv"], s["tables"], s["lens"]).as_text()
    assert TRITON_CALL not in text
