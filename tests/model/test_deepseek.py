"""DeepSeek V2 / V3 from Hugging Face folders: tiny random checkpoints made by transformers' own
`DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM` and `save_pretrained`, one per variant (V2 with and without
`q_lora_rank`, "greedy" and "group_limited_greedy" routing, YaRN; V3 with sigmoid routing, a random
`e_score_correction_bias`, expert groups, YaRN with mscale / mscale_all_dim, `rope_interleave` on and off, tied
embeddings). pagedjax must give transformers' float32 logits through `forward_dense` (K / V expanded per head) and
its greedy continuations token for token through `LLMEngine.from_pretrained` (absorbed MLA over latent pages),
with a prefix-cache hit, chunked prefill and n > 1 forks. Every refused config field is named. No hub access.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax.config.deepseek import DeepSeekConfig, DeepSeekMoEConfig  # noqa: E402
from pagedjax.model.errors import ModelLoadError  # noqa: E402
from pagedjax.model.families.deepseek import load as load_hf_deepseek  # noqa: E402
from pagedjax.model.families.deepseek import load_config as load_deepseek_config  # noqa: E402
from pagedjax.model.loading.hf_config import load_hf_config  # noqa: E402
from tests.model.test_hf import MIN_MARGIN, hf_greedy, hf_logits  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB = 80
TOL = 1e-5  # float32 logits, relative to their largest magnitude
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
               qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, num_experts_per_tok=2, first_k_dense_replace=1,
               initializer_range=0.2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 1.0,
         "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
# name -> (config class, seed, fields). Seeds picked so that no greedy step is a near tie (asserted).
MODELS = {
    "v2_lora_grouped": ("DeepseekV2Config", 1, dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                                                    topk_group=2, routed_scaling_factor=1.5, rope_parameters=_YARN)),
    "v2_greedy": ("DeepseekV2Config", 2, dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2)),
    "v3_yarn": ("DeepseekV3Config", 4, dict(q_lora_rank=24, n_group=4, topk_group=2, rope_parameters=_YARN,
                                            rope_interleave=True)),
    "v3_halves": ("DeepseekV3Config", 0, dict(q_lora_rank=None, n_group=2, topk_group=1, rope_interleave=False,
                                              norm_topk_prob=False, tie_word_embeddings=True,
                                              routed_scaling_factor=1.0)),
}
EXPECTED_MOE = {
    "v2_lora_grouped": DeepSeekMoEConfig(8, 2, 16, 1, 1, "group_limited_greedy", 4, 2, False, 1.5),
    "v2_greedy": DeepSeekMoEConfig(8, 2, 16, 2, 1, "greedy", 1, 1, False, 1.0),
    "v3_yarn": DeepSeekMoEConfig(8, 2, 16, 1, 1, "noaux_tc", 4, 2, True, 2.5),
    "v3_halves": DeepSeekMoEConfig(8, 2, 16, 1, 1, "noaux_tc", 2, 1, False, 1.0),
}
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (1, 5, 11, 19)]


def build(kind: str):
    """A tiny random transformers model of `kind`: norms random around 1 and the V3 router's correction bias
    random (every parameter a loading mistake could hide behind)."""
    cls_name, seed, extra = MODELS[kind]
    return perturbed(getattr(transformers, cls_name)(**{**_COMMON, **extra}), seed)


def perturbed(config, seed: int):
    """The transformers model of `config` (seeded) with its norms random around 1, norm biases (V3.2's indexer
    `k_norm`) random around 0 and the router's correction bias random."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.bias"):
                p.copy_(0.2 * torch.randn_like(p))
        for module in model.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.copy_(0.3 * torch.randn_like(module.e_score_correction_bias))
    return model


def saved_models(tmp_path_factory, build, kinds) -> dict:
    """kind -> (transformers model, the folder it was saved to)."""
    out = {}
    for kind in kinds:
        model = build(kind)
        folder = tmp_path_factory.mktemp(kind)
        model.save_pretrained(str(folder))
        out[kind] = (model, folder)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, saved folder)."""
    return saved_models(tmp_path_factory, build, MODELS)


def _dense_logits(model, prompts) -> list[np.ndarray]:
    graphdef, params = nnx.split(model)
    batch = np.zeros((len(prompts), max(len(p) for p in prompts)), np.int32)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    logits = np.asarray(jax.jit(lambda b: nnx.merge(graphdef, params).forward_dense(b))(batch))
    return [logits[i, : len(p)] for i, p in enumerate(prompts)]


@pytest.mark.parametrize("kind", list(MODELS))
def test_config_maps_fields(models, kind):
    model, folder = models[kind]
    hc = model.config
    cfg = load_deepseek_config(folder)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size) == (
        VOCAB, 32, 2, 4, 48)
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (16, 16, 8, 12)
    assert cfg.q_lora_rank == hc.q_lora_rank
    assert cfg.moe == EXPECTED_MOE[kind]
    assert cfg.rope_interleave == (kind != "v3_halves")
    assert cfg.tie_word_embeddings == (kind == "v3_halves")
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.dtype) == ((2,), 1, "float32")
    if "yarn" in str(MODELS[kind][2].get("rope_parameters", {})):
        assert dict(cfg.rope_scaling) == {"factor": 8.0, "original_max_position_embeddings": 16.0, "mscale": 1.0,
                                          "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}
        # transformers' softmax scale: qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2
        assert cfg.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * 0.8 * np.log(8.0) + 1) ** 2)
    else:
        assert cfg.rope_scaling is None and cfg.softmax_scale == pytest.approx(24 ** -0.5)


@pytest.mark.parametrize("kind", list(MODELS))
def test_dense_logits_match_transformers(models, kind):
    model, folder = models[kind]
    ours, tokenizer = load_hf_deepseek(folder)
    assert tokenizer is None  # no tokenizer.json saved
    for p, a, b in zip(PROMPTS, _dense_logits(ours, PROMPTS), hf_logits(model, PROMPTS), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL * np.abs(b).max(), err_msg=f"{kind}, {len(p)} tokens")


def test_the_correction_bias_and_groups_change_the_routing(models):
    """The V3 checkpoint's routing differs from the same router without its bias or without its group limit:
    the parity above covers both."""
    ours, _ = load_hf_deepseek(models["v3_yarn"][1])
    moe = ours.layers[1].mlp
    rows = jax.random.normal(jax.random.key(0), (64, 32))
    _, experts = moe.routing(rows)
    from pagedjax.model.layers.moe import route

    m = moe.moe
    logits = moe.gate(rows)
    _, unbiased = route(logits, 2, "noaux_tc", True, num_groups=4, topk_groups=2, scaling_factor=2.5)
    _, ungrouped = route(logits, 2, "noaux_tc", True, num_groups=1, topk_groups=1,
                         correction_bias=moe.gate.bias(), scaling_factor=2.5)
    assert (m.num_groups, m.topk_groups) == (4, 2)
    assert not np.array_equal(np.sort(experts, -1), np.sort(unbiased, -1))
    assert not np.array_equal(np.sort(experts, -1), np.sort(ungrouped, -1))


def test_the_multi_token_prediction_layer_is_not_read(models, tmp_path):
    """A V3 checkpoint's `num_nextn_predict_layers` layers (tensors `model.layers.{L}.*`) are skipped; a layer
    beyond them is an unexpected tensor."""
    from safetensors.numpy import load_file, save_file

    _, folder = models["v3_yarn"]
    shutil.copy(folder / "generation_config.json", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.2.eh_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    load_hf_deepseek(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ModelLoadError, match=r"unexpected tensors: \['model.layers.2.eh_proj.weight'\]"):
        load_hf_deepseek(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": "1"}))
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers"):
        load_hf_deepseek(tmp_path)


def test_a_missing_or_misshaped_tensor_is_named(models, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, folder = models["v3_yarn"]
    shutil.copy(folder / "config.json", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = tensors["model.layers.0.self_attn.kv_b_proj.weight"][:-4]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        load_hf_deepseek(tmp_path)
    assert "missing tensors: ['model.layers.1.mlp.gate.e_score_correction_bias']" in str(e.value)
    assert "model.layers.0.self_attn.kv_b_proj.weight: checkpoint [108, 16], model expects [112, 16]" in str(e.value)


def test_a_deepseek_folder_is_not_a_model_config(models):
    with pytest.raises(ModelLoadError, match="a DeepSeek model, not a ModelConfig one"):
        load_hf_config(models["v2_greedy"][1])


def _config(entry, changes: dict) -> dict:
    """The saved config.json of `entry` (a `models` value) with `changes`."""
    return {**json.loads((entry[1] / "config.json").read_text()), **changes}


@pytest.mark.parametrize("kind, changes, field", [
    ("v2_greedy", {"hidden_act": "gelu"}, "hidden_act"),
    ("v2_greedy", {"attention_bias": True}, "attention_bias"),
    ("v2_greedy", {"mlp_bias": True}, "mlp_bias"),
    ("v3_yarn", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("v2_greedy", {"rope_interleave": False}, "rope_interleave"),
    ("v2_greedy", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear"),
    ("v3_yarn", {"rope_parameters": {**_YARN, "low_freq_factor": 1.0}}, "low_freq_factor"),
    ("v3_yarn", {"rope_parameters": {**_YARN, "factor": "4"}}, "factor"),
    ("v3_yarn", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("v2_greedy", {"scoring_func": "sigmoid"}, "scoring_func"),
    ("v3_yarn", {"scoring_func": "softmax"}, "scoring_func"),
    ("v3_yarn", {"topk_method": "greedy"}, "topk_method"),
    ("v2_greedy", {"topk_method": "noaux_tc"}, "topk_method"),
    ("v2_greedy", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("v2_greedy", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("v2_greedy", {"first_k_dense_replace": 3}, "first_k_dense_replace"),
    ("v2_greedy", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("v2_greedy", {"qk_nope_head_dim": -1}, "qk_nope_head_dim"),
    ("v2_greedy", {"kv_lora_rank": "16"}, "kv_lora_rank"),
    ("v3_yarn", {"n_group": 3}, "num_groups"),  # 8 experts in 3 groups
    ("v3_yarn", {"n_group": 8, "topk_group": 4}, "at least 2 experts"),
    ("v2_lora_grouped", {"n_group": None}, "n_group"),
    ("v2_greedy", {"n_shared_experts": 0}, "n_shared_experts"),
    ("v2_greedy", {"dtype": "int8"}, "dtype"),
])
def test_unsupported_fields_are_named(models, tmp_path, kind, changes, field):
    (tmp_path / "config.json").write_text(json.dumps(_config(models[kind], changes)))
    with pytest.raises(ModelLoadError, match=field):
        load_deepseek_config(tmp_path)


def test_yarn_defaults_as_transformers_completes_them(models, tmp_path):
    """A YaRN `factor` of null is max_position_embeddings / original_max_position_embeddings; a top-level
    original_max_position_embeddings is the one read."""
    rope = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64, "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(_config(models["v3_yarn"], {
        "rope_parameters": rope, "original_max_position_embeddings": 32})))
    assert dict(load_deepseek_config(tmp_path).rope_scaling) == {"factor": 4.0,
                                                                 "original_max_position_embeddings": 32}


def test_int8_weights_keep_the_latent_up_projection_and_the_router_float(models):
    """`quantize_model` (what `from_pretrained(quantization=...)` applies to a model of the contract) quantizes
    the linear layers; `kv_b_proj`, which the absorbed path reads by head, and the router stay float. Measured
    against the float model: the top-1 token agrees at 33 of the 36 positions."""
    from pagedjax.model.families.deepseek import LatentUpProjection, Router
    from pagedjax.model.layers.quant import QuantizedLinear, quantize_model

    ours, _ = load_hf_deepseek(models["v3_yarn"][1])
    float_logits = np.concatenate(_dense_logits(ours, PROMPTS))
    quantize_model(ours, "int8")
    attn, mlp = ours.layers[1].self_attn, ours.layers[1].mlp
    assert isinstance(attn.q_a_proj, QuantizedLinear) and isinstance(mlp.shared_experts.up_proj, QuantizedLinear)
    assert isinstance(attn.kv_b_proj, LatentUpProjection) and isinstance(mlp.gate, Router)
    got = np.concatenate(_dense_logits(ours, PROMPTS))
    assert np.sum(got.argmax(-1) == float_logits.argmax(-1)) >= 30
    assert np.abs(got - float_logits).mean() < 0.15 * np.abs(float_logits).mean()


def test_the_official_v3_config_json_maps(tmp_path):
    """DeepSeek-V3's own config.json (its fields and spellings: `rope_scaling` with "type", a top-level
    `rope_theta`, `topk_method` / `scoring_func`, FP8 `quantization_config`, bf16), shrunk to 2 layers."""
    official = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "bos_token_id": 0,
        "eos_token_id": 1, "tie_word_embeddings": False, "rope_theta": 10000, "attention_bias": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(official))
    cfg = load_deepseek_config(tmp_path)
    assert cfg.moe == DeepSeekMoEConfig(256, 8, 2048, 1, 1, "noaux_tc", 8, 4, True, 2.5)
    assert (cfg.dtype, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.max_position_embeddings) == ("bfloat16", 1536, 512,
                                                                                          163840)
    assert dict(cfg.rope_scaling) == {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
    assert cfg.spec.kv_layers[0].kv_lora_rank + cfg.spec.kv_layers[0].rope_dim == 576


# ------------------------------------------------------------------------------------------ the config itself
_BASE = dict(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, intermediate_size=8, kv_lora_rank=4,
             qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)


@pytest.mark.parametrize("changes, error, match", [
    ({"num_heads": 0}, ValueError, "DeepSeekConfig.num_heads"),
    ({"qk_rope_head_dim": 3}, ValueError, "qk_rope_head_dim must be even"),
    ({"q_lora_rank": 2.0}, TypeError, "DeepSeekConfig.q_lora_rank"),
    ({"rope_interleave": 1}, TypeError, "rope_interleave"),
    ({"dtype": "float64"}, ValueError, "DeepSeekConfig.dtype"),
    ({"eos_token_ids": (16,)}, ValueError, "eos_token_ids"),
    ({"rope_scaling": {"factor": 2.0}}, ValueError, "original_max_position_embeddings"),
    ({"rope_scaling": {"factor": 2.0, "original_max_position_embeddings": 8, "beta": 1}}, ValueError, "'beta'"),
    ({"rope_scaling": {"factor": True, "original_max_position_embeddings": 8}}, TypeError, "factor"),
    ({"rope_scaling": "yarn"}, TypeError, "rope_scaling"),
    ({"moe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 4, "first_k_dense_replace": 3}},
     ValueError, "first_k_dense_replace"),
    ({"moe": {"num_experts": 4, "num_experts_per_tok": 5, "intermediate_size": 4}}, ValueError,
     "num_experts_per_tok"),
    ({"moe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 4, "num_groups": 2}}, ValueError,
     "'greedy'"),
    ({"moe": {"num_experts": 8, "num_experts_per_tok": 3, "intermediate_size": 4, "router": "noaux_tc",
              "num_groups": 4, "topk_groups": 1}}, ValueError, "eligible groups"),
    ({"moe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 4, "norm_topk_prob": True}},
     ValueError, "norm_topk_prob"),
    ({"moe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 4, "router": "sigmoid"}},
     ValueError, "router"),
    ({"moe": {"num_experts": 4, "experts_per_token": 2}}, ValueError, "experts_per_token"),
])
def test_config_fields_are_checked(changes, error, match):
    with pytest.raises(error, match=match):
        DeepSeekConfig(**{**_BASE, **changes})


@pytest.mark.parametrize("router, kwargs, match", [
    ("softmax_topk", dict(num_groups=2, topk_groups=1), "no expert groups"),
    ("greedy", dict(num_groups=2, topk_groups=1), "no expert groups"),
    ("group_limited_greedy", dict(num_groups=2, topk_groups=1, correction_bias=jnp.zeros(4)), "correction_bias"),
    ("sigmoid", {}, "unknown MoE router"),
])
def test_route_refuses_what_a_router_does_not_take(router, kwargs, match):
    from pagedjax.model.layers.moe import route

    with pytest.raises(ValueError, match=match):
        route(jnp.zeros((3, 4)), 2, router, False, **kwargs)


# ------------------------------------------------------------------------------------------------ the engine
MAX_NEW = 6


def _engine(folder, **cache):
    """An engine over the folder: blocks of 4 slots, at most 8 tokens a step (the longer prompts prefill in
    chunks), the XLA paths."""
    from pagedjax.config import CacheConfig, SchedulerConfig
    from pagedjax.engine import LLMEngine

    return LLMEngine.from_pretrained(folder, cache_config=CacheConfig(block_size=4, num_blocks=64, **cache),
                                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8,
                                                                      max_model_len=40),
                                     backend="xla")


# (CI time: ~10 s each) Two of the four by default, between them V2 and V3 routing, q_lora_rank set (q_a / q_b) and
# not, YaRN (its mscale in the absorbed attention's scale), rope_interleave on and off and a tied head; the other
# two's own fields (greedy routing, two shared experts; V3 with q_lora_rank and YaRN together) are the dense
# forward's, which test_dense_logits_match_transformers checks for all four.
ENGINE_KINDS = ["v2_lora_grouped", pytest.param("v2_greedy", marks=pytest.mark.slow),
                pytest.param("v3_yarn", marks=pytest.mark.slow), "v3_halves"]


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_engine_greedy_matches_transformers_generate(models, kind):
    """Absorbed MLA over latent pages, through chunked prefill (19 tokens at 8 a step), a prefix-cache hit (the
    longest prompt again, its full blocks cached) and n = 2 greedy forks of one prompt."""
    from pagedjax.sampling_params import SamplingParams

    model, folder = models[kind]
    expected, margins = zip(*(hf_greedy(model, p, MAX_NEW) for p in PROMPTS), strict=True)
    assert min(margins) > MIN_MARGIN, min(margins)  # a near tie would make the comparison one of rounding
    engine = _engine(folder)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=2)  # two greedy samples
    outs = engine.generate(PROMPTS, [greedy, greedy, forked, greedy], use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [list(w) for w in expected], kind
    assert [c.token_ids for c in outs[2].outputs] == [list(expected[2])] * 2
    again = engine.generate([PROMPTS[-1]], greedy, use_tqdm=False)[0]  # its full blocks cached
    assert again.num_cached_tokens >= 16 and again.output_token_ids == list(expected[-1])


# ----------------------------------------------------------------------------------- block-scaled FP8 weights
FP8_BLOCK = [8, 16]  # partial blocks at the edges of the 24- and 12-wide kernels


def with_weights(model, weights: dict[str, np.ndarray]):
    """A copy of the transformers `model` holding `weights` (checkpoint names: one tensor per expert and
    projection, which transformers 5 keeps fused, `[E, 2 * width, hidden]` gate | up and `[E, hidden, width]`)."""
    import copy

    reference = copy.deepcopy(model)
    state = reference.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            if name in state:
                state[name].copy_(torch.from_numpy(w))
                continue
            *layer, _, e, proj, _ = name.split(".")
            prefix = ".".join(layer)
            width = w.shape[0] if proj != "down_proj" else w.shape[1]
            if proj == "down_proj":
                state[f"{prefix}.experts.down_proj"][int(e)].copy_(torch.from_numpy(w))
            else:
                rows = slice(0, width) if proj == "gate_proj" else slice(width, 2 * width)
                state[f"{prefix}.experts.gate_up_proj"][int(e), rows].copy_(torch.from_numpy(w))
    return reference


def _v3_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(
        ("proj.weight", "indexer.wq_b.weight", "indexer.wk.weight")) or ".experts." in name


def fp8_folder(src, dst, block=FP8_BLOCK, linear=_v3_linear) -> dict[str, np.ndarray]:
    """The float checkpoint `src` as DeepSeek V3's official FP8 layout in `dst`: every linear weight of the
    decoder layers (`linear(name)`; V3's: a sparse layer's indexer's too, not the router, the norms, the embeddings
    or the head) float8 e4m3 with float32 `weight_scale_inv` per [8, 16] block (amax / 448). Returns the
    dequantized weights by name."""
    import ml_dtypes
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    tensors = load_file(str(src / "model.safetensors"))
    out, dequantized = {}, {}
    for name, w in tensors.items():
        if not (linear(name) and w.ndim == 2):
            out[name] = torch.from_numpy(w)
            continue
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
        padded[: w.shape[0], : w.shape[1]] = w
        amax = np.abs(padded.reshape(rows, block[0], cols, block[1])).max(axis=(1, 3))
        scale = np.maximum(amax, 1e-12) / 448.0
        full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]]
        q = (w / full).astype(ml_dtypes.float8_e4m3fn)
        dequantized[name] = q.astype(np.float32) * full
        out[name] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = torch.from_numpy(scale.astype(np.float32))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": block}
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def test_fp8_block_scaled_checkpoint_matches_transformers_over_its_dequantized_weights(models, tmp_path):
    """Dequantized at load: exactly transformers over the same dequantized weights (float32). Its accuracy
    against the float model it was quantized from, measured (e4m3 keeps 3 mantissa bits; this tiny random model
    with large weights and flipping expert choices is far more sensitive than a trained one): the top-1 token
    agrees at 32 of the 35 positions, the mean logit error is 0.14 against a mean magnitude of 0.87 (one
    position, whose experts flip, is off by 3.1). A wrong block scale would leave the top-1 agreement at chance
    (1 / 80)."""
    model, folder = models["v3_yarn"]
    dequantized = fp8_folder(folder, tmp_path)
    ours, _ = load_hf_deepseek(tmp_path)
    reference = with_weights(model, dequantized)
    got, fp8_ref, float_ref = _dense_logits(ours, PROMPTS), hf_logits(reference, PROMPTS), hf_logits(model, PROMPTS)
    for p, a, b in zip(PROMPTS, got, fp8_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL * np.abs(b).max(), err_msg=f"{len(p)} tokens")
    a, f = np.concatenate(got), np.concatenate(float_ref)
    agree = np.sum(np.argmax(a, -1) == np.argmax(f, -1))
    assert agree >= 28 and np.abs(a - f).mean() < 0.25 * np.abs(f).mean(), (agree, np.abs(a - f).mean())


@pytest.mark.parametrize("change, match", [
    (dict(fmt="e5m2"), "fmt 'e5m2'"),
    (dict(weight_block_size=None), "weight_block_size None"),
    (dict(quant_method="fbgemm_fp8"), "quant_method 'fbgemm_fp8'"),
])
def test_unsupported_fp8_configs_are_named(models, tmp_path, change, match):
    fp8_folder(models["v3_yarn"][1], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"quantization_config.*{match}"):
        load_hf_deepseek(tmp_path)


def test_a_missing_or_misshaped_fp8_scale_is_named(models, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8_folder(models["v3_yarn"][1], tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    name = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"  # [96, 24] in [8, 16] blocks: [12, 2]
    tensors[name] = tensors[name][:, :1].contiguous()
    tensors["model.norm.weight_scale_inv"] = torch.ones(1)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        load_hf_deepseek(tmp_path)
    assert "missing tensors: ['model.layers.0.self_attn.o_proj.weight_scale_inv']" in str(e.value)
    assert f"{name}: checkpoint [12, 1], blocks of [8, 16] of [96, 24] expect [12, 2]" in str(e.value)
    assert "unexpected tensors: ['model.norm.weight_scale_inv']" in str(e.value)
