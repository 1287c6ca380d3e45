"""Weight-only quantized linear layers (`pagedjax.quant_config.QuantConfig`): int8 and fp8 e4m3 per output
channel, int4 in groups along the input dimension packed two per byte. Activations stay in the model's dtype;
every product accumulates in float32.

Storage of a kernel `[in, out]` (the float layout of `pagedjax.model.llama`):
  int8   qweight int8 `[in, out]`,               scale `[out]`:              w[i, o] = q[i, o] * scale[o]
  fp8    qweight float8_e4m3fn `[in, out]`,      scale `[out]`:              w[i, o] = q[i, o] * scale[o]
  int4   qweight uint8 `[in // 2, out]`,         scale `[in // g, out]`:     w[i, o] = q[i, o] * scale[i // g, o]
         byte r of a column holds q[2r] in its low nibble and q[2r + 1] in its high one (two's complement).
Scales are stored in `QuantConfig.scale_dtype`; the quantizer divides by the stored (rounded) scale, so that
`dequantize_kernel` is exactly what the layer computes with. A zero scale (an all-zero channel or group) gives
q = 0, never a NaN.

`dequantize_kernel` is the reference: a `QuantizedLinear`'s output equals a float `Linear` holding the
dequantized kernel (up to float rounding; tests/model/test_quant.py proves it through the paged engine).

XLA:CPU does not fuse the int8 -> float conversion into its dot: the optimized HLO converts the whole kernel
to a float `[in, out]` buffer every step before the product, whichever formulation (`python
scripts/bench_quant.py --formulations` times them and checks the HLO): a dot of x with the int8 kernel under
`preferred_element_type` lowers to the same convert; a multiply-and-reduce is far slower (hundreds of
times at batch 1); int4 as a batched dot over `[groups, g, out]` then a scale-and-sum, which never builds the
float kernel, is slower than dequantize-then-dot. So the layer converts (just before its dot: see `tie` in
`QuantizedLinear._project`), then dots; the per-channel schemes apply their scale to the output (`[..., out]`
multiplies, not `[in, out]`). Whether XLA:GPU fuses the conversion is not measured here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.model.linear import apply_linear
from pagedjax.quant_config import QuantConfig

__all__ = ["QuantizedLinear", "dequantize_kernel", "pack_int4", "quantize_kernel", "quantize_model", "unpack_int4"]

# The largest |q| the quantizer produces for each scheme (int4 stores -8 too, which it never produces).
QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


def shapes(quant: QuantConfig, n_in: int, n_out: int, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(qweight shape, scale shape) of a kernel `[n_in, n_out]`; ValueError naming the tensor `name` when int4's
    group size does not divide n_in."""
    if quant.scheme != "int4":
        return (n_in, n_out), (n_out,)
    if n_in % quant.group_size:
        raise ValueError(f"{name}: int4 group size {quant.group_size} does not divide its input dimension {n_in}")
    return (n_in // 2, n_out), (n_in // quant.group_size, n_out)


def pack_int4(q: jax.Array) -> jax.Array:
    """int8 `[in, out]` of values in [-8, 7] (in even) -> uint8 `[in // 2, out]`: rows 2r, 2r + 1 -> byte r
    (low nibble, high nibble)."""
    nibbles = jax.lax.bitcast_convert_type(q.astype(jnp.int8), jnp.uint8) & 0xF
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """The inverse of `pack_int4`: uint8 `[in // 2, out]` -> int8 `[in, out]` in [-8, 7]."""
    b = jax.lax.bitcast_convert_type(packed, jnp.int8)
    low = jnp.left_shift(b, 4) >> 4  # arithmetic shifts of int8: the nibble's sign bit extends
    high = b >> 4
    return jnp.stack([low, high], axis=1).reshape(-1, packed.shape[-1])


def quantize_kernel(kernel: jax.Array, quant: QuantConfig, name: str = "kernel") -> tuple[jax.Array, jax.Array]:
    """A float kernel `[in, out]` -> (qweight, scale) of `quant.scheme` (see the module docstring): symmetric,
    scale = max |w| / QMAX over each channel (or group), rounded to the nearest level. ValueError naming
    `name` for a kernel that is not 2-D or whose input dimension int4's group size does not divide."""
    if kernel.ndim != 2:
        raise ValueError(f"{name}: a linear kernel [in, out] is 2-D, got shape {tuple(kernel.shape)}")
    shapes(quant, *kernel.shape, name)
    return _quantize(jnp.asarray(kernel), quant)


@functools.partial(jax.jit, static_argnames="quant")
def _quantize(kernel: jax.Array, quant: QuantConfig) -> tuple[jax.Array, jax.Array]:
    """`quantize_kernel` past its checks, one compiled program per kernel shape (a model's load quantizes many
    kernels of few shapes; op by op, every kernel ran a dozen small programs)."""
    n_in, n_out = kernel.shape
    w = kernel.astype(jnp.float32)
    if quant.scheme == "int4":
        w = w.reshape(n_in // quant.group_size, quant.group_size, n_out)  # [groups, g, out]
    amax = jnp.max(jnp.abs(w), axis=-2)  # [out] or [groups, out]
    scale = (amax / QMAX[quant.scheme]).astype(quant.scale_dtype)
    s = scale.astype(jnp.float32)
    s = jnp.expand_dims(jnp.where(s == 0, 1.0, s), -2)  # a zero scale's channel is all zero: q = 0
    qmax = QMAX[quant.scheme]
    if quant.scheme == "fp8":
        return jnp.clip(w / s, -qmax, qmax).astype(jnp.float8_e4m3fn), scale
    # A scale rounded down (bf16) can put |w / s| a little past qmax: clipped to the last level.
    q = jnp.clip(jnp.round(w / s), -qmax, qmax).astype(jnp.int8)
    if quant.scheme == "int4":
        return pack_int4(q.reshape(n_in, n_out)), scale
    return q, scale


def dequantize_kernel(qweight: jax.Array, scale: jax.Array, quant: QuantConfig) -> jax.Array:
    """The reference: (qweight, scale) -> the float32 kernel `[in, out]` they stand for."""
    s = scale.astype(jnp.float32)
    if quant.scheme != "int4":
        return qweight.astype(jnp.float32) * s
    q = unpack_int4(qweight).astype(jnp.float32)  # [in, out]
    groups, n_out = s.shape
    return (q.reshape(groups, -1, n_out) * s[:, None, :]).reshape(-1, n_out)


class QuantizedLinear(nnx.Module):
    """A linear layer `y = x @ w + b` whose kernel is stored quantized (`qweight`, `scale`; see the module
    docstring), built from a float `kernel` `[in, out]`. The output is in x's dtype, accumulated in float32 and
    rounded once; `bias` (if any) stays in the model's dtype `dtype`."""

    def __init__(self, kernel: jax.Array, bias: jax.Array | None = None, *, quant: QuantConfig, dtype=None,
                 name: str = "kernel"):
        qweight, scale = quantize_kernel(kernel, quant, name)
        self.in_features, self.out_features = kernel.shape
        self.quant = quant
        self.qweight = nnx.Param(qweight)
        self.scale = nnx.Param(scale)
        dtype = jnp.dtype(kernel.dtype if dtype is None else dtype)
        self.bias = None if bias is None else nnx.Param(jnp.asarray(bias, dtype))

    def kernel(self) -> jax.Array:
        """The float32 kernel the layer computes with (`dequantize_kernel`)."""
        return dequantize_kernel(self.qweight[...], self.scale[...], self.quant)

    def _project(self, x: jax.Array) -> jax.Array:
        """x `[..., in]` -> float32 `[..., out]`."""
        qweight = self.qweight[...]
        # A zero that depends on x, added to the converted kernel: XLA then converts each kernel just before its
        # dot (into a buffer the next layer reuses) instead of converting every layer's kernel at the start of
        # the step into buffers all alive at once (344 MiB of float copies for the 156M model: 4x slower than
        # float32 at batch 1; with the tie, 0.9x at batch 1 and faster at 16: README). The zero multiplies 0 or 1
        # (whether x[0] is NaN), never x itself: a non-finite x[0] must not reach the other rows' products.
        first = x.reshape(-1)[0]
        tie = jnp.zeros((), x.dtype) * (first != first).astype(x.dtype)
        if self.quant.scheme == "int4":
            # Groups scale rows of the kernel, not output columns: dequantize, then one dot.
            w = dequantize_kernel(qweight, self.scale[...], self.quant)
            y = jnp.matmul(x, w.astype(x.dtype) + tie, preferred_element_type=jnp.float32)
        else:
            # Per output channel: the dot reads the stored values (int8 and e4m3 are exact in bf16 and f32) and
            # the scale multiplies the `[..., out]` result.
            y = jnp.matmul(x, qweight.astype(x.dtype) + tie, preferred_element_type=jnp.float32)
            y = y * self.scale[...].astype(jnp.float32)
        return y if self.bias is None else y + self.bias[...].astype(jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        return apply_linear(self._project, x)


def quantize_model(model: nnx.Module, quant: QuantConfig | str, paths: set[tuple] | None = None) -> nnx.Module:
    """Replace, in place, every `nnx.Linear` of `model` (any nnx model, e.g. a user model of the
    `pagedjax.model.api` contract) by a `QuantizedLinear` of its kernel and bias, except those whose attribute
    name is in `quant.keep_float` (or, given `paths`, every linear at one of those paths). Returns `model`. A
    user model's own `param_partition` sees the new leaves `qweight` and `scale` where `kernel` was."""
    quant = QuantConfig.coerce(quant)
    found = [(tuple(path), node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear) and path
             and (str(path[-1]) not in quant.keep_float if paths is None else tuple(path) in paths)]
    for path, linear in found:
        bias = None if linear.bias is None else linear.bias[...]
        new = QuantizedLinear(linear.kernel[...], bias, quant=quant, dtype=linear.kernel[...].dtype,
                              name=".".join(map(str, path)))
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, path[-1], new)
    return model
