"""Several hosts: one process per host, all running the same program (JAX's multi-controller model).

    from pagedjax.parallel.distributed import initialize
    initialize("10.0.0.1:9876", num_processes=2, process_id=int(os.environ["RANK"]))   # before any JAX work
    engine = LLMEngine.from_pretrained(path, parallel_config=ParallelConfig(tensor_parallel_size=16))

Every process runs the same scheduler on the same requests: the scheduler is deterministic, so each computes the
same plans and feeds the same (replicated) step inputs to the one SPMD program spanning all hosts' devices;
each reads the replicated sampled tokens from its own devices. Requests must therefore reach every process
(e.g. the same prompt file, or a front end that broadcasts them).
"""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               local_device_ids: list[int] | None = None) -> None:
    """`jax.distributed.initialize`, with the CPU backend's cross-process collectives (gloo) turned on first, so
    the same code runs on CPU hosts (and in tests, as several processes on one machine). Call it before
    anything else touches JAX's devices."""
    if jax.config.jax_platforms in (None, "", "cpu") or str(jax.config.jax_platforms).startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)
    logger.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())
