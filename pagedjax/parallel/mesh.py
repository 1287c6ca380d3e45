"""Device meshes: one 1-D `tp` mesh per data-parallel replica, over disjoint devices.

Devices are taken in `jax.devices()` order (on several hosts that is every process's devices, process by
process), replica r getting devices `[r * tp, (r + 1) * tp)`: a replica's tensor-parallel group stays on
neighbouring devices (one host, one NVLink domain) whenever tp divides the devices per host.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pagedjax.config.parallel import TP, ParallelConfig
from pagedjax.parallel.sharding import log_replicated


def replica_meshes(config: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
    """`data_parallel_size` meshes of `tensor_parallel_size` devices each, disjoint. ValueError if there are
    fewer devices than `config.world_size`."""
    devices = list(jax.devices() if devices is None else devices)
    need = config.world_size
    if len(devices) < need:
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} x data_parallel_size "
                         f"{config.data_parallel_size} needs {need} devices; {len(devices)} available "
                         f"({jax.default_backend()}; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N "
                         "before JAX starts)")
    if len({d.id for d in devices[:need]}) != need:
        raise ValueError("the devices given for the mesh repeat a device")
    tp = config.tensor_parallel_size
    return [Mesh(np.array(devices[r * tp:(r + 1) * tp]), (TP,)) for r in range(config.data_parallel_size)]


def tp_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """One `tp` mesh of `tensor_parallel_size` devices (the first of `devices`, default `jax.devices()`)."""
    return replica_meshes(ParallelConfig(tensor_parallel_size=tensor_parallel_size), devices)[0]


def engine_mesh(config: ParallelConfig, spec, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The `tp` mesh of one engine (one replica; `spec`: the model's ModelSpec or ModelConfig): ValueError if
    the model's heads do not split over it, or
    if `config` asks for several replicas (those are `DataParallelEngine`'s, each with its own engine)."""
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"parallel_config must be a ParallelConfig, got {type(config).__name__}")
    if config.data_parallel_size != 1:
        raise ValueError("one LLMEngine is one replica: build data_parallel_size > 1 with pagedjax.make_engine / "
                         "pagedjax.load_engine or DataParallelEngine, which give each replica its own devices")
    config.check_model(spec)
    log_replicated(spec, config.tensor_parallel_size)
    return replica_meshes(config, devices)[0]
