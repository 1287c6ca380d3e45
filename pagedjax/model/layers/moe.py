"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss): a router picks each token's k experts, each expert is a
gated MLP (SwiGLU, or gpt-oss's clamped variant: `GLU`), and a token's output is its experts' outputs summed with
the router's weights. gpt-oss adds a bias to the router's logits and to each expert's three projections
(`MoEConfig.router_bias`, `expert_bias`).

Two computations of the same function:
  `MoEMLP.__call__`  the serving path: the (token, expert) pairs sorted by expert, and each projection one
                     grouped matmul over the sorted rows (`jax.lax.ragged_dot`: group e is the rows routed to
                     expert e, multiplied by expert e's weights). Exact: every token gets all its k experts (no
                     capacity factor drops any).
  `MoEMLP.dense`     the reference: every expert on every token, the outputs weighted by a `[tokens, experts]`
                     matrix that is zero outside each token's k experts. E / k times the work; for tests and
                     `forward_dense`.

Expert weights are stacked `[num_experts, width, hidden]` (gate_proj and up_proj as (out, in), down_proj as
(in, out): `Experts` says why): axis 0 is what expert parallelism shards (`pagedjax.parallel.sharding`). That
stacked form is the canonical one (checkpoints, loading, sharding); on one CPU device the engine's runner holds
the experts as E separate arrays instead (`per_expert_params`, `Llama.single_device_params`), the same function.
The router (`gate`, `[hidden, E]`, with a bias `[E]` where the family has one) is a plain linear layer, replicated.
With `ModelConfig.quantization` the experts are stored quantized (`pagedjax.model.layers.moe_quant.QuantizedExperts`,
built by `moe_quant.moe_mlp`; the router and the experts' biases stay float) and computed by the same three methods
below on their dequantized values.

On the CPU, XLA lowers `ragged_dot` to a masked dense product over all experts (the grouped matmul instruction is
lowered natively on GPU and TPU only): the same result at many times the work. So on the CPU the MLP takes one
of three other computations of the same function, by the step's static numbers of rows and (token, expert) pairs:
  - fewer pairs than experts (batch-1 decode: k pairs): each pair through its expert alone by `lax.switch` over
    the experts (`Experts.by_pair`), reading only the routed experts' weights. From the per-expert form a branch
    reads its expert's arrays in place; from the stacked form XLA:CPU first copies the expert's slice (a dot
    reads whole buffers), which made batch-1 decode 2x slower than the dense model of the active size;
  - many pairs, experts in the per-expert form (a single-device step), where the tiles below do less than half
    the work of every expert on every row (`cpu_method`): the pairs sorted by expert, each expert's run padded to
    whole tiles of `tile_rows` rows, and a loop over the tiles whose `lax.switch` runs each tile through its
    expert alone (`Experts.by_tile`; a tile past the last expert's is skipped). Work: the routed pairs plus at
    most one tile of padding per expert, not E / k times the pairs. `python scripts/bench_moe_layer.py --shape
    deepseek-small --batch 16 64 256 1024 --repeats 3 --calls 3` (64 experts of width 512, top 6, hidden 1024;
    per-expert form, load average 0.7-1.8): at 256 and 1024 rows 2.6x and 4.4x the speed of every expert on every
    row (114 against 295 ms, 165 against 727 ms); at 16 and 64 rows, tiles of 16 ran at 0.86-0.87x, and "every"
    is kept there;
  - otherwise the reference's: every expert on every row, weighted by zero unless routed to (E / k times the
    arithmetic of the routed rows, every expert's weights read once), as three plain dots over the flattened
    experts (`Experts.every`): the cost of the dense model of the MoE's total size. The stacked form (expert and
    tensor parallelism shard it by expert) keeps this one: XLA partitions its dots by expert.
`scripts/bench_moe.py` measures decode against dense models of the MoE's active and total size, and
`scripts/bench_moe_layer.py` one layer each way. `python scripts/bench_moe.py --max-tokens 32` (the 2-core CPU
shared with other jobs, load average 4-5): batch 1 18.8 tokens/s against 17.7 for the dense model of the active
size (target: within 1.3x; 2.12x before these two changes, measured the same way), batch 16 114.6 against 270.9
for the active size and 92.6 for the total size (8.0x and 2.8x slower before).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.config.moe import MoEConfig

# Each expert's matrices are `[width, hidden]`: gate/up as (out, in), down as (in, out) (`Experts`).
_INIT_OUT_IN = nnx.initializers.lecun_normal(in_axis=2, out_axis=1, batch_axis=(0,))
_INIT_IN_OUT = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))


def route(logits: jax.Array, k: int, router: str, norm_topk_prob: bool, *, num_groups: int = 1,
          topk_groups: int = 1, correction_bias: jax.Array | None = None,
          scaling_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Router logits `[T, E]` (float32) -> (weights float32 `[T, k]`, experts int32 `[T, k]`), by the family's
    convention. Ties go to the lower expert (and group) index.

    Mixtral / Qwen3-MoE (`pagedjax.config.moe.ROUTERS`): "topk_softmax" takes the k largest logits and a softmax
    over them; "softmax_topk" a softmax over all experts and its k largest probabilities, renormalized to sum to
    1 when `norm_topk_prob`.

    DeepSeek (`pagedjax.config.deepseek.DEEPSEEK_ROUTERS`), the experts split into `num_groups` consecutive groups
    of which the `topk_groups` best are eligible: "greedy" is "softmax_topk" (one group); "group_limited_greedy"
    ranks groups by their best probability and picks the k most probable eligible experts; "noaux_tc" scores
    experts by sigmoid, ranks groups by the sum of their two best `score + correction_bias` (float32 `[E]`; None:
    zeros) and picks the k eligible experts of largest score + bias, weighted by their plain scores. With
    `norm_topk_prob` their weights are renormalized to sum to 1 ("noaux_tc" adds 1e-20 to the sum first, as
    transformers does).

    Every router's weights are finally multiplied by `scaling_factor` (DeepSeek's `routed_scaling_factor`)."""
    deepseek = ("greedy", "group_limited_greedy", "noaux_tc")
    if router not in ("topk_softmax", "softmax_topk", *deepseek):
        raise ValueError(f"unknown MoE router {router!r}")
    grouped = router in ("group_limited_greedy", "noaux_tc")
    if not grouped and (num_groups, topk_groups) != (1, 1):
        raise ValueError(f"MoE router {router!r} has no expert groups (num_groups={num_groups}, "
                         f"topk_groups={topk_groups})")
    if correction_bias is not None and router != "noaux_tc":
        raise ValueError(f"MoE router {router!r} takes no correction_bias (only 'noaux_tc' does)")
    if router == "topk_softmax":
        top, experts = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top, axis=-1)
    elif router in ("softmax_topk", "greedy"):
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    elif router == "group_limited_greedy":
        scores = jax.nn.softmax(logits, axis=-1)
        best = jnp.max(_grouped(scores, num_groups), axis=-1)
        weights, experts = jax.lax.top_k(jnp.where(_eligible(best, topk_groups, logits.shape[-1]), scores, 0.0), k)
    else:  # "noaux_tc"
        scores = jax.nn.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
        best_two = jnp.sum(jax.lax.top_k(_grouped(choice, num_groups), 2)[0], axis=-1)
        eligible = _eligible(best_two, topk_groups, logits.shape[-1])
        _, experts = jax.lax.top_k(jnp.where(eligible, choice, -jnp.inf), k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if norm_topk_prob and router != "topk_softmax":
        total = jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights / (total + 1e-20 if router == "noaux_tc" else total)
    if scaling_factor != 1.0:
        weights = weights * jnp.float32(scaling_factor)
    return weights, experts


def _grouped(scores: jax.Array, num_groups: int) -> jax.Array:
    """`[T, E]` -> `[T, num_groups, E / num_groups]`: consecutive experts form a group."""
    return scores.reshape(*scores.shape[:-1], num_groups, scores.shape[-1] // num_groups)


def _eligible(group_scores: jax.Array, topk_groups: int, num_experts: int) -> jax.Array:
    """Group scores `[T, G]` -> bool `[T, E]`: whether each expert is in one of its row's `topk_groups` best
    groups."""
    _, best = jax.lax.top_k(group_scores, topk_groups)
    num_groups = group_scores.shape[-1]
    chosen = jnp.any(best[..., :, None] == jnp.arange(num_groups), axis=-2)  # [T, G]
    return jnp.repeat(chosen, num_experts // num_groups, axis=-1)


def tokens_per_expert(experts: jax.Array, num_experts: int) -> jax.Array:
    """How many (token, slot) pairs `experts` `[T, k]` routes to each expert: int32 `[num_experts]`."""
    return jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_BIASES = ("gate_proj_bias", "up_proj_bias", "down_proj_bias")  # `Experts`' with `MoEConfig.expert_bias`
_QUANTIZED = ("qweight", "scale")  # the leaves of a `pagedjax.model.layers.moe_quant.ExpertKernels`


@dataclass(frozen=True)
class GLU:
    """An expert's gated activation of its gate and up projections (`MoEConfig.activation`): "silu" is SwiGLU's
    silu(gate) * up; "clamped_swiglu" (gpt-oss) clamps gate to at most `limit` and up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1); "clamped_silu" (DeepSeek V4) clamps them alike, then silu(gate) * up.
    Static (a module attribute), computed in the inputs' dtype."""

    kind: str = "silu"
    alpha: float | None = None
    limit: float | None = None

    @classmethod
    def of(cls, moe: MoEConfig) -> GLU:
        return cls(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:  # both [..., width]
        if self.kind == "silu":
            return jax.nn.silu(gate) * up
        if self.kind not in ("clamped_swiglu", "clamped_silu"):
            raise ValueError(f"unknown MoE activation {self.kind!r}")
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        if self.kind == "clamped_silu":
            return jax.nn.silu(gate) * up
        return gate * jax.nn.sigmoid(gate * self.alpha) * (up + 1)


SWIGLU = GLU()  # Mixtral's, Qwen3-MoE's, DeepSeek's


def per_expert_params(state: nnx.State) -> nnx.State:
    """`state` (a model's parameters) with every stacked expert parameter (`experts.gate_proj`, `.up_proj`,
    `.down_proj`: `[E, width, hidden]`; their biases `[E, width]` / `[E, hidden]` where the experts have them) as a
    tuple of its E slices, each its own array (copied once, here); every other leaf the same array. `Experts`
    computes the same function from either form; from this one a single-device CPU step reads a routed expert's
    weights in place (`Experts.by_pair`).

    Quantized experts (`pagedjax.model.layers.moe_quant`): each projection's `qweight` and `scale` `[E, ...]` likewise
    become tuples of E per-expert arrays.

    The stacked form is the canonical one: checkpoints, loading and expert parallelism (which shards axis 0)
    use it. This form is for one device: its arrays are not sharded."""
    def split(path, leaf):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if names[-1] == "value":  # an nnx.Variable's own attribute
            names.pop()
        if len(names) >= 2 and names[-2] == "experts" and (
                (names[-1] in _PROJECTIONS and len(getattr(leaf, "shape", ())) == 3)
                or (names[-1] in _BIASES and len(getattr(leaf, "shape", ())) == 2)):
            return tuple(leaf[e] for e in range(leaf.shape[0]))
        if len(names) >= 3 and names[-3] == "experts" and names[-2] in _PROJECTIONS and names[-1] in _QUANTIZED:
            return tuple(leaf[e] for e in range(leaf.shape[0]))  # `QuantizedExperts`: values and scales alike
        return leaf
    return jax.tree_util.tree_map_with_path(split, state)


class Experts(nnx.Module):
    """`num_experts` SwiGLU MLPs, their weights stacked along axis 0 (the axis expert parallelism shards), each
    expert's three matrices `[width, hidden]`: gate_proj and up_proj `[E, width, hidden]` as (out, in), the layout
    of a torch Linear weight, and down_proj `[E, width, hidden]` as (in, out).

    Why this layout: all experts' gate (or up) rows then form one `[E * width, hidden]` matrix and all their down
    rows one `[E * width, hidden]` matrix, both mere reshapes (no copy), so every expert on every row (`every`)
    is three plain dots of the dense model's shapes at E times its width. With `[E, hidden, width]` gate / up
    weights that product is a dot batched over experts or needs a transposed copy of every expert's weights:
    4-5x slower at 16 rows on the bench_moe shape (scripts/bench_moe_layer.py).

    `bias` (gpt-oss): each projection adds its expert's bias, `gate_proj_bias` and `up_proj_bias` `[E, width]`
    and `down_proj_bias` `[E, hidden]`, to its rounded product. `glu`: the gated activation (`GLU`), SwiGLU by
    default.
    """

    def __init__(self, num_experts: int, hidden: int, width: int, dtype, rngs: nnx.Rngs, *, bias: bool = False,
                 glu: GLU = SWIGLU):
        self.gate_proj = nnx.Param(_INIT_OUT_IN(rngs.params(), (num_experts, width, hidden), dtype))
        self.up_proj = nnx.Param(_INIT_OUT_IN(rngs.params(), (num_experts, width, hidden), dtype))
        self.down_proj = nnx.Param(_INIT_IN_OUT(rngs.params(), (num_experts, width, hidden), dtype))
        zeros = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
        self.set_biases((zeros(num_experts, width), zeros(num_experts, width), zeros(num_experts, hidden))
                        if bias else None)
        self.glu = glu

    def set_biases(self, biases: tuple | None) -> None:
        """Hold `biases` (gate_proj_bias, up_proj_bias, down_proj_bias: `[E, width]`, `[E, width]`, `[E, hidden]`)
        as parameters, or none (None)."""
        for name, value in zip(_BIASES, biases or (None,) * len(_BIASES), strict=True):
            setattr(self, name, None if value is None else nnx.Param(value))

    def biases(self) -> tuple | None:
        """(gate_proj_bias, up_proj_bias, down_proj_bias): stacked arrays or, in the per-expert form, tuples of E
        arrays; None for experts without biases."""
        if self.gate_proj_bias is None:
            return None
        return tuple(getattr(self, name).get_value() for name in _BIASES)

    def apply(self, e: int, rows: jax.Array, product, biases: tuple | None) -> jax.Array:
        """Rows `[n, hidden]` through expert e (static), given `product(a, p)`: `a` times expert e's projection p
        (0 gate, 1 up, 2 down), rounded to rows' dtype, and `biases` (`biases()`'s, or None): `[n, hidden]`."""
        gate, up = product(rows, 0), product(rows, 1)
        if biases is not None:
            gate, up = gate + biases[0][e], up + biases[1][e]
        out = product(self.glu(gate, up), 2)
        return out if biases is None else out + biases[2][e]

    def grouped(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """Rows `x` `[N, hidden]` sorted by expert, `group_sizes[e]` of them expert e's (summing to N) ->
        each row through its expert `[N, hidden]`."""
        # 16-bit weights accumulate in float32 and each projection rounds once, as the dense layers do.
        # gate / up contract the rows' hidden axis (1) with the weights' last axis (2), grouped along axis 0;
        # down contracts the width with the weights' axis 1 (plain `ragged_dot`'s [E, in, out]).
        out_in = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                                   lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        # The per-expert form is stacked back here (a copy of every expert per call): it is the CPU's form, where
        # `MoEMLP` never picks this method by itself.
        stack = lambda w: jnp.stack(w) if isinstance(w, tuple) else w  # noqa: E731
        gate, up, down = (stack(w) for w in self.weights(x))
        mm = lambda a, w: jax.lax.ragged_dot_general(a, w, group_sizes, out_in,
                                                     preferred_element_type=jnp.float32).astype(x.dtype)
        gate, up = mm(x, gate), mm(x, up)
        biases = self.biases()
        if biases is not None:  # row r's expert: the group it falls in
            expert_of = jnp.repeat(jnp.arange(self.num_experts), group_sizes, total_repeat_length=x.shape[0])
            gate_bias, up_bias, down_bias = (stack(b)[expert_of] for b in biases)
            gate, up = gate + gate_bias, up + up_bias
        out = jax.lax.ragged_dot(self.glu(gate, up), down, group_sizes,
                                 preferred_element_type=jnp.float32).astype(x.dtype)
        return out if biases is None else out + down_bias

    def by_pair(self, x: jax.Array, experts: jax.Array) -> jax.Array:
        """Row p of `x` `[P, hidden]` through expert `experts[p]` (int32 `[P]`): `[P, hidden]`, one `lax.switch`
        per row whose branch e multiplies by expert e's weights alone (no product with an expert the row is not
        routed to). For few rows on the CPU (module docstring).

        The weights are operands of the switch and branch e takes expert e's: with the weights captured from
        outside instead, XLA:CPU slices every expert before the switch (all E experts' bytes copied per row: 4x
        slower measured on the bench_moe expert shape). From the stacked form a branch still copies its expert's
        slice before the dots (an XLA:CPU dot reads whole buffers: 2-3x the dense model's time at one row); from
        the per-expert form (`per_expert_params`) it reads the expert's own arrays in place.
        """
        branches = [functools.partial(lambda e, row, *operands: self.expert_mlp(e, row, operands), e)
                    for e in range(self.num_experts)]
        operands = self.switch_operands()
        return jnp.concatenate([jax.lax.switch(experts[p], branches, x[p:p + 1], *operands)
                                for p in range(x.shape[0])])

    def by_tile(self, tiles: jax.Array, tile_experts: jax.Array) -> jax.Array:
        """Tiles of rows `[S, R, hidden]`, tile s all expert `tile_experts[s]`'s (int32 `[S]`; `num_experts`: an
        unused tile, whose rows come back zero without a product) -> each row through its tile's expert, `[S, R,
        hidden]`. A loop over the tiles, each one `lax.switch` whose branch e reads expert e's weights alone, as
        `by_pair`'s rows do (its docstring: the weights are the switch's operands)."""
        branches = [functools.partial(lambda e, tile, *operands: self.expert_mlp(e, tile, operands), e)
                    for e in range(self.num_experts)]
        branches.append(lambda tile, *operands: jnp.zeros_like(tile))
        operands = self.switch_operands()
        return jax.lax.map(lambda args: jax.lax.switch(args[0], branches, args[1], *operands), (tile_experts, tiles))

    def every(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        """Every row `x` `[N, hidden]` through every expert, expert e's output weighted by `combine[:, e]`
        (float32 `[N, E]`) and summed: `[N, hidden]`. Stacked: three dots over all experts at once (class
        docstring); per-expert form: three dots per expert."""
        # The routing weights scale each expert's hidden activations before down_proj (linear, so the same as
        # scaling its output), which lets the down dots sum over experts and width together.
        # With biases, each expert's down bias is weighted likewise: `combine` times the stacked down biases.
        mm = lambda a, w, dtype=x.dtype: jnp.matmul(a, w, preferred_element_type=jnp.float32).astype(dtype)
        gate, up, down = self.weights(x)
        biases = self.biases()
        if isinstance(gate, tuple):
            y = jnp.zeros((x.shape[0], down[0].shape[1]), jnp.float32)
            for e in range(self.num_experts):
                g, u = mm(x, gate[e].T), mm(x, up[e].T)
                if biases is not None:
                    g, u = g + biases[0][e], u + biases[1][e]
                y += mm((self.glu(g, u) * combine[:, e:e + 1]).astype(x.dtype), down[e], jnp.float32)
            if biases is not None:
                y += combine @ jnp.stack(biases[2]).astype(jnp.float32)
            return y.astype(x.dtype)
        num_experts, width, hidden = gate.shape
        flat = lambda w: w.reshape(num_experts * width, hidden)  # a bitcast: the stacking is row-major
        g, u = mm(x, flat(gate).T), mm(x, flat(up).T)  # [N, E * width]
        if biases is not None:
            g, u = g + biases[0].reshape(-1), u + biases[1].reshape(-1)
        h = (self.glu(g, u).reshape(-1, num_experts, width) * combine[:, :, None]).astype(x.dtype)
        if biases is None:
            return mm(h.reshape(-1, num_experts * width), flat(down))
        y = mm(h.reshape(-1, num_experts * width), flat(down), jnp.float32)
        return (y + combine @ biases[2].astype(jnp.float32)).astype(x.dtype)

    def weights(self, x: jax.Array | None = None) -> tuple:
        """(gate_proj, up_proj, down_proj): each the stacked array `[E, width, hidden]` or, in the per-expert form
        (`per_expert_params`), a tuple of E arrays `[width, hidden]`. x: the rows they multiply (unused here;
        `QuantizedExperts` converts its weights to x's dtype, tied to x)."""
        return self.gate_proj.get_value(), self.up_proj.get_value(), self.down_proj.get_value()

    def switch_operands(self) -> tuple:
        """The operands of `by_pair`'s switch, from which branch e's `expert_mlp` reads expert e's: the weights,
        then the biases where the experts have them."""
        return self.weights() + (self.biases() or ())

    def expert_mlp(self, e: int, row: jax.Array, operands: tuple) -> jax.Array:
        """Rows `row` `[n, hidden]` through expert e, whose weights it reads from `switch_operands` (branch e of
        `by_pair`'s switch, n = 1, and of `by_tile`'s, a tile): `[n, hidden]` in row's dtype, each projection
        accumulated in float32 and rounded once."""
        weights, biases = operands[:3], operands[3:] or None
        mm = lambda a, w: jnp.matmul(a, w, preferred_element_type=jnp.float32).astype(row.dtype)  # noqa: E731
        return self.apply(e, row, lambda a, p: mm(a, weights[p][e] if p == 2 else weights[p][e].T), biases)

    @property
    def num_experts(self) -> int:
        return len(self.gate_proj.get_value())


class MoEMLP(nnx.Module):
    """A decoder layer's MLP as a mixture of experts (`ModelConfig.moe`; see the module docstring). Parameters:
    `gate` (the router, a linear layer `[hidden, E]`) and `experts` (`Experts`, or `QuantizedExperts` in a
    quantized model: `pagedjax.model.layers.moe_quant.moe_mlp` builds those; a config that quantizes the experts is a
    ValueError here)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        if cfg.quantization is not None and "experts" not in cfg.quantization.keep_float:
            raise ValueError(f"MoEMLP holds float experts, ModelConfig.quantization {cfg.quantization.name!r} "
                             "quantized ones: build it with pagedjax.model.layers.moe_quant.moe_mlp")
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.num_experts_per_tok
        self.router, self.norm_topk_prob = moe.router, moe.norm_topk_prob
        self.gate = nnx.Linear(cfg.hidden_size, moe.num_experts, use_bias=moe.router_bias, dtype=dtype,
                               param_dtype=dtype, preferred_element_type=jnp.float32, rngs=rngs)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, dtype, rngs,
                               bias=moe.expert_bias, glu=GLU.of(moe))

    def routing(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rows x `[N, hidden]` -> (weights float32 `[N, k]`, experts int32 `[N, k]`)."""
        # The logits are rounded to the model's dtype before the softmax, as transformers computes them.
        logits = self.gate(x).astype(x.dtype).astype(jnp.float32)
        return route(logits, self.top_k, self.router, self.norm_topk_prob)

    def __call__(self, x: jax.Array, method: str | None = None) -> jax.Array:
        """x `[..., hidden]` -> `[..., hidden]` by `combine_experts` (`method`: its computation, None for the
        backend's)."""
        weights, experts = self.routing(x.reshape(-1, x.shape[-1]))
        return combine_experts(self.experts, x, weights, experts, method)

    def dense(self, x: jax.Array, counts: list | None = None) -> jax.Array:
        """The reference: like `__call__`, with every expert computed on every row and weighted by zero unless
        routed to. `counts`: a list to which this layer's tokens per expert (int32 `[E]`) are appended."""
        rows = x.reshape(-1, x.shape[-1])
        weights, experts = self.routing(rows)
        if counts is not None:
            counts.append(tokens_per_expert(experts, self.num_experts))
        return combine_experts(self.experts, x, weights, experts, "every")


def combine_experts(experts: Experts, x: jax.Array, weights: jax.Array, chosen: jax.Array,
                    method: str | None = None) -> jax.Array:
    """x `[..., hidden]`, its rows' routing (weights float32 `[N, k]`, experts int32 `[N, k]`) -> each row's
    experts' outputs summed with its weights, `[..., hidden]` in x's dtype. `experts`: an `Experts` (or
    `QuantizedExperts`). `method` (static): "grouped" (grouped matmuls over the rows sorted by expert),
    "by_pair" (each (token, expert) pair by its expert alone), "tiled" (the pairs sorted by expert in tiles, each
    tile by its expert alone) or "every" (every expert on every row, weighted by zero unless routed to: the
    reference); None picks "grouped" on GPU / TPU and `cpu_method`'s on the CPU (module docstring). All four
    compute the same function."""
    lead, hidden = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, hidden)
    top_k, num_experts = chosen.shape[-1], experts.num_experts
    flat = chosen.reshape(-1)  # [N * k]: slot j of token t is pair t * k + j
    if method is None:
        method = "grouped" if jax.default_backend() != "cpu" else cpu_method(
            rows.shape[0], top_k, num_experts, per_expert=isinstance(experts.switch_operands()[0], tuple))
    if method == "every":
        combine = jnp.zeros((rows.shape[0], num_experts), jnp.float32)
        combine = combine.at[jnp.arange(rows.shape[0])[:, None], chosen].add(weights)
        return experts.every(rows, combine).reshape(x.shape)
    if method == "by_pair":
        out = experts.by_pair(jnp.repeat(rows, top_k, axis=0), flat)
    elif method == "grouped":
        order = jnp.argsort(flat, stable=True)  # the pairs grouped by expert
        group_sizes = tokens_per_expert(chosen, num_experts)
        out = experts.grouped(rows[order // top_k], group_sizes)
        out = jnp.zeros_like(out).at[order].set(out)  # back in pair order
    elif method == "tiled":
        out = _by_tiles(experts, rows, flat, top_k)
    else:
        raise ValueError(f"MoEMLP: unknown method {method!r} (grouped, by_pair, tiled, every)")
    y = jnp.einsum("nk,nkh->nh", weights, out.reshape(-1, top_k, hidden).astype(jnp.float32))
    return y.astype(x.dtype).reshape(*lead, hidden)


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """The rows of a "tiled" tile: the power of two nearest the pairs per expert, within 32..128 (measured with
    scripts/bench_moe_layer.py: tiles much larger than an expert's run are mostly padding; smaller ones cost a loop
    iteration each and a small dot, and tiles of 16 were slower than every expert on every row even where they did
    a third of its arithmetic)."""
    mean = max(num_pairs / num_experts, 1.0)
    return int(min(max(2 ** round(math.log2(mean)), 32), 128))


def cpu_method(num_rows: int, top_k: int, num_experts: int, *, per_expert: bool) -> str:
    """The CPU's computation for `num_rows` rows (module docstring): "by_pair" for fewer pairs than experts;
    "tiled" for experts in the per-expert form when its rows, the pairs plus a tile per expert at most, are under
    half of "every"'s `num_rows * num_experts`; else "every"."""
    pairs = num_rows * top_k
    if pairs < num_experts:
        return "by_pair"
    tiled_rows = pairs + min(num_experts, pairs) * tile_rows(pairs, num_experts)
    return "tiled" if per_expert and 2 * tiled_rows < num_rows * num_experts else "every"


def _by_tiles(experts: Experts, rows: jax.Array, flat: jax.Array, top_k: int) -> jax.Array:
    """Each (token, expert) pair of `flat` (int32 `[P]`, pair t * top_k + j: token t's j-th expert) through its
    expert: `[P, hidden]`, in pair order. The pairs sorted by expert, expert e's run padded with zero rows to whole
    tiles from `starts[e]`; `S` tiles in all, a static bound (the pairs' tiles plus one partial tile per expert
    that has pairs), those past the last run unused."""
    num_pairs, num_experts, hidden = flat.shape[0], experts.num_experts, rows.shape[-1]
    size = tile_rows(num_pairs, num_experts)
    num_tiles = -(-num_pairs // size) + min(num_experts, num_pairs)
    order = jnp.argsort(flat, stable=True)  # the pairs grouped by expert
    counts = tokens_per_expert(flat, num_experts)
    padded = (counts + size - 1) // size * size
    ends = jnp.cumsum(padded)  # expert e's tiles cover rows [ends[e] - padded[e], ends[e])
    runs = jnp.cumsum(counts) - counts  # expert e's first pair in sorted order
    expert_of = flat[order]
    slot = ends[expert_of] - padded[expert_of] + jnp.arange(num_pairs, dtype=jnp.int32) - runs[expert_of]
    tiles = jnp.zeros((num_tiles * size, hidden), rows.dtype).at[slot].set(rows[order // top_k])
    # Tile s holds expert e's rows when ends[e - 1] <= s * size < ends[e]; num_experts past the last run.
    tile_experts = jnp.searchsorted(ends, jnp.arange(num_tiles, dtype=jnp.int32) * size, side="right")
    out = experts.by_tile(tiles.reshape(num_tiles, size, hidden), tile_experts.astype(jnp.int32))
    return jnp.zeros((num_pairs, hidden), out.dtype).at[order].set(out.reshape(-1, hidden)[slot])
