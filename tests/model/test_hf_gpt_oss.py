"""Hugging Face gpt-oss checkpoints (`pagedjax.model.families.gpt_oss`): one tiny random `GptOssForCausalLM` as
transformers' `save_pretrained` writes it (4 layers alternating a window of 8 and full attention, non-zero sinks,
biased q/k/v/o, router and experts, YaRN not truncated, 4 experts top 2 whose clamped SwiGLU clamps at these
sizes), and the same checkpoint with its expert matrices written as MXFP4 blocks and scales by this test's own
quantizer. The engine (`LLMEngine.from_pretrained`) must give transformers' greedy `generate` tokens through chunked
prefill, preemption and fused decode, prefix hits (at a block boundary and inside a block) and n > 1, its window
and full layers in two KV cache groups; `forward_dense` transformers' logits (1e-4); the MXFP4 folder must load
exactly the experts transformers' own dequantization gives, and the tokens transformers computes with them.
No hub access.
"""

from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.config.moe import MoEConfig  # noqa: E402
from pagedjax.model.layers.rope import RoPE  # noqa: E402
from pagedjax.model.loading.hf_loader import load_hf_config, model_from_state  # noqa: E402
from pagedjax.model.loading.loader import load_pretrained  # noqa: E402
from tests.model.test_hf import MIN_MARGIN, TOL, hf_greedy, hf_logits, random_hf_model  # noqa: E402
from tests.pool import EnginePool  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB, BS, WINDOW, MAX_LEN, MAX_NEW = 96, 4, 8, 64, 8
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0}
# Seed picked so that no greedy step of any prompt is a near tie (asserted).
SEED = 3
HF_CONFIG = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                 swiglu_limit=1.5, max_position_embeddings=256, rope_parameters=YARN, initializer_range=0.2,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
_rng = np.random.default_rng(0)
SHARED = _rng.integers(3, VOCAB, 14).tolist()  # 3 blocks and half of a fourth, past the window
# Longer than the window and than a prefill chunk (8 tokens), but the last.
PROMPTS = [_rng.integers(3, VOCAB, 13).tolist(), SHARED + [3], _rng.integers(3, VOCAB, 16).tolist(),
           _rng.integers(3, VOCAB, 2).tolist()]
AT_BOUNDARY = SHARED[:12] + [40, 41, 42]  # shares SHARED's first 3 blocks exactly
INSIDE = SHARED + [50, 51]  # shares all of SHARED: its hit ends inside SHARED's fourth block
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
NUM_BLOCKS = 20  # too few for the four prompts at once in both groups: preemption


# ------------------------------------------------------------------------------------ MXFP4, this test's own
_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # e2m1 magnitudes; code = index | sign << 3


def to_mxfp4(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float matrix `[E, rows, cols]` as MXFP4: each row's groups of 32 scaled by the power of two that brings
    their largest magnitude within 6 (scale byte = exponent + 127), each value rounded to the nearest e2m1 code,
    two codes a byte (value 2j in the low nibble of byte j, 2j + 1 in the high). -> (blocks uint8 `[E, rows,
    cols / 32, 16]`, scales uint8 `[E, rows, cols / 32]`)."""
    groups = matrix.astype(np.float64).reshape(*matrix.shape[:2], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 1e-30) / 6)).astype(np.int32)
    scaled = groups / np.exp2(exponent)[..., None]
    codes = (np.abs(np.abs(scaled)[..., None] - _FP4).argmin(-1) | (scaled < 0) << 3).astype(np.uint8)
    return (codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8), (exponent + 127).astype(np.uint8)


def write_mxfp4_folder(src: str, dst: str) -> None:
    """`src`'s checkpoint with every expert matrix (`gate_up_proj` `[E, hidden, 2 * width]`, `down_proj` `[E, width,
    hidden]`) stored as MXFP4 blocks and scales of its transpose, as the released checkpoints are."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = {}
    for name, value in load_file(f"{src}/model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = to_mxfp4(value.transpose(0, 2, 1))
        else:
            tensors[name] = value
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(open(f"{dst}/config.json").read())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    open(f"{dst}/config.json", "w").write(json.dumps(config))


def transformers_dequantized(model, folder: str):
    """`model` holding the experts of the MXFP4 checkpoint in `folder` as transformers dequantizes them
    (`convert_moe_packed_tensors`, float32)."""
    from safetensors.numpy import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(f"{folder}/model.safetensors")
    model = copy.deepcopy(model)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{i}.mlp.experts.{proj}"
                value = convert_moe_packed_tensors(torch.from_numpy(tensors[f"{name}_blocks"]),
                                                   torch.from_numpy(tensors[f"{name}_scales"]), dtype=torch.float32)
                getattr(layer.mlp.experts, proj).copy_(value)
    return model


# ------------------------------------------------------------------------------------------------ fixtures
def make_engine(folder: str) -> LLMEngine:
    return LLMEngine.from_pretrained(folder, cache_config=CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS),
                                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8,
                                                                      max_model_len=MAX_LEN),
                                     decode_steps_per_call=4, backend="xla")


POOL = EnginePool(make_engine)


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    POOL.clear()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The float and MXFP4 folders, transformers' models of both, and their greedy tokens (once per module)."""
    model = random_hf_model("GptOssConfig", SEED, HF_CONFIG)  # biases random (those of the experts init to 0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(2 * torch.randn_like(layer.self_attn.sinks))
    folder, mx_folder = str(tmp_path_factory.mktemp("gpt_oss")), str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    model.save_pretrained(folder, safe_serialization=True)
    write_mxfp4_folder(folder, mx_folder)
    mx_model = transformers_dequantized(model, mx_folder)
    greedy, margins = {}, []
    for key, prompt in [*enumerate(PROMPTS), ("boundary", AT_BOUNDARY), ("inside", INSIDE)]:
        greedy[key], margin = hf_greedy(model, prompt, MAX_NEW)
        margins.append(margin)
    mx_greedy = []
    for prompt in PROMPTS:
        tokens, margin = hf_greedy(mx_model, prompt, MAX_NEW)
        mx_greedy.append(tokens)
        margins.append(margin)
    assert min(margins) > MIN_MARGIN, min(margins)  # no near tie: identical tokens do not hang on rounding
    return SimpleNamespace(model=model, folder=folder, mx_model=mx_model, mx_folder=mx_folder, greedy=greedy,
                           mx_greedy=mx_greedy)


# ------------------------------------------------------------------------------------------------- tests
def test_config_maps_gpt_oss(ckpt):
    cfg = load_hf_config(ckpt.folder)
    assert cfg.sliding_windows == (WINDOW, None, WINDOW, None)
    assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_proj_bias and not cfg.tie_word_embeddings
    assert (cfg.rope_theta, dict(cfg.rope_scaling)) == (10000.0, {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False})
    assert cfg.moe == MoEConfig(4, 2, 32, router="topk_softmax", router_bias=True, expert_bias=True,
                                activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=1.5)
    # This YaRN's truncation changes its frequencies (a loader dropping `truncate` would be caught).
    truncated = dict(cfg.rope_scaling, truncate=True)
    assert not np.array_equal(RoPE(16, 1e4, cfg.rope_scaling).inv_freq(), RoPE(16, 1e4, tuple(truncated.items()))
                              .inv_freq())


def test_fused_experts_are_split_and_the_router_renamed(ckpt):
    """gate_up_proj `[E, hidden, 2 * width]` interleaves gate (even columns) and up (odd); the model holds each
    `[E, width, hidden]` as (out, in), down as stored, the router `mlp.router` as `mlp.gate`."""
    from safetensors.numpy import load_file

    tensors = load_file(f"{ckpt.folder}/model.safetensors")
    _, state, _ = load_pretrained(ckpt.folder)
    mlp, prefix = state["layers"][1]["mlp"], "model.layers.1.mlp"
    gate_up, bias = tensors[f"{prefix}.experts.gate_up_proj"], tensors[f"{prefix}.experts.gate_up_proj_bias"]
    want = {"gate_proj": gate_up[:, :, 0::2].transpose(0, 2, 1), "up_proj": gate_up[:, :, 1::2].transpose(0, 2, 1),
            "down_proj": tensors[f"{prefix}.experts.down_proj"], "gate_proj_bias": bias[:, 0::2],
            "up_proj_bias": bias[:, 1::2], "down_proj_bias": tensors[f"{prefix}.experts.down_proj_bias"]}
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(mlp["experts"][name].get_value()), value, err_msg=name)
    np.testing.assert_array_equal(np.asarray(mlp["gate"]["kernel"].get_value()), tensors[f"{prefix}.router.weight"].T)
    np.testing.assert_array_equal(np.asarray(mlp["gate"]["bias"].get_value()), tensors[f"{prefix}.router.bias"])
    np.testing.assert_array_equal(np.asarray(state["layers"][1]["self_attn"]["sinks"].get_value()),
                                  tensors["model.layers.1.self_attn.sinks"])


def test_dense_logits_match_transformers_and_the_sinks_matter(ckpt):
    cfg, state, _ = load_pretrained(ckpt.folder)
    graphdef, params = nnx.split(model_from_state(cfg, state))
    forward = jax.jit(lambda params, batch: nnx.merge(graphdef, params).forward_dense(batch))
    batch = np.zeros((len(PROMPTS), max(map(len, PROMPTS))), np.int32)
    for i, p in enumerate(PROMPTS):
        batch[i, :len(p)] = p
    ref = hf_logits(ckpt.model, PROMPTS)
    got = np.asarray(forward(params, batch))
    for i, p in enumerate(PROMPTS):
        np.testing.assert_allclose(got[i, :len(p)], ref[i], atol=TOL, rtol=TOL, err_msg=f"{len(p)} tokens")
    # Sinks of -1e30 take no share of any softmax: without them the logits are far from transformers'.
    for layer in params["layers"].values():
        layer["self_attn"]["sinks"].set_value(jnp.full_like(layer["self_attn"]["sinks"].get_value(), -1e30))
    assert np.abs(np.asarray(forward(params, batch))[0, :len(PROMPTS[0])] - ref[0]).max() > 100 * TOL


def test_greedy_matches_transformers_through_hits_chunks_preemption_and_samples(ckpt):
    want = [ckpt.greedy[i] for i in range(len(PROMPTS))]
    with POOL.engine(folder=ckpt.folder) as engine:
        assert engine.scheduler.kv_cache_manager.num_groups == 2  # the window layers and the full ones
        # SHARED's blocks cached by a request of its own (its prefill in chunks of 8 tokens), then hits in both
        # groups: 3 blocks exactly, and a prefix whose end is inside the fourth block (its whole blocks: 12).
        assert engine.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want[1]
        for key, prompt in (("boundary", AT_BOUNDARY), ("inside", INSIDE)):
            out = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
            assert (out.num_cached_tokens, out.outputs[0].token_ids) == (12, ckpt.greedy[key]), key
        # All four at once, 4 decode steps a call, in a pool too small for them in both groups: preempted.
        preempted = engine.stats().scheduler.num_preemptions  # (a pooled engine's counts are cumulative)
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert engine.stats().scheduler.num_preemptions > preempted
        # Two samples of one prompt share its blocks (greedy: both the greedy continuation).
        samples = engine.generate([PROMPTS[2]], SamplingParams(n=2, temperature=0.0, max_tokens=MAX_NEW,
                                                               ignore_eos=True), use_tqdm=False)[0]
        assert [c.token_ids for c in samples.outputs] == [want[2]] * 2
        assert engine.stats().scheduler.memory.num_used_blocks == 0


def test_mxfp4_checkpoint_loads_transformers_dequantized_experts_and_tokens(ckpt):
    cfg, state, _ = load_pretrained(ckpt.mx_folder)
    assert cfg == load_hf_config(ckpt.folder) and cfg.quantization is None  # dequantized on load
    float_cfg, float_state, _ = load_pretrained(ckpt.folder)
    for i, layer in enumerate(ckpt.mx_model.model.layers):
        experts, gate_up = state["layers"][i]["mlp"]["experts"], layer.mlp.experts.gate_up_proj.detach().numpy()
        want = {"gate_proj": gate_up[:, :, 0::2].transpose(0, 2, 1), "up_proj": gate_up[:, :, 1::2].transpose(0, 2, 1),
                "down_proj": layer.mlp.experts.down_proj.detach().numpy()}
        for name, value in want.items():  # exactly transformers' values, which are not the float checkpoint's
            got = np.asarray(experts[name].get_value())
            np.testing.assert_array_equal(got, value, err_msg=f"layer {i} {name}")
            assert not np.array_equal(got, np.asarray(float_state["layers"][i]["mlp"]["experts"][name].get_value()))
    with POOL.engine(folder=ckpt.folder) as engine:
        engine.update_weights(state)
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ckpt.mx_greedy
        engine.update_weights(float_state)  # back to the folder's own weights for the pool's next test


@pytest.mark.parametrize("changes, field", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 64}}, "needs 'factor'"),
    ({"rope_parameters": {**YARN, "low_freq_factor": 1.0}}, "low_freq_factor"),
    ({"sliding_window": None}, "sliding_window"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]},
     "layer_types"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"swiglu_limit": "7"}, "swiglu_limit"),
])
def test_unsupported_gpt_oss_fields_are_named(ckpt, tmp_path, changes, field):
    config = {**json.loads(open(f"{ckpt.folder}/config.json").read()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_hf_config(tmp_path)
