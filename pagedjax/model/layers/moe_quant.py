"""Weight-only quantized mixture-of-experts experts (`ModelConfig.quantization` with `ModelConfig.moe`): each
expert's three matrices stored as `pagedjax.model.layers.quant.QuantizedLinear` stores a kernel, stacked on axis 0.

Per projection (`ExpertKernels`), expert e's float kernel `[in, out]` is quantized by `quantize_kernel` (the same
scheme, scales and layouts as a linear layer's, vmapped over the experts):
  gate_proj, up_proj  kernel `[hidden, width]`:  qweight `[E, width, hidden]` (int4: `[E, width, hidden // 2]`),
                      scale `[E, width]` (int4: `[E, width, hidden // g]`)
  down_proj           kernel `[width, hidden]`:  qweight `[E, hidden, width]` (int4: `[E, hidden, width // 2]`),
                      scale `[E, hidden]` (int4: `[E, hidden, width // g]`)
so gate / up's stored `[out, in]` is exactly `Experts`' (out, in) layout, and down's is its (in, out) transposed.
Axis 0 is the expert of every leaf: expert parallelism (`pagedjax.parallel.sharding`) splits values and scales
alike, and `per_expert_params` turns each leaf into a tuple of E per-expert arrays for the single-device CPU form.

The router (`MoEMLP.gate`) stays float: it is a small `[hidden, E]` matrix (E columns against the experts'
3 * E * width), and its logits decide which experts a token gets: a rounding error there changes a token's
experts (a discrete jump in the output) rather than perturbing it. `QuantConfig.keep_float` containing
"experts" keeps the experts float too.

`QuantizedExperts` computes with the float `Experts`' four methods on the dequantized values
(`dequantize_kernel`'s arithmetic, rounded to the rows' dtype), so it equals the float `Experts` holding those
values (tests/model/test_moe_quant.py):
  `by_pair`  branch e of the switch computes with expert e alone: the switch's operands are the quantized leaves,
             and a branch reads only its expert's bytes (in the per-expert form, its own arrays in place), each
             projection a `QuantizedLinear` product (`quantized_product`: for int8 and int4 XLA:CPU fuses the
             conversion into a matrix-vector product of the stored bytes; dequantizing the expert into a float
             buffer first ran int4 batch-1 decode at 0.5x the float MoE's speed on the bench_moe shape).
  `by_tile`  the same switch, once per tile of rows (`Experts.by_tile`): a tile's product of the stored bytes.
  `every`, `grouped`  every expert is dequantized (XLA:CPU fuses each projection's conversion into one loop
             fusion that writes the float `[E, width, hidden]` buffer the dots then read: the float layer's bytes,
             written once per step). The conversion is tied to the layer's rows (`quant.conversion_tie`), so it
             happens just before the layer's dots rather than every layer's at the start of the step.
With int8 activations (`QuantConfig.activations`: W8A8, W4A8) every method multiplies integers: `by_pair` and
`by_tile` through `quantized_product` as above, `every` expert by expert the same way (each expert's output
weighted afterwards, as the pair methods weight theirs), `grouped` every expert on every row (there is no grouped
integer product; the GPU's method), so the four compute the same function.
Measured (docs/quantization.md, "Quantized weights", one run each on 2 shared cores): one layer of the bench_moe shape
(`scripts/bench_moe_layer.py --quantization int8,int4`), `by_pair` at one row 1.9x faster than float32 in int8
and int4; `every` at 16 rows 3.1x (int8) and 3.5x (int4) slower: XLA:CPU's conversion of the 24 expert matrices
(scheduled together at the layer's start) costs about twice the float dots' time. Computing `every`'s per-expert
products as `quantized_product` (int8: the dot of the converted values, the scale on its output) gained only
10-15% in a probe; not done.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.config.quant import QuantConfig
from pagedjax.model.layers.moe import GLU, SWIGLU, Experts, MoEMLP
from pagedjax.model.layers.quant import (
    conversion_tie,
    dequantize_stored,
    quantize_kernel,
    quantized_product,
    replace_module,
    shapes,
)

__all__ = ["ExpertKernels", "QuantizedExperts", "check_expert_shapes", "moe_mlp", "quantize_experts",
           "quantizes_experts"]

EXPERTS = "experts"  # the `keep_float` name (and module attribute) of a MoE layer's experts


def quantizes_experts(quant: QuantConfig | None) -> bool:
    """Whether a model of `quant` (`ModelConfig.quantization`) holds its MoE experts quantized."""
    return quant is not None and EXPERTS not in quant.keep_float


def moe_mlp(cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> MoEMLP:
    """A decoder layer's `MoEMLP` for `cfg`: its experts quantized from their random float init (as
    `QuantizedLinear`s are from theirs) when `cfg.quantization` quantizes them (`quantizes_experts`)."""
    if not quantizes_experts(cfg.quantization):
        return MoEMLP(cfg, dtype, rngs)
    mlp = MoEMLP(cfg.replace(quantization=None), dtype, rngs)
    mlp.experts = QuantizedExperts.of(mlp.experts, cfg.quantization)
    return mlp


def check_expert_shapes(quant: QuantConfig, experts: Experts, name: str) -> None:
    """ValueError naming the tensor (`name`.gate_proj, ...) when int4's group size does not divide the input
    dimension of the float `experts`' kernels (gate / up: hidden; down: width)."""
    _, width, hidden = experts.gate_proj.get_value().shape
    for proj, n_in, n_out in (("gate_proj", hidden, width), ("up_proj", hidden, width), ("down_proj", width, hidden)):
        shapes(quant, n_in, n_out, f"{name}.{proj}")


class ExpertKernels(nnx.Module):
    """E float kernels `kernels` `[E, in, out]` quantized like `QuantizedLinear`'s kernel, stacked on axis 0:
    `qweight` `[E, out, in]` (int4: `[E, out, in // 2]`), `scale` `[E, out]` (int4: `[E, out, in // g]`).
    ValueError naming the tensor `name` when int4's group size does not divide `in`."""

    def __init__(self, kernels: jax.Array, quant: QuantConfig, name: str):
        if kernels.ndim != 3:
            raise ValueError(f"{name}: stacked expert kernels [E, in, out] are 3-D, got shape {tuple(kernels.shape)}")
        shapes(quant, *kernels.shape[1:], name)  # checked here: raised inside vmap, JAX appends its traceback note
        # One compiled program for all E experts (vmapped `quantize_kernel`); its float32 transposed copy of the
        # E kernels is the peak memory of quantizing a projection.
        qweight, scale = jax.vmap(lambda k: quantize_kernel(k, quant, name))(kernels)
        self.quant = quant
        self.qweight = nnx.Param(qweight)
        self.scale = nnx.Param(scale)

    def stored(self) -> jax.Array | tuple[jax.Array, ...]:
        """Every expert's float32 kernel in the stored layout: stacked `[E, out, in]` or, in the per-expert form
        (`per_expert_params`), a tuple of E `[out, in]`."""
        qweight, scale = self.qweight.get_value(), self.scale.get_value()
        if isinstance(qweight, tuple):
            return tuple(dequantize_stored(q, s, self.quant) for q, s in zip(qweight, scale, strict=True))
        return jax.vmap(lambda q, s: dequantize_stored(q, s, self.quant))(qweight, scale)


class QuantizedExperts(Experts):
    """`Experts` whose three projections are `ExpertKernels` (module docstring), quantized from the float
    `Experts` weights `gate` / `up` `[E, width, hidden]` (out, in) and `down` `[E, width, hidden]` (in, out);
    ValueError naming the tensor for any other shapes. `name`: the experts' path, which errors name (e.g.
    "layers.0.mlp.experts"). `biases` (`Experts.biases`, or None) stay float; `glu` is the float experts'
    activation."""

    def __init__(self, gate: jax.Array, up: jax.Array, down: jax.Array, *, quant: QuantConfig,
                 name: str = EXPERTS, biases: tuple | None = None, glu: GLU = SWIGLU):
        for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            if w.ndim != 3 or w.shape != gate.shape:
                raise ValueError(f"{name}.{proj}: expert weights are [E, width, hidden], all of one shape, got "
                                 f"{tuple(w.shape)} (gate_proj {tuple(gate.shape)})")
        to_in_out = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731  (out, in) -> the kernels' [E, in, out]
        self.gate_proj = ExpertKernels(to_in_out(gate), quant, f"{name}.gate_proj")
        self.up_proj = ExpertKernels(to_in_out(up), quant, f"{name}.up_proj")
        self.down_proj = ExpertKernels(down, quant, f"{name}.down_proj")
        self.set_biases(biases)
        self.glu = glu

    @classmethod
    def of(cls, experts: Experts, quant: QuantConfig, name: str = EXPERTS) -> QuantizedExperts:
        """The quantized form of the float (stacked) `experts` (their biases and activation as they are)."""
        return cls(*experts.weights(), quant=quant, name=name, biases=experts.biases(), glu=experts.glu)

    def weights(self, x: jax.Array | None = None) -> tuple:
        """The dequantized (gate_proj, up_proj, down_proj) in `Experts`' layout and x's dtype, stacked or, in the
        per-expert form, tuples of E arrays. x: the rows they multiply, to which the conversion is tied (module
        docstring); required."""
        if x is None:
            raise ValueError("QuantizedExperts.weights: the rows x the weights multiply are required")
        tie = conversion_tie(x)
        convert = lambda w: (w + tie).astype(x.dtype)  # noqa: E731
        gate, up, down = (p.stored() for p in (self.gate_proj, self.up_proj, self.down_proj))
        if isinstance(gate, tuple):  # the per-expert form; down stored `[hidden, width]` per expert
            return tuple(convert(w) for w in gate), tuple(convert(w) for w in up), tuple(convert(w.T) for w in down)
        return convert(gate), convert(up), convert(jnp.swapaxes(down, 1, 2))

    def switch_operands(self) -> tuple:
        """`by_pair`'s switch operands: the quantized leaves themselves (a branch dequantizes its expert), then the
        biases where the experts have them."""
        return tuple(leaf.get_value() for p in (self.gate_proj, self.up_proj, self.down_proj)
                     for leaf in (p.qweight, p.scale)) + (self.biases() or ())

    def expert_mlp(self, e: int, row: jax.Array, operands: tuple) -> jax.Array:
        """Rows `row` `[n, hidden]` (`by_pair`'s one, `by_tile`'s tile) through expert e, reading only expert e's
        quantized bytes from `switch_operands`: each projection is `QuantizedLinear`'s product of its stored
        `[out, in]` (`quantized_product`: for int8 and int4 one row is a fused matrix-vector product of the stored
        bytes), rounded to row's dtype."""
        stored, biases = operands[:6], operands[6:] or None
        quant = self.gate_proj.quant
        product = lambda a, p: quantized_product(  # noqa: E731
            a, stored[2 * p][e], stored[2 * p + 1][e], quant).astype(row.dtype)
        return self.apply(e, row, product, biases)

    def every(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        """`Experts.every`; with int8 activations each expert's rows through `expert_mlp` (its integer products),
        its output weighted by `combine[:, e]` afterwards, as "by_pair" and "tiled" weight theirs: scaling the
        rows before down_proj, as the float form does, would change how they are quantized."""
        if self.gate_proj.quant.activations == "float":
            return super().every(x, combine)
        operands = self.switch_operands()
        y = jnp.zeros(x.shape, jnp.float32)
        for e in range(self.num_experts):
            y += combine[:, e:e + 1] * self.expert_mlp(e, x, operands).astype(jnp.float32)
        return y.astype(x.dtype)

    def grouped(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """`Experts.grouped`; with int8 activations (no grouped integer product) every row through every expert's
        `expert_mlp`, each row keeping its group's: E times the arithmetic, the same function."""
        if self.gate_proj.quant.activations == "float":
            return super().grouped(x, group_sizes)
        expert_of = jnp.repeat(jnp.arange(self.num_experts), group_sizes, total_repeat_length=x.shape[0])
        operands = self.switch_operands()
        out = jnp.zeros_like(x)
        for e in range(self.num_experts):
            out = jnp.where((expert_of == e)[:, None], self.expert_mlp(e, x, operands), out)
        return out

    @property
    def num_experts(self) -> int:
        return len(self.gate_proj.qweight.get_value())


def quantize_experts(model: nnx.Module, quant: QuantConfig, paths: set[tuple]) -> nnx.Module:
    """Replace, in place, the float `Experts` of `model` at each of `paths` by their `QuantizedExperts`; errors
    name the path. Returns `model`."""
    found = [(tuple(path), node) for path, node in nnx.iter_graph(model)
             if type(node) is Experts and tuple(path) in paths]
    for path, experts in found:
        replace_module(model, path, QuantizedExperts.of(experts, quant, ".".join(map(str, path))))
    return model
