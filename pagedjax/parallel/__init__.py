"""Many devices: tensor parallelism over a `tp` mesh axis and data-parallel replicas (see docs/parallel.md).

    from pagedjax.parallel import ParallelConfig
    engine = LLMEngine(model_config=cfg, cache_config=cache, parallel_config=ParallelConfig(tensor_parallel_size=4))

  config.py         ParallelConfig (plain Python)
  mesh.py           one `tp` mesh per replica, over disjoint devices
  sharding.py       PartitionSpecs of the parameters (by name) and of the KV cache (by KV heads)
  attention.py      the KV write and paged attention under `shard_map`, per device over its own heads
  distributed.py    multi-host start-up (`jax.distributed.initialize`), and the per-step exchange between processes

SPMD only: nothing here imports the engine (data-parallel replicas are `pagedjax.engine.DataParallelEngine`).
Names are imported lazily, so `import pagedjax.config.parallel` stays free of JAX.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ParallelConfig": "pagedjax.config.parallel",
    "replica_meshes": "pagedjax.parallel.mesh",
    "tp_mesh": "pagedjax.parallel.mesh",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedjax.parallel' has no attribute {name!r}")
