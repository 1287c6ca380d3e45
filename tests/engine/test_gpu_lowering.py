"""The engine's whole jitted steps, on the Pallas backend, lower for NVIDIA GPUs (proven without a GPU).

The kernel tests prove each kernel lowers to Triton; this proves the engine's ragged step and its fused
fused decode loop (model, KV writes, kernels, sampling, page state) export for platform "cuda".
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.device.attention import AttentionMetadata
from pagedjax.device.kv_cache import init_kv_cache
from pagedjax.device.page_state import PageState
from pagedjax.device.sampling import SamplingMetadata
from pagedjax.model.llama import init_model
from pagedjax.runner.runner import _jitted
from tests.kernels.cases import abstract_gpu

TRITON_CALL = "__gpu$xla.gpu.triton"
CFG = ModelConfig(vocab_size=128, hidden_size=128, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                  intermediate_size=256, dtype="bfloat16")


def _spec(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)


def _export_cuda(fn, args, static):
    specs = jax.tree.map(_spec, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with abstract_gpu():
            exported = jax.export.export(
                fn, platforms=["cuda"],
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*specs, **static)
    return exported.mlir_module()


@pytest.fixture(params=[jnp.bfloat16, jnp.int8], ids=["bf16-pages", "int8-pages"])
def model_parts(monkeypatch, request):
    """The jitted step and loop, and a cache of bfloat16 pages or of int8 pages with scales (quantized on write,
    dequantized inside the Triton kernels)."""
    # Trace as if on a GPU so that interpret=None picks the compiled Triton kernels.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: init_model(CFG)))
    leaves, treedef = jax.tree.flatten(params)
    step, loop = _jitted(graphdef, treedef, (16,))
    cache = jax.eval_shape(lambda: init_kv_cache(CFG.spec.kv_layers, 64, 16, request.param))
    return leaves, step, loop, cache


def _sampling(n):
    return SamplingMetadata.from_lists([0.0] * n, [0] * n, [1.0] * n, [0] * n, [0] * n)


@pytest.mark.parametrize("decode_only", [False, True])
def test_engine_step_lowers_for_cuda(model_parts, decode_only):
    leaves, step, _, cache = model_parts
    s, t = 4, (4 if decode_only else 32)
    meta = AttentionMetadata(np.zeros(t, np.int32), np.zeros((s, 8), np.int32), np.zeros(s, np.int32),
                             np.zeros(s + 1, np.int32))
    args = (leaves, cache, np.zeros(t, np.int32), np.zeros(t, np.int32), meta, np.zeros(s, np.int32),
            _sampling(s))
    text = _export_cuda(step, args, dict(backend="pallas", decode_only=decode_only, return_logits=False))
    assert TRITON_CALL in text


def test_fused_decode_loop_lowers_for_cuda(model_parts):
    leaves, _, loop, cache = model_parts
    s = 4
    pages = PageState(np.zeros((s, 8), np.int32), np.zeros(s, np.int32), np.zeros(8, np.int32),
                      np.zeros((), np.int32), np.zeros((), bool))
    args = (leaves, cache, pages, np.zeros(s, np.int32), _sampling(s), np.full((s, 1), -1, np.int32),
            np.zeros(s, np.int32))
    text = _export_cuda(loop, args, dict(num_steps=8, backend="pallas"))
    assert TRITON_CALL in text


def test_without_a_gpu_the_pallas_backend_is_interpreted():
    graphdef, params = nnx.split(nnx.eval_shape(lambda: init_model(CFG)))
    leaves, treedef = jax.tree.flatten(params)
    step, _ = _jitted(graphdef, treedef, (16,))
    cache = jax.eval_shape(lambda: init_kv_cache(CFG.spec.kv_layers, 64, 16, jnp.bfloat16))
    s = 4
    meta = AttentionMetadata(np.zeros(s, np.int32), np.zeros((s, 8), np.int32), np.zeros(s, np.int32),
                             np.zeros(s + 1, np.int32))
    args = (leaves, cache, np.zeros(s, np.int32), np.zeros(s, np.int32), meta, np.zeros(s, np.int32), _sampling(s))
    text = step.lower(*jax.tree.map(_spec, args), backend="pallas", decode_only=True,
                      return_logits=False).as_text()
    assert TRITON_CALL not in text
