"""Pre-quantized Hugging Face checkpoints (`pagedjax.model.loading.hf_quant`): a tiny random Llama quantized and packed
by compressed-tensors' own compressor (pack-quantized W4A16, int-quantized W8A16), loaded by pagedjax; its paged
logits equal transformers' forward over the weights compressed-tensors itself decompresses (float32, 1e-4, as
tests/model/test_hf.py). Then the configs and tensors pagedjax refuses, each error naming the field or tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

from pagedjax import CacheConfig, LLMEngine, SchedulerConfig  # noqa: E402
from pagedjax.config.quant import QuantConfig  # noqa: E402
from pagedjax.model.errors import ModelLoadError  # noqa: E402
from pagedjax.model.loading.hf_loader import load_hf  # noqa: E402
from pagedjax.model.loading.hf_quant import quant_config  # noqa: E402
from tests.model.test_hf import PROMPTS, TOL, build_hf_model, hf_logits, paged_last_logits  # noqa: E402

pytestmark = pytest.mark.hf

GROUP = 32  # the tiny model's input dimensions are 64 and 128
FORMATS = {"int4": ("pack-quantized", 4, "group"), "int8": ("int-quantized", 8, "channel")}


def compressed_checkpoint(folder: Path, scheme: str):
    """The tiny random Llama of test_hf, its linear layers (not the LM head) quantized with scales from
    compressed-tensors' `calculate_qparams` and packed by its `ModelCompressor`, saved to `folder`. Returns the
    transformers model with the weights compressed-tensors decompresses again (the reference)."""
    fmt, bits, strategy = FORMATS[scheme]
    model = build_hf_model("llama")
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy,
                            group_size=GROUP if strategy == "group" else None)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    with torch.no_grad():
        for _, module in model.named_modules():
            if hasattr(module, "weight_scale"):  # what an observer would compute: min / max per group or row
                w = module.weight
                w = w.reshape(w.shape[0], -1, GROUP) if strategy == "group" else w.reshape(w.shape[0], 1, -1)
                scale, _ = calculate_qparams(w.amin(-1), w.amax(-1), args)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(folder), safe_serialization=True)
    compressor.update_config(str(folder))
    compressor.decompress_model(model)
    return model


@pytest.mark.parametrize("scheme", ["int4", pytest.param("int8", marks=pytest.mark.slow)])
def test_compressed_tensors_checkpoint_matches_transformers_over_its_decompressed_weights(tmp_path, scheme):
    reference = compressed_checkpoint(tmp_path, scheme)
    cfg, state, _ = load_hf(tmp_path)
    assert cfg.quantization == (QuantConfig("int4", group_size=GROUP) if scheme == "int4" else QuantConfig("int8"))
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=4, num_blocks=32),
                       scheduler_config=SchedulerConfig( max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32),
                       params=state)
    want = dict((tuple(p), lg[-1]) for p, lg in zip(PROMPTS, hf_logits(reference, PROMPTS), strict=True))
    for prompt, logits in paged_last_logits(engine, PROMPTS):
        np.testing.assert_allclose(logits, want[tuple(prompt)], rtol=TOL, atol=TOL)


def test_scales_that_do_not_match_their_weights_name_the_tensor(tmp_path):
    compressed_checkpoint(tmp_path, "int4")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64  # scales are per 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model.layers.0.self_attn.q_proj.weight_scale: checkpoint \[64, 2\], "
                                             r"model expects \[64, 1\]"):
        load_hf(tmp_path)


_W4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
       "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
           "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}


def _changed(path: str, value) -> dict:
    config = json.loads(json.dumps(_W4))
    *parents, last = path.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[last] = value
    return config


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    (_changed("config_groups.group_0.weights.symmetric", False), "only symmetric int weights"),
    (_changed("config_groups.group_0.weights.type", "float"), "only symmetric int weights"),
    (_changed("config_groups.group_0.weights.actorder", "group"), "activation ordering"),
    (_changed("config_groups.group_0.input_activations", {"num_bits": 8}), "quantized activations"),
    (_changed("config_groups.group_0.targets", ["re:.*mlp.*"]), "must target"),
    (_changed("config_groups.group_1", {}), "exactly one quantization group"),
    (_changed("ignore", ["lm_head", "model.layers.0.mlp.down_proj"]), "only lm_head may be left"),
    (_changed("config_groups.group_0.weights.num_bits", 8), "format 'pack-quantized' with 8-bit 'group'"),
    (_changed("format", "float-quantized"), "format 'float-quantized'"),
])
def test_unsupported_quantization_configs_name_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        quant_config(config)


def test_supported_configs():
    assert quant_config(_W4) == QuantConfig("int4", group_size=128)
    w8 = _changed("format", "int-quantized")
    w8["config_groups"]["group_0"]["weights"].update(num_bits=8, strategy="channel", group_size=None)
    w8["ignore"] = []
    assert quant_config(w8) == QuantConfig("int8", keep_float=())
