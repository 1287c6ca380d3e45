"""LoRA on the built-in models' linears, many adapters in one batch: pure functions over a pytree of stacked
adapter weights.

Every target linear of every layer holds A `[in, num_slots, r]` and B `[num_slots, r, out]` (float32), one slot
per adapter resident on the device, slot 0 all zeros (the base model), every adapter zero-padded to the slots'
rank r (zero columns of A and rows of B add nothing). A step carries one slot index per token; a linear computes
`y = x W + scale[slot] * (x A[slot]) B[slot]`. Which adapter sits in which slot is only array contents, so
loading, swapping and unloading adapters never changes a compiled program.

A token's delta depends on its own slot only: no arithmetic mixes another slot's numbers into it in a way that
could carry NaN or Inf, so an adapter (or a slot's stale contents) whose weights overflow or hold NaN spoils its
own tokens and no one else's, validation or not (`pagedjax.lora.peft` refuses such adapters at load besides).
Three forms of the per-token product, the same numbers up to summation order:
  `gathered_delta`  gathers each token's A and B (Punica's BGMV: a matrix-vector product per token);
  `selected_delta`  multiplies every token by every slot's A and B (num_slots x the LoRA flops, no gather), then
                    takes each token's row of its own slot's product: other slots' products are computed and
                    never read;
  `grouped_delta`   multiplies every token by every slot's A, keeps its own slot's columns by a select (not a
                    multiply by zero: NaN x 0 is NaN), then one product with all slots' B stacked, whose NaN and
                    infinities are selected to zero first: another slot's columns add exact zeros (0 x a finite
                    number) to a token's sums, which leave every nonzero sum as it is.
`lora_delta`, the model's, is `selected_delta` for steps of few tokens (decode) and `grouped_delta` for more
(prefill), by the step's static token count; `scripts/bench_lora.py --forms` measures them. A is stored with the
slots in the middle so that `x A` over every slot is one plain product `[T, in] x [in, num_slots * r]` and
`(x A) B` one `[T, num_slots * r] x [num_slots * r, out]`: both stacks are read as they lie (stored
`[num_slots, in, r]`, every step began with a transposed copy of each A).

Over a tensor-parallel mesh the stacks are split as their base linear (`pagedjax.parallel.sharding.lora_spec`):
B by output columns under a column-sharded base, A by input rows under a row-sharded one; the model's code is
the same, XLA inserts the collectives (for a row-sharded base, one all-reduce of the base's partial product and
the adapters' partial `x A` together).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pagedjax.config import ModelConfig
from pagedjax.config.parallel import TP
from pagedjax.parallel.sharding import lora_spec

# The linears an adapter may target, under their Hugging Face names (PEFT's target_modules), in layer order.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target linear of a built-in dense model of `cfg` (the same in every layer)."""
    h, d, w = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, cfg.num_q_heads * d), "k_proj": (h, cfg.num_kv_heads * d),
            "v_proj": (h, cfg.num_kv_heads * d), "o_proj": (cfg.num_q_heads * d, h),
            "gate_proj": (h, w), "up_proj": (h, w), "down_proj": (w, h)}


class LoRAWeights(NamedTuple):
    """Every slot's adapter weights. `a[i][name]` f32 `[in, num_slots, r]`, `b[i][name]` f32 `[num_slots, r, out]`
    for layer i and target `name`; `scales` f32 `[num_slots]` (slot 0: 0). Slot 0 is zeros and stays so."""

    a: tuple[dict[str, jax.Array], ...]
    b: tuple[dict[str, jax.Array], ...]
    scales: jax.Array


def lora_partition(cfg: ModelConfig, tp: int) -> LoRAWeights:
    """The PartitionSpec of every stack of a model of `cfg` over `tp` devices, as a `LoRAWeights` of specs."""
    layer = lambda factor: {m: lora_spec(cfg, m, factor, tp) for m in TARGET_MODULES}
    return LoRAWeights(tuple(layer("a") for _ in range(cfg.num_layers)),
                       tuple(layer("b") for _ in range(cfg.num_layers)), P())


def init_lora_weights(cfg: ModelConfig, num_slots: int, rank: int, mesh: Mesh | None = None) -> LoRAWeights:
    """All slots empty (zeros) for a model of `cfg`; over `mesh`, each stack created in place as its
    `lora_partition` splits it (no device holds more than its part)."""
    shapes = target_shapes(cfg)
    specs = lora_partition(cfg, 1 if mesh is None else mesh.shape[TP])
    at = (lambda spec: None) if mesh is None else (lambda spec: NamedSharding(mesh, spec))
    a = tuple({m: jnp.zeros((i, num_slots, rank), jnp.float32, device=at(spec[m])) for m, (i, _) in shapes.items()}
              for spec in specs.a)
    b = tuple({m: jnp.zeros((num_slots, rank, o), jnp.float32, device=at(spec[m])) for m, (_, o) in shapes.items()}
              for spec in specs.b)
    return LoRAWeights(a, b, jnp.zeros((num_slots,), jnp.float32, device=at(specs.scales)))


def lora_weights_nbytes(cfg: ModelConfig, rank: int) -> int:
    """Device bytes of one slot (one adapter resident) of a model of `cfg` at slot rank `rank`."""
    return 4 * (cfg.num_layers * rank * sum(i + o for i, o in target_shapes(cfg).values()) + 1)


def _write_slot(weights: LoRAWeights, slot, a, b, scale) -> LoRAWeights:
    return LoRAWeights(
        tuple({m: layer[m].at[:, slot].set(new[m]) for m in layer} for layer, new in zip(weights.a, a, strict=True)),
        tuple({m: layer[m].at[slot].set(new[m]) for m in layer} for layer, new in zip(weights.b, b, strict=True)),
        weights.scales.at[slot].set(scale))


# One program for every slot and adapter (the slot is traced); the old stacks are donated: updated in place.
write_slot = jax.jit(_write_slot, donate_argnums=(0,))
write_slot.__doc__ = """`weights` with slot `slot` (an int32 scalar, >= 1) holding `a`, `b` (per layer, per target:
`[in, r]`, `[r, out]` float32, zeros where the adapter has no weights) and `scale` (float32)."""


def slot_writer(cfg: ModelConfig, mesh: Mesh | None):
    """`write_slot` for the stacks of a model of `cfg` placed by `init_lora_weights(..., mesh)`: over a mesh, one
    program (compiled at the first write) that takes the host arrays `a`, `b` (tuples of per-layer dicts) split
    as their stacks are, so each device receives only its part of the adapter, and leaves every stack where it
    was; without one, `write_slot` itself."""
    if mesh is None:
        return write_slot
    specs = lora_partition(cfg, mesh.shape[TP])
    named = lambda spec: NamedSharding(mesh, spec)
    stacks = jax.tree.map(named, specs, is_leaf=lambda x: isinstance(x, P))
    # One slot's `[in, r]` / `[r, out]`: its stack's spec without the slots' axis (A's 1, B's 0).
    one_slot = lambda layers, axis: tuple({m: named(P(*spec[:axis], *spec[axis + 1:])) for m, spec in layer.items()}
                                          for layer in layers)
    replicated = named(P())
    return jax.jit(_write_slot, donate_argnums=(0,), out_shardings=stacks,
                   in_shardings=(stacks, replicated, one_slot(specs.a, 1), one_slot(specs.b, 0), replicated))


def gathered_delta(x: jax.Array, a: jax.Array, b: jax.Array, scales: jax.Array, slots: jax.Array) -> jax.Array:
    """x `[T, in]`, a `[in, N, r]`, b `[N, r, out]`, scales `[N]`, slots i32 `[T]` -> f32 `[T, out]`:
    `scales[s] * (x A[s]) B[s]` of each token's slot s, by gathering each token's A and B."""
    xa = jnp.einsum("ti,itr->tr", x.astype(jnp.float32), a[:, slots])
    return jnp.einsum("tr,tro->to", xa * scales[slots][:, None], b[slots])


def _every_slot(x: jax.Array, a: jax.Array, scales: jax.Array) -> jax.Array:
    """x `[T, in]`, a `[in, N, r]`, scales `[N]` -> f32 `[T, N, r]`: `scales[n] * x A[n]` of every token and slot;
    column block n is computed from slot n's A and scale alone."""
    return jnp.einsum("ti,inr->tnr", x.astype(jnp.float32), a) * scales[None, :, None]


def selected_delta(x: jax.Array, a: jax.Array, b: jax.Array, scales: jax.Array, slots: jax.Array) -> jax.Array:
    """As `gathered_delta`, by every slot's product of every token, each token's row of its own slot's taken."""
    by_slot = jnp.einsum("tnr,nro->nto", _every_slot(x, a, scales), b)  # [N, T, out]: slot n's alone
    return jnp.take_along_axis(by_slot, slots[None, :, None], axis=0)[0]


def grouped_delta(x: jax.Array, a: jax.Array, b: jax.Array, scales: jax.Array, slots: jax.Array) -> jax.Array:
    """As `gathered_delta`, by one product of each token's own slot's columns of `x A` (the others selected to
    zero) with every slot's B (its NaN and infinities selected to zero)."""
    own = slots[:, None] == jnp.arange(a.shape[1])[None, :]  # [T, N]
    xa = jnp.where(own[:, :, None], _every_slot(x, a, scales), 0.0)
    return jnp.einsum("tnr,nro->to", xa, jnp.where(jnp.isfinite(b), b, 0.0))


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, scales: jax.Array, slots: jax.Array) -> jax.Array:
    """The model's form (module docstring): `selected_delta` for a step of at most 2r tokens, else
    `grouped_delta`. Beyond the LoRA products' own work, `selected_delta` writes and reads num_slots x T x out
    numbers and `grouped_delta` rewrites B (num_slots x r x out), so they cross near T = 2r. Measured on the CPU,
    one layer of the 156M shape (its 7 linears, r = 16, 5 slots, random slots per token; `python
    scripts/bench_lora.py --forms`, and `--batch 512`; a shared 2-core machine, median CPU ms of 30): at 16
    tokens (decode) base 7.9, selected 9.5, grouped 9.7, gathered 13.0; at 512 (prefill) base 81.8, selected
    167.2, grouped 104.2, gathered 361.9. The former form (a one-hot multiply, which let NaN x 0 reach every
    token) timed beside them in one run: 10.1 at 16 tokens (selected 10.1), 101.1 at 512 (grouped 103.6)."""
    form = selected_delta if x.shape[0] <= 2 * a.shape[2] else grouped_delta
    return form(x, a, b, scales, slots)


class LayerLoRA(NamedTuple):
    """One layer's view of a step's adapters: its targets' stacks, the slots' scales, each token's slot, and
    whether any token has an adapter."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    scales: jax.Array
    slots: jax.Array
    any_adapter: jax.Array  # bool[]

    def apply(self, name: str, linear, x: jax.Array) -> jax.Array:
        """Target linear `name`'s output `linear(x)` (`[T, out]`) plus its adapters' `scale * (x A) B`, in the
        output's dtype. A step of base-model tokens only skips the products (a branch taken on device: one program
        either way). The base product is computed inside the branch with the delta, so that under a row-sharded
        base XLA reduces its partial product and the adapters' partial `x A` in one all-reduce (collectives are
        combined within a branch, not across one)."""
        def with_delta():
            y = linear(x)
            d = lora_delta(x, self.a[name], self.b[name], self.scales, self.slots)
            return (y.astype(jnp.float32) + d).astype(y.dtype)
        return jax.lax.cond(self.any_adapter, with_delta, lambda: linear(x))


class LoRABatch(NamedTuple):
    """A step's adapters: the resident weights and each token's slot i32 `[T]` (0 = base model)."""

    weights: LoRAWeights
    slots: jax.Array

    def layer(self, i: int) -> LayerLoRA:
        return LayerLoRA(self.weights.a[i], self.weights.b[i], self.weights.scales, self.slots, jnp.any(self.slots > 0))


def with_lora(linear, name: str, x: jax.Array, lora: LayerLoRA | None) -> jax.Array:
    """`linear(x)` (any of the built-in linears, float or quantized), plus its adapters' delta when `lora`."""
    return linear(x) if lora is None else lora.apply(name, linear, x)

