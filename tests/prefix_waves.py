"""Random shared-prefix workloads for the prefix-cache property tests of the recurrent-state models (the toy in
tests/engine/test_state_cache.py, the Hugging Face hybrids in tests/model/): requests sharing a prefix, submitted in
waves and interleaved, whose greedy tokens must equal each prompt's cold run whatever hit the prefix cache.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from pagedjax import SamplingParams


@st.composite
def shared_prefix_waves(draw, *, vocab: tuple[int, int], prefix_lens: list[int], suffix_lens: list[int],
                        max_new: int, engines: list[dict]) -> dict:
    """A shared prefix (one of `prefix_lens` tokens, drawn from range(*vocab)) and 2-5 requests on it with random
    suffixes (of `suffix_lens`; 0: the prompt is the prefix), in waves: a wave is submitted once the waves before it
    have finished, each of its requests after 0-2 engine steps of the ones before it (interleaved with them);
    1..`max_new` greedy tokens each; `engine`: one of `engines` (the keyword arguments of the test's engine)."""
    prefix_len = draw(st.sampled_from(prefix_lens), label="prefix_len")
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="token_seed"))
    prefix = rng.integers(*vocab, prefix_len).tolist()
    suffixes = draw(st.lists(st.sampled_from(suffix_lens), min_size=2, max_size=5), label="suffixes")
    prompts = [prefix + rng.integers(*vocab, max(n, 1 if not prefix else 0)).tolist() for n in suffixes]
    waves = [0] + draw(st.lists(st.integers(0, 1), min_size=len(prompts) - 1, max_size=len(prompts) - 1),
                       label="new_wave_before")
    return dict(prompts=prompts, prefix_len=prefix_len, wave=np.cumsum(waves).tolist(),
                delay=draw(st.lists(st.integers(0, 2), min_size=len(prompts), max_size=len(prompts)), label="delay"),
                max_tokens=draw(st.integers(1, max_new), label="max_tokens"),
                engine=draw(st.sampled_from(engines), label="engine"))


def run_waves(engine, w: dict) -> list:
    """Run workload `w` on `engine` (the scheduler's invariants checked after every step): each prompt's finished
    `RequestOutput`, in prompt order. Every block goes back to the pool at the end."""
    params = SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True)
    done = {}
    for wave in range(w["wave"][-1] + 1):
        ids = [i for i, v in enumerate(w["wave"]) if v == wave]
        steps = 0
        while ids or engine.has_unfinished_requests():
            while ids and w["delay"][ids[0]] <= steps:  # the next request's turn (delays count from the last)
                engine.add_request(str(ids[0]), w["prompts"][ids[0]], params)
                ids.pop(0)
                steps = 0
            for out in engine.step():
                if out.finished:
                    done[int(out.request_id)] = out
            engine.scheduler.check_invariants()
            steps += 1
    assert engine.stats().scheduler.memory.num_used_blocks == 0
    return [done[i] for i in range(len(w["prompts"]))]


def later_wave_hits(w: dict, state_block_size: int) -> bool | None:
    """Whether a later wave must hit the prefix cache (None: the workload promises nothing): when the prefix holds
    a whole state block and a request of a later wave goes past it, its first state block's snapshot was published
    by the wave before, and a hit ends at a block boundary before the prompt's last token."""
    if w["prefix_len"] >= state_block_size and any(v > 0 and len(p) > state_block_size
                                                   for v, p in zip(w["wave"], w["prompts"], strict=True)):
        return True
    return None
