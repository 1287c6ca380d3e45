"""Qwen3-Next (`model_type` "qwen3_next") from a Hugging Face folder against transformers' `Qwen3NextForCausalLM` on a
tiny random checkpoint: gated DeltaNet layers (their recurrent state and conv window as paged snapshots in a state
pool) beside gated full-attention layers with partial RoPE, sparse MoE layers with a shared expert beside a dense
MLP layer (`mlp_only_layers`). Forward logits within float32 tolerance; greedy tokens identical through prefix hits
(at a block boundary, and ending inside a block: the snapshot at the last full block), chunked prefill, preemption,
fused decode and n=2, and interleaved requests sharing a prefix then a hit (tpu-inference #3358); every unsupported
field refused by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax import SamplingParams  # noqa: E402
from pagedjax.config.kv_spec import FullAttention, RecurrentState  # noqa: E402
from pagedjax.model.families.qwen3_next import Qwen3Next  # noqa: E402
from pagedjax.model.families.qwen3_next import load as load_hf_qwen3_next  # noqa: E402
from pagedjax.model.families.qwen3_next import load_config as load_qwen3_next_config  # noqa: E402
from pagedjax.model.loading.hf_config import load_hf_config  # noqa: E402
from tests.model.test_hf import MIN_MARGIN, hf_greedy  # noqa: E402

pytestmark = pytest.mark.hf

from tests.model.hybrid_cases import (  # noqa: E402
    BS,
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

# Seed picked so that no greedy step of any prompt is a near tie (asserted).
SEED = 11
HF_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=48, layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, mlp_only_layers=[1], max_position_embeddings=256, initializer_range=0.2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Longer than a prefill chunk (8 tokens), but the last.
PROMPTS, SHARED, AT_BOUNDARY, INSIDE = hybrid_prompts((13, None, 16, 2))
POOL = hybrid_pool(num_blocks=14, max_num_seqs=4)  # KV blocks too few for the four prompts at once: preemption


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    POOL.clear()


def random_qwen3_next(seed: int):
    """The tiny transformers model, eager attention, every parameter a loading mistake could hide behind random:
    the zero-centred norms around 0, the gated norm around 1, dt_bias too."""
    hf_config = transformers.Qwen3NextConfig(**HF_CONFIG)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The folder, transformers' model and its greedy tokens (once per module)."""
    model = random_qwen3_next(SEED)
    folder = str(tmp_path_factory.mktemp("qwen3_next"))
    model.save_pretrained(folder, safe_serialization=True)
    greedy, margins = {}, []
    for key, prompt in [*enumerate(PROMPTS), ("boundary", AT_BOUNDARY), ("inside", INSIDE)]:
        greedy[key], margin = hf_greedy(model, prompt, MAX_NEW)
        margins.append(margin)
    assert min(margins) > MIN_MARGIN, min(margins)  # no near tie: identical tokens do not hang on rounding
    return SimpleNamespace(model=model, folder=folder, greedy=greedy)


def test_config_maps_qwen3_next(ckpt):
    cfg = load_qwen3_next_config(ckpt.folder)
    assert cfg.layer_types == tuple(HF_CONFIG["layer_types"]) and cfg.rotary_dim == 8
    assert cfg.moe_layers == (True, False, True) and (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    assert cfg.norm_topk_prob and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    state = RecurrentState((4, 8, 8), (2 * 2 * 8 + 4 * 8, 3))
    assert cfg.spec.kv_layers == (state, FullAttention(2, 16), state)
    assert cfg.spec.kv_layout.pools == ("kv", "state")
    with pytest.raises(ValueError, match="qwen3_next.load_config"):  # not a ModelConfig model
        load_hf_config(ckpt.folder)


def test_dense_logits_match_transformers(ckpt):
    model, _ = load_hf_qwen3_next(ckpt.folder)
    assert isinstance(model, Qwen3Next)
    assert_dense_logits_match(model, ckpt.model, PROMPTS)


def test_greedy_matches_transformers_through_hits_chunks_preemption_and_samples(ckpt):
    want = [ckpt.greedy[i] for i in range(len(PROMPTS))]
    with POOL.engine(folder=ckpt.folder) as engine:
        assert engine.scheduler.kv_cache_manager.num_groups == 2  # the state layers and the full one
        # SHARED's blocks cached by a request of its own (its prefill in chunks of 8 tokens), then hits in both
        # groups: 3 blocks exactly, and a prefix whose end is inside the fourth block (its whole blocks: 12, the
        # state snapshot at position 11, never the live state).
        assert_hits_equal_transformers(engine, PROMPTS[1], AT_BOUNDARY, INSIDE, ckpt.greedy)
        # All four at once, 4 decode steps a call, in a KV pool too small for them: preempted, recomputed.
        before = engine.stats()  # (a pooled engine's counts are cumulative)
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        stats = engine.stats()
        assert stats.scheduler.num_preemptions > before.scheduler.num_preemptions
        assert stats.fused_decode_calls > before.fused_decode_calls
        # Two samples of one prompt fork its state (greedy: both the greedy continuation).
        samples = engine.generate([PROMPTS[2]], SamplingParams(n=2, temperature=0.0, max_tokens=MAX_NEW,
                                                               ignore_eos=True), use_tqdm=False)[0]
        assert [c.token_ids for c in samples.outputs] == [want[2]] * 2
        assert engine.stats().scheduler.memory.num_used_blocks == 0
        engine.scheduler.check_invariants()


def test_interleaved_requests_sharing_a_prefix_then_a_hit_equal_transformers(ckpt):
    """tpu-inference #3358: two requests sharing SHARED run interleaved (each step advancing both), then a third
    hits it: its state must be the snapshot at the hit's end, not what a running request has made of it since."""
    with POOL.engine(folder=ckpt.folder) as engine:
        engine.add_request("a", PROMPTS[1], GREEDY)
        engine.add_request("b", INSIDE, GREEDY)
        done = {}
        for _ in range(3):  # a few steps of both: their states move past the shared blocks
            for out in engine.step():
                done[out.request_id] = out
        engine.add_request("c", AT_BOUNDARY, GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            engine.scheduler.check_invariants()
        assert done["c"].num_cached_tokens == 12
        assert [done[r].outputs[0].token_ids for r in "abc"] == [ckpt.greedy[1], ckpt.greedy["inside"],
                                                                 ckpt.greedy["boundary"]]


@pytest.mark.parametrize("changes, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     "partial_rotary_factor"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3}, "no 'full_attention'"),
    ({"layer_types": ["full_attention"] * 2}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"mlp_only_layers": [3]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": "32"}, "hidden_size"),
])
def test_unsupported_qwen3_next_fields_are_named(ckpt, tmp_path, changes, field):
    config = {**json.loads(open(f"{ckpt.folder}/config.json").read()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_qwen3_next_config(tmp_path)


def test_idle_rows_of_a_decode_step_touch_no_state_block():
    """The fused decode loop keeps a stopped sequence's row with q_len 1 and kv_len 0: the recurrent ops must read
    and write nothing for it (unmasked, the XLA path wrote a state "after position -1" into a block of its table,
    its first: a cached prefix snapshot another request then hit, with wrong tokens). Live rows are unchanged by it."""
    from pagedjax.device.attention import AttentionMetadata
    from pagedjax.device.recurrent import causal_conv1d, gated_delta_rule

    rng = np.random.default_rng(0)
    f32 = lambda *shape: jax.numpy.asarray(rng.standard_normal(shape), jax.numpy.float32)  # noqa: E731
    tables = jax.numpy.asarray([[5, 7, 9], [1, 2, 3], [4, 6, 8]], jax.numpy.int32)  # row 1 idle: its last column 3
    kv_lens = jax.numpy.asarray([6, 0, 2], jax.numpy.int32)
    meta = AttentionMetadata(jax.numpy.zeros((3,), jax.numpy.int32), tables, kv_lens,
                             jax.numpy.arange(4, dtype=jax.numpy.int32))
    state, conv = f32(10, 2, 4, 4), f32(10, 6, 3)
    q, k, v = f32(3, 2, 4), f32(3, 2, 4), f32(3, 2, 4)
    g, beta = -jax.numpy.abs(f32(3, 2)), jax.nn.sigmoid(f32(3, 2))
    x, w = f32(3, 6), f32(6, 4)
    out, new_state = gated_delta_rule(q, k, v, g, beta, state, meta, block_size=4, backend="xla", decode_only=True)
    conv_out, new_conv = causal_conv1d(x, w, conv, meta, block_size=4, backend="xla", decode_only=True,
                                       activation="silu")
    for pages, new in ((state, new_state), (conv, new_conv)):
        changed = np.flatnonzero(np.any(np.asarray(pages != new).reshape(10, -1), axis=1)).tolist()
        assert changed == [4, 7], changed  # only the live sequences' blocks of positions 5 and 1
    assert not np.any(np.asarray(out[1])) and not np.any(np.asarray(conv_out[1]))
    # The live rows as a step of the live sequences alone computes them.
    live = meta._replace(block_tables=tables[::2], kv_lens=kv_lens[::2], cu_q_lens=jax.numpy.arange(3))
    ref, _ = gated_delta_rule(q[::2], k[::2], v[::2], g[::2], beta[::2], state, live, block_size=4, backend="xla")
    ref_conv, _ = causal_conv1d(x[::2], w, conv, live, block_size=4, backend="xla", activation="silu")
    np.testing.assert_array_equal(np.asarray(out[::2]), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(conv_out[::2]), np.asarray(ref_conv))


def test_the_cli_header_names_the_state_group_and_its_pool(ckpt):
    """`pagedjax-generate --model`'s header: the KV cache groups (the state layers' among them) and the state
    pool's snapshots with the bytes a running sequence holds."""
    import io

    from pagedjax.cli.report import print_header

    args = SimpleNamespace(model=ckpt.folder, model_class=None, block_size=BS, enable_prefix_caching=True,
                           decode_steps_per_call=4)
    with POOL.engine(folder=ckpt.folder) as engine:
        out = io.StringIO()
        print_header(args, SimpleNamespace(spec=engine.model_spec), engine, 0.5, out)
        snapshot = engine.stats().kv_group_block_bytes[engine.model_spec.kv_layout.group_pools.index(1)]
        (blocks,) = engine.extra_pools
    text = out.getvalue()
    assert "KV cache: 2 groups: 2 state layers, 1 full layer" in text, text
    # a snapshot: each of the 2 state layers' float32 state [4 heads, 8, 8] and conv window [q, k, v channels:
    # 2 x 8 + 2 x 8 + 4 x 8, the kernel's 4 - 1 taps]
    assert snapshot == 2 * 4 * (4 * 8 * 8 + (2 * 8 + 2 * 8 + 4 * 8) * 3)
    assert f"state pool: {blocks:,} blocks of {snapshot:,} bytes" in text and f"{2 * snapshot:,} bytes per sequence" \
        in text, text


@settings(max_examples=2)  # (CI time: about 2 s each; the dev profile's random ones passed)
@given(w=WAVES)
def test_random_shared_prefix_waves_equal_transformers(ckpt, w):
    """Requests sharing a random prefix in interleaved waves: each one's greedy tokens transformers' for its prompt
    alone, whatever hit the prefix cache (`hybrid_cases.assert_waves_equal_transformers`)."""
    with POOL.engine(folder=ckpt.folder) as engine:
        assert_waves_equal_transformers(engine, ckpt.model, w)
