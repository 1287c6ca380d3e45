"""The native CPU decode attention (`pagedjax.device.cpu_attention`) against the dense reference: random shapes, GQA
ratios, block sizes, lengths at block edges, permuted and poisoned pools, float32 and bfloat16; which calls it takes,
how it is refused, and what runs where it cannot be built."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedjax.config.kv_spec import LayerKV
from pagedjax.device import attention, cpu_attention, native
from pallas_kernels import paged_attention_reference, paged_attention_xla
from tests.kernels.cases import HEAD_DIMS, assert_close, boundary_lengths, build, examples, gqa_heads, relocate


def _loaded() -> cpu_attention.AttentionStatus:
    status = cpu_attention.status()
    if not status.loaded:
        pytest.skip(f"the native attention kernel is not loaded: {status.reason}")
    return status


def _native(status, case, scale=None):
    """The kernel itself (not the dispatch), jitted."""
    scale = 1.0 / np.sqrt(case.q.shape[-1]) if scale is None else scale
    return jax.jit(lambda *a: cpu_attention.native_call(status.target, *a, scale=scale))(*case.decode_args())


@settings(max_examples=examples(20), deadline=None)
@given(st.integers(0, 2**32 - 1), gqa_heads(), st.sampled_from(HEAD_DIMS), st.sampled_from((16, 5, 1, 32, 8, 20)),
       st.sampled_from((3, 1, 2, 5)), st.sampled_from((3, 1, 4)), st.sampled_from(("float32", "bfloat16")),
       st.data())
@example(seed=0, heads=(4, 1), head_dim=64, block_size=16, max_blocks=4, num_seqs=4, dtype="float32", data=None)
def test_native_decode_matches_the_dense_reference(seed, heads, head_dim, block_size, max_blocks, num_seqs, dtype,
                                                   data):
    """Any shape, lengths at and beside block edges (0, 1, exact multiples, the table's capacity), blocks scattered
    through a pool whose unused slots, blocks and table entries hold NaN or garbage ids: the reference's result
    to f32 ~1e-5 / bf16 ~1e-2, and the same on the pool permuted. The dispatching `paged_decode` agrees."""
    status = _loaded()
    lengths = ([0, 1, block_size, max_blocks * block_size][:num_seqs] if data is None else
               data.draw(boundary_lengths(num_seqs, block_size, max_blocks)))
    rng = np.random.default_rng(seed)
    num_q_heads, num_kv_heads = heads
    case = build(rng, num_q_rows=len(lengths), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, block_size=block_size, max_blocks=max_blocks, kv_lens=lengths, dtype=dtype)
    want = paged_attention_reference(*case.decode_args())
    got = _native(status, case)
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    assert_close(got, want, dtype)
    assert_close(_native(status, relocate(rng, case)), want, dtype)
    assert_close(jax.jit(cpu_attention.paged_decode)(*case.decode_args()), want, dtype)
    for s, n in enumerate(lengths):
        if n == 0:
            assert not np.asarray(jnp.asarray(got[s], jnp.float32)).any()  # nothing to attend: zeros


def test_native_decode_keeps_the_scale_and_a_row_independent_of_its_batch():
    """An explicit scale is the kernel's; a sequence's bits are the same alone and beside others (each sequence
    and KV head is computed on its own)."""
    status = _loaded()
    rng = np.random.default_rng(3)
    case = build(rng, num_q_rows=3, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16, max_blocks=4,
                 kv_lens=[40, 64, 7])
    assert_close(_native(status, case, scale=0.3), paged_attention_reference(*case.decode_args(), scale=0.3),
                 "float32")
    together = np.asarray(_native(status, case))
    alone = case.__class__(case.q[1:2], case.k_pages, case.v_pages, case.block_tables[1:2], case.lengths[1:2])
    np.testing.assert_array_equal(np.asarray(_native(status, alone))[0], together[1])


def _layer_and_meta(case):
    layer = LayerKV(k=case.k_pages, v=case.v_pages)
    meta = attention.AttentionMetadata(slot_mapping=jnp.zeros(case.q.shape[0], jnp.int32),
                                       block_tables=case.block_tables, kv_lens=case.lengths,
                                       cu_q_lens=jnp.arange(case.q.shape[0] + 1, dtype=jnp.int32))
    return layer, meta


def test_the_xla_backend_decodes_with_the_kernel_where_it_applies():
    """A decode step without variants runs the kernel (its FFI target in the program); a sliding window or a soft
    cap, which it does not take, keeps XLA's gather path. Both give the reference's result."""
    status = _loaded()
    rng = np.random.default_rng(1)
    case = build(rng, num_q_rows=2, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8, max_blocks=3,
                 kv_lens=[20, 9], poison=False)
    layer, meta = _layer_and_meta(case)
    for variant, uses_kernel in (({}, True), ({"sliding_window": 4}, False), ({"logits_soft_cap": 5.0}, False)):
        step = jax.jit(lambda q, v=variant: attention.paged_attention(q, layer, meta, backend="xla",
                                                                       decode_only=True, **v))
        assert (status.target in step.lower(case.q).as_text()) == uses_kernel, variant
        assert_close(step(case.q), paged_attention_reference(*case.decode_args(), **variant), "float32")


def test_calls_the_kernel_does_not_take_are_refused_by_name():
    rng = np.random.default_rng(2)
    case = build(rng, num_q_rows=2, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, max_blocks=2,
                 kv_lens=[3, 8], poison=False)
    args = case.decode_args()
    assert cpu_attention.supports(case.q, case.k_pages)
    for variant in ({"sliding_window": 3}, {"logits_soft_cap": 2.0}, {"k_scales": case.lengths},
                    {"sinks": jnp.zeros(4)}):
        assert not cpu_attention.supports(case.q, case.k_pages, **variant)
    assert not cpu_attention.supports(case.q.astype(jnp.float16), case.k_pages.astype(jnp.float16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_attention.paged_decode(case.q.astype(jnp.float16), case.k_pages.astype(jnp.float16),
                                   case.v_pages.astype(jnp.float16), *args[3:])
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        cpu_attention.paged_decode(case.q[..., :8], case.k_pages[..., :8], case.v_pages[..., :8], *args[3:])
    with pytest.raises(ValueError, match="lengths must be int32"):
        cpu_attention.paged_decode(*args[:4], case.lengths.astype(jnp.float32))
    with pytest.raises(ValueError, match="share one dtype"):
        cpu_attention.paged_decode(case.q.astype(jnp.bfloat16), *args[1:])


def test_without_the_kernel_every_call_is_xlas_and_says_why(monkeypatch, caplog):
    """PAGEDJAX_NATIVE=off, or a kernel that cannot be built: not loaded, the reason kept (and logged as a warning
    for a failed build), and `paged_decode` is XLA's gather path, the same result."""
    assert cpu_attention.status_for("off") == cpu_attention.AttentionStatus(False, reason=f"{native.ENV}=off")

    def no_compiler(source):
        raise RuntimeError("no C++ compiler found (c++, g++ or $CXX)")

    monkeypatch.setattr(native, "build_somewhere", no_compiler)
    with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
        failed = cpu_attention.status_for(None)
    assert not failed.loaded and "no C++ compiler" in failed.reason and "no C++ compiler" in caplog.text
    monkeypatch.setattr(cpu_attention, "status", lambda: failed)
    rng = np.random.default_rng(4)
    case = build(rng, num_q_rows=2, num_q_heads=4, num_kv_heads=1, head_dim=16, block_size=4, max_blocks=3,
                 kv_lens=[5, 12])
    step = jax.jit(cpu_attention.paged_decode)
    assert cpu_attention.TARGET not in step.lower(*case.decode_args()).as_text()
    np.testing.assert_array_equal(np.asarray(step(*case.decode_args())),
                                  np.asarray(jax.jit(paged_attention_xla)(*case.decode_args())))


@pytest.mark.slow  # (CI time) a second build of the kernel, ~4 s
def test_a_portable_build_computes_the_same(tmp_path):
    """Built for any x86-64 (SSE2: the vector extensions split into 128-bit operations), registered under another
    target: the reference's result too."""
    _loaded()
    flags = tuple(f for f in native.FLAGS if f != "-march=native") + ("-march=x86-64",)
    status = cpu_attention.load(native.build(cpu_attention.SOURCE, tmp_path, flags=flags),
                                target="pagedjax_paged_decode_portable_test")
    rng = np.random.default_rng(5)
    for dtype in ("float32", "bfloat16"):
        case = build(rng, num_q_rows=3, num_q_heads=6, num_kv_heads=2, head_dim=48, block_size=5, max_blocks=4,
                     kv_lens=[0, 11, 20], dtype=dtype)
        assert_close(_native(status, case), paged_attention_reference(*case.decode_args()), dtype)
