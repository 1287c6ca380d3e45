"""Quantized mixture-of-experts experts (`pagedjax.model.layers.moe_quant`): every expert stored as a `QuantizedLinear`
stores a kernel (checked against `quantize_kernel` expert by expert), and the exactness proof: each of
`MoEMLP`'s four computations (grouped, by_pair, tiled, every), stacked and per-expert, and the paged engine's logits
and greedy tokens equal those of the float model whose experts hold the dequantized values (`dequantize_kernel`;
float32 1e-5, bfloat16 1e-2). Then expert-parallel shardings, keep_float, the errors, orbax and Hugging Face
Mixtral loading with `quantization=`."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.config import ModelConfig
from pagedjax.config.moe import MoEConfig
from pagedjax.config.quant import QuantConfig
from pagedjax.model.layers.moe import Experts, MoEMLP, per_expert_params
from pagedjax.model.layers.moe_quant import ExpertKernels, QuantizedExperts, moe_mlp
from pagedjax.model.layers.quant import QuantizedLinear, dequantize_kernel, quantize_kernel
from pagedjax.model.llama import init_model, model_from_state, quantize_params
from tests.dense import greedy_by_recompute
from tests.model.test_hf import paged_last_logits
from tests.model.test_quant import _dequantized

E, K, HIDDEN, WIDTH = 4, 2, 32, 16
PROJ = ("gate_proj", "up_proj", "down_proj")
# int4 in groups of 8: hidden 32 and width 16 hold several groups each.
SCHEMES = [QuantConfig("int8"), QuantConfig("int4", group_size=8), QuantConfig("fp8")]


def _cfg(quant=None, dtype="float32", **moe) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                       tie_word_embeddings=False, dtype=dtype, quantization=quant,
                       moe=MoEConfig(num_experts=E, num_experts_per_tok=K, intermediate_size=WIDTH, **moe))


@functools.partial(jax.jit, static_argnums=2)
def _dequantize_all(qweight, scale, quant):
    """`dequantize_kernel` of each expert: `[E, ...]` stored -> float32 kernels `[E, in, out]`."""
    return jax.vmap(lambda q, s: dequantize_kernel(q, s, quant))(qweight, scale)


def _dequantized_experts(experts: QuantizedExperts) -> tuple[jax.Array, ...]:
    """The float `Experts` weights (gate / up `[E, width, hidden]` as (out, in), down as (in, out)) holding the
    dequantized values, from the reference `dequantize_kernel`."""
    gate, up, down = (_dequantize_all(p.qweight[...], p.scale[...], p.quant)
                      for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    return jnp.swapaxes(gate, 1, 2), jnp.swapaxes(up, 1, 2), down


def _set_experts(float_experts: Experts, quantized: QuantizedExperts) -> None:
    for name, w in zip(PROJ, _dequantized_experts(quantized), strict=True):
        getattr(float_experts, name).set_value(w.astype(getattr(float_experts, name)[...].dtype))


def _reference_state(cfg: ModelConfig, state, qcfg: ModelConfig, qstate) -> nnx.State:
    """The float model's parameters with every quantized linear's kernel and every quantized expert's weights
    replaced by their dequantized values."""
    ref, qmodel = model_from_state(cfg, _dequantized(cfg, state, qcfg, qstate)), model_from_state(qcfg, qstate)
    for layer, qlayer in zip(ref.layers, qmodel.layers, strict=True):
        _set_experts(layer.mlp.experts, qlayer.mlp.experts)
    return nnx.state(ref, nnx.Param)


METHODS = ("grouped", "by_pair", "tiled", "every")


# One program per case (op by op, every operation would compile on its own): the float layer's "every" and each
# method of the quantized layer, stacked and per-expert; "by_pair" (one switch over every expert's branch per
# pair, each branch compiled) on the first row only: its 2 pairs, as in batch-1 decode.
@functools.partial(jax.jit, static_argnums=(0, 2))
def _outputs(graphdef, state, qgraphdef, qstate, split, x):
    want = nnx.merge(graphdef, state)(x, "every")
    return want, {form: tuple(nnx.merge(qgraphdef, s)(x[:1] if m == "by_pair" else x, m) for m in METHODS)
                  for form, s in (("stacked", qstate), ("per-expert", split))}


# ------------------------------------------------------------------------------------------ one MoE layer
# Each scheme once by default (both dtypes among them: 1-2 s a case, compiling); `-m slow` the other three.
_slow = pytest.mark.slow
LAYER_CASES = [(SCHEMES[0], "float32"), (SCHEMES[1], "bfloat16"), (SCHEMES[2], "float32"),
               pytest.param(SCHEMES[0], "bfloat16", marks=_slow), pytest.param(SCHEMES[1], "float32", marks=_slow),
               pytest.param(SCHEMES[2], "bfloat16", marks=_slow)]


@pytest.mark.parametrize("quant, dtype", LAYER_CASES, ids=lambda v: getattr(v, "name", v))
def test_each_method_equals_the_float_layer_of_the_dequantized_experts(quant, dtype):
    """Stacked and per-expert (the single-device CPU form), every method of a quantized MoE layer gives the float
    layer whose experts hold the dequantized values; the stored values are `quantize_kernel`'s, expert by expert
    (gate / up from their (out, in) weights' transposes, down from its (in, out) weights), so each expert is
    exactly a `QuantizedLinear` of it; the router stays float."""
    fmlp = MoEMLP(_cfg(None, dtype), jnp.dtype(dtype), nnx.Rngs(0))
    qmlp = moe_mlp(_cfg(quant, dtype), jnp.dtype(dtype), nnx.Rngs(0))  # the same random init, then quantized
    assert isinstance(qmlp.experts, QuantizedExperts) and type(qmlp.gate) is nnx.Linear
    np.testing.assert_array_equal(np.asarray(qmlp.gate.kernel[...]), np.asarray(fmlp.gate.kernel[...]))
    for name, kernel_of in (("gate_proj", lambda w: w.T), ("up_proj", lambda w: w.T), ("down_proj", lambda w: w)):
        stored, floats = getattr(qmlp.experts, name), getattr(fmlp.experts, name)[...]
        for e in (0, E - 1):
            q, s = quantize_kernel(kernel_of(floats[e]), quant)
            np.testing.assert_array_equal(np.asarray(stored.qweight[...][e]).view(np.uint8),
                                          np.asarray(q).view(np.uint8), err_msg=f"{name} {e}")
            np.testing.assert_array_equal(np.asarray(stored.scale[...][e]), np.asarray(s), err_msg=f"{name} {e}")
    _set_experts(fmlp.experts, qmlp.experts)
    x = jax.random.normal(jax.random.key(1), (3, HIDDEN)).astype(dtype)  # 6 pairs over the 4 experts
    qgraphdef, qstate = nnx.split(qmlp)
    split = per_expert_params(qstate)
    for leaf in ("qweight", "scale"):
        parts = split["experts"]["down_proj"][leaf].get_value()
        assert isinstance(parts, tuple) and len(parts) == E
    want, got = _outputs(*nnx.split(fmlp), qgraphdef, qstate, split, x)
    want = np.asarray(want, np.float32)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2 * np.abs(want).max())
    for form, outs in got.items():
        for method, y in zip(METHODS, outs, strict=True):
            assert y.dtype == jnp.dtype(dtype) and y.shape == (1 if method == "by_pair" else 3, HIDDEN)
            np.testing.assert_allclose(np.asarray(y, np.float32), want[:len(y)], **tol, err_msg=f"{form} {method}")


def test_gpt_oss_experts_keep_their_biases_and_activation_quantized():
    """gpt-oss's experts (biases, the clamped SwiGLU) quantized (int8): the biases stay float and every method,
    stacked and per-expert, gives the float layer of the dequantized weights and the same biases."""
    moe = dict(router_bias=True, expert_bias=True, activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=1.0)
    fmlp = MoEMLP(_cfg(None, **moe), jnp.float32, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for param in (fmlp.gate.bias, fmlp.experts.gate_proj_bias, fmlp.experts.up_proj_bias,
                  fmlp.experts.down_proj_bias):
        param[...] = jnp.asarray(rng.normal(size=param[...].shape), jnp.float32)
    qmlp = MoEMLP(_cfg(None, **moe), jnp.float32, nnx.Rngs(0))
    nnx.update(qmlp, nnx.state(fmlp))
    qmlp.experts = QuantizedExperts.of(qmlp.experts, QuantConfig("int8"))
    assert qmlp.experts.glu == fmlp.experts.glu and qmlp.experts.glu.kind == "clamped_swiglu"
    for ours, theirs in zip(qmlp.experts.biases(), fmlp.experts.biases(), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    _set_experts(fmlp.experts, qmlp.experts)
    x = jax.random.normal(jax.random.key(1), (3, HIDDEN))
    qgraphdef, qstate = nnx.split(qmlp)
    want, got = _outputs(*nnx.split(fmlp), qgraphdef, qstate, per_expert_params(qstate), x)
    for form, outs in got.items():
        for method, y in zip(METHODS, outs, strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(want)[:len(y)], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{form} {method}")


def test_by_pair_switches_over_the_quantized_leaves():
    """`by_pair`'s switch operands are the quantized leaves (int4 bytes and scales): the program never holds a
    float copy of the stacked experts (a branch computes with its own expert's bytes)."""
    quant = QuantConfig("int4", group_size=8)
    qmlp = moe_mlp(_cfg(quant), jnp.float32, nnx.Rngs(0))
    operands = qmlp.experts.switch_operands()
    assert [o.dtype for o in operands] == [jnp.uint8, jnp.float32] * 3
    assert operands[0].shape == (E, WIDTH, HIDDEN // 2) and operands[5].shape == (E, HIDDEN, WIDTH // 8)
    lowered = lambda method: jax.jit(lambda s, x: nnx.merge(*s)(x, method)).lower(  # noqa: E731
        nnx.split(qmlp), jnp.ones((1, HIDDEN))).as_text()
    stacked_float = f"tensor<{E}x{WIDTH}x{HIDDEN}xf32>"
    assert "stablehlo.case" in lowered("by_pair") and stacked_float not in lowered("by_pair")
    assert stacked_float in lowered("every")  # the check can see one: every expert dequantized
    with pytest.raises(ValueError, match="rows x the weights multiply are required"):
        qmlp.experts.weights()
    with pytest.raises(ValueError, match="MoEMLP holds float experts, ModelConfig.quantization 'int4:8' quantized "
                                         "ones: build it with pagedjax.model.layers.moe_quant.moe_mlp"):
        MoEMLP(_cfg(quant), jnp.float32, nnx.Rngs(0))


# ------------------------------------------------------------------------------------------ the paged engine
@pytest.mark.parametrize("quant", [QuantConfig("int4", group_size=8),
                                   pytest.param(QuantConfig("int8"), marks=_slow),
                                   pytest.param(QuantConfig("fp8", scale_dtype="bfloat16"), marks=_slow)],
                         ids=lambda q: q.name)
def test_paged_logits_and_greedy_tokens_equal_the_float_model_of_the_dequantized_weights(quant):
    """A quantized MoE decoder (experts and linears; quantized by `quantize_params`) through the engine: one
    prefill step's logits (many pairs: "every", stacked in the step's per-expert form) within float32 1e-5 of
    the float model holding the dequantized values, and greedy tokens (batch-1 decode steps: "by_pair") equal
    to that model's by full recompute."""
    cfg = _cfg(router="softmax_topk", norm_topk_prob=True)
    graphdef, state = nnx.split(init_model(cfg, seed=1))
    state = jax.tree.map(lambda a: a * 3, state)  # a livelier random model: not one repeated token
    qcfg, qstate = quantize_params(cfg, state, quant)
    qmodel = model_from_state(qcfg, qstate)
    assert isinstance(qmodel.layers[0].mlp.experts, QuantizedExperts)
    assert isinstance(qmodel.layers[1].self_attn.q_proj, QuantizedLinear)
    assert type(qmodel.layers[0].mlp.gate) is nnx.Linear  # the router stays float
    ref = _reference_state(cfg, state, qcfg, qstate)
    forward = jax.jit(lambda t: nnx.merge(graphdef, ref).forward_dense(t))
    engine = LLMEngine(model_config=qcfg, cache_config=CacheConfig(block_size=4, num_blocks=32),
                       scheduler_config=SchedulerConfig( max_num_seqs=4, max_num_batched_tokens=32, max_model_len=24),
                       params=qstate, backend="xla")
    assert isinstance(engine.runner.params["layers"][0]["mlp"]["experts"]["gate_proj"]["qweight"].get_value(), tuple)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (1, 5, 11)]
    want, margin = greedy_by_recompute(forward, prompts[1:2], 6, 24)
    assert margin > 1e-3, margin
    out = engine.generate(prompts[1:2], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert [out.token_ids] == want
    assert any(shape.tokens == 1 for shape in engine.runner.programs.executables)  # one-row decode steps ran
    logits = forward(jnp.asarray([prompts[1] + out.token_ids], jnp.int32))[0]
    log_probs = np.asarray(jax.nn.log_softmax(logits[len(prompts[1]) - 1:-1]))  # each generated position
    # float32 1e-5 of the logits' scale (~30 here): the float engine differs from forward_dense by as much.
    atol = 1e-5 * float(jnp.abs(logits).max())
    for step, lp in enumerate(out.logprobs):
        ids, values = zip(*lp.top, strict=True)
        np.testing.assert_allclose(values, log_probs[step, list(ids)], rtol=1e-5, atol=atol)
    for prompt, logits in paged_last_logits(engine, prompts):
        want = np.asarray(forward(jnp.asarray([prompt], jnp.int32)))[0, -1]
        np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # New weights in the canonical stacked form: the runner splits the quantized leaves per expert again.
    _, qstate2 = quantize_params(cfg, jax.tree.map(lambda a: a * 1.25, state), quant)
    engine.update_weights(qstate2)
    parts = engine.runner.params["layers"][1]["mlp"]["experts"]["down_proj"]["scale"].get_value()
    stacked = np.asarray(qstate2["layers"][1]["mlp"]["experts"]["down_proj"]["scale"].get_value())
    assert isinstance(parts, tuple) and len(parts) == E
    for e, part in enumerate(parts):
        np.testing.assert_array_equal(np.asarray(part), stacked[e])


# --------------------------------------------------------------------------------------- expert parallelism
def test_quantized_expert_leaves_shard_along_the_experts():
    """Every quantized expert leaf (qweight `[E, out, in]`, scale `[E, out]` or int4's `[E, out, in // g]`) is
    split along axis 0, values and scales alike (each device holds whole experts), by the built-in models' rule
    and by the any-model rule; an expert count tp does not divide is replicated. Float experts are unchanged."""
    from jax.sharding import PartitionSpec as P

    from pagedjax.parallel.sharding import default_param_partition, key_names

    for quant in (QuantConfig("int4", group_size=8), QuantConfig("int8")):
        cfg = _cfg(quant)
        model = nnx.eval_shape(lambda cfg=cfg: init_model(cfg))
        leaves = [(key_names(kp), x.shape) for kp, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))
                  if "experts" in key_names(kp)]
        assert {names[-1] for names, _ in leaves} == {"qweight", "scale"} and len(leaves) == 2 * 3 * 2
        assert {len(shape) for names, shape in leaves if names[-1] == "scale"} == {3 if quant.group_size else 2}
        for names, shape in leaves:
            for tp in (2, 4):
                assert model.param_partition(names, tp) == P("tp"), (names, tp)
                assert default_param_partition(names, shape, head_dim=8, tp=tp) == P("tp"), (names, tp)
            assert model.param_partition(names, 3) == P() and default_param_partition(names, shape, head_dim=8,
                                                                                      tp=3) == P()
    float_model = nnx.eval_shape(lambda: init_model(_cfg()))
    names = ("layers", 0, "mlp", "experts", "gate_proj")
    assert float_model.param_partition(names, 2) == P("tp", None, None)


# --------------------------------------------------------------------------------------- keep_float, errors
def test_keep_float_experts_and_a_group_size_that_does_not_divide_an_expert():
    """int4 groups of 16 divide hidden 32 but not an expert width of 24: ValueError naming the expert tensor
    (from `quantize_params` by its whole path, from a random init by its module's), unless keep_float keeps the
    experts float: then they are the float model's own weights and the linears are quantized."""
    cfg = _cfg().replace(moe=MoEConfig(num_experts=E, num_experts_per_tok=K, intermediate_size=24))
    state = nnx.state(init_model(cfg, seed=1), nnx.Param)
    with pytest.raises(ValueError, match=r"^layers\.0\.mlp\.experts\.down_proj: int4 group size 16 does not "
                                         r"divide its input dimension 24$"):
        quantize_params(cfg, state, "int4:16")
    with pytest.raises(ValueError, match=r"^experts\.down_proj: int4 group size 16 does not divide .* 24$"):
        init_model(cfg.replace(quantization="int4:16"))
    keep = QuantConfig("int4", group_size=16, keep_float=("lm_head", "experts"))
    qcfg, qstate = quantize_params(cfg, state, keep)
    qmodel = model_from_state(qcfg, qstate)
    assert type(qmodel.layers[0].mlp.experts) is Experts
    assert isinstance(qmodel.layers[0].self_attn.o_proj, QuantizedLinear)
    for name in PROJ:
        np.testing.assert_array_equal(np.asarray(qstate["layers"][1]["mlp"]["experts"][name].get_value()),
                                      np.asarray(state["layers"][1]["mlp"]["experts"][name].get_value()))
    assert type(init_model(cfg.replace(quantization=keep)).layers[0].mlp.experts) is Experts
    w = jnp.ones((E, WIDTH, HIDDEN))
    with pytest.raises(ValueError, match=r"^experts\.up_proj: expert weights are \[E, width, hidden\], all of one"):
        QuantizedExperts(w, w[0], w, quant=QuantConfig("int8"))
    with pytest.raises(ValueError, match=r"^experts\.down_proj: .* got \(4, 32, 16\) \(gate_proj \(4, 16, 32\)\)"):
        QuantizedExperts(w, w, jnp.swapaxes(w, 1, 2), quant=QuantConfig("int8"))
    with pytest.raises(ValueError, match=r"^e\.gate_proj: stacked expert kernels \[E, in, out\] are 3-D"):
        ExpertKernels(w[0], QuantConfig("int8"), "e.gate_proj")


# ---------------------------------------------------------------------------------------------------- orbax
def test_a_quantized_moe_checkpoint_saves_and_restores_as_stored(tmp_path):
    """A float MoE checkpoint quantized at load (what `LLMEngine.from_pretrained(path, quantization=)` does)
    holds `quantize_params`' values; saved quantized, it restores as stored, and a dtype override casts neither
    the experts' stored values nor their scales."""
    from pagedjax.model.loading.checkpoint import save_checkpoint
    from pagedjax.model.loading.loader import load_pretrained

    cfg, quant = _cfg(), QuantConfig("int4", group_size=8)
    state = nnx.state(init_model(cfg, seed=1), nnx.Param)
    save_checkpoint(tmp_path / "float", cfg, state)
    qcfg, qstate = quantize_params(cfg, state, quant)
    loaded_cfg, loaded, _ = load_pretrained(tmp_path / "float", quantization=quant)
    assert loaded_cfg == qcfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(qstate), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_checkpoint(tmp_path / "quantized", qcfg, qstate)
    cfg2, state2, _ = load_pretrained(tmp_path / "quantized")
    assert cfg2 == qcfg
    for a, b in zip(jax.tree.leaves(state2), jax.tree.leaves(qstate), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert json.loads((tmp_path / "quantized" / "pagedjax_config.json").read_text())["format_version"] == 3
    cfg16, state16, _ = load_pretrained(tmp_path / "quantized", dtype="bfloat16")
    experts = model_from_state(cfg16, state16).layers[1].mlp.experts
    assert experts.down_proj.qweight[...].dtype == jnp.uint8 and experts.down_proj.scale[...].dtype == jnp.float32
    assert model_from_state(cfg16, state16).layers[1].mlp.gate.kernel[...].dtype == jnp.bfloat16


def test_a_quantized_moe_checkpoint_of_format_version_2_restores_its_float_experts(tmp_path):
    """Before format version 3 a quantized MoE model's experts were float whatever keep_float said (its config
    says keep_float ("lm_head",)): such a checkpoint loads as it was stored, keep_float gaining "experts". A
    quantized dense model is still written as version 2 (every pagedjax since reads it)."""
    from pagedjax.model.loading.checkpoint import save_checkpoint
    from pagedjax.model.loading.loader import load_pretrained

    cfg = _cfg()
    stored = QuantConfig("int8", keep_float=("lm_head", "experts"))  # what version 2 held
    qcfg, qstate = quantize_params(cfg, nnx.state(init_model(cfg, seed=1), nnx.Param), stored)
    save_checkpoint(tmp_path, qcfg, qstate)
    config_file = tmp_path / "pagedjax_config.json"
    meta = json.loads(config_file.read_text())
    assert meta["format_version"] == 2  # its experts float: readable by version-2 readers
    meta["model_config"]["quantization"]["keep_float"] = ["lm_head"]
    config_file.write_text(json.dumps(meta))
    loaded_cfg, state, _ = load_pretrained(tmp_path)
    assert loaded_cfg == qcfg and loaded_cfg.quantization.keep_float == ("lm_head", "experts")
    with pytest.raises(ValueError, match=r"quantization 'int8': the checkpoint holds 'int8' weights already "
                                         r"\(scale_dtype 'float32', keep_float \('lm_head', 'experts'\)\)"):
        load_pretrained(tmp_path, quantization="int8")
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(qstate), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------- Hugging Face Mixtral
@pytest.mark.hf
@_slow  # 4 s: transformers builds and saves the model
def test_a_mixtral_checkpoint_loads_with_quantized_experts(tmp_path):
    """transformers' per-expert Mixtral tensors, stacked and then quantized at load: each expert's values are
    `quantize_kernel` of its saved weight (w1 / w3 / w2 `[out, in]`, transposed to a kernel `[in, out]`), the
    router stays float, and the dense logits equal those of the float model holding the dequantized values."""
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from pagedjax.model.loading.loader import load_pretrained
    from tests.model.test_hf_moe import PROMPTS, dense_logits, hf_model

    _, folder, cfg, state = hf_model("mixtral", str(tmp_path))
    quant = QuantConfig("int4", group_size=16)  # hidden 32, expert width 48
    qcfg, qstate, _ = load_pretrained(folder, quantization=quant)
    assert qcfg == cfg.replace(quantization=quant)
    tensors = load_file(f"{folder}/model.safetensors")
    experts = qstate["layers"][1]["mlp"]["experts"]
    for hf, ours in zip(("w1", "w3", "w2"), PROJ, strict=True):
        for e in range(cfg.moe.num_experts):
            q, s = quantize_kernel(tensors[f"model.layers.1.block_sparse_moe.experts.{e}.{hf}.weight"].T, quant)
            np.testing.assert_array_equal(np.asarray(experts[ours]["qweight"].get_value()[e]), np.asarray(q))
            np.testing.assert_array_equal(np.asarray(experts[ours]["scale"].get_value()[e]), np.asarray(s))
    assert "kernel" in qstate["layers"][1]["mlp"]["gate"]
    ref = _reference_state(cfg, state, qcfg, qstate)
    for p, got, want in zip(PROMPTS, dense_logits(qcfg, qstate, PROMPTS), dense_logits(cfg, ref, PROMPTS),
                            strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=f"{len(p)} tokens")


def test_a_pre_quantized_moe_checkpoint_with_quantized_routers_is_refused_naming_the_field(tmp_path):
    """compressed-tensors MoE checkpoints load (tests/model/test_hf_quant_moe.py) when they leave the routers float,
    which pagedjax keeps float: one whose "ignore" does not is a ModelLoadError naming config.json's field."""
    pytest.importorskip("transformers")
    from pagedjax.model.loading.hf_loader import load_hf_config
    from tests.model.test_hf_moe import _write_config

    w4a16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
             "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    for model_type, router in (("mixtral", "block_sparse_moe.gate"), ("qwen3_moe", "mlp.gate")):
        folder = _write_config(tmp_path, {"model_type": model_type, "num_hidden_layers": 2,
                                          "quantization_config": w4a16})
        with pytest.raises(ValueError, match=rf"field 'quantization_config': ignore: the MoE routers "
                                             rf"\['model.layers.0.{router}', 'model.layers.1.{router}'\] are "
                                             rf"quantized; pagedjax keeps routers float"):
            load_hf_config(folder)
