"""Block-scaled FP8 weights, the official DeepSeek V3 / R1 layout, dequantized at load:

    config.json "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [B0, B1]}
    <linear>.weight            float8_e4m3fn [out, in]
    <linear>.weight_scale_inv  float32 [ceil(out / B0), ceil(in / B1)]: w[i, j] = weight[i, j] *
                               weight_scale_inv[i // B0, j // B1] (the name says "inverse": the scale the
                               quantizer divided by, so multiplying undoes it)

Every such weight becomes its float value in the model's dtype (`fill_state`): exact in float32 (an e4m3 value
times a float32 scale is one float32 product), one rounding in bfloat16. Tensors stored in float (embeddings,
norms, the router, the LM head) load as they are. `activation_scheme` names how the checkpoint's own kernels
quantize activations; pagedjax computes them in the model's dtype, so any scheme is accepted.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from pagedjax.config.fields import is_int

FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # `<name>.weight` -> `<name>.weight_scale_inv`
_SCALE_DTYPES = ("F32", "BF16", "F16")


def block_size(quantization_config) -> tuple[int, int]:
    """The `weight_block_size` of a block-scaled FP8 `quantization_config`; ValueError naming the field for
    anything else (another `quant_method`, another float8 format, a malformed block size)."""
    qc = quantization_config
    if not isinstance(qc, dict):
        raise ValueError(f"expected an object, got {qc!r}")
    if qc.get("quant_method") != "fp8":
        raise ValueError(f"quant_method {qc.get('quant_method')!r} is not supported (only 'fp8': block-scaled "
                         "float8 weights)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fmt {fmt!r} is not supported (only 'e4m3')")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(is_int(b) and b >= 1 for b in block)):
        raise ValueError(f"weight_block_size {block!r}: expected [rows, columns], two positive ints (per-tensor "
                         "fp8 scales are not supported)")
    return int(block[0]), int(block[1])


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The `weight_scale_inv` shape of a `[out, in]` weight: one scale per block, the last blocks partial."""
    out, inp = weight_shape
    return -(-out // block[0]), -(-inp // block[1])


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float8 `weight` `[out, in]` times its block scales `[ceil(out / B0), ceil(in / B1)]` -> float32."""
    out, inp = weight.shape
    scales = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)[:out, :inp]
    return weight.astype(np.float32) * scales


def raw_dtype(name: str):
    """The numpy dtype of a safetensors float8 dtype name (ml_dtypes'), or None."""
    return np.dtype(ml_dtypes.float8_e4m3fn) if name == FP8_DTYPE else None


def is_scale_dtype(name: str) -> bool:
    return name in _SCALE_DTYPES
