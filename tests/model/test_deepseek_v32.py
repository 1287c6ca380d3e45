"""DeepSeek V3.2 (DeepSeek Sparse Attention) from Hugging Face folders: tiny random checkpoints made by
transformers' own `DeepseekV32ForCausalLM` and `save_pretrained`, whose `index_topk` is smaller than the prompts
(so the indexer's selection decides what each query attends to). pagedjax must give transformers' float32
logits through `forward_dense` (every indexer score, top k, dense MLA masked to the selection), on data whose
indexer scores have no near tie at the k-th place (asserted: a tie would make the comparison one of rounding),
and its greedy continuations token for token through `LLMEngine.from_pretrained` (`PagedSparseAttention` over
latent and indexer-key pages) with a prefix-cache hit, chunked prefill, n > 1 forks, preemption and fused
decode; with `index_topk` past the context the engine equals plain MLA. Every refused config field is named
(GLM-5, `glm_moe_dsa`, has a file of its own: test_hf_glm_moe_dsa.py). No hub access.
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

from pagedjax.config import IndexedSparse  # noqa: E402
from pagedjax.config.deepseek import DeepSeekConfig, DeepSeekIndexerConfig, DeepSeekMoEConfig  # noqa: E402
from pagedjax.model.errors import ModelLoadError  # noqa: E402
from pagedjax.model.families.deepseek import load as load_hf_deepseek  # noqa: E402
from pagedjax.model.families.deepseek import load_config as load_deepseek_config  # noqa: E402
from pagedjax.model.families.deepseek import top_k_mask  # noqa: E402
from pagedjax.model.loading.hf_config import load_hf_config  # noqa: E402
from tests.model.test_deepseek import perturbed, saved_models  # noqa: E402
from tests.model.test_hf import hf_logits  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB = 80
TOL = 1e-5  # float32 logits, relative to their largest magnitude
TOPK = 6
# The k-th best indexer score minus the (k + 1)-th, relative to the largest score, at every query with more than
# k positions: far above float32 rounding, so both implementations select the same positions.
MIN_INDEX_MARGIN = 1e-3
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
               q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, num_experts_per_tok=2,
               first_k_dense_replace=1, n_group=4, topk_group=2, initializer_range=0.2, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, index_topk=TOPK, index_head_dim=16, index_n_heads=4)
_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 1.0,
         "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
# name -> (seed, fields). Seeds picked so that no indexer score and no greedy step is a near tie (asserted).
MODELS = {
    "v32": (1, dict(index_n_heads=8)),
    "v32_yarn": (8, dict(rope_parameters=_YARN, index_topk=4, index_n_heads=8, index_head_dim=8)),
}
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (3, 12, 17, 20)]


def build(kind: str):
    """A tiny random `DeepseekV32ForCausalLM`: norms (the indexer's LayerNorm bias too) random around 1 / 0 and
    the router's correction bias random (every parameter a loading mistake could hide behind)."""
    seed, extra = MODELS[kind]
    return perturbed(transformers.DeepseekV32Config(**{**_COMMON, **extra}), seed)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, saved folder)."""
    return saved_models(tmp_path_factory, build, MODELS)


def _batch(prompts) -> np.ndarray:
    batch = np.zeros((len(prompts), max(len(p) for p in prompts)), np.int32)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    return batch


def _dense_logits(model, prompts) -> list[np.ndarray]:
    graphdef, params = nnx.split(model)
    logits = np.asarray(jax.jit(lambda b: nnx.merge(graphdef, params).forward_dense(b))(_batch(prompts)))
    return [logits[i, : len(p)] for i, p in enumerate(prompts)]


def index_margins(model, prompts) -> tuple[float, int]:
    """(the smallest relative gap between the k-th and (k + 1)-th indexer score over every layer and every query
    with more than k positions of every prompt, how many such queries there were), from pagedjax's dense
    forward (one batch, right-padded: the padding comes after every query it could touch)."""
    graphdef, params = nnx.split(model)

    def every_layer(batch):
        m = nnx.merge(graphdef, params)
        x, scores, visible = m.embed_tokens(batch), [], None
        for layer in m.layers:
            if layer.self_attn.indexer is not None:  # (a GLM-5 shared layer reads the one before's selection)
                scores.append(layer.self_attn.dense_index_scores(layer.input_layernorm(x)))
            x, visible = layer.dense(x, visible)
        return jnp.stack(scores)

    scores = np.asarray(jax.jit(every_layer)(_batch(prompts)))  # [layers, prompts, S, S]
    k = model.config.indexer.topk
    margin, queries = np.inf, 0
    for layer in scores:
        for i, p in enumerate(prompts):
            for s in range(k, len(p)):
                row = np.sort(layer[i, s, : s + 1])[::-1]
                largest = np.abs(row).max()  # 0: every score 0, a tie
                margin = min(margin, (row[k - 1] - row[k]) / largest if largest > 0 else 0.0)
                queries += 1
    return margin, queries


def test_config_maps_fields(models):
    cfg = load_deepseek_config(models["v32"][1])
    assert cfg.indexer == DeepSeekIndexerConfig(num_heads=8, head_dim=16, topk=TOPK)
    assert cfg.moe == DeepSeekMoEConfig(8, 2, 16, 1, 1, "noaux_tc", 4, 2, True, 2.5)
    assert (cfg.q_lora_rank, cfg.rope_interleave, cfg.max_position_embeddings) == (24, True, 128)
    assert cfg.spec.kv_layers == (IndexedSparse(16, 8, 16, TOPK),) * 2
    yarn = load_deepseek_config(models["v32_yarn"][1])
    assert yarn.indexer == DeepSeekIndexerConfig(num_heads=8, head_dim=8, topk=4)
    assert yarn.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * 0.8 * np.log(8.0) + 1) ** 2)


@pytest.mark.parametrize("kind", list(MODELS))
def test_dense_logits_match_transformers(models, kind):
    model, folder = models[kind]
    ours, _ = load_hf_deepseek(folder)
    margin, queries = index_margins(ours, PROMPTS)
    assert margin > MIN_INDEX_MARGIN, (kind, margin)
    assert queries > 40  # the selection decides most queries' attention
    for p, a, b in zip(PROMPTS, _dense_logits(ours, PROMPTS), hf_logits(model, PROMPTS), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL * np.abs(b).max(), err_msg=f"{kind}, {len(p)} tokens")


def test_the_selection_changes_the_logits(models):
    """The same weights with index_topk >= the prompt (every earlier position selected: dense MLA) give other
    logits: the parity above is a parity of the sparse attention, not of MLA."""
    from pagedjax.model.families.deepseek import deepseek_from_state

    ours, _ = load_hf_deepseek(models["v32"][1])
    cfg = ours.config
    everything = deepseek_from_state(cfg.replace(indexer=DeepSeekIndexerConfig(8, 16, 64)), nnx.state(ours))
    sparse, full = _dense_logits(ours, PROMPTS[-1:])[0], _dense_logits(everything, PROMPTS[-1:])[0]
    assert np.abs(sparse - full)[TOPK:].max() > 0.1
    np.testing.assert_allclose(sparse[:TOPK], full[:TOPK], rtol=1e-6, atol=1e-6)  # the first k: all selected


def test_top_k_mask_selects_the_best_earlier_positions():
    scores = jnp.asarray([[0.0, -jnp.inf, -jnp.inf, -jnp.inf], [2.0, 1.0, -jnp.inf, -jnp.inf],
                          [1.0, 3.0, 2.0, -jnp.inf], [4.0, 0.5, 3.0, 1.0]])
    want = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0]], bool)
    np.testing.assert_array_equal(np.asarray(top_k_mask(scores, 2)), want)
    np.testing.assert_array_equal(np.asarray(top_k_mask(scores, 9)), np.tril(np.ones((4, 4), bool)))


def _config(entry, changes: dict) -> dict:
    return {**json.loads((entry[1] / "config.json").read_text()), **changes}


@pytest.mark.parametrize("changes, field", [
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"index_topk": 0}, "index_topk"),
    ({"index_n_heads": "4"}, "index_n_heads"),
    ({"index_head_dim": 4}, "head_dim"),  # below qk_rope_head_dim 8
    ({"layer_types": ["indexed_attention", "full_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["sparse", "dense"]}, "mlp_layer_types"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
])
def test_unsupported_fields_are_named(models, tmp_path, changes, field):
    (tmp_path / "config.json").write_text(json.dumps(_config(models["v32"], changes)))
    with pytest.raises(ModelLoadError, match=field):
        load_deepseek_config(tmp_path)


def test_mlp_layer_types_decide_the_moe_layers(models, tmp_path):
    """transformers' V3.2 reads `mlp_layer_types` (first_k_dense_replace only derives its default)."""
    (tmp_path / "config.json").write_text(json.dumps(_config(models["v32"], {
        "mlp_layer_types": ["sparse", "sparse"], "first_k_dense_replace": 1})))
    assert load_deepseek_config(tmp_path).moe.first_k_dense_replace == 0


def test_a_v32_folder_is_not_a_model_config(models):
    with pytest.raises(ModelLoadError, match="'deepseek_v32': a DeepSeek model, not a ModelConfig one"):
        load_hf_config(models["v32"][1])


@pytest.mark.parametrize("changes, error, match", [
    ({"indexer": {"num_heads": 2, "head_dim": 4, "topk": 0}}, ValueError, "DeepSeekConfig.indexer.topk"),
    ({"indexer": {"num_heads": 2.0, "head_dim": 4, "topk": 2}}, TypeError, "DeepSeekConfig.indexer.num_heads"),
    ({"indexer": {"num_heads": 2, "head_dim": 4, "top_k": 2}}, ValueError, "top_k"),
    ({"indexer": {"num_heads": 2, "head_dim": 1, "topk": 2}}, ValueError, "indexer.head_dim"),
    ({"indexer": {"num_heads": 2, "head_dim": 4, "topk": 2}, "q_lora_rank": None}, ValueError, "q_lora_rank"),
])
def test_indexer_config_fields_are_checked(changes, error, match):
    base = dict(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2, intermediate_size=8, kv_lora_rank=4,
                qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, q_lora_rank=4)
    with pytest.raises(error, match=match):
        DeepSeekConfig(**{**base, **changes})


# ------------------------------------------------------------------------------------------------ the engine
MAX_NEW = 6
_CACHE = dict(block_size=4, num_blocks=64)
_SCHED = dict(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=40)


def _engine(folder=None, model=None, num_blocks: int = 64, **engine):
    """An engine over the folder (or a model of the contract): `num_blocks` blocks of 4 slots, at most 8 tokens a
    step (the longer prompts prefill in chunks), the XLA paths."""
    from pagedjax.config import CacheConfig, SchedulerConfig
    from pagedjax.engine import LLMEngine

    kwargs = dict(cache_config=CacheConfig(**{**_CACHE, "num_blocks": num_blocks}),
                  scheduler_config=SchedulerConfig(**_SCHED), backend="xla", **engine)
    if model is not None:
        return LLMEngine(model=model, **kwargs)
    return LLMEngine.from_pretrained(folder, **kwargs)


# (CI time: ~9 s) test_hf_glm_moe_dsa.py's engine test runs the same sparse layers (and GLM-5's shared ones) through
# the same chunked prefill, prefix hit and forks by default; this family's dense logits run here by default
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["v32"])  # YaRN's rotation in the engine: test_deepseek's v2_lora_grouped
def test_engine_greedy_matches_transformers_generate(models, kind):
    """Sparse MLA over the latent and indexer-key pages (`PagedSparseAttention`), through chunked prefill (20
    tokens at 8 a step), a prefix-cache hit (the longest prompt again, its full blocks cached: their indexer keys
    too) and n = 2 greedy forks of one prompt; every prompt but the shortest outgrows index_topk."""
    from pagedjax.sampling_params import SamplingParams
    from tests.model.test_hf import MIN_MARGIN, hf_greedy

    model, folder = models[kind]
    expected, margins = zip(*(hf_greedy(model, p, MAX_NEW) for p in PROMPTS), strict=True)
    assert min(margins) > MIN_MARGIN, min(margins)  # a near tie would make the comparison one of rounding
    ours, _ = load_hf_deepseek(folder)
    margin, _ = index_margins(ours, [p + list(w)[:-1] for p, w in zip(PROMPTS, expected, strict=True)])
    assert margin > MIN_INDEX_MARGIN, (kind, margin)  # no near tie along the continuations either
    engine = _engine(folder)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=2)  # two greedy samples
    outs = engine.generate(PROMPTS, [greedy, greedy, forked, greedy], use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [list(w) for w in expected], kind
    assert engine.stats().indexer_ties == 0  # tie-free scores (the margin above): nothing for the tie rule to decide
    assert [c.token_ids for c in outs[2].outputs] == [list(expected[2])] * 2
    again = engine.generate([PROMPTS[-1]], greedy, use_tqdm=False)[0]  # its full blocks cached
    assert again.num_cached_tokens >= 16 and again.output_token_ids == list(expected[-1])


@pytest.mark.slow  # (CI time: ~6 s) tests/model/test_hf_glm_moe_dsa.py runs the sparse path through both
def test_engine_greedy_through_preemption_and_fused_decode(models):
    """Four requests of up to 26 tokens in 8 blocks of 4: some are preempted and recomputed (their latent
    entries and indexer keys written again); decode runs 4 fused steps a call. The tokens stay transformers'."""
    from pagedjax.sampling_params import SamplingParams
    from tests.model.test_hf import hf_greedy

    model, folder = models["v32"]
    expected = [hf_greedy(model, p, MAX_NEW)[0] for p in PROMPTS]  # tie-free: the test above
    engine = _engine(folder, num_blocks=8, decode_steps_per_call=4)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = engine.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    assert engine.stats().scheduler.num_preemptions > 0 and engine.stats().fused_decode_calls > 0


def test_indexer_ties_are_counted_and_warned_once(models, caplog):
    """The engine over the V3.2 weights with the indexer's head weights zeroed, so that every score is 0 (as a tiny
    config's few heads meet exact zeros after the ReLU), four requests in 8 blocks of 4 (preempted and recomputed),
    4 fused decode steps a call: the selection at the index_topk-th place is pagedjax's tie rule's (the lower
    position) where transformers' topk is unordered, and the engine counts every query row that met such a tie
    (`EngineStats.indexer_ties`, from the steps' and fused decodes' device outputs) and warns of it once."""
    from pagedjax.sampling_params import SamplingParams

    _, folder = models["v32"]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    tied, _ = load_hf_deepseek(folder)
    for layer in tied.layers:
        weights = layer.self_attn.indexer.weights_proj.kernel
        weights[...] = jnp.zeros_like(weights[...])
    engine = _engine(model=tied, num_blocks=8, decode_steps_per_call=4)
    with caplog.at_level("WARNING", logger="pagedjax"):
        engine.generate(PROMPTS, greedy, use_tqdm=False)
        first = engine.stats().indexer_ties
        engine.generate(PROMPTS, greedy, use_tqdm=False)
    # Every position past index_topk of every sequence runs through every layer at least once (the last sampled
    # token never runs); preemption runs some again.
    runs = len(tied.layers) * sum(len(p) + MAX_NEW - 1 - TOPK for p in PROMPTS if len(p) + MAX_NEW - 1 > TOPK)
    assert first >= runs and engine.stats().indexer_ties >= first + runs, (first, runs)
    warned = [r.getMessage() for r in caplog.records if "indexer's top-k met equal scores" in r.getMessage()]
    assert len(warned) == 1 and "pagedjax keeps the lower position" in warned[0], warned


@pytest.mark.slow  # (CI time: 36 s) the kernels' and the toy model's "every position selected = MLA" run by default
def test_engine_with_index_topk_past_the_context_is_plain_mla(models):
    """index_topk (64) >= every context: the sparse layers select every earlier position, so the engine's
    tokens and log-probabilities equal those of the same weights without an indexer (V3's absorbed MLA over
    latent pages)."""
    from pagedjax.model.families.deepseek import deepseek_from_state
    from pagedjax.sampling_params import SamplingParams

    ours, _ = load_hf_deepseek(models["v32"][1])
    cfg, state = ours.config, nnx.state(ours)
    everything = deepseek_from_state(cfg.replace(indexer=DeepSeekIndexerConfig(8, 16, 64)), state)
    plain_state = nnx.from_flat_state([(k, v) for k, v in nnx.to_flat_state(state) if "indexer" not in k])
    plain = deepseek_from_state(cfg.replace(indexer=None), plain_state)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    got = _engine(model=everything).generate(PROMPTS, params, use_tqdm=False)
    want = _engine(model=plain).generate(PROMPTS, params, use_tqdm=False)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    np.testing.assert_allclose([o.outputs[0].cumulative_logprob for o in got],
                               [o.outputs[0].cumulative_logprob for o in want], rtol=1e-5, atol=1e-5)


def test_the_official_v32_config_json_maps(tmp_path):
    """DeepSeek-V3.2-Exp's config.json (V3's fields and spellings, plus the indexer's), shrunk to 2 layers: the
    indexer, its cache (the bf16 latent entry and indexer key: (576 + 128) * 2 bytes a token per layer) and its
    float32 `weights_proj` in a bf16 model."""
    from pagedjax.model.families.deepseek import abstract_deepseek

    official = {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280,
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
        "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(official))
    cfg = load_deepseek_config(tmp_path)
    assert cfg.indexer == DeepSeekIndexerConfig(num_heads=64, head_dim=128, topk=2048)
    assert cfg.spec.kv_layers == (IndexedSparse(512, 64, 128, 2048),) * 2
    assert cfg.spec.kv_layers[0].bytes_per_token(2) == (576 + 128) * 2
    indexer = abstract_deepseek(cfg).layers[0].self_attn.indexer
    assert indexer.weights_proj.kernel.dtype == jnp.float32 and indexer.wq_b.kernel.dtype == jnp.bfloat16
    assert (indexer.scale, indexer.weight_scale) == pytest.approx((128 ** -0.5, 64 ** -0.5))
