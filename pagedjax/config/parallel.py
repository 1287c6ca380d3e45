"""`ParallelConfig`: how many devices one model spans (tensor parallelism) and how many replicas serve it
(data parallelism). Plain Python, no JAX, like `pagedjax.config`.

A config rather than a `mesh=` argument: the engine needs the two sizes to build disjoint sub-meshes for its
replicas, to size the KV pool per device and to pick which weights shard; a user names sizes, not devices.
`devices=` on the engine (optional) says which devices; by default the first `world_size` of `jax.devices()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config.fields import check_int, option

TP = "tp"  # the mesh axis that weights and the KV cache are sharded over


def kv_heads_per_device(num_kv_heads: int, tp: int) -> int:
    """KV heads each of `tp` devices holds: num_kv_heads / tp, or 1 (a replica) when tp > num_kv_heads."""
    return max(num_kv_heads // tp, 1)


def kv_heads_stored(num_kv_heads: int, tp: int) -> int:
    """KV heads in the cache's global array (dim 0) over `tp` devices: num_kv_heads, or tp when each KV head is
    replicated (tp > num_kv_heads)."""
    return max(num_kv_heads, tp)


@dataclass(frozen=True)
class ParallelConfig:
    """`tensor_parallel_size` devices hold one model (weights and KV cache sharded over a `tp` mesh axis);
    `data_parallel_size` such groups each run an independent replica (own scheduler and KV pool)."""

    tensor_parallel_size: int = option(1, "shard the model and its KV cache over N devices (on CPU: XLA_FLAGS="
                                          "--xla_force_host_platform_device_count=N); --kv-memory is then per device")
    data_parallel_size: int = option(1, "N independent replicas (each --tensor-parallel-size devices, its own KV "
                                        "pool of --num-blocks / --kv-memory); requests go to the least loaded")

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            object.__setattr__(self, name, check_int("ParallelConfig", name, getattr(self, name), lo=1))

    @property
    def world_size(self) -> int:
        """Devices used in all: tp x dp."""
        return self.tensor_parallel_size * self.data_parallel_size

    def check_model(self, spec) -> None:
        """ValueError unless the model's heads split over `tensor_parallel_size` devices (`spec`: its ModelSpec
        or ModelConfig): the query heads evenly, and the KV heads evenly or (tp > num_kv_heads) each replicated
        on tp / num_kv_heads devices. A model whose layers are all latent (MLA / DSA: one entry per token shared by
        every head) splits its query heads and keeps its latent pages whole on every device; a hybrid of
        full-attention layers of one shape and recurrent-state layers splits both by heads (`_check_hybrid`); a
        mix of full-attention and latent layers is served on one device."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        if spec.num_q_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's {spec.num_q_heads} query heads")
        if spec.num_kv_heads is None:  # some layer is not FullAttention of the one shape (ModelSpec)
            if not any(layer.heads_axis is not None for layer in spec.kv_layers):
                return  # every layer latent (MLA, DSA): query heads split, the latent pages replicated
            if self._check_hybrid(spec):
                return
            raise ValueError(f"tensor_parallel_size {tp}: this model's ModelSpec.kv_layers mixes full-attention "
                             "layers with latent ones or full-attention layers of different shapes; tensor "
                             "parallelism shards either full-attention KV heads of one shape or latent layers "
                             "only (serve it with tensor_parallel_size 1)")
        if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp} and the model's {spec.num_kv_heads} KV heads: one must "
                             "divide the other (KV heads are split evenly, or replicated when tp > num_kv_heads)")

    def _check_hybrid(self, spec) -> bool:
        """Whether `spec` is a hybrid of full-attention layers of one shape and recurrent-state layers (Qwen3-Next,
        Qwen3.5, Nemotron-H), each split by heads: True if so and they split over tp (ValueError naming what does
        not: the KV heads must be a multiple of tp here, the recurrent layers' heads and channels too)."""
        tp = self.tensor_parallel_size
        full = {layer.kv_heads_shape for layer in spec.kv_layers if layer.splits_kv_heads}
        others = [layer for layer in spec.kv_layers if not layer.splits_kv_heads]
        if len(full) > 1 or any(layer.heads_axis is None for layer in others):
            return False
        for layer in others:
            why = layer.check_tensor_parallel(tp)
            if why is not None:
                raise ValueError(why)
        if full and next(iter(full))[0] % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the {next(iter(full))[0]} KV heads of a model "
                             "with recurrent-state layers (KV heads are not replicated past tp in a hybrid model)")
        return True

    def kv_heads_per_device(self, num_kv_heads: int) -> int:
        """KV heads each device holds (see the module-level function)."""
        return kv_heads_per_device(num_kv_heads, self.tensor_parallel_size)

    def kv_heads_stored(self, num_kv_heads: int) -> int:
        """KV heads in the cache's global array (see the module-level function)."""
        return kv_heads_stored(num_kv_heads, self.tensor_parallel_size)
