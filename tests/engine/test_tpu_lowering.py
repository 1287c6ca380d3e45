"""The engine's whole jitted steps, on the Pallas backend, lower for TPUs (proven without a TPU).

tests/kernels/test_tpu_lowering.py proves each TPU kernel lowers to Mosaic; this proves the engine's ragged
step and its fused decode loop (model, KV writes, kernels, sampling, page state) export for
platform "tpu" with the kernels the engine picks there, and that the engine's backend "auto" is "pallas"
on a TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.device.attention import AttentionMetadata, resolve_backend
from pagedjax.device.kv_cache import init_kv_cache
from pagedjax.device.page_state import PageState
from pagedjax.device.sampling import SamplingMetadata
from pagedjax.model.llama import init_model
from pagedjax.runner.runner import _jitted

TPU_CALL = "tpu_custom_call"
CFG = ModelConfig(vocab_size=128, hidden_size=128, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                  intermediate_size=256, dtype="bfloat16")


def _spec(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)


def _export_tpu(fn, args, static) -> str:
    return jax.export.export(fn, platforms=["tpu"])(*jax.tree.map(_spec, args), **static).mlir_module()


@pytest.fixture
def model_parts(monkeypatch):
    # Trace as if on a TPU, so that target "auto" and interpret=None pick the compiled Mosaic kernels.
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: init_model(CFG)))
    leaves, treedef = jax.tree.flatten(params)
    step, loop = _jitted(graphdef, treedef, (16,))
    cache = jax.eval_shape(lambda: init_kv_cache(CFG.spec.kv_layers, 64, 16, jnp.bfloat16))
    return leaves, step, loop, cache


def _sampling(n):
    return SamplingMetadata.from_lists([0.0] * n, [0] * n, [1.0] * n, [0] * n, [0] * n)


def test_auto_backend_is_pallas_on_a_tpu(model_parts):
    assert resolve_backend("auto") == "pallas"


@pytest.mark.parametrize("decode_only", [False, True])
def test_engine_step_lowers_for_tpu(model_parts, decode_only):
    leaves, step, _, cache = model_parts
    s, t = 4, (4 if decode_only else 32)
    meta = AttentionMetadata(np.zeros(t, np.int32), np.zeros((s, 8), np.int32), np.zeros(s, np.int32),
                             np.zeros(s + 1, np.int32))
    args = (leaves, cache, np.zeros(t, np.int32), np.zeros(t, np.int32), meta, np.zeros(s, np.int32),
            _sampling(s))
    text = _export_tpu(step, args, dict(backend="pallas", decode_only=decode_only, return_logits=False))
    assert TPU_CALL in text


def test_fused_decode_loop_lowers_for_tpu(model_parts):
    leaves, _, loop, cache = model_parts
    s = 4
    pages = PageState(np.zeros((s, 8), np.int32), np.zeros(s, np.int32), np.zeros(8, np.int32),
                      np.zeros((), np.int32), np.zeros((), bool))
    args = (leaves, cache, pages, np.zeros(s, np.int32), _sampling(s), np.full((s, 1), -1, np.int32),
            np.zeros(s, np.int32))
    text = _export_tpu(loop, args, dict(num_steps=8, backend="pallas"))
    assert TPU_CALL in text
