"""Weight-only quantization (`pagedjax.model.layers.quant`): int4 packing and the quantize / dequantize round trip
(hypothesis: shapes, group sizes, signs, extremes, all-zero channels), and the exactness proof: a quantized
model's logits through the paged engine equal those of the float model whose kernels hold the dequantized values
(float32, 1e-5). Then loading with `quantization=`, user models (`quantize_model`), and the errors."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.config import ModelConfig
from pagedjax.config.quant import QuantConfig
from pagedjax.model.layers.quant import (
    QuantizedLinear,
    dequantize_kernel,
    holds_quantized,
    pack_int4,
    quantize_kernel,
    quantize_model,
    unpack_int4,
)
from pagedjax.model.llama import init_model, model_from_state, quantize_params
from tests.model.test_hf import paged_last_logits

# The tests' tiny shape: every input dimension (64, 128) a multiple of int4's group of 32.
CFG = ModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, tie_word_embeddings=False, qkv_bias=True)
PROMPTS = [[5], [7, 1, 2, 3, 4, 9], list(range(10, 23))]
# Each case compiles two engines' steps: the default run proves int8 and int4, `-m slow` the rest.
_slow = pytest.mark.slow
SCHEMES = [QuantConfig("int8"), QuantConfig("int4", group_size=32), pytest.param(QuantConfig("fp8"), marks=_slow),
           # the LM head quantized too, scales in bf16
           pytest.param(QuantConfig("int8", scale_dtype="bfloat16", keep_float=()), marks=_slow)]


def _engine(cfg: ModelConfig, params) -> LLMEngine:
    return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=4, num_blocks=32),
                     scheduler_config=SchedulerConfig( max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32),
                     params=params)


def _dequantized(cfg: ModelConfig, state, qcfg: ModelConfig, qstate) -> nnx.State:
    """The float model's parameters with each quantized layer's kernel replaced by its dequantized values (a new
    state: `state` is left as it is, though a merged model shares its variables)."""
    model, qmodel = nnx.clone(model_from_state(cfg, state)), model_from_state(qcfg, qstate)
    for path, node in nnx.iter_graph(qmodel):
        if isinstance(node, QuantizedLinear):
            target = model
            for key in path:
                target = target[key] if isinstance(key, int) else getattr(target, key)
            target.kernel.set_value(node.kernel().astype(target.kernel[...].dtype))
    return nnx.state(model, nnx.Param)


# --------------------------------------------------------------------------------------------- int4 packing
# Jitted, and over few shapes: eager ops would compile each primitive for every new shape.
_pack, _unpack = jax.jit(pack_int4, static_argnums=1), jax.jit(unpack_int4, static_argnums=1)
_quantize = jax.jit(quantize_kernel, static_argnums=1)
_dequantize = jax.jit(dequantize_kernel, static_argnums=2)


@given(st.data())
def test_int4_pack_round_trip_and_byte_layout(data):
    rows, cols, group = data.draw(st.sampled_from([(1, 2, 2), (3, 8, 4), (2, 8, 8)]))  # [out, in], packed along in
    q = np.array(data.draw(st.lists(st.integers(-8, 7), min_size=rows * cols, max_size=rows * cols)),
                 np.int8).reshape(rows, cols)
    packed = np.asarray(_pack(jnp.asarray(q), group))
    assert packed.dtype == np.uint8 and packed.shape == (rows, cols // 2)
    nibble = (q.view(np.uint8) & 0xF).reshape(rows, -1, 2, group // 2)  # [out, groups, half, g / 2]
    np.testing.assert_array_equal(packed, (nibble[:, :, 0] | (nibble[:, :, 1] << 4)).reshape(rows, -1))
    np.testing.assert_array_equal(np.asarray(_unpack(jnp.asarray(packed), group)), q)


def test_int4_extremes_by_hand():
    q = np.array([[-8, 7, -1, 0], [7, -8, -1, 1]], np.int8)  # [out=2, in=4]
    # Groups of 4: byte j holds input j (low nibble) and input 2 + j (high). -8 = 0x8, 7 = 0x7, -1 = 0xF.
    np.testing.assert_array_equal(np.asarray(pack_int4(jnp.asarray(q), 4)),
                                  np.array([[0xF8, 0x07], [0xF7, 0x18]], np.uint8))
    # Groups of 2: byte j holds inputs 2j and 2j + 1.
    packed = np.asarray(pack_int4(jnp.asarray(q), 2))
    np.testing.assert_array_equal(packed, np.array([[0x78, 0x0F], [0x87, 0x1F]], np.uint8))
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed), 2)), q)


# --------------------------------------------------------------------------------------- quantize round trip
_VALUES = st.one_of(st.just(0.0), st.floats(-1e4, 1e4, width=32), st.floats(-2.0 ** -10, 2.0 ** -10, width=32))


@given(st.data())
def test_quantize_round_trip_is_within_half_a_step(data):
    scheme = data.draw(st.sampled_from(["int8", "int4", "fp8"]))
    group = data.draw(st.sampled_from([2, 8])) if scheme == "int4" else None
    quant = QuantConfig(scheme, group_size=group, scale_dtype=data.draw(st.sampled_from(["float32", "bfloat16"])))
    n_in, n_out = 16, data.draw(st.sampled_from([1, 3]))
    w = np.array(data.draw(st.lists(_VALUES, min_size=n_in * n_out, max_size=n_in * n_out)),
                 np.float32).reshape(n_in, n_out)
    w[:, 0] = 0.0 if data.draw(st.booleans()) else w[:, 0]  # an all-zero channel (and int4 groups): scale 0
    qweight, scale = _quantize(jnp.asarray(w), quant)
    back = np.asarray(_dequantize(qweight, scale, quant))
    assert np.isfinite(back).all()
    s = np.asarray(scale.astype(jnp.float32))
    s = np.repeat(s, group, axis=1).T if scheme == "int4" else np.broadcast_to(s, w.shape)  # each element's scale
    if scheme == "fp8":  # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals' step is 2^-9 of the scale
        bound = 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * s
    else:
        bound = 0.5 * s
    assert (np.abs(back - w) <= bound * (1 + 1e-5) + 1e-30).all()
    zero = ~w.any(axis=0)
    assert (back[:, zero] == 0).all()


def test_quantize_uses_the_whole_range():
    w = jnp.asarray(np.linspace(-3.0, 2.0, 64, dtype=np.float32).reshape(32, 2))
    q, s = quantize_kernel(w, QuantConfig("int8"))
    assert q.shape == (2, 32) and np.abs(np.asarray(q)).max(axis=1).tolist() == [127, 127]  # [out, in]
    q4, _ = quantize_kernel(w, QuantConfig("int4", group_size=32))
    values = np.asarray(unpack_int4(q4, 32))
    assert {int(values.min()), int(values.max())} <= set(range(-7, 8)) and int(np.abs(values).max()) == 7


# ------------------------------------------------------------------------------------------ exactness proof
@pytest.mark.parametrize("quant", SCHEMES, ids=lambda q: f"{q.name}-{q.scale_dtype}-{len(q.keep_float)}")
def test_paged_logits_equal_the_float_model_of_the_dequantized_weights(quant):
    state = nnx.state(init_model(CFG, seed=1), nnx.Param)
    qcfg, qstate = quantize_params(CFG, state, quant)
    assert qcfg.quantization == quant
    ref = _dequantized(CFG, state, qcfg, qstate)
    got = paged_last_logits(_engine(qcfg, qstate), PROMPTS)
    want = dict((tuple(p), lg) for p, lg in paged_last_logits(_engine(CFG, ref), PROMPTS))
    for prompt, logits in got:
        np.testing.assert_allclose(logits, want[tuple(prompt)], rtol=1e-5, atol=1e-5)
    lm_head = model_from_state(qcfg, qstate).lm_head
    assert isinstance(lm_head, QuantizedLinear) == ("lm_head" not in quant.keep_float)


@pytest.mark.parametrize("quant", [QuantConfig("int4", group_size=32), pytest.param(QuantConfig("int8"),
                                                                                      marks=_slow)], ids=str)
def test_batch_one_decode_equals_the_float_model_of_the_dequantized_weights(quant):
    """Decode steps of one sequence run every quantized layer's one-row product (`QuantizedLinear._one_row`,
    fed by the paged attention and the norms): their log-probabilities equal the float model's (1e-5)."""
    state = nnx.state(init_model(CFG, seed=2), nnx.Param)
    qcfg, qstate = quantize_params(CFG, state, quant)
    engine = LLMEngine(model_config=qcfg, cache_config=CacheConfig(block_size=4, num_blocks=8),
                       scheduler_config=SchedulerConfig( max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16),
                       params=qstate)
    prompt = PROMPTS[1]
    out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert any(shape.tokens == 1 for shape in engine.runner.programs.executables)  # one-row decode steps ran
    graphdef, ref = nnx.split(model_from_state(CFG, _dequantized(CFG, state, qcfg, qstate)))
    tokens = jnp.asarray([prompt + out.token_ids], jnp.int32)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t))(ref, tokens)[0]
    want = np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:-1]))  # [4, vocab]: each generated position
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step] == int(want[step].argmax())
        ids, values = zip(*lp.top, strict=True)
        np.testing.assert_allclose(values, want[step, list(ids)], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bfloat16_model_matches_its_dequantized_float_model():
    cfg = CFG.replace(dtype="bfloat16")
    state = nnx.state(init_model(cfg, seed=1), nnx.Param)
    qcfg, qstate = quantize_params(cfg, state, "int4:32")
    ref = _dequantized(cfg, state, qcfg, qstate)
    want = dict((tuple(p), lg) for p, lg in paged_last_logits(_engine(cfg, ref), PROMPTS))
    for prompt, logits in paged_last_logits(_engine(qcfg, qstate), PROMPTS):
        np.testing.assert_allclose(logits, want[tuple(prompt)], rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------ loading, users
def test_from_pretrained_quantizes_the_bundled_model():
    engine = LLMEngine.from_pretrained(None, quantization="int8", cache_config=CacheConfig(block_size=4,
                                       num_blocks=16), scheduler_config=SchedulerConfig(max_num_seqs=2,
                                       max_num_batched_tokens=16, max_model_len=16))
    attn = nnx.merge(engine.runner.graphdef, engine.runner.params).layers[0].self_attn
    assert engine.model_config.quantization == QuantConfig("int8")
    assert isinstance(attn.q_proj, QuantizedLinear) and attn.q_proj.qweight[...].dtype == jnp.int8


def test_a_user_models_quantized_linears_through_the_paged_engine():
    """`quantize_model` on the GPT-2 of the bring-your-own-model example: its paged logits equal its float twin's
    dense forward with the dequantized kernels."""
    from tests.model.gpt2_example import GPT2, GPT2Config

    cfg = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=4)
    model, twin = GPT2(cfg, rngs=nnx.Rngs(0)), GPT2(cfg, rngs=nnx.Rngs(0))
    quantize_model(model, "int4:32")
    linears = {tuple(path): node for path, node in nnx.iter_graph(twin) if isinstance(node, nnx.Linear)}
    quantized = {tuple(path): node for path, node in nnx.iter_graph(model) if isinstance(node, QuantizedLinear)}
    assert quantized.keys() == linears.keys()
    for path, layer in quantized.items():
        linears[path].kernel.set_value(layer.kernel())
    engine = LLMEngine(model=model, cache_config=CacheConfig(block_size=4, num_blocks=32),
                       scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32))
    prompts = [[p % 64 for p in prompt] for prompt in PROMPTS]
    graphdef, state = nnx.split(twin)
    width = max(map(len, prompts))  # one dense call, right-padded (causal: padding changes nothing before it)
    padded = jnp.asarray([p + [0] * (width - len(p)) for p in prompts], jnp.int32)
    dense = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t))(state, padded))
    rows = {tuple(p): i for i, p in enumerate(prompts)}
    for prompt, logits in paged_last_logits(engine, prompts):
        np.testing.assert_allclose(logits, dense[rows[tuple(prompt)], len(prompt) - 1], rtol=1e-5, atol=1e-5)


def test_keep_float_names_that_match_nothing_in_a_user_model_are_refused():
    """A name that matched no module of a user's model used to be ignored: a typo quantized what it meant to keep
    float. The default "lm_head" may match nothing (the example's head is its tied embedding)."""
    from tests.model.gpt2_example import GPT2, GPT2Config

    cfg = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=4)
    model = GPT2(cfg, rngs=nnx.Rngs(0))
    linears = sorted({str(path[-1]) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear)})
    with pytest.raises(ValueError, match=r"keep_float names no module of this model: \['c_atn'\] \(its linear "
                                         rf"modules: {', '.join(linears)};"):
        quantize_model(model, QuantConfig("int8", keep_float=("c_atn",)))
    assert not any(isinstance(node, QuantizedLinear) for _, node in nnx.iter_graph(model))  # nothing replaced
    quantize_model(model, QuantConfig("int8", keep_float=(linears[0], "lm_head")))
    kept = {str(path[-1]) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear)}
    assert kept == {linears[0]}


# ------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("value, error, match", [
    ("int3", ValueError, "QuantConfig.scheme 'int3' is not supported"),
    ("int4:33", ValueError, "group_size must be even"),
    ("int8:32", ValueError, "a group size is written 'int4:<int>'"),
    (dict(scheme="int8", group_size=32), ValueError, "group_size applies to scheme 'int4' only"),
    (dict(scheme="int8", scale_dtype="float16"), ValueError, "QuantConfig.scale_dtype"),
    (dict(scheme="int8", bits=8), ValueError, r"unknown QuantConfig fields: \['bits'\]"),
    (dict(scheme="int8", keep_float="lm_head"), TypeError, "keep_float must be a tuple"),
    (8, TypeError, "quantization must be None, a QuantConfig"),
    (dict(scheme="fp8", activations="int8"), ValueError, "goes with integer weights .* not 'fp8'"),
    (dict(scheme="int8", activations="int4"), ValueError, "QuantConfig.activations"),
    ("w8a8:32", ValueError, "a group size is written 'int4:<int>' or 'w4a8:<int>'"),
    ("w4a8:48", ValueError, "group_size 48: int4 weights with int8 activations .* groups of 8, 16, 32, 64"),
    ("w4a8:4", ValueError, "group_size 4: int4 weights with int8 activations"),
])
def test_bad_quantization_names_the_field(value, error, match):
    with pytest.raises(error, match=match):
        CFG.replace(quantization=value)


def test_quantization_names_are_case_insensitive_and_errors_list_every_name():
    """'INT8' used to be refused, and the error listed 'int8, int4, fp8' without the int4:<N> group sizes."""
    assert QuantConfig.parse("INT8") == QuantConfig("int8")
    assert QuantConfig.parse(" Int4:32 ") == QuantConfig("int4", group_size=32)
    assert CFG.replace(quantization="FP8").quantization == QuantConfig("fp8")
    for bad in ("int3", "int8:32"):
        with pytest.raises(ValueError, match=r"accepted names: int8, fp8, int4 .*int4:<N> .*e\.g\. int4:32"):
            QuantConfig.parse(bad)


def test_group_size_must_divide_the_input_dimension_naming_the_tensor():
    with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj: int4 group size 256 does not divide its "
                                         r"input dimension 128"):
        quantize_params(CFG, nnx.state(init_model(CFG), nnx.Param), "int4:256")
    with pytest.raises(ValueError, match="layer.w: a linear kernel"):
        quantize_kernel(jnp.ones((2, 2, 2)), QuantConfig("int8"), "layer.w")


def test_keep_float_must_name_a_module_and_a_tied_head_stays_float_with_a_warning(caplog):
    state = nnx.state(init_model(CFG), nnx.Param)
    with pytest.raises(ValueError, match=r"keep_float names no module of the built-in models: \['lm_haed'\]"):
        quantize_params(CFG, state, QuantConfig("int8", keep_float=("lm_haed",)))
    tied = CFG.replace(tie_word_embeddings=True)
    tied_state = nnx.state(init_model(tied), nnx.Param)
    with caplog.at_level(logging.WARNING, logger="pagedjax.model.llama"):
        quantize_params(tied, tied_state, "int8")  # the default keeps the head float: nothing to say
        assert caplog.text == ""
        _, qstate = quantize_params(tied, tied_state, QuantConfig("int8", keep_float=()))
    assert "its tied embedding table, which is never quantized: the head stays float" in caplog.text
    assert "lm_head" not in qstate and qstate["embed_tokens"]["embedding"].get_value().dtype == jnp.float32
    assert "qweight" in qstate["layers"][0]["self_attn"]["q_proj"]  # the rest is quantized


def test_config_round_trips_and_quantizing_twice_is_refused():
    cfg = CFG.replace(quantization="int4:32")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert QuantConfig.parse("int4").group_size == 128 and QuantConfig.parse("int4:32").name == "int4:32"
    with pytest.raises(ValueError, match="quantized already"):
        quantize_params(cfg, nnx.state(init_model(cfg), nnx.Param), "int8")


def test_quantized_forward_runs_under_jit():
    cfg = CFG.replace(quantization="fp8")
    graphdef, state = nnx.split(init_model(cfg))
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t))(state, jnp.ones((1, 4), jnp.int32))
    assert logits.shape == (1, 4, CFG.vocab_size) and bool(jnp.isfinite(logits).all())


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli_quantization_flag(capsys):
    from pagedjax import cli
    from pagedjax.cli.args import build_parser
    from pagedjax.cli.engine_setup import load_model_for_cli
    from pagedjax.serve.cli import build_parser as build_serve_parser

    args = build_parser().parse_args(["--quantization", "int4:32"])
    assert args.quantization == QuantConfig("int4", group_size=32)
    assert build_serve_parser().parse_args(["--quantization", "fp8"]).quantization == QuantConfig("fp8")
    assert load_model_for_cli(args).model_config.quantization == QuantConfig("int4", group_size=32)
    with pytest.raises(SystemExit) as e:
        cli.main(["--quantization", "int3"])
    assert e.value.code == 2 and "--quantization: QuantConfig.scheme 'int3' is not supported" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- orbax
@pytest.mark.parametrize("quant", ["int4:32", pytest.param("fp8", marks=_slow)])
def test_a_quantized_checkpoint_saves_and_restores_as_stored(tmp_path, quant):
    from pagedjax.model.loading.checkpoint import save_checkpoint
    from pagedjax.model.loading.loader import load_pretrained

    qcfg, qstate = quantize_params(CFG, nnx.state(init_model(CFG, seed=1), nnx.Param), quant)
    save_checkpoint(tmp_path, qcfg, qstate)
    cfg, state, _ = load_pretrained(tmp_path, quantization=quant)  # the scheme it holds: nothing to do
    assert cfg == qcfg
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(qstate), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    # A dtype override casts the float parameters, never the stored weights and scales.
    cfg16, state16, _ = load_pretrained(tmp_path, dtype="bfloat16")
    q_proj = model_from_state(cfg16, state16).layers[0].self_attn.q_proj
    assert q_proj.qweight[...].dtype == qstate["layers"][0]["self_attn"]["q_proj"]["qweight"][...].dtype
    assert q_proj.scale[...].dtype == jnp.float32 and q_proj.bias[...].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="the checkpoint holds 'int4:32' weights already|holds 'fp8'"):
        load_pretrained(tmp_path, quantization="int8")
    # Format version 2; one of version 1 held its kernels [in, out] (square ones would restore silently wrong).
    config_file = tmp_path / "pagedjax_config.json"
    meta = json.loads(config_file.read_text())
    assert meta["format_version"] == 2
    config_file.write_text(json.dumps({**meta, "format_version": 1}))
    with pytest.raises(ValueError, match="format version 1 stores its kernels \\[in, out\\].*quantize the float"):
        load_pretrained(tmp_path)


def test_a_float_checkpoint_is_written_as_format_version_1(tmp_path):
    """Readable by every pagedjax: only quantized checkpoints changed."""
    from pagedjax.model.loading.checkpoint import FORMAT_VERSION, load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path, CFG, nnx.state(init_model(CFG, seed=1), nnx.Param))
    assert json.loads((tmp_path / "pagedjax_config.json").read_text())["format_version"] == 1
    assert load_checkpoint(tmp_path)[0] == CFG
    config_file = tmp_path / "pagedjax_config.json"
    newer = FORMAT_VERSION + 1
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "format_version": newer}))
    with pytest.raises(ValueError, match=f"checkpoint format version {newer}; this pagedjax reads up to {newer - 1}"):
        load_checkpoint(tmp_path)


def test_cli_quantizes_a_model_class_factorys_linears():
    from pagedjax.cli.args import build_parser
    from pagedjax.cli.engine_setup import load_model_for_cli
    from pagedjax.cli.errors import CLIError

    factory = ["--model-class", "tests.model.gpt2_example:load"]
    model = load_model_for_cli(build_parser().parse_args([*factory, "--quantization", "int8"])).model
    layers = [n for _, n in nnx.iter_graph(model) if isinstance(n, nnx.Linear | QuantizedLinear)]
    assert len(layers) == 8 and all(isinstance(n, QuantizedLinear) for n in layers)  # 2 blocks x 4 linears
    with pytest.raises(CLIError, match=r"--quantization int4:256: h.0.attn.c_attn: int4 group size 256 does not "
                                       r"divide its input dimension 64"):
        load_model_for_cli(build_parser().parse_args([*factory, "--quantization", "int4:256"]))


def test_each_kernel_is_converted_just_before_its_dot():
    """XLA:CPU converts a quantized kernel to a float buffer before a dot; the layer's `tie` makes that happen
    layer by layer (buffers reused), not all at the start of the step (every float copy alive at once: 4x slower
    at batch 1 on the 156M shape, `scripts/bench_quant.py`). Read from the compiled step's memory, not timed."""
    cfg = CFG.replace(num_layers=4, quantization="int8")
    graphdef, state = nnx.split(init_model(cfg))
    step = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t))
    # Four tokens: the several-row path (one row of int8 is a multiply-and-reduce, with no float copy at all).
    temp = step.lower(state, jnp.ones((1, 4), jnp.int32)).compile().memory_analysis().temp_size_in_bytes
    float_copies = sum(4 * x.size for p, x in nnx.to_flat_state(state) if p[-1] == "qweight")
    assert temp < float_copies / 2, (temp, float_copies)


def test_a_non_finite_row_stays_in_its_row():
    layer = QuantizedLinear(jnp.asarray(np.random.default_rng(0).standard_normal((32, 8)), jnp.float32),
                            quant=QuantConfig("int8"))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 32)), jnp.float32).at[0, 0].set(jnp.inf)
    y = np.asarray(layer(x))
    assert not np.isfinite(y[0]).all()
    np.testing.assert_allclose(y[1:], np.asarray(x[1:] @ layer.kernel()), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- one row, many
_LAYER = jax.jit(lambda layer, x: layer(x))


@pytest.mark.parametrize("quant", [QuantConfig("int8"), QuantConfig("int4", group_size=16), QuantConfig("fp8"),
                                   QuantConfig("int8", scale_dtype="bfloat16")], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_one_row_and_many_rows_equal_the_dequantized_product(quant, dtype, tol):
    """A single row (batch-1 decode: int8 / int4 fused matrix-vector products) and several rows (a dot) both equal
    x @ dequantize_kernel(...) plus the bias, in float32 (1e-5) and bf16 activations (1e-2)."""
    rng = np.random.default_rng(0)
    kernel = jnp.asarray(rng.standard_normal((128, 24)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(24), dtype)
    layer = QuantizedLinear(kernel, bias, quant=quant, dtype=dtype)
    assert layer.qweight[...].shape == ((24, 64) if quant.scheme == "int4" else (24, 128))  # [out, ...]
    want_w = np.asarray(layer.kernel())  # [in, out]
    for shape in [(1, 128), (1, 1, 128), (5, 128), (2, 3, 128)]:
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        got = _LAYER(layer, x)
        assert got.dtype == jnp.dtype(dtype) and got.shape == (*shape[:-1], 24)
        want = np.asarray(x, np.float32) @ want_w + np.asarray(bias, np.float32)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max(),
                                   err_msg=f"{shape}")


def test_one_row_int4_reads_every_byte_value():
    """The one-row int4 product unpacks each nibble plane as 16 x q: every byte (both nibbles in [-8, 7], -8 too,
    which the quantizer never writes) against the dequantized reference, with scales differing per group."""
    quant = QuantConfig("int4", group_size=32)
    layer = QuantizedLinear(jnp.zeros((512, 2), jnp.float32), quant=quant)  # [in, out]: 256 bytes a channel
    qweight = np.stack([np.arange(256), np.arange(256)[::-1]]).astype(np.uint8)  # [out, in // 2]
    layer.qweight.set_value(jnp.asarray(qweight))
    layer.scale.set_value(jnp.asarray(np.random.default_rng(0).uniform(0.5, 2.0, (2, 16)), jnp.float32))
    want_w = np.asarray(layer.kernel())  # [in, out]
    assert set(np.unique(unpack_int4(layer.qweight[...], 32))) == set(range(-8, 8))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 512)), jnp.float32)
    want = np.asarray(x, np.float64) @ want_w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(_LAYER(layer, x)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("quant", [QuantConfig("int8"), QuantConfig("int4", group_size=32)], ids=lambda q: q.name)
def test_one_row_never_converts_the_kernel(quant):
    """The single-row path reads the stored bytes inside its fused matrix-vector product: the compiled layer holds
    no float buffer of the kernel's (int4: a plane's) size; several rows still convert for their dot (the check
    can see one)."""
    layer = QuantizedLinear(jnp.ones((128, 64), jnp.float32), quant=quant)
    # The entry computation's instructions are the buffers (a fused computation's are registers).
    hlo = lambda rows: _LAYER.lower(layer, jnp.ones((rows, 128), jnp.float32)).compile().as_text().split(  # noqa
        "\nENTRY")[1]
    floats = ("f32[64,128]", "f32[128,64]", "f32[64,64]")
    assert not any(f in hlo(1) for f in floats)
    assert any(f in hlo(4) for f in floats)


def test_holds_quantized_tells_the_runner_to_keep_ynnpack():
    """`holds_quantized`: the engine's runner keeps XLA:CPU's YNNPACK fusions for such models
    (tests/engine/test_cpu_dots.py has the rule)."""
    kernel = jnp.ones((32, 8), jnp.float32)
    assert holds_quantized(nnx.state(QuantizedLinear(kernel, quant=QuantConfig("int4", group_size=16)), nnx.Param))
    assert not holds_quantized(nnx.state(nnx.Linear(32, 8, rngs=nnx.Rngs(0)), nnx.Param))


def test_quantized_leaves_shard_along_the_stored_out_in_axes():
    """qweight `[out, in]` (and int4's scale `[out, in // g]`): column-parallel layers split axis 0, row-parallel
    ones axis 1; per-channel scales `[out]` split with a column layer's outputs, replicated for a row layer."""
    from jax.sharding import PartitionSpec as P

    from pagedjax.parallel.sharding import default_param_partition, param_spec

    for quant, grouped in ((QuantConfig("int4", group_size=16), True), (QuantConfig("int8"), False)):
        cfg = CFG.replace(quantization=quant)
        spec = lambda *names, cfg=cfg: param_spec(("layers", 0, *names), cfg, 2)  # noqa: E731
        assert spec("self_attn", "q_proj", "qweight") == P("tp", None)
        assert spec("mlp", "down_proj", "qweight") == P(None, "tp")
        assert spec("self_attn", "q_proj", "scale") == (P("tp", None) if grouped else P("tp"))
        assert spec("mlp", "down_proj", "scale") == (P(None, "tp") if grouped else P())
        assert spec("mlp", "down_proj", "kernel") == P("tp", None)  # a float kernel `[in, out]` is unchanged
    part = lambda module, leaf, shape: default_param_partition(("h", module, leaf), shape, head_dim=16, tp=2)  # noqa
    assert part("q_proj", "qweight", (64, 32)) == P("tp", None) and part("q_proj", "scale", (64,)) == P("tp")
    assert part("o_proj", "qweight", (32, 64)) == P(None, "tp") and part("o_proj", "scale", (32, 4)) == P()
    assert part("down_proj", "scale", (32, 4)) == P(None, "tp") and part("up_proj", "scale", (32, 4)) == P("tp", None)
    assert part("q_proj", "qweight", (48, 64)) == P()  # 48 outputs are not whole heads of 16 per device
