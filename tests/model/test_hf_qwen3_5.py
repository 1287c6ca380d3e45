"""Qwen3.5 (`model_type` "qwen3_5_text", "qwen3_5_moe_text", and the text of "qwen3_5", "qwen3_5_moe") from Hugging
Face folders against transformers' `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` and their
`...ForConditionalGeneration` on tiny random checkpoints: the gated DeltaNet's separate input projections, the
interleaved multimodal RoPE sections (a text position in all three: plain partial RoPE), a dense MLP in every layer
or the MoE with a shared expert in every layer, the conditional-generation checkpoint's `model.language_model.`
tensors beside a vision tower that is not read (and its top-level `tie_word_embeddings`). Forward logits within
float32 tolerance; greedy tokens identical through prefix hits (at a block boundary and inside a block), chunked
prefill, preemption, fused decode and n=2; images refused; every unsupported field refused by name.

Qwen3.5 is a variant of `pagedjax.model.families.qwen3_next`: the serving mechanics its state layers share with
Qwen3-Next (idle decode rows, interleaved requests, the CLI header) are tested in test_hf_qwen3_next.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("transformers has no Qwen3.5", allow_module_level=True)

from pagedjax import SamplingParams  # noqa: E402
from pagedjax.config.kv_spec import FullAttention, RecurrentState  # noqa: E402
from pagedjax.model.families.qwen3_next import Qwen3Next  # noqa: E402
from pagedjax.model.families.qwen3_next import load as load_hf_qwen3_next  # noqa: E402
from pagedjax.model.families.qwen3_next import load_config as load_qwen3_next_config  # noqa: E402
from pagedjax.model.loading.hf_config import load_hf_config  # noqa: E402
from tests.model.test_hf import MIN_MARGIN, hf_greedy, hf_logits  # noqa: E402

pytestmark = pytest.mark.hf

from tests.model.hybrid_cases import (  # noqa: E402
    GREEDY,
    MAX_NEW,
    VOCAB,
    WAVES,
    assert_dense_logits_match,
    assert_hits_equal_transformers,
    assert_waves_equal_transformers,
    hybrid_pool,
    hybrid_prompts,
)

SEED = 1  # no greedy step of any prompt a near tie (asserted)
TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"], linear_conv_kernel_dim=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    # 8 of head_dim 16 rotated: 4 frequencies, split 2 / 1 / 1 among the temporal, height and width positions.
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
DENSE = dict(TEXT, intermediate_size=48)
MOE = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
           tie_word_embeddings=True)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
              num_position_embeddings=16, patch_size=4)
PROMPTS, SHARED, AT_BOUNDARY, INSIDE = hybrid_prompts((13, None, 2))
POOL = hybrid_pool(num_blocks=10, max_num_seqs=3)  # KV blocks too few for the three prompts at once: preemption


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    POOL.clear()


def _randomise(model):
    """Every parameter a loading mistake could hide behind random: the zero-centred norms around 0, the gated norm
    around 1, dt_bias too."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def _eager(config):
    config._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        if hasattr(config, sub):
            getattr(config, sub)._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Four folders, two pairs holding the same decoder: "dense" (Qwen3_5ForCausalLM) and "dense_full" (its
    weights in a Qwen3_5ForConditionalGeneration, beside a vision tower); "moe_full" (Qwen3_5MoeForConditional-
    Generation, tied embeddings) and "moe" (its decoder as a Qwen3_5MoeForCausalLM). The transformers models, and
    the greedy tokens of the conditional-generation dense one (what the engine serves from "dense_full")."""
    torch.manual_seed(SEED)
    dense = _randomise(transformers.Qwen3_5ForCausalLM(_eager(transformers.Qwen3_5TextConfig(**DENSE))).eval())
    dense_full = transformers.Qwen3_5ForConditionalGeneration(_eager(transformers.Qwen3_5Config(
        text_config=DENSE, vision_config=VISION))).eval()
    moe_full = _randomise(transformers.Qwen3_5MoeForConditionalGeneration(_eager(transformers.Qwen3_5MoeConfig(
        text_config=MOE, vision_config=VISION, tie_word_embeddings=True))).eval())
    moe = transformers.Qwen3_5MoeForCausalLM(_eager(transformers.Qwen3_5MoeTextConfig(**MOE))).eval()
    with torch.no_grad():
        dense_full.model.language_model.load_state_dict(dense.model.state_dict())
        dense_full.lm_head.load_state_dict(dense.lm_head.state_dict())
        moe.model.load_state_dict(moe_full.model.language_model.state_dict())
    assert moe.lm_head.weight is moe.model.embed_tokens.weight
    assert moe_full.lm_head.weight is moe_full.model.language_model.embed_tokens.weight
    models = dict(dense=dense, dense_full=dense_full, moe=moe, moe_full=moe_full)
    folders = {}
    for kind, model in models.items():
        folders[kind] = str(tmp_path_factory.mktemp(kind))
        model.save_pretrained(folders[kind], safe_serialization=True)
    greedy, margins = {}, []
    for key, prompt in [*enumerate(PROMPTS), ("boundary", AT_BOUNDARY), ("inside", INSIDE)]:
        greedy[key], margin = hf_greedy(dense_full, prompt, MAX_NEW)
        margins.append(margin)
    assert min(margins) > MIN_MARGIN, min(margins)  # no near tie: identical tokens do not hang on rounding
    return SimpleNamespace(models=models, folders=folders, greedy=greedy)


def test_config_maps_all_four_model_types(ckpts):
    cfgs = {kind: load_qwen3_next_config(folder) for kind, folder in ckpts.folders.items()}
    assert [json.loads(open(f"{f}/config.json").read())["model_type"] for f in ckpts.folders.values()] == [
        "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"]
    dense, moe = cfgs["dense"], cfgs["moe"]
    assert cfgs["dense_full"] == dense and cfgs["moe_full"] == moe  # the text_config is the decoder's config
    assert not dense.fused_projections and dense.rotary_dim == 8 and dense.rope_theta == 10000.0
    assert dense.moe_layers == (False,) * 3 and dense.intermediate_size == 48 and not dense.tie_word_embeddings
    assert moe.moe_layers == (True,) * 3 and (moe.num_experts, moe.num_experts_per_tok) == (4, 2)
    assert moe.norm_topk_prob and moe.tie_word_embeddings and moe.eos_token_ids == (2,) and moe.bos_token_id == 1
    state = RecurrentState((4, 8, 8), (2 * 2 * 8 + 4 * 8, 3))  # conv: [q | k | v] channels
    assert dense.spec.kv_layers == (state, FullAttention(2, 16), state)
    for folder in ckpts.folders.values():
        with pytest.raises(ValueError, match="qwen3_next.load_config"):  # not a ModelConfig model
            load_hf_config(folder)


def test_conditional_generation_checkpoints_load_their_decoders_weights(ckpts):
    """A ForConditionalGeneration folder's decoder (`model.language_model.*`, the vision tower skipped) loads as the
    CausalLM folder holding the same weights does, bit for bit; transformers computes the same logits from both."""
    for causal, full in (("dense", "dense_full"), ("moe", "moe_full")):
        ref = hf_logits(ckpts.models[causal], PROMPTS)
        for got, want in zip(hf_logits(ckpts.models[full], PROMPTS), ref, strict=True):
            np.testing.assert_array_equal(got, want)
        a, b = (nnx.to_flat_state(nnx.state(load_hf_qwen3_next(ckpts.folders[k])[0])) for k in (causal, full))
        assert [p for p, _ in a] == [p for p, _ in b]
        for (path, x), (_, y) in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(path))


@pytest.mark.parametrize("kind", ["dense", "moe_full"])
def test_dense_logits_match_transformers(ckpts, kind):
    model, _ = load_hf_qwen3_next(ckpts.folders[kind])
    assert isinstance(model, Qwen3Next)
    assert_dense_logits_match(model, ckpts.models[kind], PROMPTS)


def test_greedy_matches_transformers_through_chunks_hits_and_fused_decode(ckpts):
    """The conditional-generation folder served by `from_pretrained` (text only; images refused) against
    transformers' greedy generate of that model."""
    with POOL.engine(folder=ckpts.folders["dense_full"]) as engine:
        assert engine.scheduler.kv_cache_manager.num_groups == 2  # the state layers and the full one
        with pytest.raises(ValueError, match="takes no images"):
            engine.generate([{"prompt_token_ids": PROMPTS[0],
                              "multi_modal_data": {"image": np.zeros((8, 8, 3), np.uint8)}}], GREEDY, use_tqdm=False)
        # SHARED's blocks cached by a request of its own (its prefill in chunks of 8 tokens, its decode 4 steps a
        # call), then hits in both groups: 3 blocks exactly, and a prefix whose end is inside the fourth block (the
        # state snapshot at position 11, never the live state).
        before = engine.stats()  # (a pooled engine's counts are cumulative)
        assert_hits_equal_transformers(engine, PROMPTS[1], AT_BOUNDARY, INSIDE, ckpts.greedy)
        assert engine.stats().fused_decode_calls > before.fused_decode_calls
        assert engine.stats().scheduler.memory.num_used_blocks == 0
        engine.scheduler.check_invariants()


# (CI time) the batch shapes this compiles cost more than the rest of the file; preemption and forks of the state
# snapshots are the family module's serving mechanics, covered for Qwen3-Next (the same GatedDeltaNet and cache code)
# by test_hf_qwen3_next.py's test_greedy_matches_transformers_through_hits_chunks_preemption_and_samples, and Qwen3.5's
# forward by test_dense_logits_match_transformers and test_greedy_matches_transformers_through_chunks_hits_and_...
@pytest.mark.slow
def test_greedy_matches_transformers_through_preemption_and_samples(ckpts):
    want = [ckpts.greedy[i] for i in range(len(PROMPTS))]
    with POOL.engine(folder=ckpts.folders["dense_full"]) as engine:
        # All at once, 4 decode steps a call, in a KV pool too small for them: preempted, recomputed.
        before = engine.stats()
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert engine.stats().scheduler.num_preemptions > before.scheduler.num_preemptions
        # Two samples of one prompt fork its state (greedy: both the greedy continuation).
        samples = engine.generate([PROMPTS[0]], SamplingParams(n=2, temperature=0.0, max_tokens=MAX_NEW,
                                                               ignore_eos=True), use_tqdm=False)[0]
        assert [c.token_ids for c in samples.outputs] == [want[0]] * 2
        assert engine.stats().scheduler.memory.num_used_blocks == 0
        engine.scheduler.check_invariants()


# (CI time) the MoE decoder served end to end; its forward is test_dense_logits_match_transformers[moe_full], its
# loading test_conditional_generation_checkpoints_load_their_decoders_weights, the serving (hits, chunks, fused
# decode) the dense one's test_greedy_matches_transformers_through_chunks_hits_and_fused_decode.
@pytest.mark.slow
def test_moe_greedy_matches_transformers_through_a_hit_and_preemption(ckpts):
    model = ckpts.models["moe"]
    want = {}
    for key, prompt in [*enumerate(PROMPTS), ("inside", INSIDE)]:
        want[key], margin = hf_greedy(model, prompt, MAX_NEW)
        assert margin > MIN_MARGIN, (key, margin)
    with POOL.engine(folder=ckpts.folders["moe"]) as engine:
        assert engine.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want[1]
        out = engine.generate([INSIDE], GREEDY, use_tqdm=False)[0]
        assert (out.num_cached_tokens, out.outputs[0].token_ids) == (12, want["inside"])
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [want[i] for i in range(len(PROMPTS))]
        engine.scheduler.check_invariants()


@pytest.mark.parametrize("kind, changes, field", [
    ("dense", {"hidden_act": "gelu"}, "hidden_act"),
    ("dense", {"attention_bias": True}, "attention_bias"),
    ("dense", {"attn_output_gate": False}, "attn_output_gate"),
    ("dense", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("dense", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
    ("dense", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_sections": [2, 1, 1]}},
     "rope_parameters"),
    ("dense", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     "partial_rotary_factor"),
    ("dense", {"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ("dense", {"layer_types": ["linear_attention"] * 3}, "no 'full_attention'"),
    ("dense", {"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ("dense", {"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ("dense", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ("dense", {"num_experts": 4}, "num_experts"),
    ("dense", {"intermediate_size": 0}, "intermediate_size"),
    ("moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("moe", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("moe", {"num_experts": 0}, "num_experts"),
    ("moe", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ("moe", {"hidden_size": "32"}, "hidden_size"),
    ("moe_full", {"text_config": None}, "text_config"),
    ("moe_full", {"text_config": {"model_type": "qwen3_5_text"}}, "text_config"),
    ("moe_full", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_unsupported_qwen3_5_fields_are_named(ckpts, tmp_path, kind, changes, field):
    config = {**json.loads(open(f"{ckpts.folders[kind]}/config.json").read()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_qwen3_next_config(tmp_path)


@pytest.mark.slow  # (CI time: ~3 s) test_hf_qwen3_next.py runs the same workloads by default; 40 random passed here
@settings(max_examples=2)
@given(w=WAVES)
def test_random_shared_prefix_waves_equal_transformers(ckpts, w):
    """Requests sharing a random prefix in interleaved waves: each one's greedy tokens transformers' for its prompt
    alone, whatever hit the prefix cache (`hybrid_cases.assert_waves_equal_transformers`)."""
    with POOL.engine(folder=ckpts.folders["moe"]) as engine:
        assert_waves_equal_transformers(engine, ckpts.models["moe"], w)
