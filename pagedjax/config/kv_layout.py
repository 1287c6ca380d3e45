"""KV cache groups: which layers share a block table, and which page arrays back them (`ModelSpec.kv_layout`).

Layers whose specs (`pagedjax.config.kv_spec`) release blocks by the same rule form a KV cache group: one block
table per request per group, one release rule per group (a window group releases the blocks its window left while
a full group keeps all of its own). A group may hold layers of several page layouts (MLA latent layers beside GQA
ones keep every block alike: one table serves them, as before groups). Every group draws its blocks from the one
pool (one allocator, one LRU, one hash index); a block belongs to one group at a time, so memory moves freely
between kinds as requests come and go.

The pool's memory is shared the way vLLM's hybrid KV cache manager shares it: per page layout the cache holds
`S_L` page arrays (slots) of `num_blocks` blocks each, and the i-th layer of layout L of every group lives in slot
i of L. A block id handed to a group is that block in every slot, so one block costs the same bytes whichever group
holds it, and a group holding a block uses it in each of its layers. So that groups are about as large as each
other, a rule's layers may be split into several groups (equal rules, separate tables), and a group with fewer
layers of a layout than its slots leaves those unused in its blocks (padding). The split is chosen as the group
size that leaves the groups keeping every block unpadded (they hold nearly all of a long context's KV) and makes
the fewest groups with at most 15% of a block's bytes padding (`_grouping`): gpt-oss (12 window + 12 full layers)
gets 2 groups of 12, Gemma 3 27B (52 local + 10 global) 7 groups of 10 (8 padded slots in the window groups), a
model whose layers all keep every block one group of all its layers (slot i is layer i, the one-table case).

Recurrent states (`RecurrentState`: gated DeltaNet, Mamba-2) keep one snapshot per block, hundreds of times a
block of K/V: their groups draw from a pool of their own ("state", `KVCacheLayout.pools`), whose blocks are that
large and as many as the sequences need, so that the KV blocks stay small. Each pool has its own allocator, LRU and
hash index, and its own page arrays; a prefix hit is still one that every group of every pool serves. DeepSeek V4's
windows (`SharedKVWindow`) are such a pool too ("window"): a sequence holds a few of their blocks, each a window
layer's K = V of `block_size` tokens, 4 to 128 times the bytes of a block of the compressed entries that are its
context's KV; sharing one pool, every entry block would carry a window block's bytes unused.

Plain Python, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config.kv_spec import KVCacheSpec

# The most of all blocks' bytes the groups may leave unused (padding) to be fewer: Gemma 3 27B's 7 groups of 10 pad
# 8 of 70 slots (11%), all in window groups, which hold little of a long context (13 groups of 5 would pad 3).
MAX_PADDING = 0.15


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share a block table: `layers` (model layer indices, ascending), their `slots` (the page array
    each lives in), the `pool` their blocks come from (an index into `KVCacheLayout.pools`); `spec` the first
    layer's (every layer of the group releases blocks as it does)."""

    spec: KVCacheSpec
    layers: tuple[int, ...]
    slots: tuple[int, ...]
    pool: int = 0


@dataclass(frozen=True)
class KVCacheLayout:
    """A model's KV cache groups and page arrays. `groups` in the order of their first layer; `slot_specs[s]` the
    spec whose page shapes slot s has (the first spec of its layout) and `slot_pools[s]` the pool whose blocks it
    holds; `layer_group[l]` and `layer_slot[l]` layer l's group and slot; `pools` the block pools' names ("kv"
    first where there is one: token pages; "state": recurrent state snapshots)."""

    groups: tuple[KVCacheGroup, ...]
    slot_specs: tuple[KVCacheSpec, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    slot_pools: tuple[int, ...] = ()
    pools: tuple[str, ...] = ("kv",)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's release window (`KVCacheSpec.release_window`; None: it keeps every block)."""
        return tuple(g.spec.release_window for g in self.groups)

    @property
    def group_pools(self) -> tuple[int, ...]:
        """Each group's pool (an index into `pools`)."""
        return tuple(g.pool for g in self.groups)

    def bytes_per_block(self, block_size: int, element_bytes: int, scale_bytes: int = 0, pool: int = 0) -> int:
        """Bytes of one physical block of pool `pool`: its share of every slot of that pool."""
        return sum(spec.bytes_per_block(block_size, element_bytes, scale_bytes)
                   for spec, p in zip(self.slot_specs, self.slot_pools, strict=True) if p == pool)

    def group_name(self, g: int) -> str:
        """Group g's rule and kinds: "window-W" or "full" (it keeps every block), "full" replaced by its layers'
        kinds where those are others ("latent", "full/latent/sparse"); "state" for recurrent states."""
        group = self.groups[g]
        kinds = sorted({self.slot_specs[slot].kind for slot in group.slots})
        if group.spec.sliding_window is not None:
            return f"window-{group.spec.sliding_window}"
        return "/".join(kinds)

    def describe(self) -> str:
        """One line naming the groups, e.g. "2 groups: 12 full layers, 12 window-128 layers" or
        "7 groups: 52 window-1024 layers (6 groups), 10 full layers"."""
        kinds: dict[str, list[int]] = {}  # name -> [layers, groups]
        for g, group in enumerate(self.groups):
            entry = kinds.setdefault(self.group_name(g), [0, 0])
            entry[0] += len(group.layers)
            entry[1] += 1
        parts = [f"{n} {name} layer{'s' * (n != 1)}" + (f" ({k} groups)" if k > 1 else "")
                 for name, (n, k) in kinds.items()]
        return f"{self.num_groups} group{'s' * (self.num_groups != 1)}: {', '.join(parts)}"


def _rule(spec: KVCacheSpec):
    """What a group's layers share: how their blocks are released (a window, or none)."""
    return spec.release_window


def _split(layers: list[int], parts: int) -> list[list[int]]:
    """`layers` in `parts` consecutive runs whose lengths differ by at most one (the longer first)."""
    size, extra = divmod(len(layers), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(layers[start:end])
        start = end
    return out


def _grouping(kv_layers: tuple[KVCacheSpec, ...], layers: list[int]) -> list[list[int]]:
    """The groups (lists of layer indices) of `layers` (those of one pool): each rule's layers in as many groups as a
    target size needs, each layout's layers spread evenly over them. The target size is chosen, in this order: (1)
    no padding (bytes of unused slots) in the groups that keep every block, which hold a long context's KV almost
    alone; (2) padding within `MAX_PADDING` of all blocks' bytes; (3) the fewest groups (each a block table a step
    builds and the host keeps); (4) the least padding."""
    rules: dict = {}
    for i in layers:
        spec = kv_layers[i]
        rules.setdefault(_rule(spec), {}).setdefault(spec.page_layout, []).append(i)
    weight = {layout: max(layout.bytes_per_block(16, 1), 1) for by_layout in rules.values() for layout in by_layout}
    candidates = []
    for size in range(1, max(sum(map(len, by_layout.values())) for by_layout in rules.values()) + 1):
        groups: list[tuple[object, dict]] = []
        for rule, by_layout in rules.items():
            parts = -(-sum(map(len, by_layout.values())) // size)
            runs = {layout: _split(layers, parts) for layout, layers in by_layout.items()}
            groups += [(rule, {layout: runs[layout][j] for layout in by_layout}) for j in range(parts)]
        slots = {layout: max(len(g.get(layout, ())) for _, g in groups) for layout in weight}
        block = sum(slots[layout] * weight[layout] for layout in weight)
        unused = {id(g): block - sum(len(layers) * weight[layout] for layout, layers in g.items()) for _, g in groups}
        padding = sum(unused.values()) / (len(groups) * block)
        full_padded = any(unused[id(g)] for rule, g in groups if rule is None)
        candidates.append(((full_padded, padding > MAX_PADDING, len(groups), padding, size), groups))
    groups = min(candidates, key=lambda c: c[0])[1]
    return [sorted(i for layers in g.values() for i in layers) for _, g in groups]


def kv_cache_layout(kv_layers: tuple[KVCacheSpec, ...]) -> KVCacheLayout:
    """Group `kv_layers` (one spec per layer) and lay out their page arrays (see the module docstring)."""
    by_pool: dict[str, list[int]] = {}
    for i, spec in enumerate(kv_layers):
        by_pool.setdefault(spec.pool, []).append(i)
    pools = sorted(by_pool, key=lambda name: (name != "kv", by_pool[name][0]))  # "kv" first, then by first layer
    groups = sorted(((pools.index(name), layers) for name in pools for layers in _grouping(kv_layers, by_pool[name])),
                    key=lambda g: g[1][0])  # in the order of their first layer
    # Slots: per pool and layout, as many as the most layers of it one group has; slot i of a layout holds the i-th
    # layer of that layout of every group of its pool. Layouts in the order of their first layer.
    counts: dict[tuple[int, KVCacheSpec], int] = {}
    first_spec: dict[tuple[int, KVCacheSpec], KVCacheSpec] = {}
    for pool, layers in groups:
        per_layout: dict[KVCacheSpec, int] = {}
        for i in layers:
            layout = kv_layers[i].page_layout
            per_layout[layout] = per_layout.get(layout, 0) + 1
            first_spec.setdefault((pool, layout), kv_layers[i])
        for layout, n in per_layout.items():
            counts[pool, layout] = max(counts.get((pool, layout), 0), n)
    first_layer = {key: min(i for i, s in enumerate(kv_layers) if (pools.index(s.pool), s.page_layout) == key)
                   for key in counts}
    base, slot_specs, slot_pools = {}, [], []
    for key in sorted(counts, key=lambda key: (key[0], first_layer[key])):
        base[key] = len(slot_specs)
        slot_specs += [first_spec[key]] * counts[key]
        slot_pools += [key[0]] * counts[key]
    layer_group = [0] * len(kv_layers)
    layer_slot = [0] * len(kv_layers)
    out = []
    for g, (pool, layers) in enumerate(groups):
        seen: dict[KVCacheSpec, int] = {}
        slots = []
        for i in layers:
            layout = kv_layers[i].page_layout
            slots.append(base[pool, layout] + seen.get(layout, 0))
            seen[layout] = seen.get(layout, 0) + 1
            layer_group[i], layer_slot[i] = g, slots[-1]
        out.append(KVCacheGroup(kv_layers[layers[0]], tuple(layers), tuple(slots), pool))
    return KVCacheLayout(tuple(out), tuple(slot_specs), tuple(layer_group), tuple(layer_slot), tuple(slot_pools),
                         tuple(pools))
