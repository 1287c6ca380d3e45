"""Hugging Face checkpoints of the newer families: tiny random Qwen3 (q/k norms per head, a sliding window from
layer 1 on), Gemma 3 text (q/k norms per head, local and global layers with their own RoPE bases, linear scaling
on the global ones only, a window shorter than the prompts), Phi-3 (fused qkv_proj and gate_up_proj split on load,
LongRoPE within its original context, a window on every layer) and OLMo 2 (norms after each sub-block only, q/k
norms over the whole projection). pagedjax must give transformers' float32 logits (1e-4) through `forward_dense`
and the engine's paged step, and transformers' greedy continuations token for token, through the engine and
through the dense model. Built with transformers' own classes and saved locally: no hub access.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax.config import CacheConfig, SchedulerConfig  # noqa: E402
from pagedjax.engine import LLMEngine  # noqa: E402
from pagedjax.model.loading.hf_loader import load_hf_config, load_hf_params, model_from_state  # noqa: E402
from pagedjax.sampling_params import SamplingParams  # noqa: E402
from tests.dense import greedy_by_recompute  # noqa: E402
from tests.model.test_hf import (  # noqa: E402
    MIN_MARGIN,
    TOL,
    _base_config,
    dense_logits,
    hf_greedy,
    hf_logits,
    paged_last_logits,
    random_hf_model,
    saved_and_loaded,
)

pytestmark = pytest.mark.hf

VOCAB = 96
MAX_NEW = 6
BLOCK = 4
MAX_LEN = 32  # Phi-3's original context here: every sequence stays within LongRoPE's short factors
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, initializer_range=0.2, bos_token_id=1,
               eos_token_id=2, pad_token_id=0)
_rng = np.random.default_rng(1)
_SHORT_FACTOR = np.round(_rng.uniform(1.0, 3.0, 8), 3).tolist()  # head_dim 16: one factor per frequency
# Seeds picked so that no greedy step of any prompt is a near tie (asserted in the tests).
MODELS = {
    # GQA, head_dim 24 (heads * head_dim != hidden), layer 0 global and layer 1 a window of 7, untied.
    "qwen3": ("Qwen3Config", 3, dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24, use_sliding_window=True,
        sliding_window=7, max_window_layers=1, max_position_embeddings=256, tie_word_embeddings=False)),
    # Layers local (window 5), global, local; the local base 100, the global 10^6 linearly scaled by 2;
    # query_pre_attn_scalar != head_dim, a final soft cap, tied embeddings.
    "gemma3": ("Gemma3TextConfig", 0, dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
        query_pre_attn_scalar=24, final_logit_softcapping=8.0)),
    # LongRoPE extending a context of 32 to 256 (attention factor sqrt(1 + ln 8 / ln 32)), random short factors;
    # a window of 9 on both layers; GQA.
    "phi3": ("Phi3Config", 4, dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=9,
        max_position_embeddings=256, original_max_position_embeddings=MAX_LEN,
        rope_scaling={"rope_type": "longrope", "short_factor": _SHORT_FACTOR, "long_factor": [4.0] * 8,
                      "original_max_position_embeddings": MAX_LEN})),
    # MHA, untied.
    "olmo2": ("Olmo2Config", 0, dict(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)),
}
EXPECTED = {  # what the loader must make of each config
    "qwen3": dict(architecture="llama", block_norms="pre", qk_norm="head", head_dim=24, qkv_bias=False,
                  sliding_windows=(None, 7), rope_local_theta=None, max_position_embeddings=256),
    "gemma3": dict(architecture="gemma2", block_norms="sandwich", qk_norm="head", sliding_windows=(5, None, 5),
                   rope_theta=1e6, rope_scaling=(("factor", 2.0), ("rope_type", "linear")), rope_local_theta=100.0,
                   query_pre_attn_scalar=24.0, attn_logit_softcapping=None, final_logit_softcapping=8.0,
                   tie_word_embeddings=True),
    "phi3": dict(architecture="llama", block_norms="pre", qk_norm=None, sliding_windows=(9, 9),
                 max_position_embeddings=MAX_LEN, tie_word_embeddings=False,
                 rope_scaling=(("attention_factor", pytest.approx(np.sqrt(1 + np.log(8) / np.log(MAX_LEN)))),
                               ("original_max_position_embeddings", MAX_LEN), ("rope_type", "longrope"),
                               ("short_factor", tuple(_SHORT_FACTOR)))),
    "olmo2": dict(architecture="llama", block_norms="post", qk_norm="full", sliding_windows=None,
                  tie_word_embeddings=False),
}
# Fields whose effect must show at these sizes: without them the longest prompt's logits are far off. (OLMo 2's
# variants change the parameters themselves: the loader's name and shape checks hold them.)
ABLATIONS = {"qwen3": {"sliding_windows": None}, "gemma3": {"rope_local_theta": None},
             "phi3": {"rope_scaling": None}}
_prompt_rng = np.random.default_rng(0)
PROMPTS = [_prompt_rng.integers(3, VOCAB, n).tolist() for n in (1, 6, 13, 22)]  # three longer than every window


def build_hf_model(kind: str):
    cls_name, seed, extra = MODELS[kind]
    return random_hf_model(cls_name, seed, {**_COMMON, **extra}, norm_center=0 if kind == "gemma3" else 1,
                           random_biases=False)


@functools.cache
def hf_model(kind: str, folder: str):
    """(transformers model, folder, loaded (cfg, state)) saved under `folder`."""
    model = build_hf_model(kind)
    cfg, state = saved_and_loaded(model, folder)
    return model, folder, cfg, state


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: hf_model(kind, str(tmp_path_factory.mktemp(kind))) for kind in MODELS}


@pytest.mark.parametrize("kind", list(MODELS))
def test_config_maps_families(models, kind):
    _, _, cfg, _ = models[kind]
    for field, want in EXPECTED[kind].items():
        assert getattr(cfg, field) == want, field


def test_phi3_fused_tensors_are_split(models, caplog):
    """The checkpoint holds fused qkv_proj / gate_up_proj; the model their parts, row blocks of them."""
    from safetensors.numpy import load_file

    _, folder, _, state = models["phi3"]
    tensors = load_file(f"{folder}/model.safetensors")
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]
    gate_up = tensors["model.layers.1.mlp.gate_up_proj.weight"]
    assert not any(".q_proj." in name or ".gate_proj." in name for name in tensors)
    attn, mlp = state["layers"][1]["self_attn"], state["layers"][1]["mlp"]
    q, k, v = np.split(qkv, [64, 64 + 32])
    for name, want in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        np.testing.assert_array_equal(np.asarray(attn[name]["kernel"].get_value()), want.T)
    np.testing.assert_array_equal(np.asarray(mlp["gate_proj"]["kernel"].get_value()), gate_up[:128].T)
    np.testing.assert_array_equal(np.asarray(mlp["up_proj"]["kernel"].get_value()), gate_up[128:].T)
    with caplog.at_level(logging.WARNING, logger="pagedjax.model.loading.hf_config"):
        load_hf_config(folder)
    assert "original_max_position_embeddings = 32" in caplog.text  # the context cap is said


@pytest.mark.parametrize("kind", list(MODELS))
def test_dense_logits_match_transformers(models, kind):
    model, _, cfg, state = models[kind]
    ref = hf_logits(model, PROMPTS)
    for p, a, b in zip(PROMPTS, dense_logits(cfg, state, PROMPTS), ref, strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{kind}, prompt of {len(p)} tokens")
    if kind not in ABLATIONS:
        return
    ablated = cfg.replace(**ABLATIONS[kind])
    assert np.abs(dense_logits(ablated, state, PROMPTS[-1:])[0] - ref[-1]).max() > 100 * TOL


def _engine(cfg, state):
    return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=BLOCK, num_blocks=64),
                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN),
                     params=model_from_state(cfg, state), backend="xla")


@pytest.mark.parametrize("kind", list(MODELS))
def test_paged_logits_match_transformers(models, kind):
    """One prefill step of every prompt through the engine's paged path: each prompt's last logits."""
    model, _, cfg, state = models[kind]
    last = paged_last_logits(_engine(cfg, state), PROMPTS)
    for (p, got), ref in zip(last, hf_logits(model, [p for p, _ in last]), strict=True):
        np.testing.assert_allclose(got, ref[-1], atol=TOL, rtol=TOL, err_msg=f"{kind}, {len(p)} tokens")


@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_matches_transformers_generate(models, kind):
    """The engine's greedy tokens and the dense model's (full recompute) both equal transformers' generate, with
    prompts and continuations longer than the windows."""
    model, _, cfg, state = models[kind]
    expected, margins = zip(*(hf_greedy(model, p, MAX_NEW) for p in PROMPTS), strict=True)
    assert min(margins) > MIN_MARGIN, min(margins)  # no near tie: identical tokens do not hang on rounding
    outs = _engine(cfg, state).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                                        use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [list(w) for w in expected], kind
    graphdef, params = nnx.split(model_from_state(cfg, state))
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, params).forward_dense(tokens))
    dense, _ = greedy_by_recompute(forward, PROMPTS, MAX_NEW, MAX_LEN)
    assert dense == [list(w) for w in expected], kind


def test_fused_tensor_of_the_wrong_shape_is_named(models, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, folder, _, _ = models["phi3"]
    for f in ("config.json", "generation_config.json"):
        shutil.copy(f"{folder}/{f}", tmp_path / f)
    tensors = load_file(f"{folder}/model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mis-shaped") as e:
        load_hf_params(tmp_path, load_hf_config(tmp_path))
    assert f"{name}: checkpoint [112, 64], model expects [128, 64]" in str(e.value)


# ------------------------------------------------------------------------------------------------ configs
def _write_config(folder, changes: dict):
    """test_hf's small Llama config.json with `changes` (a value of ... removes the field)."""
    config = {k: v for k, v in {**_base_config(), **changes}.items() if v is not ...}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


_SQRT = np.sqrt(1 + np.log(32) / np.log(4096))  # LongRoPE's attention factor for a context extended 32 times


@pytest.mark.parametrize("changes, fields", [
    # Gemma 3 as transformers 4 wrote it: top-level bases, rope_scaling for the global layers, the pattern.
    ({"model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 8, "sliding_window": 16,
      "sliding_window_pattern": 3, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     dict(sliding_windows=(16, 16, None, 16, 16, None), rope_theta=5e5, rope_local_theta=2e4,
          rope_scaling=(("factor", 8.0), ("rope_type", "linear")), architecture="gemma2", qk_norm="head")),
    # transformers' defaults: every 6th layer global, bases 10^6 and 10^4, no soft caps, scalar 256.
    ({"model_type": "gemma3_text", "num_hidden_layers": 7, "head_dim": 8, "sliding_window": 16, "rope_theta": ...},
     dict(sliding_windows=(16,) * 5 + (None, 16), rope_theta=1e6, rope_local_theta=1e4, rope_scaling=None,
          attn_logit_softcapping=None, final_logit_softcapping=None, query_pre_attn_scalar=256.0)),
    # Phi-3 128k as published: "su" is LongRoPE; the context is capped to the original one.
    ({"model_type": "phi3", "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "su", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [4.0] * 4}},
     dict(max_position_embeddings=4096, rope_scaling=(
         ("attention_factor", pytest.approx(_SQRT)), ("original_max_position_embeddings", 4096.0),
         ("rope_type", "longrope"), ("short_factor", (1.0, 1.5, 2.0, 2.5))))),
    ({"model_type": "phi3", "max_position_embeddings": 4096, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "attention_factor": 1.25}},
     dict(max_position_embeddings=4096, rope_scaling=(
         ("attention_factor", 1.25), ("original_max_position_embeddings", 4096.0), ("rope_type", "longrope"),
         ("short_factor", (1.0,) * 4)))),
    ({"model_type": "phi3", "sliding_window": 2047}, dict(sliding_windows=(2047,), rope_scaling=None)),
    ({"model_type": "qwen3"}, dict(head_dim=128, qk_norm="head", qkv_bias=False, sliding_windows=None)),
    ({"model_type": "olmo2"}, dict(qk_norm="full", norm_placement="post", block_norms="post")),
])
def test_family_config_fields(tmp_path, changes, fields):
    cfg = load_hf_config(_write_config(tmp_path, changes))
    for field, want in fields.items():
        assert getattr(cfg, field) == want, field


@pytest.mark.parametrize("changes, field", [
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": "1"},
     "max_window_layers"),
    ({"model_type": "olmo2", "attention_bias": True}, "attention_bias"),
    ({"model_type": "olmo2", "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"model_type": "gemma3_text", "sliding_window": None}, "sliding_window"),
    ({"model_type": "gemma3_text", "sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({"model_type": "gemma3_text", "hidden_activation": "gelu"}, "hidden_activation"),
    ({"model_type": "gemma3_text", "rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0}, "full_attention": {"rope_type": "default"}}},
     "sliding_attention"),
    ({"model_type": "gemma3_text", "rope_parameters": {
        "sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "full_attention"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"model_type": "phi3", "rope_scaling": {"type": "su", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}},
     "short_factor"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 4}}, "short_factor"),
    ({"model_type": "phi3", "sliding_window": 8, "layer_types": ["full_attention"]}, "layer_types"),
    ({"model_type": "phi3", "hidden_act": "gelu_new"}, "hidden_act"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                                              "original_max_position_embeddings": 32}}, "rope_scaling"),
    ({"model_type": "qwen2", "rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ({"model_type": "gemma3"}, "model_type"),  # the multimodal wrapper: its text model is gemma3_text
])
def test_unsupported_family_fields_are_named(tmp_path, changes, field):
    with pytest.raises(ValueError, match=field):
        load_hf_config(_write_config(tmp_path, changes))
