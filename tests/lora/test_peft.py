"""Reading PEFT adapter folders without torch: what is supported loads as the built-in model's layout, and every
unsupported feature is refused naming its field (or tensor)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pagedjax.config import ModelConfig
from pagedjax.lora.peft import load_peft_adapter
from pagedjax.model.layers.lora import TARGET_MODULES, target_shapes
from tests.lora.adapters import write_adapter

CFG = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128)


def load(folder, max_rank=16):
    return load_peft_adapter(folder, "a", 1, CFG, max_rank)


def test_all_linear_loads_transposed_with_its_scale(tmp_path):
    folder = write_adapter(tmp_path / "a", CFG, rank=4, seed=0, targets="all-linear", alpha=8)
    adapter = load(folder)
    assert adapter.rank == 4 and adapter.scale == 2.0
    assert set(adapter.weights) == {(i, m) for i in range(2) for m in TARGET_MODULES}
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    a, b = adapter.weights[1, "down_proj"]
    np.testing.assert_array_equal(a, tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].T)
    np.testing.assert_array_equal(b, tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].T)
    assert a.shape == (128, 4) and b.shape == (4, 64)


def test_rslora_scale_and_a_target_subset(tmp_path):
    adapter = load(write_adapter(tmp_path / "a", CFG, rank=9, seed=0, targets=("q_proj", "v_proj"), alpha=6,
                                 rslora=True))
    assert adapter.scale == pytest.approx(6 / math.sqrt(9))
    assert {m for _, m in adapter.weights} == {"q_proj", "v_proj"}


def test_slot_arrays_zero_pad_to_the_slot_rank(tmp_path):
    adapter = load(write_adapter(tmp_path / "a", CFG, rank=3, seed=0, targets=("k_proj",)))
    a, b = adapter.slot_arrays(target_shapes(CFG), CFG.num_layers, 8)
    assert a[0]["k_proj"].shape == (64, 8) and b[0]["k_proj"].shape == (8, 32)
    np.testing.assert_array_equal(a[0]["k_proj"][:, :3], adapter.weights[0, "k_proj"][0])
    assert not a[0]["k_proj"][:, 3:].any() and not b[0]["k_proj"][3:].any()
    assert not a[1]["q_proj"].any() and not b[1]["up_proj"].any()  # not targeted: zeros


def _edit_config(folder, **changes):
    file = folder / "adapter_config.json"
    cfg = json.loads(file.read_text())
    cfg.update(changes)
    file.write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(("changes", "field"), [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"bias": "lora_only"}, "bias"),
    ({"r": 32}, "r"),
    ({"r": 0}, "r"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ({"target_modules": ["lm_head"]}, "target_modules"),
    ({"target_modules": ".*proj"}, "target_modules"),
    ({"target_modules": []}, "target_modules"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"use_rslora": "yes"}, "use_rslora"),
    ({"lora_alpha": "8"}, "lora_alpha"),
])
def test_unsupported_config_fields_are_refused_by_name(tmp_path, changes, field):
    folder = _edit_config(write_adapter(tmp_path / "a", CFG, rank=4, seed=0), **changes)
    with pytest.raises(ValueError, match=f"field '{field}'"):
        load(folder)


def _edit_tensors(folder, edit):
    file = str(folder / "adapter_model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return folder


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 97), np.float32)}),
     "embedding adapter"),
    (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)}),
     "not a LoRA A/B weight"),
    (lambda t: t.update({f"{Q}.lora_A.bias": np.zeros(4, np.float32)}), "not a LoRA A/B weight"),
    (lambda t: t.pop(f"{Q}.lora_B.weight"), "no lora_B"),
    (lambda t: t.update({f"{Q}.lora_A.weight": np.zeros((4, 63), np.float32)}), "has shape"),
    (lambda t: t.update({"base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight":
                         np.zeros((4, 64), np.float32)}), "layer 2"),
    (lambda t: t.update({"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight":
                         np.zeros((4, 64), np.float32)}), "no module of target_modules"),
])
def test_bad_tensors_are_refused_by_name(tmp_path, edit, message):
    folder = _edit_tensors(write_adapter(tmp_path / "a", CFG, rank=4, seed=0), edit)
    with pytest.raises(ValueError, match=message):
        load(folder)


def _set(key: str, row: int, value, dtype=np.float32):
    """An edit putting `value` at `[row, 0]` of tensor `key` (stored as `dtype`)."""
    def edit(tensors):
        t = tensors[key].astype(dtype)
        t[row, 0] = value
        tensors[key] = t
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (_set(f"{Q}.lora_A.weight", 3, np.nan), f"tensor '{Q}.lora_A.weight' holds NaN"),
    (_set(f"{Q}.lora_B.weight", 0, -np.inf), f"tensor '{Q}.lora_B.weight' holds an infinity"),
    (_set(f"{Q}.lora_B.weight", 5, 1e38), rf"'{Q}.lora_B.weight' holds a weight of magnitude 1e\+38, above the 1e\+06"),
    (_set(f"{Q}.lora_A.weight", 0, 1e300, np.float64), rf"'{Q}.lora_A.weight' holds an infinity \(as float32"),
    (_set(f"{Q}.lora_A.weight", 1, np.nan, np.float16), f"'{Q}.lora_A.weight' holds NaN"),
], ids=["nan", "inf", "huge", "f64-overflow", "f16-nan"])
def test_non_finite_or_huge_weights_are_refused_by_tensor(tmp_path, edit, message):
    """One bad number anywhere refuses the adapter, naming its tensor (it would otherwise reach a device slot)."""
    folder = _edit_tensors(write_adapter(tmp_path / "a", CFG, rank=4, seed=0), edit)
    with pytest.raises(ValueError, match=message):
        load(folder)


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -math.inf, 1e308, -2e6, 10**400])
def test_a_non_finite_or_absurd_alpha_is_refused(tmp_path, alpha):
    folder = _edit_config(write_adapter(tmp_path / "a", CFG, rank=4, seed=0), lora_alpha=alpha)
    with pytest.raises(ValueError, match=r"field 'lora_alpha' must be a finite number of magnitude at most 1e\+06"):
        load(folder)


def test_a_deeply_nested_config_is_refused_as_a_value_error(tmp_path):
    """100,000 nested arrays made the JSON decoder raise RecursionError, which no caller expects (the server
    answered 500 and dropped the connection)."""
    folder = write_adapter(tmp_path / "a", CFG, rank=4, seed=0)
    (folder / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="adapter_config.json is nested too deeply to read"):
        load(folder)


def test_a_tensor_of_an_untargeted_module_is_refused(tmp_path):
    folder = write_adapter(tmp_path / "a", CFG, rank=4, seed=0)
    _edit_config(folder, target_modules=["k_proj"])
    with pytest.raises(ValueError, match="no module of target_modules"):
        load(folder)


def test_target_modules_by_path_as_peft_saves_all_linear(tmp_path):
    folder = write_adapter(tmp_path / "a", CFG, rank=4, seed=0, targets=("q_proj",))
    _edit_config(folder, target_modules=["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"])
    assert set(load(folder).weights) == {(0, "q_proj"), (1, "q_proj")}
    _edit_config(folder, target_modules=["model.layers.0.self_attn.q_proj"])  # layer 1's tensor is of no target
    with pytest.raises(ValueError, match="layers.1.self_attn.q_proj.lora_A.weight' is of no module"):
        load(folder)
    _edit_config(folder, target_modules=["model.layers.0.self_attn.rotary_emb"])
    with pytest.raises(ValueError, match="field 'target_modules' names"):
        load(folder)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load(tmp_path / "empty")
    folder = write_adapter(tmp_path / "a", CFG, rank=4, seed=0)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(ValueError, match="torch pickle"):
        load(folder)


def test_unreadable_files_are_named(tmp_path):
    folder = write_adapter(tmp_path / "a", CFG, rank=4, seed=0)
    (folder / "adapter_config.json").write_bytes(b'{"r": 4, \xff')
    with pytest.raises(ValueError, match="adapter_config.json is not valid JSON"):
        load(folder)
    folder = write_adapter(tmp_path / "b", CFG, rank=4, seed=0)
    (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")  # safetensors' own error type
    with pytest.raises(ValueError, match="adapter_model.safetensors is not a valid safetensors file"):
        load(folder)


def test_a_bf16_adapter_loads_as_its_float32_save(tmp_path, monkeypatch):
    """PEFT saves adapters in bf16 mostly; safetensors' numpy API cannot read BF16 where numpy has no 'bfloat16'
    (TypeError: data type 'bfloat16' not understood): such tensors are read from the file's bytes instead."""
    import ml_dtypes
    import safetensors

    f32 = write_adapter(tmp_path / "f32", CFG, rank=4, seed=0, targets="all-linear")
    weights = f32 / "adapter_model.safetensors"
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(str(weights)).items()}
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(weights))  # values bf16 can hold
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "adapter_config.json").write_text((f32 / "adapter_config.json").read_text())
    save_file(tensors, str(bf16 / "adapter_model.safetensors"))
    with safetensors.safe_open(str(bf16 / "adapter_model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # as PEFT writes them

    real = np.dtype

    def numpy_without_bf16(name, *args, **kwargs):  # numpy where ml_dtypes registered no 'bfloat16' name
        if name == "bfloat16":
            raise TypeError("data type 'bfloat16' not understood")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(np, "dtype", numpy_without_bf16)
    with pytest.raises(TypeError, match="bfloat16"):
        load_file(str(bf16 / "adapter_model.safetensors"))  # what safetensors' numpy API does then
    a = load(bf16)
    monkeypatch.undo()
    b = load(f32)
    assert a.rank == b.rank and a.scale == b.scale and set(a.weights) == set(b.weights)
    for key, (lo, hi) in b.weights.items():
        assert a.weights[key][0].dtype == np.float32
        np.testing.assert_array_equal(a.weights[key][0], lo)
        np.testing.assert_array_equal(a.weights[key][1], hi)
