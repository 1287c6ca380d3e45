"""A model folder's pooling (`folder_pooling_defaults`): sentence-transformers' modules.json, Pooling config and Dense
modules (config.json + model.safetensors), read as `PoolingDefaults`; what pagedjax cannot compute is refused with
the reason, a file that is not JSON or weights of the wrong shape are errors naming them."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

from pagedjax.config.pooling import DenseLayer, PoolingDefaults
from pagedjax.model.loading.pooling_config import folder_pooling_defaults

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
DENSE_3 = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
IDENTITY, TANH = "torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Tanh"
FLAGS = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
         "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def folder(tmp_path, modules, pooling: dict | None):
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def flags(on: str, **extra) -> dict:
    return {"word_embedding_dimension": 64, **{f: f == on for f in FLAGS}, **extra}


@pytest.mark.parametrize("flag, pooling", [("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                           ("pooling_mode_cls_token", "cls")])
def test_each_mode_with_and_without_normalize(tmp_path, flag, pooling):
    d = folder_pooling_defaults(folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], flags(flag, include_prompt=True)))
    assert (d.pooling, d.normalize, d.refused) == (pooling, True, None)
    assert d.source.endswith("modules.json") and d.describe().endswith(f"normalized ({d.source})")
    (tmp_path / "modules.json").write_text(json.dumps([TRANSFORMER, POOLING]))
    assert folder_pooling_defaults(tmp_path).normalize is False


def test_newer_pooling_mode_strings_and_no_folder_files(tmp_path):
    assert folder_pooling_defaults(folder(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode": "lasttoken"})).pooling \
        == "last"
    assert folder_pooling_defaults(tmp_path / "1_Pooling") == PoolingDefaults()  # no modules.json: last, normalized


@pytest.mark.parametrize("modules, pooling, why", [
    ([TRANSFORMER, POOLING, DENSE, NORMALIZE], flags("pooling_mode_mean_tokens"), "'2_Dense': no config.json"),
    ([TRANSFORMER, POOLING, NORMALIZE, DENSE], flags("pooling_mode_mean_tokens"), "optional Normalize .in that order"),
    ([TRANSFORMER, POOLING], flags("pooling_mode_max_tokens"), r"pooling \['pooling_mode_max_tokens'\]"),
    ([TRANSFORMER, POOLING], {**flags("pooling_mode_cls_token"), "pooling_mode_mean_tokens": True}, "pooling"),
    ([TRANSFORMER, POOLING], flags("pooling_mode_mean_tokens", include_prompt=False), "include_prompt false"),
    ([POOLING], flags("pooling_mode_cls_token"), "not a Transformer, a Pooling"),
])
def test_what_pagedjax_cannot_compute_is_refused_with_the_reason(tmp_path, modules, pooling, why):
    d = folder_pooling_defaults(folder(tmp_path, modules, pooling))
    assert d.refused is not None and d.describe().startswith("refused")
    assert re.search(why, d.refused), d.refused


def test_files_of_the_wrong_shape_are_errors_naming_them(tmp_path):
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(ValueError, match="modules.json: not a readable JSON file"):
        folder_pooling_defaults(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps({"0": TRANSFORMER}))
    with pytest.raises(ValueError, match="must hold a list of module objects"):
        folder_pooling_defaults(tmp_path)
    folder(tmp_path, [TRANSFORMER, POOLING], None)
    with pytest.raises(ValueError, match="the Pooling module's config must be a JSON object"):
        folder_pooling_defaults(tmp_path)
    with pytest.raises(ValueError, match="PoolingDefaults.pooling 'max' is not supported"):
        PoolingDefaults(pooling="max")
    with pytest.raises(TypeError, match="PoolingDefaults.normalize must be true or false"):
        PoolingDefaults(normalize="yes")


def dense_module(folder, path: str, n_in: int, n_out: int, *, bias=True, activation=IDENTITY, seed=0,
                 weights: str = "model.safetensors"):
    """A Dense module as sentence-transformers saves it; returns its (weight, bias)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n_out, n_in)).astype(np.float32)
    b = rng.normal(size=(n_out,)).astype(np.float32) if bias else None
    (folder / path).mkdir()
    (folder / path / "config.json").write_text(json.dumps(
        {"in_features": n_in, "out_features": n_out, "bias": bias, "activation_function": activation}))
    save_file({"linear.weight": w, **({"linear.bias": b} if bias else {})}, str(folder / path / weights))
    return w, b


def test_dense_modules_are_read_and_applied_in_order(tmp_path):
    folder(tmp_path, [TRANSFORMER, POOLING, DENSE, DENSE_3, NORMALIZE], flags("pooling_mode_mean_tokens"))
    w1, b1 = dense_module(tmp_path, "2_Dense", 8, 12, activation=TANH)
    w2, _ = dense_module(tmp_path, "3_Dense", 12, 5, bias=False, seed=1)
    d = folder_pooling_defaults(tmp_path)
    assert (d.pooling, d.normalize, d.refused, d.output_size(8)) == ("mean", True, None, 5)
    assert "Dense 8 -> 12, Dense 12 -> 5, normalized" in d.describe()
    x = np.random.default_rng(2).normal(size=8).astype(np.float32)
    y = x
    for layer in d.dense:
        y = layer(y)
    np.testing.assert_allclose(y, w2 @ np.tanh(w1 @ x + b1), rtol=1e-5)
    assert PoolingDefaults().output_size(8) == 8


@pytest.mark.parametrize("make, why", [
    (lambda f: dense_module(f, "2_Dense", 8, 8, activation="torch.nn.modules.activation.ReLU"),
     "activation 'torch.nn.modules.activation.ReLU' is not one pagedjax computes"),
    (lambda f: dense_module(f, "2_Dense", 8, 8, weights="pytorch_model.bin"), "no model.safetensors"),
])
def test_dense_modules_pagedjax_cannot_compute_are_refused(tmp_path, make, why):
    folder(tmp_path, [TRANSFORMER, POOLING, DENSE], flags("pooling_mode_mean_tokens"))
    make(tmp_path)
    d = folder_pooling_defaults(tmp_path)
    assert d.refused is not None and why in d.refused, d.refused


def test_dense_weights_of_the_wrong_shape_are_errors(tmp_path):
    folder(tmp_path, [TRANSFORMER, POOLING, DENSE, DENSE_3], flags("pooling_mode_mean_tokens"))
    dense_module(tmp_path, "2_Dense", 8, 12)
    dense_module(tmp_path, "3_Dense", 10, 4)  # takes 10, the layer before gives 12
    assert "dense[1] takes 10 inputs, but dense[0] gives 12" in folder_pooling_defaults(tmp_path).refused
    (tmp_path / "3_Dense" / "config.json").write_text(json.dumps({"in_features": 12, "out_features": 4}))
    with pytest.raises(ValueError, match=r"3_Dense/model.safetensors: linear.weight has shape \[4, 10\]"):
        folder_pooling_defaults(tmp_path)
    with pytest.raises(ValueError, match="DenseLayer.weight must be a float32"):
        DenseLayer(np.zeros((2, 3)), None)
    with pytest.raises(ValueError, match="DenseLayer.bias must be None or a float32 .2."):
        DenseLayer(np.zeros((2, 3), np.float32), np.zeros(3, np.float32))


def test_a_dense_module_without_its_tensors_is_an_error_naming_the_file(tmp_path):
    folder(tmp_path, [TRANSFORMER, POOLING, DENSE], flags("pooling_mode_mean_tokens"))
    dense_module(tmp_path, "2_Dense", 8, 4, bias=False)
    config = json.loads((tmp_path / "2_Dense" / "config.json").read_text())
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps({**config, "bias": True}))  # no linear.bias stored
    with pytest.raises(ValueError, match=r"2_Dense/model.safetensors: cannot read the Dense layer's linear.bias: not"):
        folder_pooling_defaults(tmp_path)
    (tmp_path / "2_Dense" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        folder_pooling_defaults(tmp_path)
