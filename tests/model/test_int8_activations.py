"""int8 activations (`QuantConfig(activations="int8")`: "w8a8" with int8 weights, "w4a8" with int4 groups): each
row of a linear's input quantized to int8 and multiplied in exact integer sums (`pagedjax.model.layers.quant`'s
`w8a8_product`, `w4a8_product`). The layer against a numpy reference (one row, several, float32 and bf16, bias);
rows isolated from each other whatever one holds (NaN, inf, huge, zero); the paged engine (chunked prefill, batched
and one-row decode, the fused decode; MoE experts too) against the same model's dense forward; MoE experts by each
of the layer's methods; loading quantized checkpoints; the names, the refusal of tensor parallelism and the GPU
export."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.config import ModelConfig
from pagedjax.config.moe import MoEConfig
from pagedjax.config.quant import QuantConfig
from pagedjax.model.layers.moe import per_expert_params
from pagedjax.model.layers.moe_quant import QuantizedExperts, moe_mlp
from pagedjax.model.layers.quant import QuantizedLinear, check_tensor_parallel, quantize_rows, unpack_int4
from pagedjax.model.llama import init_model

W8A8 = QuantConfig.parse("w8a8")
W4A8 = QuantConfig.parse("w4a8:32")
BOTH = pytest.mark.parametrize("quant", [W8A8, W4A8], ids=lambda q: q.name)
CFG = ModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, tie_word_embeddings=False, qkv_bias=True)
MOE = CFG.replace(hidden_size=32, head_dim=8, moe=MoEConfig(num_experts=4, num_experts_per_tok=2,
                                                            intermediate_size=16))
_LAYER = jax.jit(lambda layer, x: layer(x))


def _reference(layer: QuantizedLinear, x: np.ndarray) -> np.ndarray:
    """numpy: each row quantized (round half to even, as jnp.round), the integer sums exact (per output for int8
    weights, per group for int4), then the scales."""
    rows = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    amax = np.abs(rows).max(axis=-1)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.round(rows * inverse[:, None]), -127, 127).astype(np.int64)
    scale = np.asarray(layer.scale[...], np.float64)
    if layer.quant.scheme == "int4":
        w = np.asarray(unpack_int4(layer.qweight[...], layer.quant.group_size), np.int64)  # [out, in]
        groups = scale.shape[1]
        sums = (q[:, None].reshape(len(q), 1, groups, -1) * w.reshape(1, len(w), groups, -1)).sum(-1)
        y = (sums * scale[None]).sum(-1)
    else:
        y = (q @ np.asarray(layer.qweight[...], np.int64).T) * scale
    y = y * (amax / np.float32(127))[:, None] + np.asarray(layer.bias[...], np.float32)
    return y.reshape(*x.shape[:-1], -1)


@BOTH
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layer_equals_its_reference_for_one_row_and_many(quant, dtype):
    rng = np.random.default_rng(0)
    n_in = 130 if quant.scheme == "int8" else 160  # int8: no multiple of the kernel's vectors; int4: 5 groups of 32
    layer = QuantizedLinear(jnp.asarray(rng.standard_normal((n_in, 24)), jnp.float32),
                            jnp.asarray(rng.standard_normal(24), dtype), quant=quant, dtype=dtype)
    for shape in [(1, n_in), (1, 1, n_in), (5, n_in), (2, 3, n_in)]:
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        got = _LAYER(layer, x)
        assert got.dtype == jnp.dtype(dtype) and got.shape == (*shape[:-1], 24)
        want = _reference(layer, np.asarray(x, np.float32))
        tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: the output rounded once to x's dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())


def test_quantize_rows_uses_the_whole_range_and_a_zero_row_is_zero():
    x = jnp.asarray([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.75]], jnp.float32)
    q, scale = quantize_rows(x)
    np.testing.assert_array_equal(np.asarray(q), [[64, -127, 32], [0, 0, 0], [127, 64, -32]])  # 63.5 -> 64 (even)
    np.testing.assert_allclose(np.asarray(scale), [1 / 127, 0, 3 / 127], rtol=1e-7)


@BOTH
def test_a_row_holding_nan_inf_or_huge_values_changes_no_other_row(quant):
    """Every row but one poisoned in every way: the clean row's output is bitwise what it is alone; a NaN or
    infinite row gives NaN, a huge finite row finite values, a zero row the bias."""
    rng = np.random.default_rng(1)
    layer = QuantizedLinear(jnp.asarray(rng.standard_normal((64, 16)), jnp.float32),
                            jnp.asarray(rng.standard_normal(16), jnp.float32), quant=quant)
    clean = jnp.asarray(rng.standard_normal((1, 64)), jnp.float32)
    alone = np.asarray(_LAYER(layer, clean))
    poison = np.asarray(rng.standard_normal((5, 64)), np.float32)
    poison[0, 3] = np.nan
    poison[1, 7] = np.inf
    poison[2, 0] = -np.inf
    poison[3] *= 1e30  # far past any activation, the output still finite
    poison[4] = 0.0
    for where in range(6):
        rows = jnp.asarray(np.insert(poison, where, np.asarray(clean)[0], axis=0))
        out = np.asarray(_LAYER(layer, rows))
        np.testing.assert_array_equal(out[where], alone[0])
        others = np.delete(out, where, axis=0)
        assert np.isnan(others[:3]).all() and np.isfinite(others[3]).all()
        np.testing.assert_array_equal(others[4], np.asarray(layer.bias[...]))


# (CI time) the MoE model's attention and dense layers are w8a8 too: the dense-only model runs with -m slow.
@pytest.mark.parametrize("quant, moe", [pytest.param(W8A8, False, marks=pytest.mark.slow), (W4A8, False), (W8A8, True)],
                         ids=["w8a8", "w4a8:32", "w8a8-moe"])
def test_the_paged_engine_equals_the_dense_forward_of_the_same_model(quant, moe):
    """Chunked prefill (several rows per product), batched decode, one-row decode and the fused decode: each
    generated position's log-probabilities equal the same quantized model's dense forward (float32, 1e-5); with
    MoE experts, the engine's methods (by pair, tiled, every) against the dense forward's every."""
    cfg = (MOE if moe else CFG).replace(quantization=quant)
    model = init_model(cfg, seed=3)
    graphdef, state = nnx.split(model)
    engine = LLMEngine(model_config=cfg, params=nnx.state(model, nnx.Param),
                       cache_config=CacheConfig(block_size=4, num_blocks=32),
                       scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32),
                       decode_steps_per_call=4)
    prompts = [[5, 9, 2, 11, 40, 3, 7, 1, 8, 30, 2], [3, 1]]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, logprobs=3, ignore_eos=True)
                                     for n in (6, 14)], use_tqdm=False)
    shapes = list(engine.runner.programs.executables)
    assert any(s.kind == "step" for s in shapes)  # prefill chunks: several rows per product
    assert any(s.kind == "decode_loop" and s.tables[0] == 1 for s in shapes)  # the fused decode of one row
    dense = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t))
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        logits = dense(state, jnp.asarray([prompt + completion.token_ids], jnp.int32))[0]
        want = np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:-1]))
        for step, lp in enumerate(completion.logprobs):
            assert lp.token_id == completion.token_ids[step] == int(want[step].argmax())
            ids, values = zip(*lp.top, strict=True)
            np.testing.assert_allclose(values, want[step, list(ids)], rtol=1e-5, atol=1e-5)


def test_names_and_round_trip():
    assert QuantConfig.parse(" W8A8 ") == W8A8 == QuantConfig("int8", activations="int8")
    assert W4A8 == QuantConfig("int4", group_size=32, activations="int8")
    assert QuantConfig.parse("w4a8") == QuantConfig("int4", activations="int8")
    assert (W8A8.name, W4A8.name, QuantConfig.parse("w4a8").name) == ("w8a8", "w4a8:32", "w4a8")
    assert QuantConfig("int8").activations == "float"
    for name in ("w8a8", "w4a8:32"):
        cfg = CFG.replace(quantization=name)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg


METHODS = ("grouped", "by_pair", "tiled", "every")


@functools.partial(jax.jit, static_argnums=0)
def _moe_outputs(graphdef, state, split, x):
    """Each method, stacked and per-expert, and the reference: each (row, expert) pair through `expert_mlp` alone,
    weighted by its routing weight."""
    mlp = nnx.merge(graphdef, state)
    weights, chosen = mlp.routing(x)
    operands = mlp.experts.switch_operands()
    pairs = [[mlp.experts.expert_mlp(e, x[t:t + 1], operands) for e in range(mlp.experts.num_experts)]
             for t in range(x.shape[0])]
    want = jnp.stack([sum(weights[t, j] * jnp.stack(pairs[t])[chosen[t, j], 0].astype(jnp.float32)
                          for j in range(chosen.shape[1])) for t in range(x.shape[0])])
    return want, {form: tuple(nnx.merge(graphdef, s)(x, m) for m in METHODS)
                  for form, s in (("stacked", state), ("per-expert", split))}


@pytest.mark.parametrize("quant", [W8A8, QuantConfig.parse("w4a8:8")], ids=lambda q: q.name)
def test_quantized_experts_multiply_integers_by_every_method(quant):
    """A MoE layer's experts with int8 activations: grouped, by_pair, tiled and every (stacked and per-expert)
    all equal each pair's expert alone (its integer products), weighted by the routing (float32, 1e-5)."""
    mlp = moe_mlp(MOE.replace(quantization=quant), jnp.float32, nnx.Rngs(0))
    assert isinstance(mlp.experts, QuantizedExperts) and mlp.experts.gate_proj.quant == quant
    graphdef, state = nnx.split(mlp)
    x = jax.random.normal(jax.random.key(1), (3, 32))  # 6 pairs over the 4 experts
    want, got = _moe_outputs(graphdef, state, per_expert_params(state), x)
    for form, outs in got.items():
        for method, y in zip(METHODS, outs, strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{form} {method}")


def test_tensor_parallelism_is_refused_by_name():
    model = init_model(CFG.replace(quantization=W8A8))
    with pytest.raises(ValueError, match=r"int8 activations \(W8A8, W4A8\) are not served under tensor parallelism "
                                         r"\(tp 2\)"):
        check_tensor_parallel(model, 2)
    check_tensor_parallel(model, 1)
    check_tensor_parallel(init_model(CFG.replace(quantization="int8")), 2)


@BOTH
def test_a_gpu_export_holds_xlas_integer_products_not_the_cpu_kernel(quant):
    """`jax.lax.platform_dependent` lowers the CPU kernel for the CPU only: a program exported for "cuda" computes
    the same integer products with XLA's ops (one row and several)."""
    from jax import export

    layer = QuantizedLinear(jnp.ones((64, 16), jnp.float32), quant=quant)
    for rows in (1, 5):
        exported = export.export(jax.jit(lambda x: layer(x)), platforms=("cuda",))(jnp.ones((rows, 64), jnp.float32))
        assert "pagedjax_int8_matmul" not in exported.mlir_module() and exported.platforms == ("cuda",)


def test_a_checkpoint_of_int8_or_int4_weights_loads_with_its_activations_quantized(tmp_path):
    """The stored weights are what W8A8 / W4A8 multiply: an int8 (int4:32) checkpoint loads as w8a8 (w4a8:32), the
    same arrays; other groups or schemes are refused by name."""
    from pagedjax.model.llama import model_from_state, quantize_params
    from pagedjax.model.loading.checkpoint import save_checkpoint
    from pagedjax.model.loading.loader import load_pretrained

    state = nnx.state(init_model(CFG, seed=1), nnx.Param)
    for stored, served in (("int8", W8A8), ("int4:32", W4A8)):
        folder = tmp_path / stored.replace(":", "_")
        qcfg, qstate = quantize_params(CFG, state, stored)
        save_checkpoint(folder, qcfg, qstate)
        cfg, loaded, _ = load_pretrained(folder, quantization=served.name)
        assert cfg.quantization == served
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(qstate), strict=True):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
        assert model_from_state(cfg, loaded).layers[0].mlp.down_proj.quant == served
    with pytest.raises(ValueError, match="the checkpoint holds 'int4:32' weights already"):
        load_pretrained(tmp_path / "int4_32", quantization="w4a8")  # groups of 128 asked
    with pytest.raises(ValueError, match="the checkpoint holds 'int8' weights already"):
        load_pretrained(tmp_path / "int8", quantization="w4a8:32")
    fp8_cfg, fp8_state = quantize_params(CFG, state, "fp8")
    save_checkpoint(tmp_path / "fp8", fp8_cfg, fp8_state)
    with pytest.raises(ValueError, match="the checkpoint holds 'fp8' weights already"):  # not QuantConfig's error
        load_pretrained(tmp_path / "fp8", quantization="w8a8")
