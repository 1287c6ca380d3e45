"""gpt-oss (`model_type` "gpt_oss", transformers' `GptOssForCausalLM`) as the Llama decoder of
`pagedjax.model.llama` with `ModelConfig` options: what is specific to the family is here, its config mapping
(`config_from_hf`, called by `hf_config.load_hf_config`), its weight names (`tensor_names`) and the conversion of
its expert tensors (`ExpertTensors`), both used by `hf_loader.load_hf_params`.

The model, as transformers computes it:
  - attention: q / k / v / o projections with biases (`attention_bias`: `ModelConfig.qkv_bias` and
    `o_proj_bias`), GQA, a learned sink logit per query head in every softmax's denominator
    (`ModelConfig.attention_sinks`, parameter `self_attn.sinks`); the layers `layer_types` marks
    "sliding_attention" (every other one from layer 0 when absent) see the last `sliding_window` positions, the
    others everything: `ModelConfig.sliding_windows`, whose window and full layers the engine keeps in two KV cache
    groups (`pagedjax.config.kv_layout`);
  - RoPE on rotated halves, YaRN-scaled as `rope_parameters` (transformers 5) or `rope_scaling` (4) say
    (`ModelConfig.rope_scaling` "yarn"; `truncate`, `beta_fast`, ... as transformers defaults them; absent
    altogether: GptOssConfig's own YaRN, factor 32 over 4096 positions, not truncated), base `rope_theta`
    (150000 when absent); "default" (no scaling) is the only other type;
  - RMSNorm before each sub-block; an untied LM head unless `tie_word_embeddings`;
  - a mixture of experts in every layer (`ModelConfig.moe`): the router a linear layer with a bias, the top
    `num_experts_per_tok` logits then a softmax over them ("topk_softmax"); each expert's gate / up / down
    projections with biases and the clamped SwiGLU ("clamped_swiglu": gate clamped to at most `swiglu_limit`, up
    to [-swiglu_limit, swiglu_limit], gate * sigmoid(swiglu_alpha * gate) * (up + 1)). `hidden_act` is not read
    (transformers' experts do not read it either).
Anything else (another rope type, partial rotary, `quantization_config` other than MXFP4, a null `sliding_window`
with window layers, an unknown layer type, fields of the wrong type) is a ValueError naming the field.

Checkpoint layout (transformers' `save_pretrained`, and the released checkpoints): per layer
`mlp.router.weight` `[E, hidden]` and `.bias` `[E]` (the model's `mlp.gate`), `self_attn.sinks` `[heads]`, and the
experts stacked: `mlp.experts.gate_up_proj` `[E, hidden, 2 * width]` with gate and up interleaved along the last
axis (gate the even columns, up the odd), `gate_up_proj_bias` `[E, 2 * width]` interleaved alike,
`down_proj` `[E, width, hidden]`, `down_proj_bias` `[E, hidden]`. The released checkpoints store the two expert
matrices in MXFP4 instead (`quantization_config` {"quant_method": "mxfp4"}): `<name>_blocks` uint8 `[E, rows,
cols / 32, 16]` and `<name>_scales` uint8 `[E, rows, cols / 32]` of the matrix transposed (rows: gate_up's
2 * width outputs, down's hidden outputs): byte j of a block holds values 2j (low nibble) and 2j + 1 (high
nibble) of its 32, each an FP4 e2m1 code (sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), all 32 times
2 ** (scale - 127) (an e8m0 exponent). They are dequantized on load (`dequantize_mxfp4`), exactly: every code
times a power of two 2 ** -127 .. 2 ** 125 (scale bytes 0-252) is a bfloat16 and a float32, so a float32 or
bfloat16 model holds the checkpoint's values unrounded (a float16 one rounds those outside its range), and they
are bit for bit the values transformers computes when it dequantizes (`Mxfp4Config(dequantize=True)`, or on a
machine without its Triton kernels), for every code and scale byte 0-254 (253 and 254 overflow the largest codes to
inf in both). A scale byte of 255 (NaN in the MX format) is refused. The weights stay float once loaded
(`quantization=` can quantize the experts to int8 / int4 / fp8 as any model's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pagedjax.config import ModelConfig
from pagedjax.config.model import ROPE_OPTIONAL_PARAMS, ROPE_SCALING_PARAMS
from pagedjax.config.moe import MoEConfig
from pagedjax.model.errors import ModelLoadError
from pagedjax.model.loading.hf_fields import (
    checkpoint_dtype,
    flag,
    id_list,
    layer_types,
    number,
    optional_id,
    positive_int,
    rope_source,
    rope_theta_and_type,
)

MODEL_TYPES = ("gpt_oss",)
# GptOssConfig's defaults of the fields a config.json may leave out.
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_local_experts=128,
    head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128, tie_word_embeddings=False,
    max_position_embeddings=131072, rms_norm_eps=1e-5, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
    attention_bias=True, rope_theta=150000.0)
# GptOssConfig's rope parameters when config.json has none (neither rope_parameters nor rope_scaling).
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_YARN_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", *ROPE_SCALING_PARAMS["yarn"],
              *ROPE_OPTIONAL_PARAMS["yarn"])


def config_from_hf(hf: dict, dtype: str | None, gen_bos: int | None, gen_eos: tuple[int, ...]) -> ModelConfig:
    """The `ModelConfig` of a parsed gpt-oss `config.json` (the module docstring says what it maps and refuses);
    `dtype` overrides the checkpoint's, `gen_bos` / `gen_eos` (generation_config.json's) its own stop tokens.
    ValueError naming the field."""
    qc = hf.get("quantization_config")
    if qc is not None and (not isinstance(qc, dict) or qc.get("quant_method") != "mxfp4"):
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ValueError(f"field 'quantization_config': quant_method {method!r} is not supported for gpt_oss (only "
                         "'mxfp4', dequantized on load)")
    d = _DEFAULTS
    hidden = positive_int(hf, "hidden_size", d["hidden_size"])
    num_heads = positive_int(hf, "num_attention_heads", d["num_attention_heads"])
    num_kv = positive_int(hf, "num_key_value_heads", d["num_key_value_heads"])
    if num_heads % num_kv:
        raise ValueError(f"'num_attention_heads' ({num_heads}) is not a multiple of 'num_key_value_heads' ({num_kv})")
    head_dim = positive_int(hf, "head_dim", d["head_dim"])
    if head_dim % 2:
        raise ValueError(f"field 'head_dim' = {head_dim}: RoPE needs an even head dim")
    num_layers = positive_int(hf, "num_hidden_layers", d["num_hidden_layers"])
    max_pos = positive_int(hf, "max_position_embeddings", d["max_position_embeddings"])
    theta, scaling = _rope(hf, max_pos)
    bias = flag(hf, "attention_bias", d["attention_bias"])
    bos = gen_bos if gen_bos is not None else optional_id(hf.get("bos_token_id"), "bos_token_id")
    eos = gen_eos or id_list(hf.get("eos_token_id"), "eos_token_id")
    intermediate = positive_int(hf, "intermediate_size", d["intermediate_size"])
    return ModelConfig(
        vocab_size=positive_int(hf, "vocab_size", d["vocab_size"]), hidden_size=hidden, num_layers=num_layers,
        num_q_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim, intermediate_size=intermediate,
        rope_theta=theta, rope_scaling=scaling, rms_norm_eps=number(hf, "rms_norm_eps", d["rms_norm_eps"]),
        tie_word_embeddings=flag(hf, "tie_word_embeddings", d["tie_word_embeddings"]), qkv_bias=bias,
        o_proj_bias=bias, attention_sinks=True, max_position_embeddings=max_pos, dtype=checkpoint_dtype(hf, dtype),
        bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos)), sliding_windows=_windows(hf, num_layers),
        moe=_moe(hf, intermediate))


def _windows(hf: dict, num_layers: int) -> tuple[int | None, ...] | None:
    """Each layer's window: `sliding_window` on the layers `layer_types` marks "sliding_attention" (absent:
    layers 0, 2, 4, ...), None on the others."""
    kinds = layer_types(hf, num_layers) or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(num_layers)]
    if "sliding_attention" not in kinds:
        return None
    if "sliding_window" in hf and hf["sliding_window"] is None:
        raise ValueError("field 'sliding_window': null is not supported with 'sliding_attention' layers")
    window = positive_int(hf, "sliding_window", _DEFAULTS["sliding_window"])
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def _rope(hf: dict, max_pos: int) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, ModelConfig.rope_scaling) as GptOssConfig completes them: YaRN's `factor` required (null:
    max_position_embeddings / the original length), the original length from the parameters (else
    max_position_embeddings: a top-level field is not read), `truncate` null meaning false."""
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        params, field = dict(_DEFAULT_ROPE), "rope_parameters"
    else:
        params, field = rope_source(hf)
    theta, kind = rope_theta_and_type(hf, params, field, number(hf, "rope_theta", _DEFAULTS["rope_theta"]))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"field {field!r}: rope type {kind!r} is not supported for gpt_oss (supported: default, "
                         "yarn)")
    unknown = sorted(set(params) - set(_YARN_KEYS))
    if unknown:
        raise ValueError(f"field {field!r}: YaRN parameters {unknown} are not supported")
    if "factor" not in params:
        raise ValueError(f"field {field!r}: rope type 'yarn' needs 'factor'")
    try:
        original = number(params, "original_max_position_embeddings", max_pos)
        yarn: dict[str, Any] = {"rope_type": "yarn", "original_max_position_embeddings": original,
                                "factor": number(params, "factor", max_pos / original)}
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            if params.get(key) is not None:  # null: transformers' default, as absent
                yarn[key] = number(params, key)
        if "truncate" in params:
            yarn["truncate"] = flag(params, "truncate", False)  # null reads as false in transformers
    except ValueError as e:
        raise ValueError(f"field {field!r}: {e}") from None
    for key in ("factor", "original_max_position_embeddings"):
        if yarn[key] <= 0:
            raise ValueError(f"field {field!r}: {key!r} must be > 0, got {yarn[key]}")
    return theta, tuple(sorted(yarn.items()))


def _moe(hf: dict, width: int) -> MoEConfig:
    """Every layer's experts: `num_local_experts` (transformers' alias: `num_experts`) of width
    `intermediate_size`, the top `num_experts_per_tok`, biases everywhere, the clamped SwiGLU."""
    key = "num_experts" if hf.get("num_local_experts") is None and hf.get("num_experts") is not None else \
        "num_local_experts"
    num_experts = positive_int(hf, key, _DEFAULTS["num_local_experts"])
    top_k = positive_int(hf, "num_experts_per_tok", _DEFAULTS["num_experts_per_tok"])
    if top_k > num_experts:
        raise ValueError(f"field 'num_experts_per_tok' = {top_k} exceeds the {num_experts} experts ({key!r})")
    alpha, limit = (number(hf, k, _DEFAULTS[k]) for k in ("swiglu_alpha", "swiglu_limit"))
    for name, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if value <= 0:
            raise ValueError(f"field {name!r}: expected a number > 0, got {value!r}")
    return MoEConfig(num_experts, top_k, width, router="topk_softmax", router_bias=True, expert_bias=True,
                     activation="clamped_swiglu", swiglu_alpha=alpha, swiglu_limit=limit)


# ------------------------------------------------------------------------------------------------- weights
# The model's expert parameters that come from a fused checkpoint tensor: (that tensor, which half).
_HALVES = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
           "gate_proj_bias": ("gate_up_proj_bias", "gate"), "up_proj_bias": ("gate_up_proj_bias", "up")}
_FUSED = ("experts.gate_up_proj", "experts.gate_up_proj_bias")  # gate and up interleaved along the last axis
_MXFP4 = ("experts.gate_up_proj", "experts.down_proj")  # the matrices a checkpoint may store as MXFP4


def tensor_names(path: tuple) -> list[tuple[str, bool, None]] | None:
    """A model parameter's checkpoint tensor where gpt-oss names it its own way: [(name, transposed?, None)], or
    None for the parameters named as the Llama family's (`hf_loader.hf_names`). The router (`mlp.gate`) is
    `mlp.router`; the sinks are `self_attn.sinks`; the experts' parameters are read whole, gate / up and their
    biases as the halves of the fused tensors (`ExpertTensors` presents them as `<fused>:gate` / `:up`), down and
    its bias as stored."""
    *mods, leaf = (str(p) for p in path)
    prefix = "model." + ".".join(mods)
    if leaf == "sinks":
        return [(f"{prefix}.sinks", False, None)]
    if len(mods) >= 2 and mods[-2:] == ["mlp", "gate"]:
        router = "model." + ".".join(mods[:-1] + ["router"])
        return [(f"{router}.weight", True, None)] if leaf == "kernel" else [(f"{router}.bias", False, None)]
    if mods and mods[-1] == "experts":
        fused, half = _HALVES.get(leaf, (leaf, None))
        return [(f"{prefix}.{fused}" + ("" if half is None else f":{half}"), False, None)]
    return None


class ExpertTensors:
    """The checkpoint's expert tensors as the model holds them (`hf_loader.fill_state`'s `view`): each fused
    `gate_up_proj` `[E, hidden, 2 * width]` (or its MXFP4 blocks and scales) as `gate_up_proj:gate` and `:up`
    `[E, width, hidden]` (the even and odd columns, transposed to `Experts`' (out, in)); each `gate_up_proj_bias`
    `[E, 2 * width]` as `gate_up_proj_bias:gate` and `:up` `[E, width]`; an MXFP4 `down_proj` as the dequantized
    `down_proj` `[E, width, hidden]`. Every other tensor is as stored.

    `headers(entries)` maps the checkpoint's (file, name, shape, safetensors dtype) to what the loader sees
    (ModelLoadError naming the file for MXFP4 tensors of inconsistent shapes or dtypes, or blocks without their
    scales); `read(name, read_stored)` computes a presented tensor from the stored ones (`read_stored(file, name)`
    reads one), or returns None for a tensor as stored. The two halves of a fused tensor are computed together:
    the second is kept from the first's read (the loader reads them one after the other)."""

    def __init__(self):
        # presented name -> (the stored tensor's name, "gate" / "up" / None for a whole one, MXFP4 (blocks,
        # scales) as (file, name) pairs or None for a plain tensor, the plain tensor's file)
        self._sources: dict[str, tuple[str, str | None, tuple | None, Path]] = {}
        self._kept: dict[str, np.ndarray] = {}

    def headers(self, entries) -> list[tuple[Path, str, tuple[int, ...], str]]:
        entries = [(file, name, tuple(shape), dtype) for file, name, shape, dtype in entries]
        by_name = {name: (file, shape, dtype) for file, name, shape, dtype in entries}
        out = []
        for file, name, shape, dtype in entries:
            stored = name.removesuffix("_blocks").removesuffix("_scales")
            if stored != name and stored.endswith(_MXFP4):
                if name.endswith("_blocks"):
                    out += self._mxfp4(file, stored, shape, dtype, by_name)
                continue  # the scales: read with their blocks
            if name.endswith(_FUSED):
                out += self._halves(file, name, shape, dtype, None)
            else:
                out.append((file, name, shape, dtype))
        return out

    def _mxfp4(self, file: Path, name: str, shape: tuple, dtype: str, by_name: dict) -> list:
        """The entries of the matrix `name` stored as MXFP4 `<name>_blocks` (of `shape`, `dtype`, in `file`) and
        `<name>_scales`: its halves for gate_up, the whole (transposed) for down."""
        blocks, scales = f"{name}_blocks", f"{name}_scales"
        if scales not in by_name:
            raise ModelLoadError(file, f"tensor {blocks!r} has no {scales!r}")
        scale_file, scale_shape, scale_dtype = by_name[scales]
        if dtype != "U8" or scale_dtype != "U8" or len(shape) != 4 or shape[-1] != 16 or shape[:-1] != scale_shape:
            raise ModelLoadError(file, f"MXFP4 tensors {blocks!r} {dtype}{list(shape)} and {scales!r} {scale_dtype}"
                                       f"{list(scale_shape)}: expected uint8 [E, rows, groups, 16] blocks and uint8 "
                                       "[E, rows, groups] scales")
        packed = ((file, blocks), (scale_file, scales))
        experts, rows, cols = shape[0], shape[1], shape[2] * 32  # the stored matrix: the model's transposed
        if name.endswith(_FUSED):
            return self._halves(file, name, (experts, cols, rows), "BF16", packed)
        self._sources[name] = (name, None, packed, file)
        return [(file, name, (experts, cols, rows), "BF16")]

    def _halves(self, file: Path, name: str, shape: tuple, dtype: str, packed: tuple | None) -> list:
        """The `:gate` and `:up` entries of fused tensor `name` of `shape` (gate_up_proj's `[E, hidden, 2 *
        width]` layout, or its bias's `[E, 2 * width]`)."""
        if shape[-1] % 2:
            raise ModelLoadError(file, f"tensor {name!r}: gate and up interleave along its last axis, of odd size "
                                       f"{shape[-1]}")
        half = (shape[0], shape[1] // 2) if len(shape) == 2 else (shape[0], shape[2] // 2, shape[1])
        for which in ("gate", "up"):
            self._sources[f"{name}:{which}"] = (name, which, packed, file)
        return [(file, f"{name}:{which}", half, dtype) for which in ("gate", "up")]

    def read(self, name: str, read_stored) -> np.ndarray | None:
        if name not in self._sources:
            return None
        if name in self._kept:
            return self._kept.pop(name)
        stored, which, packed, file = self._sources[name]
        if packed is not None:
            (blocks_file, blocks), (scales_file, scales) = packed
            scale_bytes = read_stored(scales_file, scales)
            if (scale_bytes == 255).any():
                raise ModelLoadError(scales_file, f"tensor {scales!r}: scale 255 (NaN in MXFP4) is not supported")
            matrix = dequantize_mxfp4(read_stored(blocks_file, blocks), scale_bytes)  # [E, outputs, inputs]
            if which is None:  # down_proj: `Experts` holds it (in, out)
                return matrix.transpose(0, 2, 1)
            gate, up = matrix[:, 0::2], matrix[:, 1::2]  # gate_up's rows, interleaved: (out, in) already
        else:
            whole = read_stored(file, stored)
            if whole.ndim == 2:  # gate_up_proj_bias [E, 2 * width]
                gate, up = whole[:, 0::2], whole[:, 1::2]
            else:  # gate_up_proj [E, hidden, 2 * width] -> (out, in) [E, width, hidden]
                gate, up = whole[:, :, 0::2].transpose(0, 2, 1), whole[:, :, 1::2].transpose(0, 2, 1)
        self._kept[f"{stored}:{'up' if which == 'gate' else 'gate'}"] = up if which == "gate" else gate
        return gate if which == "gate" else up


# FP4 e2m1 codes 0-15: bit 3 the sign, bits 0-2 the magnitude's index.
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


def dequantize_mxfp4(blocks: np.ndarray,  # uint8 [E, rows, groups, 16]
                     scales: np.ndarray,  # uint8 [E, rows, groups]
                     ) -> np.ndarray:  # bfloat16 [E, rows, groups * 32]
    """MXFP4 blocks and their e8m0 scales -> their values: value 32g + 2j + h of a row is the FP4 code in nibble h
    (0 low, 1 high) of byte j of block g, times 2 ** (scale - 127). Exact (module docstring): computed in float32,
    where every product is exact, one expert at a time (the float32 copy of one expert at most)."""
    out = np.empty((*scales.shape[:-1], scales.shape[-1] * 32), jnp.bfloat16)
    for e in range(blocks.shape[0]):
        codes = np.stack([blocks[e] & 0x0F, blocks[e] >> 4], axis=-1)  # [rows, groups, 16, 2]
        values = _FP4_VALUES[codes].reshape(*codes.shape[:-2], 32)
        exponents = scales[e].astype(np.int32)[..., None] - 127
        out[e] = np.ldexp(values, exponents).reshape(out.shape[1:]).astype(jnp.bfloat16)
    return out


__all__ = ["MODEL_TYPES", "ExpertTensors", "config_from_hf", "dequantize_mxfp4", "tensor_names"]
