"""One of two processes of a multi-process run on CPU: `python -m tests.parallel.multihost_worker RANK PORT OUT`.

Each process has 2 CPU devices; tp 4 spans both processes (gloo collectives over loopback). Both run the same
engine on the same prompts and write their tokens and the dense model's (computed locally) to OUT.
"""

from __future__ import annotations

import json
import os
import sys

# The suite's XLA flags (tests/conftest.py: -O0 and faster emitters), inherited, and 2 devices.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
os.environ["JAX_PLATFORMS"] = "cpu"


def main(rank: int, port: int, out: str) -> None:
    from pagedjax.parallel.distributed import initialize

    initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    import jax
    import numpy as np

    from pagedjax import SamplingParams
    from pagedjax.parallel import ParallelConfig
    from tests.parallel import worker

    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    # Host (numpy) weights: each process places its own devices' slices of them.
    host = jax.tree.map(np.asarray, worker.params("gqa"))
    e = worker.LLMEngine(model_config=worker.config("gqa"), cache_config=worker.CacheConfig(block_size=8, num_blocks=8),
                         scheduler_config=worker.SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                                 max_model_len=worker.MAX_LEN), params=host,
                         parallel_config=ParallelConfig(tensor_parallel_size=4), compile_cache=False,
                         decode_steps_per_call=4)
    assert {d.process_index for d in e.runner.mesh.devices.flat} == {0, 1}
    outs = e.generate(worker.PROMPTS, SamplingParams(temperature=0.0, max_tokens=worker.MAX_TOKENS), use_tqdm=False)
    with open(out, "w") as f:
        json.dump({"tokens": [o.output_token_ids for o in outs], "reference": worker.reference("gqa"),
                   "preemptions": e.stats().scheduler.num_preemptions}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
