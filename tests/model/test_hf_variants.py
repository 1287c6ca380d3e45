"""Hugging Face checkpoints with attention variants: tiny random Gemma 2 (soft-capped attention and logits,
query_pre_attn_scalar, alternating local/global layers, GeGLU, sandwich norms, scaled embeddings), Mistral and
Qwen2 with sliding windows shorter than the prompts. pagedjax must give transformers' float32 logits (1e-4)
through `forward_dense` and through the engine's paged step, and transformers' greedy continuations token for
token. Built with transformers' own classes and saved locally: no hub access.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax.config import CacheConfig, SchedulerConfig  # noqa: E402
from pagedjax.engine import LLMEngine  # noqa: E402
from pagedjax.model.loading.hf_loader import load_hf, model_from_state  # noqa: E402
from pagedjax.sampling_params import SamplingParams  # noqa: E402
from tests.model.test_hf import (  # noqa: E402
    MIN_MARGIN,
    TOL,
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
BLOCK = 4  # windows of 5 and 7 span block boundaries and are not multiples of the block size
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, initializer_range=0.2,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Seeds picked so that no greedy step of any prompt is a near tie (asserted in the tests).
MODELS = {
    # Layers local (window 5), global, local; both soft caps small enough to bend the scores and logits;
    # query_pre_attn_scalar != head_dim; tied embeddings; GQA.
    "gemma2": ("Gemma2Config", 0, dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    # A window of 5 on every layer, MQA, untied embeddings.
    "mistral": ("MistralConfig", 0, dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                         sliding_window=5, tie_word_embeddings=False)),
    # use_sliding_window from layer 1 on: layer 0 global, layers 1-2 a window of 7.
    "qwen2": ("Qwen2Config", 0, dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                     use_sliding_window=True, sliding_window=7, max_window_layers=1)),
}
EXPECTED = {  # what the loader must make of each config
    "gemma2": dict(architecture="gemma2", sliding_windows=(5, None, 5), attn_logit_softcapping=5.0,
                   final_logit_softcapping=8.0, query_pre_attn_scalar=24.0, tie_word_embeddings=True),
    "mistral": dict(architecture="llama", sliding_windows=(5, 5), attn_logit_softcapping=None,
                    final_logit_softcapping=None, query_pre_attn_scalar=None, tie_word_embeddings=False),
    "qwen2": dict(architecture="llama", sliding_windows=(None, 7, 7), attn_logit_softcapping=None,
                  final_logit_softcapping=None, query_pre_attn_scalar=None, qkv_bias=True),
}
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (1, 6, 13, 22)]  # three longer than every window


def build_hf_model(kind: str):
    cls_name, seed, extra = MODELS[kind]
    return random_hf_model(cls_name, seed, {**_COMMON, **extra}, norm_center=0 if kind == "gemma2" else 1)


@functools.cache
def hf_model(kind: str, folder: str):
    """(transformers model, loaded (cfg, state)) saved under `folder`."""
    model = build_hf_model(kind)
    cfg, state = saved_and_loaded(model, folder)
    return model, cfg, state


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: hf_model(kind, str(tmp_path_factory.mktemp(kind))) for kind in MODELS}


@pytest.mark.parametrize("kind", list(MODELS))
def test_config_maps_variants(models, kind):
    _, cfg, _ = models[kind]
    for field, want in EXPECTED[kind].items():
        assert getattr(cfg, field) == want, field
    assert cfg.max_position_embeddings == 256  # not capped to the window


@pytest.mark.parametrize("kind", list(MODELS))
def test_dense_logits_match_transformers(models, kind):
    model, cfg, state = models[kind]
    ref = hf_logits(model, PROMPTS)
    for p, a, b in zip(PROMPTS, dense_logits(cfg, state, PROMPTS), ref, strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{kind}, prompt of {len(p)} tokens")
    # The variants matter at these sizes: without them the longest prompt's logits are far off.
    plain = cfg.replace(sliding_windows=None, attn_logit_softcapping=None, final_logit_softcapping=None)
    assert np.abs(dense_logits(plain, state, PROMPTS[-1:])[0] - ref[-1]).max() > 100 * TOL


def _engine(cfg, state, **scheduler):
    return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=BLOCK, num_blocks=64),
                     scheduler_config=SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 64,
                                                         "max_model_len": 48, **scheduler}),
                     params=model_from_state(cfg, state), backend="xla")


@pytest.mark.parametrize("kind", list(MODELS))
def test_paged_logits_match_transformers(models, kind):
    """One prefill step of every prompt through the engine's paged path: each prompt's last logits."""
    model, cfg, state = models[kind]
    last = paged_last_logits(_engine(cfg, state), PROMPTS)
    for (p, got), ref in zip(last, hf_logits(model, [p for p, _ in last]), strict=True):
        np.testing.assert_allclose(got, ref[-1], atol=TOL, rtol=TOL, err_msg=f"{kind}, {len(p)} tokens")


@pytest.mark.parametrize("kind", list(MODELS))
def test_engine_greedy_matches_transformers_generate(models, kind):
    """Prompts and continuations longer than the windows."""
    model, cfg, state = models[kind]
    expected, margins = zip(*(hf_greedy(model, p, MAX_NEW) for p in PROMPTS), strict=True)
    assert min(margins) > MIN_MARGIN, min(margins)  # no near tie: identical tokens do not hang on rounding
    outs = _engine(cfg, state).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for p, out, want in zip(PROMPTS, outs, expected, strict=True):
        assert out.output_token_ids == list(want), f"{kind}, prompt of {len(p)} tokens"


def test_gemma2_bfloat16_embedding_scale(tmp_path):
    """In bf16 the embedding factor is sqrt(hidden_size) rounded to bf16 (hidden 48: 6.928... -> 6.9375), as in
    transformers, not the exact root: the embeddings equal transformers' bit for bit."""
    config = transformers.Gemma2Config(**{**_COMMON, "hidden_size": 48}, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, state, _ = load_hf(tmp_path)
    assert cfg.dtype == "bfloat16"
    ids = PROMPTS[-1]
    with torch.no_grad():
        want = model.model.embed_tokens(torch.tensor(ids)).float().numpy()
    got = np.asarray(model_from_state(cfg, state).embed(jnp.asarray(ids)), np.float32)
    np.testing.assert_array_equal(got, want)
