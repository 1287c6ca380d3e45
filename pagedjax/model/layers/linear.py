"""How every linear layer of the built-in models (float `Linear` and `QuantizedLinear`) applies its product."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def apply_linear(fn, x: jax.Array) -> jax.Array:
    """`fn(x)` for a linear map `fn` over x `[..., in]`, rounded to x's dtype.

    XLA:CPU lowers a one-row dot with 16-bit float operands to a scalar loop that reads weights at ~1 GB/s
    (two or more rows go to YNNPACK at ~15-25 GB/s; float32 one-row dots are fast either way), so on the CPU
    a single 16-bit row runs as two (the second zero) and keeps the first: batch-1 decode of a bf16 model
    10x faster on the 156M shape (`scripts/bench_engine.py`).
    """
    lead = x.shape[:-1]
    if math.prod(lead) == 1 and x.dtype in (jnp.bfloat16, jnp.float16) and jax.default_backend() == "cpu":
        x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        y = fn(x2)[:1].astype(x.dtype)
        return y.reshape(*lead, y.shape[-1])
    return fn(x).astype(x.dtype)
