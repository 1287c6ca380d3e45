"""Sliding-window and soft-capped models: `ModelConfig`'s fields, and the paged engine against the dense model
with the same windows (no cache, everything recomputed each step).

Windows of 3 (smaller than a block of 4) and 6 (not a multiple of it) with prompts and continuations longer
than both, global and local layers mixed, chunked prefill and prefix hits on a prefix longer than the window.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.model.llama import init_model
from tests import dense

BLOCK = 4
MAX_TOKENS = 8
MAX_LEN = 40
_BASE = ModelConfig(vocab_size=61, hidden_size=32, num_layers=3, num_q_heads=2, num_kv_heads=1, head_dim=16,
                    intermediate_size=64, max_position_embeddings=MAX_LEN)
CONFIGS = {
    # A global layer between two local ones: no position ever leaves the cache (kv_window None).
    "mixed": _BASE.replace(sliding_windows=(3, None, 6), attn_logit_softcapping=4.0),
    # Every layer local: positions older than the widest window (6) are read by no layer.
    "local": _BASE.replace(sliding_windows=(6, 3, 5), final_logit_softcapping=6.0, query_pre_attn_scalar=12),
    # Two layers for the interpreted Pallas kernels (each distinct window traces its own kernels).
    "pallas": _BASE.replace(num_layers=2, sliding_windows=(3, 6), attn_logit_softcapping=4.0),
}
GEMMA2 = _BASE.replace(architecture="gemma2", sliding_windows=(3, None, 3), attn_logit_softcapping=4.0,
                       final_logit_softcapping=6.0, query_pre_attn_scalar=24)
SEED = 2
_rng = np.random.default_rng(3)
_shared = _rng.integers(0, _BASE.vocab_size, 13).tolist()  # 3 full blocks shared, longer than every window
PROMPTS = [
    _rng.integers(0, _BASE.vocab_size, 1).tolist(),
    _rng.integers(0, _BASE.vocab_size, 19).tolist(),
    _shared + _rng.integers(0, _BASE.vocab_size, 2).tolist(),
    _shared + _rng.integers(0, _BASE.vocab_size, 7).tolist(),
]


# ------------------------------------------------------------------------------------------------- config
def test_config_fields_round_trip():
    cfg = GEMMA2
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["sliding_windows"] == [3, None, 3]  # JSON-ready
    listed = _BASE.replace(sliding_windows=[6, 3, 5])  # a list is stored as a tuple: the config stays hashable
    assert listed.sliding_windows == (6, 3, 5) and isinstance(hash(listed), int)
    assert _BASE.replace(sliding_windows=[None, None, None]).sliding_windows is None  # one spelling of "none"
    # A checkpoint config written before these fields existed loads with none of them.
    old = {k: v for k, v in _BASE.to_dict().items()
           if k not in ("architecture", "sliding_windows", "attn_logit_softcapping", "final_logit_softcapping",
                        "query_pre_attn_scalar")}
    assert ModelConfig.from_dict(old) == _BASE


@pytest.mark.parametrize("windows, kv_window", [
    (None, None), ((6, 3, 5), 6), ((3, None, 6), None), ((1, 1, 1), 1), ((100, 2, 3), 100)])
def test_kv_window(windows, kv_window):
    assert _BASE.replace(sliding_windows=windows).kv_window == kv_window


def test_attention_scale():
    assert _BASE.attention_scale is None
    assert _BASE.replace(query_pre_attn_scalar=64).attention_scale == 0.125


@pytest.mark.parametrize("changes, error, field", [
    ({"sliding_windows": (3, 3)}, ValueError, "one entry per layer"),
    ({"sliding_windows": (3, 0, 3)}, ValueError, r"sliding_windows\[1\]"),
    ({"sliding_windows": (3, 2.0, 3)}, TypeError, r"sliding_windows\[1\]"),
    ({"sliding_windows": (3, True, 3)}, TypeError, r"sliding_windows\[1\]"),
    ({"sliding_windows": 4}, TypeError, "sliding_windows"),
    ({"sliding_windows": "444"}, TypeError, "sliding_windows"),
    ({"attn_logit_softcapping": 0.0}, ValueError, "attn_logit_softcapping"),
    ({"final_logit_softcapping": -1}, ValueError, "final_logit_softcapping"),
    ({"final_logit_softcapping": float("inf")}, ValueError, "final_logit_softcapping"),
    ({"attn_logit_softcapping": "50"}, TypeError, "attn_logit_softcapping"),
    ({"query_pre_attn_scalar": 0}, ValueError, "query_pre_attn_scalar"),
    ({"architecture": "gemma3"}, ValueError, "architecture"),
    ({"architecture": None}, TypeError, "architecture"),
])
def test_config_validation_names_the_field(changes, error, field):
    with pytest.raises(error, match=field):
        _BASE.replace(**changes)


def test_gemma2_parameters_follow_transformers_names():
    state = nnx.state(init_model(GEMMA2))
    layer = state["layers"][0]
    assert {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm", "self_attn", "mlp"} == set(layer)
    # Gemma's norms scale by (1 + w): initialised at w = 0.
    assert not np.any(np.asarray(layer["input_layernorm"]["weight"][...]))
    assert "pre_feedforward_layernorm" not in nnx.state(init_model(_BASE))["layers"][0]


# --------------------------------------------------------------------------------------------------- engine
@functools.cache
def dense_greedy(name: str) -> list[list[int]]:
    """Greedy continuations by full recompute with the dense model (the same windows and caps)."""
    outputs, margin = dense.dense_greedy(CONFIGS[name], SEED, PROMPTS, MAX_TOKENS, MAX_LEN)
    assert margin > 1e-3, margin  # no near tie: identical tokens do not hang on rounding
    return outputs


def _engine(name: str, backend: str, **scheduler) -> LLMEngine:
    return LLMEngine(model_config=CONFIGS[name], cache_config=CacheConfig(block_size=BLOCK, num_blocks=48),
                     scheduler_config=SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 16,
                                                         "max_model_len": MAX_LEN, **scheduler}),
                     seed=SEED, backend=backend)


@pytest.mark.parametrize("name", ["mixed", "local"])
def test_engine_matches_dense(name):
    """Chunked prefill (16 tokens a step) and decoding past the windows; with every layer local, the prompts
    sharing a prefix once more: prefix hits on blocks that fell out of the windows while they ran."""
    engine = _engine(name, "xla")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = engine.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == dense_greedy(name)
    if name == "local":
        again = engine.generate(PROMPTS[2:], greedy, use_tqdm=False)
        assert [o.num_cached_tokens for o in again] == [12, 16]  # every full prompt block of the first run
        assert [o.output_token_ids for o in again] == dense_greedy(name)[2:]


def test_pallas_engine_matches_dense():
    """The Pallas kernels (interpreted on the CPU) with windows and a soft cap in the engine: the ragged
    kernel for the prefill, the decode kernel after."""
    engine = _engine("pallas", "pallas", max_num_batched_tokens=32)
    outs = engine.generate(PROMPTS[1:2], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert outs[0].output_token_ids == dense_greedy("pallas")[1][:3]
