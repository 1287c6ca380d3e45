"""One of two processes of a multi-process run on CPU: `python -m tests.parallel.multihost_worker RANK PORT OUT CASE`.

Each process has 2 CPU devices; tp 4 spans both processes (gloo collectives over loopback). Process 0 leads
(`MultiHostEngine`: it alone is given the requests), process 1 follows (`follow`). CASE:
  serve     process 0 generates the prompts (greedy, prefix hits, preemption, chunked prefill, fused decode), aborts
            one request mid-way and adds requests while others run, then closes; both write what they saw to OUT
  lost      process 1 dies (os._exit) in its third step: process 0's step must raise RankLostError at once
"""

from __future__ import annotations

import json
import os
import sys
import time

# The suite's XLA flags (tests/conftest.py: -O0 and faster emitters), inherited, and 2 devices.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
os.environ["JAX_PLATFORMS"] = "cpu"


def main(rank: int, port: int, out: str, case: str) -> None:
    from pagedjax.parallel.distributed import initialize

    initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    import jax
    import numpy as np

    from pagedjax import SamplingParams
    from pagedjax.engine.multihost import MultiHostEngine, RankLostError, follow
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
    result: dict = {}
    greedy = SamplingParams(temperature=0.0, max_tokens=worker.MAX_TOKENS)
    if rank == 1:
        if case == "lost":
            steps, step = [0], e.step

            def dying_step():
                steps[0] += 1
                if steps[0] == 3:
                    os._exit(3)
                return step()

            e.step = dying_step
        follow(e)
        result["followed"] = True
    else:
        m = MultiHostEngine(e, timeout_s=30)
        if case == "lost":
            m.add_request("a", worker.PROMPTS[3], greedy)
            start = time.perf_counter()
            try:
                while m.has_unfinished_requests():
                    m.step()
            except RankLostError as err:
                result.update(error=str(err), seconds=time.perf_counter() - start)
            try:
                m.add_request("b", [1], greedy)
            except RankLostError as err:
                result["later"] = str(err)
            os._exit(_write(out, result))  # JAX's own shutdown would wait for the lost process
        # 40 requests added and aborted before any step: one exchange of ~13 KB, past the 8 KiB frame (its tail
        # follows in a broadcast), and nothing for the follower to run.
        for i in range(40):
            m.add_request(f"gone-{i}", [1 + i % 60], greedy)
        for i in range(40):
            m.abort(f"gone-{i}")
        outs = m.generate(worker.PROMPTS, greedy)
        # Requests added while others run, and one aborted mid-way: the follower applies both between the
        # same steps.
        m.add_request("x", worker.PROMPTS[1], greedy)
        m.step()
        m.add_request("y", worker.PROMPTS[2], greedy)
        m.step()
        aborted = m.abort("x")
        late: dict = {}
        while m.has_unfinished_requests():
            late.update({o.request_id: o.output_token_ids for o in m.step() if o.finished})
        result.update(tokens=[o.output_token_ids for o in outs], reference=worker.reference("gqa"),
                      preemptions=e.stats().scheduler.num_preemptions, late=late, aborted=aborted,
                      exchanges=m.exchanges, bytes=m.bytes_sent)
        m.close()
    _write(out, result)
    jax.distributed.shutdown()


def _write(out: str, result: dict) -> int:
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
