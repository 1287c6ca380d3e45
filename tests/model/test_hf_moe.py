"""Hugging Face mixture-of-experts checkpoints: tiny random Mixtral (4 experts, top 2; top-k logits then their
softmax; `block_sparse_moe.experts.{e}.w1/w3/w2` tensors) and Qwen3-MoE (5 experts, top 2; softmax then top k,
renormalized; q/k norms per head; `mlp.experts.{e}.gate_proj/up_proj/down_proj`), as transformers' own
`save_pretrained` writes them (one tensor per expert). pagedjax must give transformers' float32 logits (1e-4)
through `forward_dense` and the engine's paged step (the grouped matmul), and transformers' greedy continuations
token for token, through the engine and the dense model. No hub access.
"""

from __future__ import annotations

import functools
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax.config import CacheConfig, SchedulerConfig  # noqa: E402
from pagedjax.config.moe import MoEConfig  # noqa: E402
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
MAX_LEN = 32
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               initializer_range=0.2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               tie_word_embeddings=False)
# Seeds picked so that no greedy step of any prompt is a near tie (asserted in the tests).
MODELS = {
    "mixtral": ("MixtralConfig", 3, dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", 0, dict(intermediate_size=64, moe_intermediate_size=24, num_experts=5,
                                            num_experts_per_tok=2, norm_topk_prob=True)),
}
EXPECTED = {
    "mixtral": dict(qk_norm=None, sliding_windows=None, moe=MoEConfig(4, 2, 48, router="topk_softmax")),
    "qwen3_moe": dict(qk_norm="head", sliding_windows=None,
                      moe=MoEConfig(5, 2, 24, router="softmax_topk", norm_topk_prob=True)),
}
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (1, 6, 13, 22)]


def build_hf_model(kind: str):
    cls_name, seed, extra = MODELS[kind]
    return random_hf_model(cls_name, seed, {**_COMMON, **extra}, random_biases=False)


@functools.cache
def hf_model(kind: str, folder: str):
    model = build_hf_model(kind)
    cfg, state = saved_and_loaded(model, folder)
    return model, folder, cfg, state


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: hf_model(kind, str(tmp_path_factory.mktemp(kind))) for kind in MODELS}


@pytest.mark.parametrize("kind", list(MODELS))
def test_config_maps_moe_families(models, kind):
    _, _, cfg, _ = models[kind]
    for field, want in EXPECTED[kind].items():
        assert getattr(cfg, field) == want, field


@pytest.mark.parametrize("kind", list(MODELS))
def test_per_expert_tensors_are_stacked(models, kind):
    """transformers saves one tensor per expert and projection `[out, in]`; the model holds them stacked
    `[E, width, hidden]`: gate / up as saved, down transposed."""
    from safetensors.numpy import load_file

    _, folder, cfg, state = models[kind]
    tensors = load_file(f"{folder}/model.safetensors")
    prefix, names = (("block_sparse_moe", ("w1", "w3", "w2")) if kind == "mixtral"
                     else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    experts = state["layers"][1]["mlp"]["experts"]
    for hf, ours in zip(names, ("gate_proj", "up_proj", "down_proj"), strict=True):
        stacked = np.asarray(experts[ours].get_value())
        assert stacked.shape[0] == cfg.moe.num_experts
        for e in range(cfg.moe.num_experts):
            saved = tensors[f"model.layers.1.{prefix}.experts.{e}.{hf}.weight"]
            np.testing.assert_array_equal(stacked[e], saved.T if ours == "down_proj" else saved)
    np.testing.assert_array_equal(np.asarray(state["layers"][1]["mlp"]["gate"]["kernel"].get_value()),
                                  tensors[f"model.layers.1.{prefix}.gate.weight"].T)


@pytest.mark.parametrize("kind", list(MODELS))
def test_dense_logits_match_transformers(models, kind):
    model, _, cfg, state = models[kind]
    for p, a, b in zip(PROMPTS, dense_logits(cfg, state, PROMPTS), hf_logits(model, PROMPTS), strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{kind}, prompt of {len(p)} tokens")


def _engine(cfg, state):
    return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=4, num_blocks=64),
                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN),
                     params=model_from_state(cfg, state), backend="xla")


@pytest.mark.parametrize("kind", list(MODELS))
def test_paged_logits_match_transformers(models, kind):
    """One prefill step of every prompt through the engine's paged path and grouped matmuls."""
    model, _, cfg, state = models[kind]
    last = paged_last_logits(_engine(cfg, state), PROMPTS)
    for (p, got), ref in zip(last, hf_logits(model, [p for p, _ in last]), strict=True):
        np.testing.assert_allclose(got, ref[-1], atol=TOL, rtol=TOL, err_msg=f"{kind}, {len(p)} tokens")


@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_matches_transformers_generate(models, kind):
    model, _, cfg, state = models[kind]
    expected, margins = zip(*(hf_greedy(model, p, MAX_NEW) for p in PROMPTS), strict=True)
    assert min(margins) > MIN_MARGIN, min(margins)
    outs = _engine(cfg, state).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                                        use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [list(w) for w in expected], kind
    graphdef, params = nnx.split(model_from_state(cfg, state))
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, params).forward_dense(tokens))
    dense, _ = greedy_by_recompute(forward, PROMPTS, MAX_NEW, MAX_LEN)
    assert dense == [list(w) for w in expected], kind


def test_a_missing_or_misshaped_expert_is_named(models, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, folder, _, _ = models["mixtral"]
    for f in ("config.json", "generation_config.json"):
        shutil.copy(f"{folder}/{f}", tmp_path / f)
    tensors = load_file(f"{folder}/model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    tensors["model.layers.1.block_sparse_moe.experts.2.w1.weight"] = tensors[
        "model.layers.1.block_sparse_moe.experts.2.w1.weight"][:-8]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        load_hf_params(tmp_path, load_hf_config(tmp_path))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in str(e.value)  # Mixtral's w2, by the model's name
    assert "model.layers.1.block_sparse_moe.experts.2.w1.weight: checkpoint [40, 32], model expects [48, 32]" in \
        str(e.value)


def _write_config(folder, changes: dict):
    config = {k: v for k, v in {**_base_config(), **changes}.items() if v is not ...}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, moe", [
    ({"model_type": "mixtral"}, MoEConfig(8, 2, 32)),  # transformers' defaults: 8 experts, top 2
    ({"model_type": "qwen3_moe", "num_experts": 16, "moe_intermediate_size": 32},  # transformers 4's name
     MoEConfig(16, 8, 32, router="softmax_topk")),
])
def test_moe_config_fields(tmp_path, changes, moe):
    assert load_hf_config(_write_config(tmp_path, changes)).moe == moe


@pytest.mark.parametrize("changes, field", [
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"model_type": "qwen3_moe", "attention_bias": True}, "attention_bias"),
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ({"model_type": "mixtral", "num_local_experts": "8"}, "num_local_experts"),
    ({"model_type": "mixtral", "hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_moe_fields_are_named(tmp_path, changes, field):
    with pytest.raises(ValueError, match=field):
        load_hf_config(_write_config(tmp_path, changes))
