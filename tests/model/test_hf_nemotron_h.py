"""Nemotron-H (`model_type` "nemotron_h") from a Hugging Face folder against transformers' `NemotronHForCausalLM` on a
tiny random checkpoint: Mamba-2 layers (their SSM state and conv window as paged snapshots in a state pool, grouped
B / C, conv and projection biases), an attention layer without positional encoding, and a relu2 MLP layer
(`hybrid_override_pattern` "M*M-"). Forward logits within float32 tolerance (transformers' PyTorch Mamba-2 path);
greedy tokens identical through prefix hits (at a block boundary, and ending inside a block: the snapshot at the
last full block), chunked prefill and fused decode, and (marked slow, CI time) preemption and n=2; the Mamba-2
scan's idle decode rows; every unsupported field refused by name, legacy field names read."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax import SamplingParams  # noqa: E402
from pagedjax.config.kv_spec import FullAttention, RecurrentState  # noqa: E402
from pagedjax.model.families.nemotron_h import NemotronH  # noqa: E402
from pagedjax.model.families.nemotron_h import load as load_hf_nemotron_h  # noqa: E402
from pagedjax.model.families.nemotron_h import load_config as load_nemotron_h_config  # noqa: E402
from pagedjax.model.loading.hf_config import load_hf_config  # noqa: E402
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
from tests.model.test_hf import MIN_MARGIN, hf_greedy  # noqa: E402

pytestmark = pytest.mark.hf

# Seed picked so that no greedy step of any prompt is a near tie (asserted).
SEED = 6
# 4 Mamba heads of 8 in 2 groups of B / C (state 8), conv of 4 taps; transformers' chunk of 4 (several chunks).
HF_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, hybrid_override_pattern="M*M-", num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
    conv_kernel=4, chunk_size=4, use_bias=True, mlp_bias=True, max_position_embeddings=256, initializer_range=0.2,
    bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Longer than a prefill chunk (8 tokens), but the last.
PROMPTS, SHARED, AT_BOUNDARY, INSIDE = hybrid_prompts((13, None, 2))
POOL = hybrid_pool(num_blocks=11, max_num_seqs=4)  # KV blocks too few for the three prompts at once: preemption


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    POOL.clear()


def random_nemotron_h(seed: int):
    """The tiny transformers model, eager attention, every parameter a loading mistake could hide behind random:
    the norms and D around 1, A_log, dt_bias and every bias (transformers initialises them to constants)."""
    hf_config = transformers.NemotronHConfig(**HF_CONFIG)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
            elif name.endswith("dt_bias") or name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The folder, transformers' model and its greedy tokens (once per module)."""
    model = random_nemotron_h(SEED)
    folder = str(tmp_path_factory.mktemp("nemotron_h"))
    model.save_pretrained(folder, safe_serialization=True)
    greedy, margins = {}, []
    for key, prompt in [*enumerate(PROMPTS), ("boundary", AT_BOUNDARY), ("inside", INSIDE)]:
        greedy[key], margin = hf_greedy(model, prompt, MAX_NEW)
        margins.append(margin)
    assert min(margins) > MIN_MARGIN, min(margins)  # no near tie: identical tokens do not hang on rounding
    return SimpleNamespace(model=model, folder=folder, greedy=greedy)


def test_config_maps_nemotron_h(ckpt):
    cfg = load_nemotron_h_config(ckpt.folder)
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "mlp")
    assert (cfg.use_bias, cfg.mlp_bias, cfg.use_conv_bias) == (True, True, True)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    state = RecurrentState((4, 8, 8), (4 * 8 + 2 * 2 * 8, 3))  # SSM [H, P, N]; conv window [x | B | C, K - 1]
    assert cfg.spec.kv_layers == (state, FullAttention(2, 8), state)  # the MLP layer holds no cache
    assert cfg.spec.kv_layout.pools == ("kv", "state")
    with pytest.raises(ValueError, match="nemotron_h.load_config"):  # not a ModelConfig model
        load_hf_config(ckpt.folder)


def test_dense_logits_match_transformers(ckpt):
    model, _ = load_hf_nemotron_h(ckpt.folder)
    assert isinstance(model, NemotronH)
    assert_dense_logits_match(model, ckpt.model, [PROMPTS[0], INSIDE, PROMPTS[2]])


def test_greedy_matches_transformers_through_hits_chunked_prefill_and_fused_decode(ckpt):
    with POOL.engine(folder=ckpt.folder) as engine:
        assert engine.scheduler.kv_cache_manager.num_groups == 2  # the Mamba-2 layers and the attention one
        # SHARED's blocks cached by a request of its own (its prefill in chunks of 8 tokens, its decode 4 steps a
        # call), then hits in both groups: 3 blocks exactly, and a prefix whose end is inside the fourth block (its
        # whole blocks: 12, the state snapshot at position 11, never the live state).
        before = engine.stats()  # (a pooled engine's counts are cumulative)
        assert_hits_equal_transformers(engine, PROMPTS[1], AT_BOUNDARY, INSIDE, ckpt.greedy)
        assert engine.stats().fused_decode_calls > before.fused_decode_calls
        assert engine.stats().scheduler.memory.num_used_blocks == 0
        engine.scheduler.check_invariants()


# (CI time: ~10 s of compiling the engine's batched programs) Preemption and forks of `RecurrentState` snapshots are
# the model-independent scheduler / state-pool paths, covered by tests/model/test_hf_qwen3_next.py's greedy test;
# several sequences in one Mamba-2 step by test_dense_logits_match_transformers (three in one ragged step), idle
# rows of a fused decode step by test_idle_rows_of_a_decode_step_touch_no_state_block. This runs them on Nemotron-H.
@pytest.mark.slow
def test_greedy_matches_transformers_through_preemption_and_samples(ckpt):
    want = [ckpt.greedy[i] for i in range(len(PROMPTS))]
    with POOL.engine(folder=ckpt.folder) as engine:
        # All at once, 4 decode steps a call, in a KV pool too small for them: preempted, recomputed.
        before = engine.stats()
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        stats = engine.stats()
        assert stats.scheduler.num_preemptions > before.scheduler.num_preemptions
        assert stats.fused_decode_calls > before.fused_decode_calls
        # Two samples of one prompt fork its state (greedy: both the greedy continuation).
        samples = engine.generate([PROMPTS[0]], SamplingParams(n=2, temperature=0.0, max_tokens=MAX_NEW,
                                                               ignore_eos=True), use_tqdm=False)[0]
        assert [c.token_ids for c in samples.outputs] == [want[0]] * 2
        assert engine.stats().scheduler.memory.num_used_blocks == 0
        engine.scheduler.check_invariants()


def test_idle_rows_of_a_decode_step_touch_no_state_block():
    """`pagedjax.device.recurrent.mamba2_ssd` in a decode-only step whose row 1 is idle (q_len 1, kv_len 0: a
    sequence that stopped inside a fused decode call) reads and writes no state block for it and gives it zeros;
    the live rows are what a step of the live sequences alone computes."""
    from pagedjax.device.attention import AttentionMetadata
    from pagedjax.device.recurrent import mamba2_ssd

    rng = np.random.default_rng(0)
    f32 = lambda *shape: jax.numpy.asarray(rng.standard_normal(shape), jax.numpy.float32)  # noqa: E731
    tables = jax.numpy.asarray([[5, 7, 9], [1, 2, 3], [4, 6, 8]], jax.numpy.int32)
    kv_lens = jax.numpy.asarray([6, 0, 2], jax.numpy.int32)
    meta = AttentionMetadata(jax.numpy.zeros((3,), jax.numpy.int32), tables, kv_lens,
                             jax.numpy.arange(4, dtype=jax.numpy.int32))
    state = f32(10, 4, 2, 3)  # H 4, P 2, N 3
    x, b, c = f32(3, 4, 2), f32(3, 2, 3), f32(3, 2, 3)  # 2 groups
    dt, a, d = jax.nn.softplus(f32(3, 4)), -jax.numpy.exp(f32(4)), f32(4)
    out, new = mamba2_ssd(x, dt, a, b, c, state, meta, block_size=4, backend="xla", decode_only=True, D=d)
    changed = np.flatnonzero(np.any(np.asarray(state != new).reshape(10, -1), axis=1)).tolist()
    assert changed == [4, 7], changed  # only the live sequences' blocks of positions 5 and 1
    assert not np.any(np.asarray(out[1]))
    live = meta._replace(block_tables=tables[::2], kv_lens=kv_lens[::2], cu_q_lens=jax.numpy.arange(3))
    ref, _ = mamba2_ssd(x[::2], dt[::2], a, b[::2], c[::2], state, live, block_size=4, backend="xla", D=d)
    np.testing.assert_array_equal(np.asarray(out[::2]), np.asarray(ref))


@pytest.mark.parametrize("changes, field", [
    ({"layers_block_type": ["linear_attention", "moe", "full_attention"]}, "layers_block_type"),
    ({"layers_block_type": None, "hybrid_override_pattern": "M*E"}, "hybrid_override_pattern"),
    ({"layers_block_type": None, "hybrid_override_pattern": "M*X"}, "hybrid_override_pattern"),
    ({"layers_block_type": ["linear_attention", "mlp"]}, "no 'full_attention'"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ({"mamba_ssm_cache_dtype": "bfloat16"}, "mamba_ssm_cache_dtype"),
    ({"time_step_limit": [0.0, 0.1]}, "time_step_limit"),
    ({"time_step_limit": "wide"}, "time_step_limit"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"sliding_window": 16}, "sliding_window"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"n_groups": 3}, "n_groups"),
    ({"conv_kernel": 1}, "conv_kernel"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": "32"}, "hidden_size"),
])
def test_unsupported_nemotron_h_fields_are_named(ckpt, tmp_path, changes, field):
    config = {**json.loads(open(f"{ckpt.folder}/config.json").read()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_nemotron_h_config(tmp_path)


def test_legacy_field_names_map_as_transformers_reads_them(ckpt, tmp_path):
    """Older config.json files: `hybrid_override_pattern` and the `mamba_*` names (`NemotronHConfig.__post_init__`),
    a plain JSON Infinity in `mamba_dt_limit`."""
    config = json.loads(open(f"{ckpt.folder}/config.json").read())
    for key in ("layers_block_type", "n_groups", "conv_kernel", "use_conv_bias", "time_step_limit"):
        del config[key]
    config.update(hybrid_override_pattern="M*M-", mamba_n_groups=2, mamba_d_conv=4, mamba_conv_bias=False,
                  mamba_dt_limit=[0.0, float("inf")])
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_nemotron_h_config(tmp_path) == load_nemotron_h_config(ckpt.folder).replace(use_conv_bias=False)


def test_tensors_under_model_load_as_under_backbone(ckpt, tmp_path):
    """transformers reads a Nemotron-H checkpoint's tensors under `backbone.` (NVIDIA's, and what its
    `save_pretrained` writes) or `model.`: so does the loader."""
    import shutil

    from safetensors.numpy import load_file, save_file

    tensors = load_file(f"{ckpt.folder}/model.safetensors")
    assert any(name.startswith("backbone.") for name in tensors)
    save_file({name.replace("backbone.", "model.", 1): t for name, t in tensors.items()},
              str(tmp_path / "model.safetensors"))
    shutil.copy(f"{ckpt.folder}/config.json", tmp_path / "config.json")
    want, _ = load_hf_nemotron_h(ckpt.folder)
    got, _ = load_hf_nemotron_h(tmp_path)
    for a, b in zip(jax.tree.leaves(nnx.state(want)), jax.tree.leaves(nnx.state(got)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # (CI time: ~3 s) test_hf_qwen3_next.py runs the same workloads by default; 40 random passed here
@settings(max_examples=2)
@given(w=WAVES)
def test_random_shared_prefix_waves_equal_transformers(ckpt, w):
    """Requests sharing a random prefix in interleaved waves: each one's greedy tokens transformers' for its prompt
    alone, whatever hit the prefix cache (`hybrid_cases.assert_waves_equal_transformers`)."""
    with POOL.engine(folder=ckpt.folder) as engine:
        assert_waves_equal_transformers(engine, ckpt.model, w)
