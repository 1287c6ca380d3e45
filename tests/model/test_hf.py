"""Hugging Face checkpoints: tiny random Llama / Mistral / Qwen2 models built with transformers' own config
classes, saved with `save_pretrained` and loaded by pagedjax, must give transformers' logits (float32, 1e-4)
and transformers' greedy `generate` continuations token for token. No hub access: everything is local.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from pagedjax.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from pagedjax.engine import LLMEngine  # noqa: E402
from pagedjax.model.hf_tokenizer import HFTokenizer  # noqa: E402
from pagedjax.model.llama import init_model  # noqa: E402
from pagedjax.model.loading.hf_loader import (  # noqa: E402
    _read_raw,
    load_hf,
    load_hf_config,
    load_hf_params,
    model_from_state,
)
from pagedjax.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB = 96
MAX_NEW = 8
TOL = 1e-4  # float32 logits, pagedjax vs transformers
MIN_MARGIN = 1e-2  # top-1 minus top-2 logit at every greedy step: far from a tie at TOL
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "big", "red", "house", "in", "sun"]

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128, initializer_range=0.2,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
# Seeds picked so that no greedy step of any prompt is a near tie (asserted in the tests).
MODELS = {
    # GQA, untied embeddings, llama3 rope scaling with every frequency band in use at head_dim 16.
    "llama": ("LlamaConfig", 0, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    # MQA, an explicit head_dim (heads * head_dim != hidden), a sliding window longer than any test sequence.
    "mistral": ("MistralConfig", 0, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                         sliding_window=128, tie_word_embeddings=False)),
    # MHA, q/k/v biases, tied embeddings.
    "qwen2": ("Qwen2Config", 0, dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
}
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (1, 6, 13, 22)]


def random_hf_model(cls_name: str, seed: int, config: dict, *, norm_center: float = 1.0,
                    random_biases: bool = True):
    """A tiny random transformers model of config class `cls_name`, eager attention (Gemma's soft caps need it;
    one attention code for all), its norms random around `norm_center` (1, or 0 for Gemma's, which scale by
    1 + w) and its biases random too: every parameter a weight-loading mistake could hide behind."""
    hf_config = getattr(transformers, cls_name)(**config)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.2 * torch.randn_like(p))
            elif name.endswith("bias") and random_biases:
                p.copy_(0.5 * torch.randn_like(p))
    return model


def saved_and_loaded(model, folder: str):
    """`model` saved under `folder` and loaded by pagedjax: (cfg, state)."""
    model.save_pretrained(folder, safe_serialization=True)
    cfg, state, _ = load_hf(folder)
    return cfg, state


def paged_last_logits(engine: LLMEngine, prompts) -> list[tuple[list[int], np.ndarray]]:
    """Every prompt's prefill as one step of the engine's paged path: (prompt, its last position's logits) in
    the step's order."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=1))
    plan = engine.scheduler.schedule()
    assert plan.num_seqs == len(prompts)
    logits = engine.runner.execute(engine.step_inputs(plan), return_logits=True).logits
    return [(engine.scheduler.get_request(r).prompt_token_ids, logits[i]) for i, r in enumerate(plan.request_ids)]


def build_hf_model(kind: str):
    cls_name, seed, extra = MODELS[kind]
    return random_hf_model(cls_name, seed, {**_COMMON, **extra})


def _save(model, path: Path, **kw) -> Path:
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    return path


def dense_logits(cfg: ModelConfig, state: nnx.State, prompts) -> list[np.ndarray]:
    """pagedjax's no-cache forward on right-padded prompts (causal: padding changes nothing before it)."""
    graphdef, params = nnx.split(model_from_state(cfg, state))
    batch = np.zeros((len(prompts), max(len(p) for p in prompts)), np.int32)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    # Jitted: run op by op, a forward dispatches (and at -O0 compiles) every primitive on its own, several times
    # slower than compiling it once.
    logits = np.asarray(jax.jit(lambda b: nnx.merge(graphdef, params).forward_dense(b))(batch))
    return [logits[i, : len(p)] for i, p in enumerate(prompts)]


def hf_logits(model, prompts) -> list[np.ndarray]:
    batch = np.zeros((len(prompts), max(len(p) for p in prompts)), np.int64)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    with torch.no_grad():
        logits = model(torch.from_numpy(batch)).logits.float().numpy()
    return [logits[i, : len(p)] for i, p in enumerate(prompts)]


def hf_greedy(model, prompt, max_new: int) -> tuple[list[int], float]:
    """transformers' greedy generate (EOS not a stop), and the smallest top-1/top-2 margin on the way."""
    ids = torch.tensor([prompt], dtype=torch.long)
    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id = None  # older transformers fall back to this when eos_token_id=None is passed
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, max_new_tokens=max_new,
                         do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                         output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == max_new
    margin = np.inf
    for step, logits in enumerate(out.logits):
        top2 = torch.topk(logits[0].float(), 2).values
        margin = min(margin, float(top2[0] - top2[1]))
        assert int(torch.argmax(logits[0])) == tokens[step]
    return tokens, margin


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """kind -> (transformers model, saved folder)."""
    out = {}
    for kind in MODELS:
        model = build_hf_model(kind)
        out[kind] = (model, _save(model, tmp_path_factory.mktemp(kind)))
    return out


def word_tokenizer(bos: bool = True) -> tokenizers.Tokenizer:
    """A tiny WordLevel tokenizer whose post-processor adds BOS (as Llama's does)."""
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return tok


# --------------------------------------------------------------------------------------------- model equality
@pytest.mark.parametrize("kind", list(MODELS))
def test_config_maps_fields(hf_models, kind):
    model, path = hf_models[kind]
    hc = model.config
    cfg = load_hf_config(path)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (
        hc.vocab_size, hc.hidden_size, hc.num_hidden_layers, hc.intermediate_size)
    assert (cfg.num_q_heads, cfg.num_kv_heads) == (hc.num_attention_heads, hc.num_key_value_heads)
    assert cfg.head_dim == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    assert cfg.tie_word_embeddings == (kind == "qwen2")
    assert cfg.qkv_bias == (kind == "qwen2")
    assert cfg.dtype == "float32"
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert cfg.rms_norm_eps == pytest.approx(hc.rms_norm_eps)
    if kind == "llama":
        assert cfg.rope_theta == 50000.0
        assert dict(cfg.rope_scaling) == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16.0}
        assert cfg.max_position_embeddings == 256
    else:
        assert cfg.rope_scaling is None
    if kind == "mistral":
        assert cfg.max_position_embeddings == 256  # a window is served as such: no cap to it
        assert cfg.sliding_windows == (128, 128)
    else:
        assert cfg.sliding_windows is None


@pytest.mark.parametrize("kind", list(MODELS))
def test_state_matches_init_model_structure(hf_models, kind):
    _, path = hf_models[kind]
    cfg = load_hf_config(path)
    state = load_hf_params(path, cfg)
    want = nnx.split(init_model(cfg))[1]
    assert jax.tree.structure(state) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_match_transformers(hf_models, kind):
    model, path = hf_models[kind]
    cfg, state, tok = load_hf(path)
    assert tok is None  # no tokenizer.json saved
    ours = dense_logits(cfg, state, PROMPTS)
    ref = hf_logits(model, PROMPTS)
    for p, a, b in zip(PROMPTS, ours, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{kind}, prompt of {len(p)} tokens")


def test_linear_rope_scaling_logits(tmp_path):
    """Linear RoPE scaling (positions divided by the factor), MHA, one layer."""
    config = transformers.LlamaConfig(**{**_COMMON, "num_hidden_layers": 1}, num_attention_heads=2,
                                      num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 3.0})
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    cfg, state, _ = load_hf(_save(model, tmp_path / "linear"))
    assert dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 3.0}
    for a, b in zip(dense_logits(cfg, state, PROMPTS), hf_logits(model, PROMPTS), strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kind", list(MODELS))
def test_engine_greedy_matches_transformers_generate(hf_models, kind):
    model, path = hf_models[kind]
    expected, margins = zip(*(hf_greedy(model, p, MAX_NEW) for p in PROMPTS), strict=True)
    # A near tie would make "identical tokens" depend on rounding: these seeds have none.
    assert min(margins) > MIN_MARGIN, min(margins)
    cfg, state, _ = load_hf(path)
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=32),
                       scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                       params=model_from_state(cfg, state))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0,
                                                   max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for p, out, want in zip(PROMPTS, outs, expected, strict=True):
        assert out.output_token_ids == want, f"{kind}, prompt of {len(p)} tokens"


def test_engine_string_prompts_with_tokenizer(hf_models, tmp_path):
    """A folder with tokenizer.json: load_hf returns a tokenizer, string prompts generate like transformers."""
    model, path = hf_models["llama"]
    folder = tmp_path / "llama-tok"
    folder.mkdir()
    for f in path.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    word_tokenizer().save(str(folder / "tokenizer.json"))
    cfg, state, tok = load_hf(folder)
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (2,)
    texts = ["the cat sat on a mat", "sun in the house", "a big red house"]
    ids = [tok.encode(t) for t in texts]
    assert all(i[0] == 1 for i in ids)  # BOS from the post-processor
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=32),
                       scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                       params=model_from_state(cfg, state), tokenizer=tok)
    outs = engine.generate(texts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for i, out in zip(ids, outs, strict=True):
        want, margin = hf_greedy(model, i, MAX_NEW)
        assert margin > MIN_MARGIN
        assert out.prompt_token_ids == i
        assert out.output_token_ids == want
        assert out.text == tok.decode(want)


# ---------------------------------------------------------------------------------------- formats and dtypes
def test_sharded_checkpoint_loads_identically(hf_models, tmp_path):
    model, path = hf_models["llama"]
    sharded = _save(model, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    cfg = load_hf_config(path)
    single = load_hf_params(path, cfg)
    shards = load_hf_params(sharded, cfg)
    assert jax.tree.structure(single) == jax.tree.structure(shards)
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(shards), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint(hf_models, tmp_path, dtype):
    """bf16/f16 weights load bit-exactly in their own dtype, and in float32 give the float32 logits of the
    rounded weights."""
    model, _ = hf_models["qwen2"]
    half = copy.deepcopy(model).to(getattr(torch, dtype))
    path = _save(half, tmp_path / dtype)
    cfg = load_hf_config(path)
    assert cfg.dtype == dtype  # the checkpoint's dtype is the default
    state = load_hf_params(path, cfg)
    q = state["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.dtype == jax.numpy.dtype(dtype)
    want = half.model.layers[0].self_attn.q_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(np.asarray(q, np.float32), want)

    cfg32 = load_hf_config(path, dtype="float32")
    state32 = load_hf_params(path, cfg32)
    ours = dense_logits(cfg32, state32, PROMPTS[1:3])
    # The float32 reference: the rounded weights in a float32 model (casting the half model itself back would
    # also round transformers' RoPE inv_freq buffer, which is not part of the checkpoint).
    rounded = copy.deepcopy(model)
    rounded.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    ref = hf_logits(rounded, PROMPTS[1:3])
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL)


def test_raw_reader_matches_safetensors(hf_models, tmp_path):
    """The fallback reader (for safetensors versions whose numpy API lacks bf16) reads the same bits."""
    from safetensors import safe_open

    model, _ = hf_models["mistral"]
    path = _save(copy.deepcopy(model).to(torch.bfloat16), tmp_path / "bf16")
    file = path / "model.safetensors"
    with safe_open(str(file), framework="numpy") as f:
        for name in f.keys():
            raw = _read_raw(file, name)
            assert raw.dtype == jax.numpy.dtype("bfloat16")
            np.testing.assert_array_equal(raw.view(np.uint16), f.get_tensor(name).view(np.uint16))


# --------------------------------------------------------------------------------------------------- errors
def _rewrite_tensors(path: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("problem", ["missing", "unexpected", "misshaped"])
def test_checkpoint_mismatch_names_the_tensor(hf_models, tmp_path, problem):
    _, src = hf_models["llama"]
    path = _copy_folder(src, tmp_path / problem)
    name = "model.layers.1.mlp.up_proj.weight"
    if problem == "missing":
        _rewrite_tensors(path, lambda t: t.pop(name))
    elif problem == "unexpected":
        _rewrite_tensors(path, lambda t: t.update({"model.layers.1.mlp.extra.weight": np.zeros(3, np.float32)}))
        name = "model.layers.1.mlp.extra.weight"
    else:
        _rewrite_tensors(path, lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(ValueError, match=problem.replace("misshaped", "mis-shaped")) as e:
        load_hf_params(path, load_hf_config(path))
    assert name in str(e.value)


def _base_config() -> dict:
    return {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64, "eos_token_id": 2,
            "bos_token_id": 1}


def _write_config(tmp_path: Path, changes: dict, generation: dict | None = None) -> Path:
    config = {**_base_config(), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


@pytest.mark.parametrize("changes, field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"model_type": "deepseek_v3"}, "model_type"),  # a mixture of experts pagedjax does not compute
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_attention_heads": 3}, "hidden_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0,
      "layer_types": ["full_attention"], "num_hidden_layers": 1, "hidden_act": "relu"}, "hidden_act"),
    ({"model_type": "mistral", "layer_types": ["chunked_attention"], "sliding_window": 8}, "layer_types"),
    ({"model_type": "mistral", "layer_types": ["full_attention"], "sliding_window": 8}, "layer_types"),
    ({"model_type": "mistral", "layer_types": ["sliding_attention"] * 2, "sliding_window": 8}, "layer_types"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": -1},
     "max_window_layers"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "hidden_activation"),
    ({"model_type": "gemma2", "attention_bias": True}, "attention_bias"),
    ({"model_type": "gemma2", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma2", "attn_logit_softcapping": 0}, "attn_logit_softcapping"),
    ({"model_type": "gemma2", "final_logit_softcapping": "30"}, "final_logit_softcapping"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": None}, "query_pre_attn_scalar"),
])
def test_unsupported_config_names_the_field(tmp_path, changes, field):
    with pytest.raises(ValueError, match=field):
        load_hf_config(_write_config(tmp_path, changes))


def test_config_variants(tmp_path):
    # transformers-4 style: rope_theta and rope_scaling ("type") at the top, torch_dtype, no head_dim.
    cfg = load_hf_config(_write_config(tmp_path, {"rope_theta": 5e5, "torch_dtype": "bfloat16",
                                                  "rope_scaling": {"type": "linear", "factor": 2.0}}))
    assert cfg.rope_theta == 5e5 and cfg.dtype == "bfloat16" and cfg.head_dim == 8
    assert cfg.rope_scaling == (("factor", 2.0), ("rope_type", "linear"))
    assert load_hf_config(tmp_path, dtype="float32").dtype == "float32"
    # "default" rope scaling is no scaling; num_key_value_heads defaults to MHA.
    cfg = load_hf_config(_write_config(tmp_path, {"rope_scaling": {"rope_type": "default"},
                                                  "num_key_value_heads": None}))
    assert cfg.rope_scaling is None and cfg.num_kv_heads == 2
    # generation_config.json's EOS ids are what generate stops on.
    cfg = load_hf_config(_write_config(tmp_path, {}, generation={"eos_token_id": [2, 7], "bos_token_id": 1}))
    assert cfg.eos_token_ids == (2, 7) and cfg.bos_token_id == 1


@pytest.mark.parametrize("changes, windows", [
    ({"model_type": "mistral", "sliding_window": 16}, (16, 16)),
    ({"model_type": "mistral", "sliding_window": None}, None),  # an explicit null: no window
    ({"model_type": "mistral"}, (4096, 4096)),  # absent: transformers' default window
    ({"model_type": "mistral", "sliding_window": 16, "layer_types": ["sliding_attention"] * 2}, (16, 16)),
    # Qwen2: the window only with use_sliding_window, on layers from max_window_layers on (default 28) ...
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False}, None),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 0}, (16, 16)),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1},
     (None, 16)),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True}, None),
    # ... or on the layers layer_types marks.
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 0,
      "layer_types": ["sliding_attention", "full_attention"]}, (16, None)),
    ({"model_type": "llama", "sliding_window": 16}, None),
])
def test_sliding_windows_per_layer(tmp_path, changes, windows):
    cfg = load_hf_config(_write_config(tmp_path, {"num_hidden_layers": 2, **changes}))
    assert cfg.sliding_windows == windows
    assert cfg.max_position_embeddings == 64  # never capped to the window


# ------------------------------------------------------------------------------------------------ tokenizer
def test_word_tokenizer_round_trip(tmp_path):
    word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    tok = HFTokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == len(tok) == 3 + len(WORDS)
    assert tok.eos_token_ids == (2,) and tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.special_token_ids == (0, 1, 2)
    text = "the big red dog ran to a house"
    ids = tok.encode(text)
    assert ids[0] == 1 and len(ids) == 1 + len(text.split())
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert hf(text)["input_ids"] == ids


def test_byte_level_bpe_round_trip(tmp_path):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "naïve café — déjà vu", "x = f(y) + 1\n"] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    wrapped = HFTokenizer.from_file(tmp_path / "tokenizer.json", eos_token_ids=[tok.token_to_id("<|end|>")])
    for text in ["the lazy fox", "déjà vu, naïve café!", "unseen ☃ text\twith tabs"]:
        ids = wrapped.encode(text)
        assert all(0 <= i < wrapped.vocab_size for i in ids)
        assert wrapped.decode(ids) == text
    assert wrapped.eos_token_ids == (0,)
