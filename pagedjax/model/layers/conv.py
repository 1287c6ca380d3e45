"""The depthwise causal conv of the recurrent-state layers, as transformers stores its weight."""

from __future__ import annotations

import math

import jax
from flax import nnx


class Conv1d(nnx.Module):
    """A depthwise conv's weight `[channels, 1, kernel]` (transformers' `nn.Conv1d(groups=channels)`: Qwen3-Next's
    `linear_attn.conv1d`, Mamba-2's `mixer.conv1d`); applied by `pagedjax.device.recurrent.causal_conv1d`."""

    def __init__(self, channels: int, kernel: int, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (channels, 1, kernel), dtype) / math.sqrt(kernel))
