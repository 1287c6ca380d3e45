"""Pre-quantized mixture-of-experts checkpoints in the compressed-tensors format (`pagedjax.model.loading.hf_quant`): a
tiny random Mixtral whose attention and expert projections are quantized (W4A16 groups) with compressed-tensors'
own `calculate_qparams` / `quantize` and packed by its `pack_to_int32`, one tensor per expert and projection as
vLLM reads them (transformers 5 holds a Mixtral's experts fused, so its compressor, which targets `Linear`
modules, cannot write them), routers left float by a "re:" ignore entry as llm-compressor's recipes write it.
pagedjax loads the experts stacked and quantized; its paged logits equal, within float32 1e-5, the float model of
the values compressed-tensors dequantizes. Then the router rules of "ignore"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from pagedjax import CacheConfig, LLMEngine, SchedulerConfig  # noqa: E402
from pagedjax.config.quant import QuantConfig  # noqa: E402
from pagedjax.model.layers.moe_quant import QuantizedExperts  # noqa: E402
from pagedjax.model.layers.quant import QuantizedLinear  # noqa: E402
from pagedjax.model.loading.hf_loader import load_hf, model_from_state  # noqa: E402
from pagedjax.model.loading.hf_quant import quant_config  # noqa: E402
from tests.model.test_hf import paged_last_logits  # noqa: E402
from tests.model.test_hf_moe import PROMPTS, build_hf_model  # noqa: E402

pytestmark = pytest.mark.hf

GROUP = 16  # divides the tiny Mixtral's hidden size (32) and expert width (48)
SCHEMES = {  # name -> (compressed-tensors' arguments, its format, the QuantConfig pagedjax reads)
    "int4": (QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP),
             "pack-quantized", QuantConfig("int4", group_size=GROUP)),
    "int8": (QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"), "int-quantized",
             QuantConfig("int8")),
}
ROUTERS = "re:.*block_sparse_moe.gate$"  # as llm-compressor's Mixtral recipe writes it: the routers stay float


def _quantized(name: str) -> bool:
    """Whether checkpoint tensor `name` is a linear weight the W4A16 scheme quantizes: attention and experts."""
    return name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def compressed_moe_checkpoint(folder: Path, reference: Path, scheme: str) -> list[str]:
    """The tiny random Mixtral of test_hf_moe saved by transformers (one tensor per expert and projection), its
    quantized weights replaced in `folder` by compressed-tensors' tensors of `scheme` (int4: `weight_packed`,
    `weight_scale`, `weight_shape`; int8: `weight`, `weight_scale`) and in `reference` (a float checkpoint) by the
    values compressed-tensors dequantizes. Returns the names of the quantized weights."""
    args, fmt, _ = SCHEMES[scheme]
    build_hf_model("mixtral").save_pretrained(str(reference), safe_serialization=True)
    shutil.copytree(reference, folder)
    tensors = load_file(str(reference / "model.safetensors"))
    packed, dequantized = {}, {}
    names = sorted(n for n in tensors if _quantized(n))
    for name, w in tensors.items():
        if name not in names:
            packed[name] = dequantized[name] = w
            continue
        groups = w.reshape(w.shape[0], -1, GROUP if scheme == "int4" else w.shape[1])
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)  # [out, in / GROUP] or [out, 1]
        q = quantize(w, scale, zero, args)
        prefix = name.removesuffix(".weight")
        if scheme == "int4":
            packed[f"{prefix}.weight_packed"] = pack_to_int32(q.to(torch.int8), 4)
            packed[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape))
        else:
            packed[name] = q.to(torch.int8)
        packed[f"{prefix}.weight_scale"] = scale
        dequantized[name] = dequantize(q, scale, zero, args).to(w.dtype)
    save_file(packed, str(folder / "model.safetensors"))
    save_file(dequantized, str(reference / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head", ROUTERS],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": args.num_bits, "type": "int", "symmetric": True, "strategy": str(args.strategy),
            "group_size": args.group_size}}}}
    (folder / "config.json").write_text(json.dumps(config))
    return names


def _engine(cfg, state):
    return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=4, num_blocks=64),
                     scheduler_config=SchedulerConfig( max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32),
                     params=state, backend="xla")


@pytest.mark.parametrize("scheme", ["int4", pytest.param("int8", marks=pytest.mark.slow)])
def test_a_compressed_tensors_mixtral_loads_its_experts_quantized_and_equals_its_dequantized_float_model(tmp_path,
                                                                                                         scheme):
    names = compressed_moe_checkpoint(tmp_path / "quantized", tmp_path / "dequantized", scheme)
    assert any(".block_sparse_moe.experts.3.w2." in n for n in names)  # per-expert tensors, Mixtral's names
    cfg, state, _ = load_hf(tmp_path / "quantized")
    assert cfg.quantization == SCHEMES[scheme][2]
    float_cfg, float_state, _ = load_hf(tmp_path / "dequantized")
    assert float_cfg.quantization is None
    model = model_from_state(cfg, state)
    layer = model.layers[1]
    assert isinstance(layer.mlp.experts, QuantizedExperts) and isinstance(layer.self_attn.q_proj, QuantizedLinear)
    assert not isinstance(model.lm_head, QuantizedLinear) and not isinstance(layer.mlp.gate, QuantizedLinear)
    experts = state["layers"][1]["mlp"]["experts"]["down_proj"]
    per_byte, groups = (2, 48 // GROUP) if scheme == "int4" else (1, None)
    assert experts["qweight"].get_value().shape == (4, 32, 48 // per_byte)  # [E, out, in (/ 2)]: stacked, as stored
    assert experts["scale"].get_value().shape == (4, 32, groups)[:2 if groups is None else 3]
    want = dict((tuple(p), lg) for p, lg in paged_last_logits(_engine(float_cfg, float_state), PROMPTS))
    for prompt, logits in paged_last_logits(_engine(cfg, state), PROMPTS):
        expected = want[tuple(prompt)]
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


_MIXTRAL = (("model.layers.0.block_sparse_moe.gate", "model.layers.0.mlp.gate"),
            ("model.layers.1.block_sparse_moe.gate", "model.layers.1.mlp.gate"))
_QWEN3 = (("model.layers.0.mlp.gate",), ("model.layers.1.mlp.gate",))


def _w4(ignore: list) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}


@pytest.mark.parametrize("routers, ignore", [
    (_MIXTRAL, ["lm_head", ROUTERS]),
    (_MIXTRAL, ["lm_head", "model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"]),
    (_MIXTRAL, ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]),  # transformers 5's names; head quantized
    (_QWEN3, ["lm_head", "re:.*mlp.gate$"]),
])
def test_routers_left_float_by_name_or_pattern_load(routers, ignore):
    keep = ("lm_head",) if "lm_head" in ignore else ()
    assert quant_config(_w4(ignore), routers) == QuantConfig("int4", group_size=32, keep_float=keep)


@pytest.mark.parametrize("routers, ignore, match", [
    (_MIXTRAL, ["lm_head"], r"the MoE routers \['model.layers.0.block_sparse_moe.gate', "
                            r"'model.layers.1.block_sparse_moe.gate'\] are quantized"),
    (_MIXTRAL, ["lm_head", "model.layers.0.block_sparse_moe.gate"],
     r"the MoE routers \['model.layers.1.block_sparse_moe.gate'\] are quantized"),
    (_MIXTRAL, ["lm_head", ROUTERS, "re:.*experts.*"], r"ignore \['re:.\*experts.\*'\]: only lm_head and the MoE "
                                                       r"routers may be left unquantized"),
    ((), ["lm_head", ROUTERS], r"ignore \['re:.\*block_sparse_moe.gate\$'\]: only lm_head may be left"),
    (_QWEN3, ["lm_head", 3], "a list of module names"),
])
def test_ignore_must_leave_every_router_and_nothing_else_float(routers, ignore, match):
    with pytest.raises(ValueError, match=match):
        quant_config(_w4(ignore), routers)
