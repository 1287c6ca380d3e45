"""GLM-5 (`glm_moe_dsa`) from Hugging Face folders: DeepSeek V3.2's sparse attention but for its indexer, which
rotates interleaved pairs, and its "shared" layers (`indexer_types`), which have no indexer and attend over the
selection of the last "full" layer before them. Tiny random checkpoints made by transformers' own
`GlmMoeDsaForCausalLM` and `save_pretrained`, `index_topk` below the prompts; pagedjax must give transformers'
float32 logits through `forward_dense`, on data whose indexer scores have no near tie at the k-th place
(asserted), and its greedy continuations token for token through `LLMEngine.from_pretrained` (a shared layer's
`PagedSharedSparseAttention` reading the step's selection) with chunked prefill, a prefix-cache hit, n > 1 forks,
preemption and fused decode. Both differences from V3.2 decide the logits (asserted), and every refused field is
named. No hub access.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax.config import IndexedSparse, LatentAttention  # noqa: E402
from pagedjax.config.deepseek import DeepSeekIndexerConfig  # noqa: E402
from pagedjax.model.errors import ModelLoadError  # noqa: E402
from pagedjax.model.families.deepseek import deepseek_from_state  # noqa: E402
from pagedjax.model.families.deepseek import load as load_hf_deepseek  # noqa: E402
from pagedjax.model.families.deepseek import load_config as load_deepseek_config  # noqa: E402
from pagedjax.model.loading.hf_config import load_hf_config  # noqa: E402
from pagedjax.sampling_params import SamplingParams  # noqa: E402
from tests.model.test_deepseek import fp8_folder, perturbed, saved_models, with_weights  # noqa: E402
from tests.model.test_deepseek_v32 import (  # noqa: E402
    MAX_NEW,
    MIN_INDEX_MARGIN,
    TOL,
    _dense_logits,
    _engine,
    index_margins,
)
from tests.model.test_hf import MIN_MARGIN, hf_greedy, hf_logits  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB = 80
TOPK = 6
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
               q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, num_experts_per_tok=2,
               first_k_dense_replace=1, n_group=1, topk_group=1, initializer_range=0.2, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, index_topk=TOPK, index_head_dim=16, index_n_heads=16,
               indexer_types=["full", "shared", "full"],
               # Every rotary pair turns far within the prompts, so that the indexer's pairing (interleaved, not
               # V3.2's halves) decides its selection (asserted).
               rope_parameters={"rope_type": "default", "rope_theta": 100.0})
SEED = 21  # no indexer score and no greedy step a near tie (asserted)
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (3, 12, 17, 20)]


def build(kind: str):
    """A tiny random `GlmMoeDsaForCausalLM` (norms and biases random as `perturbed` makes them)."""
    return perturbed(transformers.GlmMoeDsaConfig(**_COMMON), SEED)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, saved folder)."""
    return saved_models(tmp_path_factory, build, ["glm"])


def _config(models, changes: dict) -> dict:
    return {**json.loads((models["glm"][1] / "config.json").read_text()), **changes}


def test_config_maps_glm_moe_dsa(models, tmp_path):
    cfg = load_deepseek_config(models["glm"][1])
    assert cfg.indexer == DeepSeekIndexerConfig(num_heads=16, head_dim=16, topk=TOPK, rope_interleave=True,
                                                shared_layers=(1,))
    indexed = IndexedSparse(16, 8, 16, TOPK)
    assert cfg.spec.kv_layers == (indexed, LatentAttention(16, 8), indexed)  # a shared layer keeps no indexer key
    assert (cfg.moe.num_groups, cfg.moe.topk_groups, cfg.moe.first_k_dense_replace) == (1, 1, 1)
    # Without indexer_types, as transformers derives them: a pattern, else index_topk_freq / _offset.
    base = {k: v for k, v in _config(models, {}).items() if k != "indexer_types"}
    for extra, shared in (({"index_topk_pattern": "FSS"}, (1, 2)), ({}, ()),
                          ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, (1,))):
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        assert load_deepseek_config(tmp_path).indexer.shared_layers == shared, extra
    with pytest.raises(ModelLoadError, match="'glm_moe_dsa': a DeepSeek model, not a ModelConfig one"):
        load_hf_config(models["glm"][1])


@pytest.mark.parametrize("changes, field", [
    ({"indexer_types": ["shared", "full", "full"]}, "layer 0 is 'shared'"),
    ({"indexer_types": ["full", "full"]}, "indexer_types"),
    ({"indexer_types": ["full", "sparse", "full"]}, "indexer_types"),
    ({"indexer_types": None, "index_topk_pattern": "FXF"}, "index_topk_pattern"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"q_lora_rank": None}, "q_lora_rank"),
])
def test_unsupported_glm_fields_are_named(models, tmp_path, changes, field):
    (tmp_path / "config.json").write_text(json.dumps(_config(models, changes)))
    with pytest.raises(ModelLoadError, match=field):
        load_deepseek_config(tmp_path)


def test_dense_logits_match_transformers(models):
    model, folder = models["glm"]
    ours, _ = load_hf_deepseek(folder)
    assert ours.layers[1].self_attn.indexer is None  # the shared layer: no indexer weights read
    margin, queries = index_margins(ours, PROMPTS)
    assert margin > MIN_INDEX_MARGIN, margin
    assert queries > 20  # the selection decides most queries' attention
    for p, a, b in zip(PROMPTS, _dense_logits(ours, PROMPTS), hf_logits(model, PROMPTS), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL * np.abs(b).max(), err_msg=f"{len(p)} tokens")


@pytest.mark.slow  # (CI time) test_deepseek.py's FP8 test runs the same loader (dequantized at load) by default
def test_fp8_block_scaled_checkpoint_matches_transformers_over_its_dequantized_weights(models, tmp_path):
    """GLM-5 in the released FP8 layout (every decoder linear, the indexer's included, float8 e4m3 with a float32
    `weight_scale_inv` per block: V3's, `fp8_folder`) loads dequantized: transformers' logits over the same
    dequantized weights, its indexer's selections without a near tie."""
    model, folder = models["glm"]
    dequantized = fp8_folder(folder, tmp_path)
    assert {n.rsplit(".", 2)[-2] for n in dequantized if ".indexer." in n} == {"wq_b", "wk", "weights_proj"}
    ours, _ = load_hf_deepseek(tmp_path)
    margin, _ = index_margins(ours, PROMPTS)
    assert margin > MIN_INDEX_MARGIN, margin
    reference = with_weights(model, dequantized)
    for p, a, b in zip(PROMPTS, _dense_logits(ours, PROMPTS), hf_logits(reference, PROMPTS), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL * np.abs(b).max(), err_msg=f"{len(p)} tokens")


def test_both_differences_from_v32_decide_the_logits(models):
    """The same weights read as V3.2 would read them (the indexer's halves rotation; or the shared layer with an
    indexer of its own, every position selected) give other logits: the parity above holds for GLM-5's
    definition, not by an accident of the data."""
    ours, _ = load_hf_deepseek(models["glm"][1])
    cfg, state = ours.config, nnx.state(ours)
    want = _dense_logits(ours, PROMPTS[-1:])[0]
    halves = deepseek_from_state(cfg.replace(indexer=DeepSeekIndexerConfig(16, 16, TOPK, False, (1,))), state)
    assert np.abs(_dense_logits(halves, PROMPTS[-1:])[0] - want)[TOPK:].max() > 1e-3
    # The shared layer attending densely (an indexer of its own with index_topk past the prompt would select all).
    ours.layers[1].self_attn.shared = False
    ours.layers[1].self_attn.indexer = None
    assert np.abs(_dense_logits(ours, PROMPTS[-1:])[0] - want)[TOPK:].max() > 1e-3


def test_engine_greedy_matches_transformers(models):
    """The shared layer reads the step's selection of layer 0 (`PagedSharedSparseAttention`) through chunked
    prefill (20 tokens at 8 a step), n = 2 greedy forks, preemption and fused decodes of 4 steps (four prompts in 12
    blocks of 4), and a prefix-cache hit (the longest prompt again: its full blocks stay cached). One engine (CI
    time: its programs are most of the test)."""
    model, folder = models["glm"]
    expected, margins = zip(*(hf_greedy(model, p, MAX_NEW) for p in PROMPTS), strict=True)
    assert min(margins) > MIN_MARGIN, min(margins)
    ours, _ = load_hf_deepseek(folder)
    margin, _ = index_margins(ours, [p + list(w)[:-1] for p, w in zip(PROMPTS, expected, strict=True)])
    assert margin > MIN_INDEX_MARGIN, margin  # no near tie along the continuations either
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=2)
    engine = _engine(folder, num_blocks=12, decode_steps_per_call=4)
    outs = engine.generate(PROMPTS, [greedy, greedy, forked, greedy], use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [list(w) for w in expected]
    assert [c.token_ids for c in outs[2].outputs] == [list(expected[2])] * 2
    stats = engine.stats()
    assert stats.indexer_ties == 0 and stats.scheduler.num_preemptions > 0 and stats.fused_decode_calls > 0
    again = engine.generate([PROMPTS[-1]], greedy, use_tqdm=False)[0]  # its full blocks cached: a hit at 16
    assert again.num_cached_tokens == 16 and again.output_token_ids == list(expected[-1])
    # A prompt sharing the first 18 tokens (a prefix ending inside a block): the hit is its 4 whole blocks.
    inside = PROMPTS[-1][:18] + [5, 6, 7]
    want, margin = hf_greedy(model, inside, MAX_NEW)
    assert margin > MIN_MARGIN, margin
    out = engine.generate([inside], greedy, use_tqdm=False)[0]
    assert (out.num_cached_tokens, out.output_token_ids) == (16, list(want))


def test_a_config_json_that_leaves_fields_out_takes_transformers_defaults(tmp_path):
    """What pagedjax assumes for the fields a GLM-5 config.json leaves out is what transformers' `GlmMoeDsaConfig`
    defaults them to (the published model's shape: 64 heads, latent 512, rope 64 + nope 192, values 256, 256
    experts of 2048 in one group, an indexer of 32 heads of 128 keeping 2048, every layer "full")."""
    given = dict(vocab_size=154880, hidden_size=6144, num_hidden_layers=4, num_attention_heads=64,
                 intermediate_size=12288)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", **given}))
    cfg = load_deepseek_config(tmp_path)
    hf = transformers.GlmMoeDsaConfig(**given)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (
        hf.kv_lora_rank, hf.q_lora_rank, hf.qk_rope_head_dim, hf.qk_nope_head_dim, hf.v_head_dim)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.rope_interleave) == (
        hf.rms_norm_eps, hf.max_position_embeddings, True)
    moe = cfg.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size, moe.num_shared_experts,
            moe.num_groups, moe.topk_groups, moe.routed_scaling_factor, moe.norm_topk_prob) == (
        hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.n_shared_experts, hf.n_group,
        hf.topk_group, hf.routed_scaling_factor, hf.norm_topk_prob)
    assert moe.first_k_dense_replace == hf.mlp_layer_types.count("dense") == 3
    assert cfg.indexer == DeepSeekIndexerConfig(hf.index_n_heads, hf.index_head_dim, hf.index_topk, True,
                                                tuple(i for i, k in enumerate(hf.indexer_types) if k == "shared"))
