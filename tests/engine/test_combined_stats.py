"""`combined_stats`: a data-parallel engine's counters over its replicas (no engine needed: snapshots)."""

from __future__ import annotations

import dataclasses

from pagedjax.core.memory_stats import KVMemoryStats
from pagedjax.core.scheduler import SchedulerStats
from pagedjax.engine.data_parallel import combined_stats
from pagedjax.engine.stats import EngineStats


def _snapshot(i: int) -> EngineStats:
    """A replica's stats whose every counter is distinct (from `i`), its layout the same as every replica's."""
    memory = KVMemoryStats(num_blocks=10 + i, block_size=16, num_used_blocks=i, num_free_blocks=10, num_cached_blocks=0,
                           num_lent_blocks=0, slots_reserved=16 * i, slots_used=15 * i, num_partial_blocks=i,
                           free_runs=None, largest_free_run=None)
    scheduler = SchedulerStats(num_waiting=i, num_running=i, prefix_cache_queries=10 * i, prefix_cache_hits=i,
                               num_evictions=i, num_preemptions=i, num_steps=5 + i, memory=memory)
    ints = {f.name: 100 * i + n for n, f in enumerate(dataclasses.fields(EngineStats)) if f.type == "int"}
    floats = {f.name: 1.5 * i + n for n, f in enumerate(dataclasses.fields(EngineStats)) if f.type == "float"}
    layout = dict(tensor_parallel_size=2, kv_cache_bytes_per_device=4096, kv_bytes_per_token=64,
                  kv_bytes_per_block=1024, kv_dtype="int8")
    return EngineStats(**{**ints, **floats, **layout}, scheduler=scheduler)


def test_counters_add_up_times_are_the_slowest_and_the_layout_is_each_replicas():
    one, two = _snapshot(1), _snapshot(2)
    got = combined_stats([one, two], [3, 4])
    for f in dataclasses.fields(EngineStats):
        a, b, c = getattr(one, f.name), getattr(two, f.name), getattr(got, f.name)
        if f.name in ("tensor_parallel_size", "kv_cache_bytes_per_device", "kv_bytes_per_token", "kv_bytes_per_block",
                      "kv_dtype"):
            assert c == a == b, f.name
        elif f.type == "float" or f.name == "steps":
            assert c == max(a, b), f.name
        elif f.type == "int":  # every counter, speculative decoding's and the images' included
            assert c == a + b, f.name
    assert (got.spec_proposed_tokens, got.spec_accepted_tokens) == (one.spec_proposed_tokens + two.spec_proposed_tokens,
                                                                    one.spec_accepted_tokens + two.spec_accepted_tokens)
    assert got.scheduler.num_preemptions == 3 and got.scheduler.memory.num_blocks == 23
    assert got.scheduler.memory.block_size == 16
    assert got.replicas == (one, two) and got.requests_per_replica == (3, 4)
