"""Fault injection: a device call that raises never wedges the engine, leaks a block or changes another
request's output.

`Faults` makes the runner raise at chosen device calls (1-step ragged steps and fused decodes alike):
before the call ran, after it ran (its results thrown away, its KV writes done), or after losing the
donated KV cache. A request whose step failed either reran alone and produced exactly its fault-free output,
or (when the failing step ran it alone) finished with finish_reason "error".
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from tests.engine.test_engine import CFG, MAX_LEN, PROMPTS, SEED, assert_all_free, reference
from tests.pool import EnginePool

MODES = ("before", "after", "lose_cache")


class InjectedFault(RuntimeError):
    pass


class Faults:
    """Wraps `engine.runner`'s device calls; call number i (counted over both kinds) raises if i is in
    `fail_at`, or if `poison` (a run of token ids) occurs in the call's input tokens."""

    def __init__(self, engine: LLMEngine, fail_at=(), mode: str = "before", poison: tuple[int, ...] = (),
                 error: type[BaseException] = InjectedFault):
        self.engine, self.fail_at, self.mode, self.poison, self.error = engine, set(fail_at), mode, poison, error
        self.calls = 0
        self.raised: list[tuple[int, str]] = []
        runner = engine.runner
        runner.execute = self._wrap(runner.execute, "step", lambda x: x.token_ids)
        runner.execute_fused_decode = self._wrap(runner.execute_fused_decode, "fused", lambda x: x.tokens)

    def remove(self) -> None:
        """The runner's own device calls again."""
        for name in ("execute", "execute_fused_decode"):
            del self.engine.runner.__dict__[name]

    def _wrap(self, fn, kind, tokens_of):
        def call(inputs, *args, **kwargs):
            i = self.calls
            self.calls += 1
            poisoned = bool(self.poison) and _contains(np.asarray(tokens_of(inputs)).tolist(), self.poison)
            if i not in self.fail_at and not poisoned:
                return fn(inputs, *args, **kwargs)
            self.raised.append((i, kind))
            if self.mode == "after":
                fn(inputs, *args, **kwargs)  # it ran (KV written), then failed on the way back
            elif self.mode == "lose_cache":
                for x in jax.tree.leaves(self.engine.runner.kv_cache):
                    x.delete()  # what a failure after donation leaves behind
            raise self.error(f"injected fault at device call {i} ({kind})")
        return call


def _contains(tokens: list[int], run: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(run)]) == run for i in range(len(tokens) - len(run) + 1))


def make_engine(*, block_size=8, num_blocks=64, budget=64, max_num_seqs=8, steps=1, prefix=True, cfg=CFG,
                kv_dtype="auto"):
    return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                                enable_prefix_caching=prefix, kv_dtype=kv_dtype),
                     scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                      max_model_len=MAX_LEN), seed=SEED, decode_steps_per_call=steps)


# (CI time) Engines of a configuration are shared by the module's tests (tests/pool.py: each left idle, its prefix
# cache emptied before the next): the fault-free runs on engines no fault ever reaches, the faulted runs on others.
REFERENCE, FAULTED = EnginePool(make_engine), EnginePool(make_engine)


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    REFERENCE.clear()
    FAULTED.clear()


@contextlib.contextmanager
def faulted(config: dict, **faults):
    """A pooled engine of `config` with `Faults(engine, **faults)` on it, removed when the block ends."""
    with FAULTED.engine(**config) as engine:
        injected = Faults(engine, **faults)
        yield engine, injected
        injected.remove()


MAX_TOKENS_SHORT = 6
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8), SamplingParams(max_tokens=8, temperature=0.8, seed=5),
          SamplingParams(max_tokens=8, temperature=1.0, top_k=10, seed=9)]


def run(engine, prompts, params):
    return engine.generate(prompts, params, use_tqdm=False)


def check_against_fault_free(outs, expected, faults: Faults):
    errors = [o for o in outs if o.finish_reason == "error"]
    assert len(errors) <= len(faults.raised)
    for o, want in zip(outs, expected, strict=True):
        if o.finish_reason == "error":
            assert "InjectedFault" in o.error
        else:
            assert (o.output_token_ids, o.finish_reason) == (want.output_token_ids, want.finish_reason)


_FAULT_FREE: dict = {}


def fault_free(config: dict, prompts, params):
    """The outputs of `prompts` on an engine of `config`'s model, block size and KV dtype that no fault reaches.
    Its pool, token budget and decode steps are the default ones whatever `config` says: outputs do not depend on
    them (tests/engine/test_engine.py, test_engine_properties.py), and one reference engine then serves every
    workload (CI time: each configuration's engine compiles its own programs)."""
    reference = {k: v for k, v in config.items() if k not in ("num_blocks", "budget", "steps")}
    key = (REFERENCE.key(reference), tuple(map(tuple, prompts)), tuple(params))
    if key not in _FAULT_FREE:
        with REFERENCE.engine(**reference) as engine:
            _FAULT_FREE[key] = run(engine, prompts, params)
    return _FAULT_FREE[key]


@st.composite
def fault_workloads(draw):
    n = draw(st.integers(1, len(PROMPTS)))
    return dict(
        prompts=draw(st.permutations(PROMPTS))[:n],
        params=[draw(st.sampled_from(PARAMS)) for _ in range(n)],
        # Few distinct shapes keep compilations few; 24 blocks of 8 put the longer workloads under
        # preemption pressure (other block sizes and pools are covered by the fault-free property tests).
        block_size=8,
        num_blocks=24,
        budget=draw(st.sampled_from([16, 64])),
        steps=draw(st.sampled_from([1, 4])),
        fail_at=draw(st.sets(st.integers(0, 12), min_size=1, max_size=3)),
        mode=draw(st.sampled_from(MODES)),
    )


@settings(max_examples=1)  # (CI time) + 2 explicit examples; each runs two or three engines
@example(w=dict(prompts=PROMPTS, params=PARAMS * 2, block_size=8, num_blocks=64, budget=64, steps=4,
                fail_at={0, 3, 7}, mode="lose_cache"))
@example(w=dict(prompts=PROMPTS[:3], params=PARAMS, block_size=8, num_blocks=24, budget=16, steps=1,
                fail_at={1, 2}, mode="after"))
@given(w=fault_workloads())
def test_faults_over_random_workloads(w):
    """Faults at random device calls (prefill, decode, fused decode; first, middle, last): every block comes
    back, every request either matches its fault-free output or failed alone, and the engine goes on."""
    config = {k: w[k] for k in ("block_size", "num_blocks", "budget", "steps")}
    if w["num_blocks"] * w["block_size"] < MAX_LEN:
        w["prompts"] = [p for p in w["prompts"] if len(p) + 8 <= w["num_blocks"] * w["block_size"]] or [PROMPTS[0]]
    params = w["params"][: len(w["prompts"])] + [PARAMS[0]] * (len(w["prompts"]) - len(w["params"]))
    expected = fault_free(config, w["prompts"], params)

    with faulted(config, fail_at=w["fail_at"], mode=w["mode"]) as (engine, faults):
        failed_before = engine.stats().failed_steps
        outs = run(engine, w["prompts"], params)
        check_against_fault_free(outs, expected, faults)
        assert_all_free(engine)
        assert engine.stats().failed_steps - failed_before == len(faults.raised)
        # still serving: a later request is exact
        faults.fail_at = set()
        again = run(engine, [w["prompts"][0]], [params[0]])[0]
        assert again.output_token_ids == expected[0].output_token_ids
        assert_all_free(engine)


@pytest.mark.parametrize("mode", MODES)
def test_failed_fused_decode_does_not_wedge_the_engine(mode):
    """A fused decode that raises returns its lent blocks; later steps run (they used to raise "a fused
    decode is in flight" forever)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_LEN // 4)
    expected = fault_free(dict(steps=4), PROMPTS[:3], [params] * 3)
    with faulted(dict(steps=4), mode=mode) as (engine, faults):
        for i, p in enumerate(PROMPTS[:3]):
            engine.add_request(str(i), p, params)
        fused_before = engine.stats().fused_decode_calls
        while engine.stats().fused_decode_calls == fused_before:  # until decode-only, then fail the next fused call
            engine.step()
        faults.fail_at = {faults.calls}
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
        assert faults.raised and faults.raised[0][1] == "fused"
        assert engine.scheduler.kv_cache_manager.lent_block_ids == frozenset()
        assert [outs[str(i)].output_token_ids for i in range(3)] == [o.output_token_ids for o in expected]
        assert_all_free(engine)


@pytest.mark.parametrize("mode", MODES)
def test_failed_steps_of_a_windowed_int8_model_lose_nothing(mode):
    """Sliding windows (blocks released while requests run) and int8 pages (scales beside the values): a plain
    step and a fused decode that fail after blocks were released neither leak a block nor change an output."""
    cfg = CFG.replace(sliding_windows=(6, 10))
    config = dict(block_size=4, steps=4, cfg=cfg, kv_dtype="int8")
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = fault_free(config, PROMPTS[2:5], [params] * 3)
    with faulted(config, mode=mode) as (engine, faults):
        for i, p in enumerate(PROMPTS[2:5]):
            engine.add_request(str(i), p, params)
        kv = engine.scheduler.kv_cache_manager
        fused_before = engine.stats().fused_decode_calls
        while not (engine.stats().fused_decode_calls > fused_before
                   and any(kv.num_released_blocks(r.request_id) for r in engine.scheduler.running)):
            engine.step()
        faults.fail_at = {faults.calls, faults.calls + 2}  # the next fused decode, then a step of the recovery
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
        assert len(faults.raised) == 2 and faults.raised[0][1] == "fused"
        check_against_fault_free([outs[str(i)] for i in range(3)], expected, faults)
        assert kv.lent_block_ids == frozenset()
        assert_all_free(engine)


def test_a_request_that_breaks_every_step_fails_alone():
    """A request whose prefill always fails (here: a poison run of tokens in its prompt) finishes with "error"
    after running alone; the requests batched with it get exactly their fault-free outputs."""
    poison = (CFG.vocab_size - 1, 0, CFG.vocab_size - 1)
    assert not any(_contains(p, poison) for p in PROMPTS)
    bad = [3, *poison, 4]
    for steps in (1, 4):
        with faulted(dict(steps=steps), poison=poison) as (engine, faults):
            outs = run(engine, PROMPTS[:2] + [bad] + PROMPTS[2:], SamplingParams(temperature=0.0,
                                                                                 max_tokens=MAX_TOKENS_SHORT))
            assert outs[2].finish_reason == "error" and "InjectedFault" in outs[2].error
            assert outs[2].output_token_ids == []
            good = outs[:2] + outs[3:]
            assert all(o.finish_reason == "length" for o in good)
            assert [o.output_token_ids for o in good] == [r[:MAX_TOKENS_SHORT] for r in reference()]
            assert len(faults.raised) >= 2  # the batch, then the request alone
            assert_all_free(engine)


def test_lost_kv_cache_is_rebuilt_and_everything_recomputed():
    """A failure after the cache was donated ("Array has been deleted" on every later step, before): the
    engine makes a fresh cache, forgets the prefix cache (its KV is gone) and recomputes."""
    with faulted({}) as (engine, faults):
        run(engine, [PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=2))  # leaves a cached prefix behind
        assert engine.stats().scheduler.memory.num_cached_blocks > 0
        faults.fail_at, faults.mode, faults.calls = {faults_at := 2}, "lose_cache", 0
        outs = run(engine, PROMPTS, SamplingParams(temperature=0.0, max_tokens=len(reference()[0])))
        assert faults.raised == [(faults_at, "step")]
        assert not engine.runner.kv_cache_lost
        assert [o.output_token_ids for o in outs] == reference()  # the failed step ran several: none failed
        assert_all_free(engine)


def test_keyboard_interrupt_propagates_and_leaves_the_engine_usable():
    """Ctrl-C inside a step: it propagates, generate() withdraws its requests, and no block leaks."""
    with faulted(dict(steps=4), fail_at={1}, error=KeyboardInterrupt) as (engine, _):
        failed_before = engine.stats().failed_steps
        with pytest.raises(KeyboardInterrupt):
            run(engine, PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
        assert not engine.has_unfinished_requests()
        assert_all_free(engine)
        assert engine.stats().failed_steps - failed_before == 1
        out = run(engine, [PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS_SHORT))[0]
        assert out.output_token_ids == reference()[2][:MAX_TOKENS_SHORT]


def test_compiled_steps_live_and_die_with_their_engine():
    """Compiled programs used to sit in a module-level cache forever (~70 MiB per pool size)."""
    engine = make_engine()
    run(engine, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.stats().compilations > 0
    runner = weakref.ref(engine.runner)
    executables = weakref.ref(next(iter(engine.runner.programs.executables.values())))
    del engine
    gc.collect()
    assert runner() is None and executables() is None


@pytest.mark.parametrize("fail_at, mode", [(1, "after"), (1, "lose_cache"), (2, "before")])
def test_failed_step_of_forked_samples_does_not_wedge_the_engine(fail_at, mode):
    """Multi-sample requests (forked KV): call 1 is the samples' first step, the one that copies their shared
    partial block; a fault there or later fails only what ran alone, every other sample equals the fault-free
    run's, nothing stays held, and the engine serves on."""
    prompts = [PROMPTS[2][:13], PROMPTS[2][:17]]  # forked inside a block (copy-on-write) / at a block boundary
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3)
    config = dict(block_size=8, num_blocks=64, budget=64, steps=4)
    expected = fault_free(config, prompts, [params] * 2)
    with faulted(config, fail_at=[fail_at], mode=mode) as (engine, faults):
        outs = run(engine, prompts, [params] * 2)
        assert faults.raised
        for o, want in zip(outs, expected, strict=True):
            for got, w in zip(o.outputs, want.outputs, strict=True):
                if got.finish_reason != "error":
                    assert got.token_ids == w.token_ids
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.kv_cache_manager.block_pool.num_used == 0
        engine.scheduler.check_invariants()
        again = run(engine, prompts, [params] * 2)  # still serving, exactly
        assert [[c.token_ids for c in o.outputs] for o in again] == \
            [[c.token_ids for c in o.outputs] for o in expected]


def test_beam_search_survives_a_failed_step_and_fails_cleanly_on_a_request_that_breaks_steps():
    """A transient fault in a step of several beams: they rerun alone and the search gives the fault-free
    beams. A beam that breaks every step it is in: RuntimeError naming it, every beam aborted, nothing held,
    and the engine serves on."""
    from pagedjax.sampling_params import BeamSearchParams

    prompts = [PROMPTS[2][:13], PROMPTS[1]]
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    with REFERENCE.engine() as engine:
        expected = engine.beam_search(prompts, params)
    with faulted({}, fail_at=[3]) as (engine, faults):
        got = engine.beam_search(prompts, params)
        assert faults.raised
        assert [[s.token_ids for s in o.sequences] for o in got] == \
            [[s.token_ids for s in o.sequences] for o in expected]
    with faulted({}, poison=tuple(PROMPTS[1][:4])) as (broken, _):  # every call carrying this prompt's start fails
        with pytest.raises(RuntimeError, match="beam search: request .* failed"):
            broken.beam_search(prompts, params)
        assert not broken.has_unfinished_requests()
        assert broken.scheduler.kv_cache_manager.block_pool.num_used == 0
        assert broken.generate([PROMPTS[2][:13]], SamplingParams(temperature=0.0, max_tokens=3),
                               use_tqdm=False)[0].finish_reason == "length"
