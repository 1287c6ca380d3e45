"""The mixture-of-experts MLP (`pagedjax.model.layers.moe`) and a decoder built with it: each family's routing against a
numpy transcription, the grouped matmul against the dense reference and a per-token loop (exact: no token loses
an expert, even when all of them pick the same ones), 16-bit weights, the engine's greedy tokens against the dense
model's, router statistics, and `ModelConfig.moe`'s checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.config import ModelConfig
from pagedjax.config.moe import MoEConfig
from pagedjax.model.api import check_model
from pagedjax.model.layers import moe
from pagedjax.model.layers.moe import MoEMLP, combine_experts, cpu_method, per_expert_params, route, tile_rows
from pagedjax.model.llama import init_model
from tests.dense import greedy_by_recompute
from tests.kernels.cases import examples

E, K, HIDDEN, WIDTH = 6, 2, 16, 12
ROUTERS = [("topk_softmax", False), ("softmax_topk", True), ("softmax_topk", False)]


def _cfg(router="topk_softmax", norm=False, **kw) -> ModelConfig:
    moe = MoEConfig(num_experts=E, num_experts_per_tok=K, intermediate_size=WIDTH, router=router,
                    norm_topk_prob=norm)
    return ModelConfig(**{**dict(vocab_size=64, hidden_size=HIDDEN, num_layers=2, num_q_heads=4, num_kv_heads=2,
                                 head_dim=8, moe=moe), **kw})


def _numpy_route(logits: np.ndarray, router: str, norm: bool):
    """Each family's convention as transformers writes it, in float64."""
    if router == "topk_softmax":  # Mixtral: the top-k logits, their softmax
        idx = np.argsort(-logits, axis=-1, kind="stable")[:, :K]
        top = np.take_along_axis(logits, idx, -1)
        w = np.exp(top - top.max(-1, keepdims=True))
        return w / w.sum(-1, keepdims=True), idx
    p = np.exp(logits - logits.max(-1, keepdims=True))  # Qwen3-MoE: softmax over all, the top k
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :K]
    w = np.take_along_axis(p, idx, -1)
    return (w / w.sum(-1, keepdims=True) if norm else w), idx


@pytest.mark.parametrize("router, norm", ROUTERS)
def test_routing_follows_each_family(router, norm):
    logits = np.random.default_rng(0).normal(size=(9, E)).astype(np.float32) * 3
    weights, experts = route(jnp.asarray(logits), K, router, norm)
    want_w, want_e = _numpy_route(logits.astype(np.float64), router, norm)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-6, atol=1e-7)
    sums = np.asarray(weights).sum(-1)
    assert np.allclose(sums, 1, atol=1e-6) == (router == "topk_softmax" or norm)


def _per_token_loop(mlp: MoEMLP, x: np.ndarray) -> np.ndarray:
    """Each token through its k experts one by one, in float64."""
    gate_w, up_w, down_w = (np.asarray(getattr(mlp.experts, n)[...], np.float64)
                            for n in ("gate_proj", "up_proj", "down_proj"))
    logits = x @ np.asarray(mlp.gate.kernel[...], np.float64)
    weights, experts = _numpy_route(logits, mlp.router, mlp.norm_topk_prob)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t], strict=True):
            g = gate_w[e] @ x[t]  # gate / up are (out, in), down (in, out): `Experts`
            out[t] += w * ((g / (1 + np.exp(-g)) * (up_w[e] @ x[t])) @ down_w[e])
    return out


@pytest.mark.parametrize("router, norm", ROUTERS)
def test_every_method_equals_the_reference_and_a_per_token_loop(router, norm):
    """The grouped matmul (GPU / TPU), each pair by its expert and every expert on every row (the CPU's, by the
    number of pairs; "tiled" for many in the per-expert form) compute the reference's function; the default on this
    CPU is "every" for many pairs of the stacked form."""
    mlp = MoEMLP(_cfg(router, norm), jnp.float32, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 7, HIDDEN))
    dense = np.asarray(mlp.dense(x))
    want = _per_token_loop(mlp, np.asarray(x, np.float64).reshape(-1, HIDDEN)).reshape(x.shape)
    np.testing.assert_allclose(dense, want, rtol=1e-4, atol=1e-5)
    for method in ("grouped", "by_pair", "tiled", "every"):
        got = np.asarray(mlp(x, method))
        assert got.shape == x.shape
        np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-6, err_msg=method)
    np.testing.assert_array_equal(np.asarray(mlp(x)), np.asarray(mlp(x, "every")))
    with pytest.raises(ValueError, match="unknown method 'sparse'"):
        mlp(x, "sparse")
    assert cpu_method(21, K, E, per_expert=False) == "every"


def test_few_pairs_run_by_their_experts_alone_with_the_same_result():
    """Fewer (token, expert) pairs than experts (batch-1 decode) take `Experts.by_pair` on the CPU: the same
    function as the grouped matmul, the reference and the per-token loop (bfloat16: the next test)."""
    assert 2 * K < E and jax.default_backend() == "cpu"
    mlp = MoEMLP(_cfg("softmax_topk", True), jnp.float32, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (2, HIDDEN))
    got = np.asarray(mlp(x))
    np.testing.assert_array_equal(got, np.asarray(mlp(x, "by_pair")))
    np.testing.assert_allclose(got, np.asarray(mlp(x, "grouped")), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, np.asarray(mlp.dense(x)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, _per_token_loop(mlp, np.asarray(x, np.float64)), rtol=1e-4, atol=1e-5)


# gpt-oss's experts: router and expert biases, the clamped SwiGLU. The limit is small enough that these rows'
# projections pass it both ways (asserted), so that every clamp changes the result.
GPT_OSS_MOE = MoEConfig(num_experts=E, num_experts_per_tok=K, intermediate_size=WIDTH, router_bias=True,
                        expert_bias=True, activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=0.8)


def gpt_oss_mlp(seed: int = 0) -> MoEMLP:
    """A gpt-oss MoE layer with random non-zero biases (they initialize to zero)."""
    mlp = MoEMLP(_cfg(moe=GPT_OSS_MOE), jnp.float32, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for param in (mlp.gate.bias, mlp.experts.gate_proj_bias, mlp.experts.up_proj_bias, mlp.experts.down_proj_bias):
        param[...] = jnp.asarray(rng.normal(size=param[...].shape), jnp.float32)
    return mlp


def _gpt_oss_loop(mlp: MoEMLP, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' GptOssMLP token by token in float64: the biased router's top-k logits and their softmax, each
    expert's biased projections and clamped SwiGLU. Also returns every gate / up value before clamping."""
    f64 = lambda p: np.asarray(p[...], np.float64)  # noqa: E731
    ex, limit, alpha = mlp.experts, GPT_OSS_MOE.swiglu_limit, GPT_OSS_MOE.swiglu_alpha
    weights, experts = _numpy_route(x @ f64(mlp.gate.kernel) + f64(mlp.gate.bias), "topk_softmax", False)
    out, seen = np.zeros_like(x), []
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t], strict=True):
            gate = f64(ex.gate_proj)[e] @ x[t] + f64(ex.gate_proj_bias)[e]
            up = f64(ex.up_proj)[e] @ x[t] + f64(ex.up_proj_bias)[e]
            seen += [gate, up]
            gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
            glu = gate / (1 + np.exp(-alpha * gate))
            out[t] += w * (((up + 1) * glu) @ f64(ex.down_proj)[e] + f64(ex.down_proj_bias)[e])
    return out, np.concatenate(seen)


def test_gpt_oss_experts_every_method_and_form_equals_a_per_token_loop():
    """Biased router and experts, the clamped SwiGLU: the reference equals transformers' computation written
    token by token, and each method, stacked and per-expert, the reference."""
    mlp = gpt_oss_mlp()
    x = jax.random.normal(jax.random.key(1), (7, HIDDEN))
    want, projections = _gpt_oss_loop(mlp, np.asarray(x, np.float64))
    limit = GPT_OSS_MOE.swiglu_limit
    assert (projections > limit).any() and (projections < -limit).any()  # both clamps change the result
    graphdef, state = nnx.split(mlp)
    split = per_expert_params(state)
    assert isinstance(split["experts"]["down_proj_bias"].get_value(), tuple)
    methods = ("grouped", "by_pair", "tiled", "every")

    @jax.jit  # one program (op by op, every operation would compile on its own); by_pair on a few pairs
    def outputs(state, split, x):
        return nnx.merge(graphdef, state).dense(x), {
            form: [nnx.merge(graphdef, s)(x[:2] if m == "by_pair" else x, m) for m in methods]
            for form, s in (("stacked", state), ("per-expert", split))}

    dense, got = outputs(state, split, x)
    np.testing.assert_allclose(np.asarray(dense), want, rtol=1e-4, atol=1e-5)
    for form, outs in got.items():
        for method, y in zip(methods, outs, strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(dense)[:len(y)], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{form} {method}")


def test_no_token_is_dropped_when_every_token_picks_the_same_experts():
    """A router biased so that all 21 tokens choose experts 4 and 1: no capacity limit, each gets both."""
    mlp = MoEMLP(_cfg(), jnp.float32, nnx.Rngs(0))
    x = jnp.abs(jax.random.normal(jax.random.key(2), (21, HIDDEN))) + 1  # positive rows
    kernel = np.zeros((HIDDEN, E), np.float32)
    kernel[:, 4], kernel[:, 1] = 2.0, 1.0
    mlp.gate.kernel[...] = jnp.asarray(kernel)
    assert (np.sort(np.asarray(mlp.routing(x)[1]), -1) == [1, 4]).all()
    for method in ("grouped", "tiled", "every"):  # tiled: two runs of 21 pairs (runs past a tile: the next test)
        np.testing.assert_allclose(np.asarray(mlp(x, method)), _per_token_loop(mlp, np.asarray(x, np.float64)),
                                   rtol=1e-4, atol=1e-5)


def test_bfloat16_experts_stay_close_to_float32():
    mlp = MoEMLP(_cfg(), jnp.float32, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (10, HIDDEN))
    want = np.asarray(mlp(x))
    graphdef, state = nnx.split(mlp)
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), state)
    # Each method as one program (op by op, each of its operations compiled on its own: 4x the test's time).
    call = jax.jit(lambda s, x, method: nnx.merge(graphdef, s)(x, method), static_argnums=2)
    dense = jax.jit(lambda s, x: nnx.merge(graphdef, s).dense(x))
    xh = x.astype(jnp.bfloat16)
    for got in (call(half, xh, "grouped"), call(half, xh, None), call(half, xh[:2], "by_pair"), dense(half, xh)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), want[:got.shape[0]], atol=0.05 * np.abs(want).max())


@pytest.mark.parametrize("rows, dtype, methods", [
    (1, jnp.float32, ("by_pair", "every", "grouped")), (4, jnp.float32, ("by_pair", "tiled", "every")),
    (1, jnp.bfloat16, ("by_pair",)), (4, jnp.bfloat16, ("tiled", "every"))])
def test_the_per_expert_form_computes_the_same_function(rows, dtype, methods):
    """`per_expert_params` (the experts as E separate arrays, the single-device CPU form) through each method
    gives the stacked form's reference: float32 to 1e-5, bfloat16 to 1e-2 of the float32 reference (in 16 bits
    the methods the CPU picks, by_pair for 1 row, tiled and every for 4: 8 pairs > 6 experts; grouped, never
    picked on the CPU, at 1 row)."""
    mlp = MoEMLP(_cfg("softmax_topk", True), jnp.float32, nnx.Rngs(0))
    graphdef, state = nnx.split(mlp)
    x = jax.random.normal(jax.random.key(5), (rows, HIDDEN))
    want = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s).dense(x))(state, x))
    state = jax.tree.map(lambda a: a.astype(dtype), state)
    split = per_expert_params(state)
    for name in ("gate_proj", "up_proj", "down_proj"):
        stacked, parts = state["experts"][name].get_value(), split["experts"][name].get_value()
        assert isinstance(parts, tuple) and len(parts) == E
        for e, part in enumerate(parts):
            np.testing.assert_array_equal(np.asarray(part), np.asarray(stacked[e]))
    assert split["gate"]["kernel"].get_value() is state["gate"]["kernel"].get_value()  # other leaves: as they are
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2 * np.abs(want).max())
    for method in methods:
        got = jax.jit(lambda x, s, method=method: nnx.merge(graphdef, s)(x, method))(x.astype(dtype), split)
        assert got.dtype == dtype and got.shape == x.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), want, **tol, err_msg=method)


def test_moe_decoder_engine_greedy_equals_the_dense_model():
    """A two-layer MoE decoder through the engine (paged attention, chunked prefill, the CPU's MoE methods) gives
    the dense model's greedy tokens (reference MoE, no cache); the router statistics count every token k times."""
    cfg = _cfg("softmax_topk", True)
    model = init_model(cfg, seed=1)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: a * 3, state)  # a livelier random model: not one repeated token
    model = nnx.merge(graphdef, state)
    check_model(model)
    assert type(model.layers[0].mlp).__name__ == "MoEMLP"
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (1, 5, 11)]
    want, margin = greedy_by_recompute(jax.jit(lambda t: nnx.merge(graphdef, state).forward_dense(t)), prompts, 6,
                                       24)
    assert margin > 1e-3, margin
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=4, num_blocks=32),
                       scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=24),
                       params=model, backend="xla")
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == want
    # One CPU device: the runner holds the experts as separate arrays (`Llama.single_device_params`), and takes
    # new weights in the model's stacked form.
    assert isinstance(engine.runner.params["layers"][0]["mlp"]["experts"]["down_proj"].get_value(), tuple)
    state2 = jax.tree.map(lambda a: a * 1.25, state)
    want2, _ = greedy_by_recompute(jax.jit(lambda t: nnx.merge(graphdef, state2).forward_dense(t)), prompts, 6, 24)
    assert want2 != want
    engine.update_weights(state2)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == want2
    counts = np.asarray(jax.jit(lambda t: nnx.merge(graphdef, state).tokens_per_expert(t))(jnp.asarray([prompts[2]])))
    assert counts.shape == (2, E) and (counts.sum(-1) == 11 * K).all()


def test_the_cpu_picks_tiles_where_they_do_less_than_half_the_work_of_every_expert():
    assert cpu_method(2, 2, 6, per_expert=True) == "by_pair"  # 4 pairs < 6 experts
    # 16 experts, top 2, tiles of 32: the pairs + 16 tiles against 16 x the rows
    assert cpu_method(85, 2, 16, per_expert=True) == "every" and cpu_method(86, 2, 16, per_expert=True) == "tiled"
    assert cpu_method(4096, 2, 16, per_expert=False) == "every"  # stacked: sharded by expert under parallelism
    # Few experts (Mixtral's 8, top 2: "every" does 4x the routed work): tiles only for long chunks, whose tiles of
    # 128 rows pad little.
    assert cpu_method(512, 2, 8, per_expert=True) == "every" and cpu_method(4096, 2, 8, per_expert=True) == "tiled"
    # bench_moe_layer's deepseek-small (64 experts, top 6): tiles at 256 rows, not 64 (where they were slower)
    assert cpu_method(64, 6, 64, per_expert=True) == "every" and cpu_method(256, 6, 64, per_expert=True) == "tiled"
    assert [tile_rows(p, 8) for p in (1, 8 * 32, 8 * 45, 8 * 46, 8 * 1000)] == [32, 32, 32, 64, 128]


@settings(max_examples=examples(6), deadline=None)
@given(st.integers(1, 9), st.data())
def test_tiles_give_each_pair_its_experts_output(num_experts, data):
    """"tiled" against each pair through its expert in float64, over any routing: experts with no pair, runs of
    any length (shorter and longer than a tile, exact multiples), one expert taking every pair, repeated rows."""
    top_k = data.draw(st.integers(1, num_experts), label="top_k")
    rows = data.draw(st.integers(1, 40), label="rows")
    favourite = data.draw(st.integers(0, num_experts - 1), label="favourite")
    skew = data.draw(st.sampled_from([0.0, 0.5, 1.0]), label="skew")  # the share of pairs sent to `favourite`
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    # Each token's k distinct experts: the favourite first with probability `skew`, then a random order.
    chosen = np.stack([np.concatenate([[favourite], rng.permutation(np.delete(np.arange(num_experts), favourite))])
                       [:top_k] if rng.random() < skew else rng.permutation(num_experts)[:top_k] for _ in range(rows)])
    weights = rng.random((rows, top_k)).astype(np.float32)
    cfg = ModelConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=8,
                      moe=MoEConfig(num_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=WIDTH))
    experts = MoEMLP(cfg, jnp.float32, nnx.Rngs(0)).experts
    x = rng.normal(size=(rows, HIDDEN)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w, c: combine_experts(experts, x, w, c, "tiled"))(x, weights, chosen))
    gate, up, down = (np.asarray(getattr(experts, n)[...], np.float64) for n in ("gate_proj", "up_proj", "down_proj"))
    want = np.zeros((rows, HIDDEN))
    for t in range(rows):
        for w, e in zip(weights[t], chosen[t], strict=True):
            g = gate[e] @ x[t]
            want[t] += w * ((g / (1 + np.exp(-g)) * (up[e] @ x[t])) @ down[e])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_long_prefill_takes_the_tiles_and_gives_the_dense_models_tokens(monkeypatch):
    """The engine's single-device CPU step over a 120-token chunk (240 pairs of 16 experts: "tiled") gives the
    dense model's greedy tokens (every expert on every row)."""
    tiled = []
    by_tiles = moe._by_tiles
    monkeypatch.setattr(moe, "_by_tiles", lambda *a: tiled.append(a[1].shape) or by_tiles(*a))
    cfg = _cfg("topk_softmax").replace(moe=MoEConfig(num_experts=16, num_experts_per_tok=K, intermediate_size=WIDTH))
    model = init_model(cfg, seed=2)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: a * 3, state)
    prompt = np.random.default_rng(1).integers(0, 64, 120).tolist()
    want, margin = greedy_by_recompute(jax.jit(lambda t: nnx.merge(graphdef, state).forward_dense(t)), [prompt], 3,
                                       128)
    assert margin > 1e-3, margin
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=16),
                       scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=128, max_model_len=128),
                       params=nnx.merge(graphdef, state), backend="xla", compile_cache=False)
    outs = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == want
    assert tiled and all(rows > 85 for rows, _ in tiled), tiled  # the prefill's programs, not the decode's


def test_moe_config_round_trips_and_names_bad_fields():
    cfg = _cfg("softmax_topk", True)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict(_cfg(moe=GPT_OSS_MOE).to_dict()).moe == GPT_OSS_MOE
    assert ModelConfig.from_dict({**cfg.to_dict(), "moe": None}).moe is None
    bad = [(dict(num_experts_per_tok=7), ValueError, "num_experts_per_tok"),
           (dict(num_experts=0), ValueError, "num_experts"),
           (dict(intermediate_size=2.0), TypeError, "intermediate_size"),
           (dict(router="sigmoid"), ValueError, "router"),
           (dict(router="topk_softmax", norm_topk_prob=True), ValueError, "norm_topk_prob"),
           (dict(capacity_factor=1.0), ValueError, "capacity_factor"),
           (dict(router_bias=1), TypeError, "router_bias"),
           (dict(activation="gelu"), ValueError, "activation"),
           (dict(activation="clamped_swiglu", swiglu_alpha=1.7), ValueError, "swiglu_limit is required"),
           (dict(swiglu_limit=7.0), ValueError, "swiglu_limit applies to activation 'clamped_swiglu' only"),
           (dict(activation="clamped_swiglu", swiglu_alpha=1.7, swiglu_limit=-1.0), ValueError, "swiglu_limit")]
    for change, error, field in bad:
        with pytest.raises(error, match=field):
            ModelConfig.from_dict({**cfg.to_dict(), "moe": {**cfg.to_dict()["moe"], **change}})
    with pytest.raises(ValueError, match="moe"):
        _cfg(architecture="gemma2")
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        init_model(_cfg(moe=None)).tokens_per_expert(jnp.zeros((1, 2), jnp.int32))
