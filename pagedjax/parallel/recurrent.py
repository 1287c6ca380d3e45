"""Recurrent-state layers (gated DeltaNet, Mamba-2) under tensor parallelism: their per-step core (the causal
conv over their channels, the scan over their heads, the snapshots written) as a `shard_map` over the `tp` axis,
each device running the unchanged single-device kernels (Pallas or the XLA path) over its own heads.

No collective is needed inside: a head's conv channels, decay, state and output are its own. Each device holds the
snapshots of its heads (`RecurrentState.heads_axis`: the state `[blocks, heads, ...]` and the conv window
`[blocks, channels, K - 1]` split along axis 1). A device's conv channels are the channels of its heads in the
layer's own order (gated DeltaNet: its key heads' q, then k, then its value heads' v; Mamba-2: its heads' x, then
its groups' B, then C), so the global conv window's channels are device 0's, then device 1's, ...: another order
than one device's, which no one reads but the layer itself (snapshots never move between engines).

`over_heads(core, mesh, split, whole, pages, meta)`: `core(*split, *whole, pages, meta)` per device, with each
array of `split` divided along its heads axis (`split_axes`: axis 1 for per-token `[T, heads, ...]`, axis 0 for
per-head parameters `[heads, ...]`), `whole` on every device, pages by their heads axis; it returns (out `[T,
heads, ...]` split by heads, the pages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pagedjax.config.parallel import TP


def axis_spec(axis: int) -> P:
    """Split along `axis` (the rest whole)."""
    return P(*(None,) * axis, TP)


def over_heads(core: Callable, mesh: Mesh, split: Sequence, split_axes: Sequence[int], whole: Sequence, pages,
               meta) -> tuple:
    """Run `core(*split, *whole, pages, meta) -> (out, pages)` on each device of `mesh` over its heads (module
    docstring); an entry of `split` or `whole` may be None (a spec over no arrays)."""
    if len(split) != len(split_axes):
        raise ValueError(f"over_heads: {len(split)} split arrays, {len(split_axes)} axes")
    pages_spec = jax.tree.map(lambda _: axis_spec(1), pages)
    in_specs = (*(axis_spec(a) for a in split_axes), *(P() for _ in whole), pages_spec, P())
    # check_vma off: pallas_call has no replication typing; every operand's spec is stated explicitly here.
    run = jax.shard_map(core, mesh=mesh, in_specs=in_specs, out_specs=(axis_spec(1), pages_spec), check_vma=False)
    return run(*split, *whole, pages, meta)
