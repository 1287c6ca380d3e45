"""DeepSeek V4 (`deepseek_v4`) from Hugging Face folders: every layer type (sliding window only, CSA with its
indexer, HCA), hyper-connections, the grouped output projection, hash-routed and top-k routed experts. A tiny random
checkpoint made by transformers' own `DeepseekV4ForCausalLM` and `save_pretrained` (the released tensor names), with
its window, compress rates and `index_topk` far below the prompts; its zero-initialised parameters (window-slot
biases, sinks, hyper-connection biases, router biases, `tid2eid`) made random so that each decides the logits.
pagedjax must give transformers' float32 logits over fresh pages, and its greedy tokens token for token through
`LLMEngine.from_pretrained` with chunked prefill (8 tokens a step, ending inside windows), preemption, fused decode,
n = 2 forks and prefix-cache hits at a state block's boundary and inside a block. No hub access.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.config.kv_spec import CompressedEntries, CompressorState, SharedKVWindow  # noqa: E402
from pagedjax.model.api import check_model, forward_on_fresh_pages  # noqa: E402
from pagedjax.model.errors import ModelLoadError  # noqa: E402
from pagedjax.model.families.deepseek_v4 import init_deepseek_v4, load, load_config  # noqa: E402
from tests.model.test_deepseek import fp8_folder  # noqa: E402
from tests.model.test_hf import MIN_MARGIN, TOL, hf_greedy, hf_logits  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB, EXPERTS, BS, MAX_NEW = 80, 8, 4, 8
HF_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.5, q_lora_rank=24, num_experts_per_tok=2,
    n_routed_experts=EXPERTS, n_shared_experts=1, o_groups=2, o_lora_rank=8, hc_mult=2, sliding_window=6,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    index_n_heads=8, index_head_dim=8, index_topk=3, mlp_layer_types=["hash_moe", "moe", "moe"],
    max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2,
    rope_theta=100.0, compress_rope_theta=1000.0)
SEED = 8  # no greedy step of any prompt a near tie (asserted)
_rng = np.random.default_rng(1)
SHARED = _rng.integers(3, VOCAB, 14).tolist()
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (3, 17, 9)] + [SHARED + [3]]
AT_BOUNDARY, INSIDE = SHARED[:12] + [40, 41, 42], SHARED + [50, 51]


def random_v4(seed: int, **changes):
    """The transformers model (of HF_CONFIG with `changes`) with its norms random around 1 and every
    zero-initialised parameter random."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**{**HF_CONFIG, **changes})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("position_bias", "sinks", ".base", "hc_base")):
                p.copy_(0.5 * torch.randn_like(p))
        for module in model.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.copy_(0.3 * torch.randn_like(module.e_score_correction_bias))
            if getattr(module, "tid2eid", None) is not None:
                module.tid2eid.copy_(torch.stack([torch.randperm(EXPERTS)[:2] for _ in range(VOCAB)]))
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = random_v4(SEED)
    folder = tmp_path_factory.mktemp("deepseek_v4")
    model.save_pretrained(str(folder))
    return model, folder


def test_config_maps_deepseek_v4(ckpt):
    """Each layer's KV layers: a window of K = V vectors for every layer, entries (with indexer keys in CSA) and a
    compressor state for the compressed ones."""
    cfg = load_config(ckpt[1])
    assert (cfg.csa_rate, cfg.hca_rate, cfg.rope_dim, cfg.sliding_window, cfg.index_topk) == (2, 4, 8, 6, 3)
    assert cfg.spec.kv_layers == (SharedKVWindow(16, 6),) * 3 + (
        CompressedEntries(16, 2, 8), CompressedEntries(16, 4), CompressorState(16, True, 8), CompressorState(16, False))
    assert [cfg.kv_index(i) for i in range(3)] == [(0, None, None), (1, 3, 5), (2, 4, 6)]


@pytest.mark.parametrize("changes, field", [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [8, 16], "expert_dtype": "fp4"}},
     "expert_dtype 'fp4'"),
    ({"layer_types": ["sliding_attention"] * 2 + ["full_attention"]}, "layer_types"),
    ({"rope_parameters": {"main": {"rope_type": "linear", "factor": 2.0}, "compress": {"rope_type": "default"}}},
     "rope_parameters"),
])
def test_unsupported_fields_are_named(ckpt, tmp_path, changes, field):
    config = {**json.loads((ckpt[1] / "config.json").read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=field):
        load_config(tmp_path)


def test_integer_tensors_load_only_into_integer_parameters(ckpt, tmp_path):
    """`tid2eid` is read as integers; stored as floats it is refused by name, as integers for a float parameter are."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(ckpt[1] / "model.safetensors"))
    (tmp_path / "config.json").write_text((ckpt[1] / "config.json").read_text())
    for name, dtype in (("model.layers.0.ffn.gate.tid2eid", np.float32), ("model.layers.0.attn.attn_sink", np.int64)):
        save_file({**tensors, name: tensors[name].astype(dtype)}, str(tmp_path / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=f"tensor '{name}': dtype"):
            load(tmp_path)


def test_check_model_and_fresh_pages_take_blocks_of_whole_entries(ckpt):
    """A model whose HCA rate (128, the released one) exceeds the contract check's 4-token blocks: the check and
    `forward_on_fresh_pages` take the least multiple that holds whole entries."""
    cfg = load_config(ckpt[1]).replace(hca_rate=128)
    model = nnx.eval_shape(lambda: init_deepseek_v4(cfg))
    assert check_model(model).block_multiple == 128
    logits = jax.eval_shape(lambda: forward_on_fresh_pages(init_deepseek_v4(cfg), jnp.zeros((1, 3), jnp.int32)))
    assert logits.shape == (1, 3, VOCAB)


def test_tensor_parallel_partition_splits_the_attention_by_query_heads(ckpt):
    """The parameters' PartitionSpecs at tp 2 (the 8-device worker check `deepseek_v4_tensor_parallel` serves with
    them): the query heads' projections, sinks and grouped output split, the compressors and the indexer whole,
    the rest by the default rule; a tp that does not divide `o_groups` refused by name."""
    from jax.sharding import PartitionSpec as P

    cfg = load_config(ckpt[1])
    model = nnx.eval_shape(lambda: init_deepseek_v4(cfg))
    attn = ("layers", 1, "attn")
    want = {(*attn, "wq_b", "kernel"): P(None, "tp"), (*attn, "wo_a", "kernel"): P(None, "tp"),
            (*attn, "wo_b", "kernel"): P("tp", None), (*attn, "attn_sink"): P("tp"), (*attn, "wq_a", "kernel"): P(),
            (*attn, "wkv", "kernel"): P(), (*attn, "indexer", "wq_b", "kernel"): P(),
            (*attn, "compressor", "wkv", "kernel"): P(), ("layers", 1, "ffn", "gate", "weight"): None}
    for names, spec in want.items():
        assert model.param_partition(names, 2) == spec, names
    assert model.param_partition((*attn, "wq_b", "kernel"), 1) is None
    odd = nnx.eval_shape(lambda: init_deepseek_v4(cfg.replace(o_groups=1)))
    with pytest.raises(ValueError, match=r"must divide 'num_attention_heads' \(\d+\) and 'o_groups' \(1\)"):
        odd.param_partition((*attn, "wq_b", "kernel"), 2)


def test_block_size_must_hold_whole_entries(ckpt):
    """A block holds block_size / m whole entries: a block size that is no multiple of a compress rate is refused
    by name when the engine allocates its pages, as are 8-bit pages."""
    with pytest.raises(ValueError, match="multiple of the compress rate 4"):
        LLMEngine.from_pretrained(ckpt[1], cache_config=CacheConfig(block_size=2, num_blocks=8), backend="xla")
    with pytest.raises(ValueError, match="not stored 8-bit"):
        LLMEngine.from_pretrained(ckpt[1], cache_config=CacheConfig(block_size=4, num_blocks=8, kv_dtype="int8"),
                                  backend="xla")


@pytest.mark.slow  # (CI time) the engine test below holds the same forward to transformers' tokens by default
def test_dense_logits_match_transformers(ckpt):
    """One forward over fresh pages (every window, entry and compressor state the serving path computes) gives
    transformers' logits for prompts past the window, the rates and index_topk."""
    model, folder = ckpt
    ours, _ = load(folder)
    prompts = [PROMPTS[1], SHARED]
    batch = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    got = np.asarray(forward_on_fresh_pages(ours, jnp.asarray(batch)))
    for i, (p, want) in enumerate(zip(prompts, hf_logits(model, prompts), strict=True)):
        np.testing.assert_allclose(got[i, :len(p)], want, rtol=TOL, atol=TOL * np.abs(want).max())


def _engine(folder, num_blocks: int = 16, **options) -> LLMEngine:
    options.setdefault("backend", "xla")
    return LLMEngine.from_pretrained(
        folder, cache_config=CacheConfig(block_size=BS, num_blocks=num_blocks, state_block_size=3 * BS), **options)


def test_engine_chunked_prefill_and_a_hit_inside_a_block_match_transformers(ckpt):
    """One sequence at a time (CI time: the test below runs the engine's other paths): 8-token prefill chunks that
    end inside windows of both rates, then a prompt sharing the first 14 tokens hits the 12 of its whole state
    block (the snapshot there, never the live state) and recomputes the rest: transformers' tokens both times."""
    model, folder = ckpt
    engine = _engine(folder, scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8,
                                                              max_model_len=24))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for prompt, cached in ((PROMPTS[3], 0), (INSIDE, 12)):
        want, margin = hf_greedy(model, prompt, 4)
        assert margin > MIN_MARGIN, margin
        out = engine.generate([prompt], greedy, use_tqdm=False)[0]
        assert (out.num_cached_tokens, out.outputs[0].token_ids) == (cached, want)


@pytest.mark.slow  # (CI time: 50 s of compiling) the test above covers chunked prefill and a hit by default
def test_engine_greedy_matches_transformers(ckpt):
    """Four prompts whose entries take 9 KV blocks of 4 tokens (preemption; the windows and compressor states are
    pools of their own), 8-token prefill chunks, fused decodes of 4 steps, n = 2 greedy forks, then hits on a
    cached prefix: at a state block's end (12) and from inside the fourth block."""
    model, folder = ckpt
    expected = [hf_greedy(model, p, MAX_NEW) for p in [*PROMPTS, AT_BOUNDARY, INSIDE]]
    assert min(margin for _, margin in expected) > MIN_MARGIN, [m for _, m in expected]
    engine = _engine(folder, num_blocks=9, scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8,
                                                                            max_model_len=64), decode_steps_per_call=4)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=2)
    outs = engine.generate(PROMPTS, [greedy, forked, greedy, greedy], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in expected[:4]]
    assert [c.token_ids for c in outs[1].outputs] == [expected[1][0]] * 2
    stats = engine.stats()
    assert stats.indexer_ties == 0 and stats.scheduler.num_preemptions > 0 and stats.fused_decode_calls > 0
    assert engine.generate([PROMPTS[3]], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected[3][0]
    for prompt, (want, _) in ((AT_BOUNDARY, expected[4]), (INSIDE, expected[5])):
        out = engine.generate([prompt], greedy, use_tqdm=False)[0]
        assert (out.num_cached_tokens, out.outputs[0].token_ids) == (12, want)


@pytest.mark.slow  # (CI time) the host tier's own tests move every kind of page by default
def test_windows_compressor_states_and_entries_come_back_from_the_host_tier(ckpt):
    """V4's three pools (compressed entries, the window, the compressor states) each with a host tier, in a pool of
    9 KV blocks: a prompt evicted by another comes back with its 12-token hit loaded from the tiers, with
    transformers' tokens."""
    model, folder = ckpt
    engine = LLMEngine.from_pretrained(
        folder, backend="xla", cache_config=CacheConfig(block_size=BS, num_blocks=9, state_block_size=3 * BS,
                                                         num_state_blocks=8, kv_host_memory_bytes=64 << 20),
        scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=32))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[3], PROMPTS[1], PROMPTS[3], PROMPTS[1]]
    outs = [engine.generate([p], greedy, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 4)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 12, 12]
    tiers = engine.scheduler.kv_cache_manager.tiers
    assert all(t is not None for t in tiers) and engine.stats().scheduler.host_hit_tokens > 0
    assert engine.scheduler.kv_cache_manager.block_pool.num_used == 0


@pytest.mark.slow  # (CI time: the interpreter) the kernel's own tests compare it with the XLA path by default
def test_the_pallas_backend_serves_v4_attention_with_the_gpu_kernel(ckpt):
    """backend "pallas": the attention and the compressor through their Triton kernels (the Pallas interpreter on a
    CPU), chunked prefill and a hit inside a block, transformers' tokens."""
    model, folder = ckpt
    engine = _engine(folder, scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8,
                                                              max_model_len=24), backend="pallas")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for prompt, cached in ((PROMPTS[3], 0), (INSIDE, 12)):
        want, _ = hf_greedy(model, prompt, 4)
        out = engine.generate([prompt], greedy, use_tqdm=False)[0]
        assert (out.num_cached_tokens, out.outputs[0].token_ids) == (cached, want)


# The linears the released FP8 checkpoint stores float8 (the compressor and indexer projections stay bfloat16).
_FP8_LINEARS = tuple(f".{name}.weight" for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w1", "w2", "w3"))


@pytest.mark.slow  # (CI time) test_deepseek.py's FP8 test runs the loader's dequantization by default
def test_fp8_block_scaled_checkpoint_loads_as_its_dequantized_weights(ckpt, tmp_path):
    """V3's FP8 layout (quantization_config fp8; the attention's and experts' linears float8 e4m3 with a float32
    `weight_scale_inv` per block, the compressor's and indexer's bfloat16 as released): the model equals the float
    model of the same dequantized weights, logit for logit."""
    from safetensors.numpy import load_file, save_file

    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    fp8.mkdir()
    plain.mkdir()
    linear = lambda name: name.startswith("model.layers.") and name.endswith(_FP8_LINEARS) and not (  # noqa: E731
        ".compressor." in name or ".indexer." in name)
    dequantized = fp8_folder(ckpt[1], fp8, linear=linear)
    assert any(".experts." in n for n in dequantized) and any(".attn.wo_a." in n for n in dequantized)
    save_file({**load_file(str(ckpt[1] / "model.safetensors")), **dequantized}, str(plain / "model.safetensors"))
    (plain / "config.json").write_text((ckpt[1] / "config.json").read_text())
    batch = jnp.asarray([SHARED], jnp.int32)
    got, want = (np.asarray(forward_on_fresh_pages(load(folder)[0], batch)) for folder in (fp8, plain))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # (CI time) the default tests use unscaled rotations; this one checks the YaRN mapping
def test_yarn_on_the_compressed_layers_matches_transformers(tmp_path):
    """`rope_parameters` YaRN (flat: transformers applies it to the compressed layers only, with attention factor
    1): pagedjax's logits over fresh pages are transformers'."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
            "beta_slow": 1.0}
    model = random_v4(SEED, rope_parameters=rope)
    model.save_pretrained(str(tmp_path))
    ours, _ = load(tmp_path)
    assert dict(ours.config.compress_rope_scaling)["attention_factor"] == 1.0
    got = np.asarray(forward_on_fresh_pages(ours, jnp.asarray([SHARED], jnp.int32)))[0]
    want = hf_logits(model, [SHARED])[0]
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * np.abs(want).max())
