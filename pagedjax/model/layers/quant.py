"""Quantized linear layers (`pagedjax.config.quant.QuantConfig`): weights in int8 and fp8 e4m3 per output
channel, int4 in groups along the input dimension packed two per byte. Activations stay in the model's dtype;
every product accumulates in float32. With `QuantConfig.activations == "int8"` each row of the input is quantized
to int8 on the fly and multiplied exactly in integers (`w8a8_product` for int8 weights, `w4a8_product` for int4).

A kernel `[in, out]` (the float layout of `pagedjax.model.llama`) is stored `[out, ...]` (Hugging Face's layout:
each output channel's values contiguous, which the one-row product below needs):
  int8   qweight int8 `[out, in]`,               scale `[out]`:              w[i, o] = q[o, i] * scale[o]
  fp8    qweight float8_e4m3fn `[out, in]`,      scale `[out]`:              w[i, o] = q[o, i] * scale[o]
  int4   qweight uint8 `[out, in // 2]`,         scale `[out, in // g]`:     w[i, o] = q[o, i] * scale[o, i // g]
         nibble planes per group: byte j of group k (columns k * g/2 + j) holds input k * g + j in its low
         nibble and input k * g + g/2 + j in its high one (two's complement), so each plane is a contiguous
         `[out, in // 2]` array of the group's first / second halves (`pack_int4`).
Scales are stored in `QuantConfig.scale_dtype`; the quantizer divides by the stored (rounded) scale, so that
`dequantize_kernel` is exactly what the layer computes with. A zero scale (an all-zero channel or group) gives
q = 0, never a NaN.

`dequantize_kernel` is the reference (the float kernel `[in, out]`): a `QuantizedLinear`'s output equals a float
`Linear` holding the dequantized kernel (up to float rounding; tests/model/test_quant.py proves it through the
paged engine, and layer by layer for one row and for many, in float32 and bf16).

How XLA:CPU computes them (`python scripts/bench_quant.py --chain` times the linears of the 156M shape alone,
`python scripts/bench_quant.py` the engine; docs/quantization.md, "Quantized weights"):
  one row (batch-1 decode), int8 and int4: `row @ w.T` with w the converted (int4: unpacked and scaled) kernel
      `[out, in]`. XLA:CPU fuses the conversion, the transpose and the one-row dot into one loop fusion (a
      matrix-vector product split over the cores) that reads the stored bytes: no float copy of the kernel is
      written. Its inner loop is LLVM's vectorization of XLA's per-element code (the runner compiles it 512
      bits wide): per 16 weights, int8 sign-extends 16 bytes to int32 lanes (`vpmovsxbd`), converts them to
      float and multiply-adds them into one of four accumulators (`vfmadd231ps`: the x86 backend contracts the
      IR's separate multiply and add); int4 adds one byte operation (its plane's unpacking) and the multiply
      by the group's scale. The row is first gathered into a buffer of its own (`jnp.take`): else XLA fuses
      the row's producer (the norm, the attention) into the product and recomputes it for every output channel
      (int8 decode at batch 1 ran at 0.95x float32 so), and int4's strided read of each group's halves was not
      vectorized. int4 runs one product per nibble plane, kept apart by an optimization barrier (fused into
      one add, the second product would convert its plane into a buffer first), each plane read as 16 x q
      (`_planes16`: a shift or a mask, where sign-extending the low nibble took two byte shifts) and the sum
      divided by 16. `taskset -c 1 python scripts/bench_quant_matvec.py` (one 156M kernel at a time on one core,
      two runs at load average 6): int4 12.9 - 16.9 G weights/s, int8 7.1 - 14.3, float32's dot 3.0 - 5.5; the
      two-shift unpacking at 0.73 - 0.99x of 16 x q. int4 is bound by its instructions (int8 is not, by bytes
      either: what holds it at 7 - 14 GB/s, below float32's 12 - 22, is not pinned down). Without the scale
      multiply int4's loop ran 1.1 - 1.3x faster, but the multiply cannot leave the inner loop: a per-group sum
      is a batched dot or a reduce, which XLA:CPU does not fuse with the conversion (0.02 - 0.1x), and the
      fast-math compile options leave the IR unchanged. Converting `jnp.int4` arrays (XLA's packed 4-bit type)
      instead ran at 0.1x (XLA:CPU extracts each nibble with scalar code); an int8 x int8 -> int32 dot
      of the row quantized to int8 (llama.cpp's Q8_0 arithmetic, were activations not kept in the model's dtype)
      at 0.04 - 0.17x (no integer SIMD dot products); one fusion for both planes (a concatenated or an
      interleaved kernel, a per-plane shift by iota) converted into a buffer or was not vectorized (0.05 - 0.1x).
      A plane of 512 inputs (in 1024) is unrolled into one chain of 32 dependent
      multiply-adds; with LLVM's unrolling off (`--xla_backend_extra_options=xla_cpu_disable_loop_unrolling`, a
      process-wide XLA_FLAGS only) it ran no faster (the out-of-order core presumably overlaps consecutive
      output channels' chains).
  one fp8 row, and several rows of every scheme: convert (int4: dequantize), then a dot contracting the
      kernel's last axis, on YNNPACK (`pagedjax.runner.runner.cpu_compiler_options` keeps it on for quantized
      models: XLA's own dots of an `[out, in]` kernel ran about 3x slower); the per-channel schemes apply their
      scale to the `[..., out]` result. XLA:CPU's e4m3 -> float conversion is a slow per-element routine (the
      fused one-row product ran at 0.6x float32), and an exact conversion by integer ops (subnormals included:
      XLA:CPU flushes float32 denormals, so they need a select) only matched float32.
  `conversion_tie` (in `QuantizedLinear._project`) makes XLA convert each kernel just before its product
      instead of every kernel at the start of the step into buffers all alive at once.
  In the fused decode's `while_loop` every conversion is loop-invariant, and XLA hoisted it out of the loop (a
      float copy of every kernel, which each iteration's products then read): the loop body takes the weights
      through an optimization barrier with its iteration counter (`pagedjax.runner.runner._fused_decode_loop`),
      so the products there are the single step's.
Whether XLA:GPU fuses the conversion is not measured here.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.config.quant import QuantConfig
from pagedjax.device.int8_matmul import int4_matmul, int8_matmul
from pagedjax.model.layers.linear import apply_linear

__all__ = ["QuantizedLinear", "check_tensor_parallel", "dequantize_kernel", "dequantize_stored", "holds_quantized",
           "pack_int4", "quantize_kernel", "quantize_model", "quantize_rows", "quantizes_activations",
           "quantized_product", "replace_module", "unpack_int4", "w4a8_product", "w8a8_product"]

# The largest |q| the quantizer produces for each scheme (int4 stores -8 too, which it never produces).
QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


def shapes(quant: QuantConfig, n_in: int, n_out: int, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(qweight shape, scale shape) of a kernel `[n_in, n_out]` (stored `[out, ...]`); ValueError naming the
    tensor `name` when int4's group size does not divide n_in."""
    if quant.scheme != "int4":
        return (n_out, n_in), (n_out,)
    if n_in % quant.group_size:
        raise ValueError(f"{name}: int4 group size {quant.group_size} does not divide its input dimension {n_in}")
    return (n_out, n_in // 2), (n_out, n_in // quant.group_size)


def pack_int4(q: jax.Array, group_size: int) -> jax.Array:
    """int8 `[..., in]` of values in [-8, 7] -> uint8 `[..., in // 2]` in nibble planes per group of
    `group_size` (even, dividing in): input j of a group's first half -> the low nibble of the group's byte j,
    input j of its second half -> the high nibble."""
    nibbles = jax.lax.bitcast_convert_type(q.astype(jnp.int8), jnp.uint8) & 0xF
    grouped = nibbles.reshape(*q.shape[:-1], -1, 2, group_size // 2)  # [..., groups, half, g / 2]
    return (grouped[..., 0, :] | (grouped[..., 1, :] << 4)).reshape(*q.shape[:-1], -1)


def _planes(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 `[..., n]` -> (low, high) int8 `[..., n]` in [-8, 7]: each group's first and second halves."""
    b = jax.lax.bitcast_convert_type(packed, jnp.int8)
    return jnp.left_shift(b, 4) >> 4, b >> 4  # arithmetic shifts of int8: the nibble's sign bit extends


def _planes16(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 `[..., n]` -> (low, high) int8 `[..., n]`, each nibble plane times 16 (the nibble moved to the byte's
    top, its low four bits zero): one byte operation per plane (a shift, a mask) where `_planes` sign-extends
    the low nibble with two. 16 * q is exact in float32, and the one-row product divides its sum by 16 (a power of
    two: exact outside float32's subnormal range)."""
    b = jax.lax.bitcast_convert_type(packed, jnp.int8)
    return jnp.left_shift(b, 4), b & jnp.int8(-16)  # -16: 0xF0


def unpack_int4(packed: jax.Array, group_size: int) -> jax.Array:
    """The inverse of `pack_int4`: uint8 `[..., in // 2]` -> int8 `[..., in]` in [-8, 7]."""
    low, high = (p.reshape(*packed.shape[:-1], -1, 1, group_size // 2) for p in _planes(packed))
    return jnp.concatenate([low, high], axis=-2).reshape(*packed.shape[:-1], -1)


def quantize_kernel(kernel: jax.Array, quant: QuantConfig, name: str = "kernel") -> tuple[jax.Array, jax.Array]:
    """A float kernel `[in, out]` -> (qweight, scale) of `quant.scheme`, stored `[out, ...]` (see the module
    docstring): symmetric, scale = max |w| / QMAX over each channel (or group), rounded to the nearest level.
    ValueError naming `name` for a kernel that is not 2-D or whose input dimension int4's group size does not
    divide."""
    if kernel.ndim != 2:
        raise ValueError(f"{name}: a linear kernel [in, out] is 2-D, got shape {tuple(kernel.shape)}")
    shapes(quant, *kernel.shape, name)
    return _quantize(jnp.asarray(kernel), quant)


@functools.partial(jax.jit, static_argnames="quant")
def _quantize(kernel: jax.Array, quant: QuantConfig) -> tuple[jax.Array, jax.Array]:
    """`quantize_kernel` past its checks, one compiled program per kernel shape (a model's load quantizes many
    kernels of few shapes; op by op, every kernel ran a dozen small programs)."""
    n_in, n_out = kernel.shape
    w = kernel.astype(jnp.float32).T  # [out, in]
    if quant.scheme == "int4":
        w = w.reshape(n_out, n_in // quant.group_size, quant.group_size)  # [out, groups, g]
    amax = jnp.max(jnp.abs(w), axis=-1)  # [out] or [out, groups]
    scale = (amax / QMAX[quant.scheme]).astype(quant.scale_dtype)
    s = scale.astype(jnp.float32)
    s = jnp.where(s == 0, 1.0, s)[..., None]  # a zero scale's channel is all zero: q = 0
    qmax = QMAX[quant.scheme]
    if quant.scheme == "fp8":
        return jnp.clip(w / s, -qmax, qmax).astype(jnp.float8_e4m3fn), scale
    # A scale rounded down (bf16) can put |w / s| a little past qmax: clipped to the last level.
    q = jnp.clip(jnp.round(w / s), -qmax, qmax).astype(jnp.int8)
    if quant.scheme == "int4":
        return pack_int4(q.reshape(n_out, n_in), quant.group_size), scale
    return q, scale


def dequantize_stored(qweight: jax.Array, scale: jax.Array, quant: QuantConfig) -> jax.Array:
    """(qweight, scale) -> the float32 kernel in the stored layout `[out, in]`."""
    s = scale.astype(jnp.float32)
    if quant.scheme != "int4":
        return qweight.astype(jnp.float32) * s[:, None]
    q = unpack_int4(qweight, quant.group_size).astype(jnp.float32)  # [out, in]
    n_out, groups = s.shape
    return (q.reshape(n_out, groups, -1) * s[:, :, None]).reshape(n_out, -1)


def dequantize_kernel(qweight: jax.Array, scale: jax.Array, quant: QuantConfig) -> jax.Array:
    """The reference: (qweight, scale) -> the float32 kernel `[in, out]` they stand for."""
    return dequantize_stored(qweight, scale, quant).T


@functools.lru_cache
def _row_order(n_in: int, group_size: int | None) -> np.ndarray:
    """The input each element of a one-row product's gathered row is: i32 `[n_in]`, the identity for int8 (no
    groups), int4's nibble planes' inputs (low plane then high, see `pack_int4`)."""
    order = np.arange(n_in, dtype=np.int32)
    if group_size is None:
        return order
    return order.reshape(-1, 2, group_size // 2).transpose(1, 0, 2).reshape(-1)  # [groups, half, g / 2]


def conversion_tie(x: jax.Array) -> jax.Array:
    """A float32 zero that depends on x, added to a kernel converted from its stored bytes: XLA then converts each
    kernel just before its product (fused into it for one row, else into a buffer the next layer reuses) instead
    of converting every layer's kernel at the start of the step into buffers all alive at once (344 MiB of float
    copies for the 156M model, 4x slower than float32 at batch 1). The zero multiplies 0 or 1 (whether x's first
    element is NaN), never x itself: a non-finite x[0] must not reach the other rows' products."""
    first = x.reshape(-1)[0]
    return jnp.zeros((), jnp.float32) * (first != first).astype(jnp.float32)


def _dot_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """x `[..., in]` times a converted kernel stored `[out, in]` -> float32 `[..., out]`, contracting the last
    axes (several rows: a YNNPACK dot of the converted kernel)."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _matvec(row: jax.Array, w: jax.Array) -> jax.Array:
    """row f32 `[1, k]` times w f32 `[n, k]` (an expression of the stored bytes) -> f32 `[1, n]`, written
    `row @ w.T`: XLA:CPU then fuses w's expression into a loop-emitted matrix-vector product that reads the
    stored bytes (contracting w's last axis directly, as `_dot_rows` does, it converts w into a buffer first)."""
    return row @ w.T


def one_row(x: jax.Array, quant: QuantConfig) -> bool:
    """Whether x `[..., in]` is a single row (batch-1 decode; static under jit) of an int8 or int4 kernel,
    computed as a float32 product (a fused matrix-vector product of the stored bytes, module docstring; W8A8's
    integer product)."""
    return math.prod(x.shape[:-1]) == 1 and quant.scheme in ("int8", "int4")


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x `[m, k]` -> (q int8 `[m, k]`, scale float32 `[m]`), each row symmetric: scale = max |row| / 127 and q the
    row times 127 / max |row| rounded to the nearest integer (ties to even), so that x ~= q * scale. An all-zero
    row has scale 0 and q 0; a row holding a NaN or an infinity has a non-finite scale (its products are NaN,
    `w8a8_product`) and q 0: nothing of it reaches the integer product or any other row."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)  # [m]; NaN or inf for a row holding one
    finite = jnp.isfinite(amax) & (amax > 0)
    inverse = jnp.where(finite, 127.0 / jnp.where(finite, amax, 1.0), 0.0)
    q = jnp.where(finite[:, None], jnp.clip(jnp.round(x * inverse[:, None]), -127, 127), 0.0)
    return q.astype(jnp.int8), amax / 127.0


def w8a8_product(x: jax.Array, qweight: jax.Array, scale: jax.Array) -> jax.Array:
    """x `[..., in]` times int8 `qweight` `[out, in]` with float `scale` `[out]`, x's rows quantized to int8
    (`quantize_rows`) -> float32 `[..., out]` = (q_x . q_w) * scale_x * scale_w, the int32 sum exact
    (`pagedjax.device.int8_matmul`: an integer SIMD kernel on the CPU). A row's result depends on that row alone."""
    rows = x.reshape(-1, x.shape[-1])
    q, row_scale = quantize_rows(rows)
    acc = int8_matmul(q, qweight)  # i32[m, out]
    y = acc.astype(jnp.float32) * row_scale[:, None] * scale.astype(jnp.float32)
    return y.reshape(*x.shape[:-1], -1)


def w4a8_product(x: jax.Array, qweight: jax.Array, scale: jax.Array, group_size: int) -> jax.Array:
    """x `[..., in]` times int4 `qweight` `[out, in // 2]` (`pack_int4`) with `scale` `[out, in // group_size]`, x's
    rows quantized to int8 (`quantize_rows`) -> float32 `[..., out]` = scale_x * sum over groups of scale_w times the
    group's exact integer sum (`pagedjax.device.int8_matmul.int4_matmul`). A row's result depends on that row
    alone."""
    rows = x.reshape(-1, x.shape[-1])
    q, row_scale = quantize_rows(rows)
    y = int4_matmul(q, qweight, scale.astype(jnp.float32), group_size) * row_scale[:, None]
    return y.reshape(*x.shape[:-1], -1)


def quantized_product(x: jax.Array, qweight: jax.Array, scale: jax.Array, quant: QuantConfig) -> jax.Array:
    """x `[..., in]` times the kernel stored as `qweight` `[out, in]` (int4: `[out, in // 2]`) and `scale` `[out]`
    (int4: `[out, in // g]`) -> float32 `[..., out]`: `QuantizedLinear`'s product (module docstring); with int8
    activations `w8a8_product` (int8 weights) or `w4a8_product` (int4)."""
    if quant.activations == "int8":
        if quant.scheme == "int4":
            return w4a8_product(x, qweight, scale, quant.group_size)
        return w8a8_product(x, qweight, scale)
    scale = scale.astype(jnp.float32)
    tie = conversion_tie(x)
    if one_row(x, quant):
        # x's row, gathered into a buffer of its own: fused into the product, x's producer (a norm, the
        # attention) would be recomputed for every output channel, and int4's strided read of x ran 10x slower.
        row = jnp.take(x.reshape(-1).astype(jnp.float32), _row_order(x.shape[-1], quant.group_size))
        if quant.scheme == "int8":
            y = _matvec(row[None], qweight.astype(jnp.float32) + tie) * scale
        else:
            # One product per nibble plane: each plane `[out, groups, g / 2]` (16 times its values, scaled by
            # its group) against the matching halves of x's groups (the row is gathered plane by plane:
            # `[2, in // 2]`). The sum is divided by 16 at the end: exact, a power of two.
            n_out, groups = scale.shape
            halves = row.reshape(2, -1)
            low, high = (
                (p.astype(jnp.float32).reshape(n_out, groups, -1) * scale[:, :, None]).reshape(n_out, -1) + tie
                for p in _planes16(qweight))  # [out, in // 2] each
            # Kept apart, else XLA fuses the sum into the second product, which then converts its plane first.
            y_low, y_high = jax.lax.optimization_barrier((_matvec(halves[:1], low), _matvec(halves[1:], high)))
            y = (y_low + y_high) * 0.0625
        y = y.reshape(*x.shape[:-1], -1)
    elif quant.scheme == "int4":
        # Groups scale the kernel's inputs, not its output columns: dequantize, then one dot.
        w = dequantize_stored(qweight, scale, quant) + tie  # [out, in]
        y = _dot_rows(x, w.astype(x.dtype))
    else:
        # Per output channel: the dot reads the stored values (int8 and e4m3 are exact in bf16 and f32) and
        # the scale multiplies the `[..., out]` result.
        y = _dot_rows(x, (qweight.astype(jnp.float32) + tie).astype(x.dtype)) * scale
    return y


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
        """The float32 kernel `[in, out]` the layer computes with (`dequantize_kernel`)."""
        return dequantize_kernel(self.qweight[...], self.scale[...], self.quant)

    def _one_row(self, x: jax.Array) -> bool:
        """`one_row` for this layer's scheme."""
        return one_row(x, self.quant)

    def _project(self, x: jax.Array) -> jax.Array:
        """x `[..., in]` -> float32 `[..., out]`."""
        y = quantized_product(x, self.qweight[...], self.scale[...], self.quant)
        return y if self.bias is None else y + self.bias[...].astype(jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self._one_row(x):  # a float32 matrix-vector product: `apply_linear`'s second (zero) 16-bit row not needed
            return self._project(x).astype(x.dtype)
        return apply_linear(self._project, x)


def holds_quantized(params: nnx.State) -> bool:
    """Whether a model's parameters hold `QuantizedLinear` kernels (XLA:CPU computes their several-row products
    fast only with its YNNPACK fusions: `pagedjax.runner.runner`)."""
    return any(str(path[-1]) == "qweight" for path, _ in nnx.to_flat_state(params))


def quantizes_activations(model: nnx.Module) -> bool:
    """Whether any `QuantizedLinear` of `model` quantizes its input rows (W8A8, W4A8: `QuantConfig.activations`)."""
    return any(isinstance(node, QuantizedLinear) and node.quant.activations != "float"
               for _, node in nnx.iter_graph(model))


def check_tensor_parallel(model: nnx.Module, tp: int) -> None:
    """ValueError when `model` quantizes activations (W8A8, W4A8) and would be sharded over `tp` > 1 devices: its
    integer products are one device's kernels, which XLA's partitioner would only run on gathered weights."""
    if tp > 1 and quantizes_activations(model):
        raise ValueError(f"int8 activations (W8A8, W4A8) are not served under tensor parallelism (tp {tp}): their "
                         f"integer products are one device's kernels; use tensor_parallel_size 1 (data parallel "
                         f"replicas serve it) or a weight-only scheme ('int8', 'int4')")


def quantize_model(model: nnx.Module, quant: QuantConfig | str, paths: set[tuple] | None = None) -> nnx.Module:
    """Replace, in place, every `nnx.Linear` of `model` (any nnx model, e.g. a user model of the
    `pagedjax.model.api` contract) by a `QuantizedLinear` of its kernel and bias, except those whose attribute
    name is in `quant.keep_float` (or, given `paths`, every linear at one of those paths). Returns `model`. A
    user model's own `param_partition` sees the new leaves `qweight` and `scale` where `kernel` was.

    Without `paths`, a `keep_float` name that is no module's attribute name in `model` is a ValueError naming it
    and the modules there are (a typo would quantize what it meant to keep float), except the default "lm_head":
    a model of its own may call its head otherwise, or tie it to the embedding."""
    quant = QuantConfig.coerce(quant)
    if paths is None:
        modules = sorted({str(path[-1]) for path, node in nnx.iter_graph(model)
                          if path and isinstance(node, nnx.Module) and not isinstance(path[-1], int)})
        unknown = [name for name in quant.keep_float if name not in modules and name != "lm_head"]
        if unknown:
            linears = sorted({str(path[-1]) for path, node in nnx.iter_graph(model)
                              if path and isinstance(node, nnx.Linear)})
            raise ValueError(f"QuantConfig.keep_float names no module of this model: {unknown} (its linear "
                             f"modules: {', '.join(linears) or 'none'}; all its modules: {', '.join(modules)})")
    found = [(tuple(path), node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear) and path
             and (str(path[-1]) not in quant.keep_float if paths is None else tuple(path) in paths)]
    for path, linear in found:
        bias = None if linear.bias is None else linear.bias[...]
        new = QuantizedLinear(linear.kernel[...], bias, quant=quant, dtype=linear.kernel[...].dtype,
                              name=".".join(map(str, path)))
        replace_module(model, path, new)
    return model


def replace_module(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
    """Put `new` where `model`'s graph path `path` (attribute names and list indices) leads, in place."""
    parent = model
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)
