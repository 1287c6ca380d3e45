"""Pre-quantized Hugging Face checkpoints in the compressed-tensors format, as vLLM reads them: the weight-only
schemes whose stored values are exactly pagedjax's (`pagedjax.model.layers.quant`).

    config.json "quantization_config": {"quant_method": "compressed-tensors", "format": F,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": B, "type": "int",
                          "symmetric": true, "strategy": S, "group_size": G}, "input_activations": null}},
        "ignore": ["lm_head"]}     (and a mixture-of-experts model's routers: see `quant_config`)
    F = "pack-quantized", B = 4, S = "group" (W4A16)   -> QuantConfig("int4", group_size=G)
        <layer>.weight_packed  int32 [out, in / 8]: word w of a row holds inputs 8w .. 8w + 7, input 8w + j in
                               bits 4j .. 4j + 3 as q + 8 (q in [-8, 7])
        <layer>.weight_scale   [out, in / G]          <layer>.weight_shape  [out, in] (redundant: not read)
    F = "int-quantized" (or "naive-quantized"), B = 8, S = "channel" (W8A16)   -> QuantConfig("int8")
        <layer>.weight         int8 [out, in]         <layer>.weight_scale  [out, 1]
Each tensor becomes the model's `qweight` / `scale`, whose layout is the checkpoint's `[out, ...]` (int4
re-packed two per byte in `pack_int4`'s nibble planes, scales in float32: a 16-bit scale converts exactly).
A mixture-of-experts model's experts are one such linear per expert and projection (`...experts.{e}.w1` or
`.gate_proj`, as vLLM reads them), stacked into `pagedjax.model.layers.moe_quant.QuantizedExperts` on load; its routers
are float and must be in "ignore" (by name, or by a "re:" pattern as compressed-tensors writes them), since
pagedjax keeps routers float. Anything else (asymmetric zero points, activation ordering, quantized activations,
other bit widths or strategies, layers other than the LM head and the routers left in float, quantized routers)
is a ValueError naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from pagedjax.config.quant import QuantConfig
from pagedjax.model.layers.quant import pack_int4

_INT8_FORMATS = ("int-quantized", "naive-quantized")
_FLOAT_SCALES = ("F32", "F16", "BF16")


def _ignored(entry: str, name: str) -> bool:
    """Whether an "ignore" entry (a module name, or "re:" and a pattern matched from the name's start, as
    compressed-tensors matches them) covers module `name`."""
    return re.match(entry[3:], name) is not None if entry.startswith("re:") else entry == name


def _check_ignore(ignore, routers: tuple[tuple[str, ...], ...]) -> None:
    """"ignore" may leave the LM head and the MoE routers (each router: the names it may have) in float, and must
    leave every router so (pagedjax keeps routers float); ValueError otherwise."""
    names = ["lm_head", *(name for spellings in routers for name in spellings)]
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise ValueError(f"ignore {ignore!r}: a list of module names")
    stray = [e for e in ignore if not any(_ignored(e, name) for name in names)]
    if stray:
        left = "only lm_head" + (" and the MoE routers" if routers else "")
        raise ValueError(f"ignore {stray!r}: {left} may be left unquantized")
    quantized = [spellings[0] for spellings in routers
                 if not any(_ignored(e, name) for e in ignore for name in spellings)]
    if quantized:
        raise ValueError(f"ignore: the MoE routers {quantized} are quantized; pagedjax keeps routers float (they "
                         "decide each token's experts): only checkpoints that leave them unquantized load")


def quant_config(qc, routers: tuple[tuple[str, ...], ...] = ()) -> QuantConfig:
    """config.json's "quantization_config" -> the QuantConfig of its scheme; ValueError naming the field that
    pagedjax cannot load exactly. `routers`: a mixture-of-experts model's routers, each as the names a checkpoint
    may give it (none for a dense model)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ValueError(f"quant_method {method!r} is not supported (only compressed-tensors pack-quantized W4A16 "
                         "and int-quantized W8A16)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError("config_groups: exactly one quantization group is supported")
    (group,) = groups.values()
    if not isinstance(group, dict) or group.get("targets") != ["Linear"]:
        raise ValueError("config_groups: the group must target [\"Linear\"]")
    if group.get("input_activations") is not None or group.get("output_activations") is not None:
        raise ValueError("config_groups: quantized activations are not supported (weight-only A16 schemes)")
    w = group.get("weights")
    if not isinstance(w, dict) or w.get("type") != "int" or w.get("symmetric") is not True:
        raise ValueError("config_groups.weights: only symmetric int weights are supported")
    if w.get("actorder") not in (None, False) or w.get("dynamic") not in (None, False):
        raise ValueError("config_groups.weights: activation ordering and dynamic scales are not supported")
    ignore = qc.get("ignore") or []
    _check_ignore(ignore, routers)
    keep = ("lm_head",) if any(_ignored(e, "lm_head") for e in ignore) else ()
    fmt, bits, strategy = qc.get("format"), w.get("num_bits"), w.get("strategy")
    if fmt == "pack-quantized" and bits == 4 and strategy == "group":
        return QuantConfig("int4", group_size=w.get("group_size"), keep_float=keep)
    if fmt in _INT8_FORMATS and bits == 8 and strategy == "channel":
        return QuantConfig("int8", keep_float=keep)
    raise ValueError(f"format {fmt!r} with {bits}-bit {strategy!r} weights is not supported (only pack-quantized "
                     "4-bit 'group' and int-quantized 8-bit 'channel')")


@dataclass(frozen=True)
class Codec:
    """How one checkpoint tensor becomes a model leaf: its shape in the checkpoint for the leaf's shape, the
    safetensors dtypes it may have, the conversion and the leaf's dtype."""

    kind: str  # "int4", "int4_scale", "int8", "int8_scale"
    group_size: int = 0  # int4: the groups `pack_int4` lays its nibble planes out by

    def hf_shape(self, shape: tuple) -> tuple:
        if self.kind == "int4":  # [out, in / 2] <- [out, in / 8]
            return shape[0], shape[1] * 2 // 8
        if self.kind == "int8_scale":  # [out] <- [out, 1]
            return shape[0], 1
        return shape  # [out, in] and [out, groups]: the same layout

    @property
    def dtypes(self) -> tuple[str, ...]:
        return {"int4": ("I32",), "int8": ("I8",)}.get(self.kind, _FLOAT_SCALES)

    @property
    def dtype(self):
        return {"int4": np.uint8, "int8": np.int8}.get(self.kind, np.float32)

    def convert(self, array: np.ndarray) -> np.ndarray:
        if self.kind == "int4":
            words = np.ascontiguousarray(array).view(np.uint32)  # [out, in / 8]
            nibbles = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # [out, in / 8, 8]
            q = nibbles.reshape(words.shape[0], -1).astype(np.int8) - 8  # [out, in]
            return np.asarray(pack_int4(q, self.group_size))
        if self.kind == "int8_scale":
            return array.reshape(-1).astype(np.float32)
        return array.astype(np.float32) if self.kind == "int4_scale" else array


def tensor(prefix: str, leaf: str, quant: QuantConfig) -> tuple[str, Codec]:
    """The checkpoint tensor of a `QuantizedLinear`'s leaf ("qweight" | "scale") under `prefix` (the layer's
    Hugging Face name, e.g. "model.layers.0.self_attn.q_proj"), and its codec."""
    if leaf == "qweight":
        if quant.scheme == "int4":
            return f"{prefix}.weight_packed", Codec("int4", quant.group_size)
        return f"{prefix}.weight", Codec("int8")
    return f"{prefix}.weight_scale", Codec("int4_scale" if quant.scheme == "int4" else "int8_scale")
