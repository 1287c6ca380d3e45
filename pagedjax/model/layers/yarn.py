"""YaRN RoPE scaling (DeepSeek V2 / V3), in transformers' formulation (`_compute_yarn_parameters`): each rotary
frequency is blended between itself (extrapolation, the fast ones) and itself divided by `factor`
(interpolation, the slow ones) by a linear ramp over the dims between the correction range's bounds, and cos /
sin are multiplied by an attention factor.

    inv_freq = interpolated * (1 - e) + extrapolated * e,   e = 1 - clamp((i - low) / (high - low), 0, 1)

`low` and `high` are the dims at which a frequency turns `beta_fast` and `beta_slow` times over the original
context (`original_max_position_embeddings`), floored and ceiled unless `truncate` is false. The attention factor
is `attention_factor` if given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set and
non-zero, else mscale(factor) (`pagedjax.config.deepseek.yarn_mscale`). The softmax-scale correction of MLA
(mscale(factor, mscale_all_dim) squared) is the config's (`DeepSeekConfig.softmax_scale`).
"""

from __future__ import annotations

import math

import numpy as np

from pagedjax.config.deepseek import yarn_mscale


def yarn_inv_freq(dim: int, theta: float, params: dict) -> np.ndarray:
    """YaRN's inverse frequencies `[dim // 2]` (float64) for a rotary dim `dim` and base `theta`."""
    factor = float(params["factor"])
    original = float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolated = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return extrapolated / factor * (1 - keep) + extrapolated * keep


def yarn_attention_factor(params: dict) -> float:
    """What YaRN multiplies cos and sin by (the module docstring)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)
