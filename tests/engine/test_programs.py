"""Compiled programs (issue 32, item 3): request parameters come in few sizes, so the programs an engine compiles
are bounded (`pagedjax.runner.shapes`); and a step whose program is new runs on a bigger one already compiled
while its own compiles in the background (`pagedjax.runner.programs`), so after `warmup()` no step waits for a
compile, with the tokens of its own program."""

from __future__ import annotations

import itertools
import logging
import os
import re
import sys
import threading
import time

import jax
import numpy as np

from pagedjax import CacheConfig, LLMEngine, PoolingParams, SamplingParams, SchedulerConfig
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.runner import programs
from pagedjax.runner.inputs import STOP_ID_WIDTHS, TOP_LOGPROBS_SIZES
from pagedjax.runner.programs import MAX_PENDING, ProgramCache
from pagedjax.runner.shapes import LoopShape, StepShape, dominates, variants_bound, warmup_shapes
from pagedjax.sampling_params import StructuredOutput
from tests.serve.server_utils import CFG  # vocabulary 259: room for 256 stop ids

MAX_NUM_SEQS, MAX_BATCHED, MAX_LEN, BLOCK_SIZE = 4, 32, 60, 16  # tables of at most 4 blocks


def make_engine(**kwargs) -> LLMEngine:
    kwargs.setdefault("compile_in_background", True)
    kwargs.setdefault("tokenizer", ByteTokenizer())
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
                     scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED,
                                                      max_model_len=MAX_LEN), seed=3, **kwargs)


def _no_compile(*args, **kwargs):
    raise AssertionError("a step waited for a compile on the engine thread")


def _recording_lookups(monkeypatch, engine: LLMEngine) -> list[tuple]:
    """(step shape, shape of the program it ran on) of every program lookup from now on."""
    seen = []
    programs = engine.runner.programs
    lookup = programs.lookup

    def record(shape, prepare):
        ran, exe = lookup(shape, prepare)
        seen.append((shape, ran))
        return ran, exe

    monkeypatch.setattr(programs, "lookup", record)
    return seen


# -------------------------------------------------------------------------------------------- the bound
def test_many_parameter_combinations_stay_within_the_documented_bound(monkeypatch):
    """Requests with log-probabilities 0..20, 1..256 stop ids, penalties, prompt log-probabilities and forks (n=2:
    block copies) used to compile a program per power of two of each (up to 2 x 10 x 7 x 7 variants of a step's
    optional parts). Each part now takes off or one of its documented sizes: per (T, S, B) at most
    `variants_bound()` = 2 (copies) x 3 (stop ids: off, 8, 512) x 3 (top log-probabilities: off, 5, 20)
    x 3 (prompt's) x 2 (structured output's token mask) x 2 (pooled sums) x 3 (sampling: off, greedy, drawing)
    x 2 (logits) programs;
    with T, S, B
    powers of two up to this engine's limits, the
    engine's bound is their count times that. After warm-up, not one of these steps waited for a compile, an
    embedding's included."""
    engine = make_engine()
    engine.warmup()
    seen = _recording_lookups(monkeypatch, engine)
    monkeypatch.setattr(engine.runner.programs, "compile", _no_compile)
    rng = np.random.default_rng(0)
    knobs = zip(range(36), itertools.cycle([None, 0, 1, 5, 6, 13, 20]), itertools.cycle([1, 8, 9, 100, 255]),
                itertools.cycle([0.0, 0.5, -1.0]), itertools.cycle([None, None, 0, 7, 20]), itertools.cycle([1, 2]))
    for i, logprobs, num_stops, presence, prompt_logprobs, n in knobs:
        params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=logprobs, stop_token_ids=range(num_stops),
                                presence_penalty=presence, prompt_logprobs=prompt_logprobs, n=n, ignore_eos=i % 2 == 0,
                                structured=StructuredOutput(regex="[a-z]{1,4}") if i % 4 == 1 else None)
        prompt = rng.integers(0, 256, 3 + i % 11).tolist()
        if i % 5 == 3:  # an embedding: a step with pooled sums
            engine.add_request(f"r{i}", prompt, pooling=PoolingParams(("last", "mean", "cls")[i % 3]))
        else:
            engine.add_request(f"r{i}", prompt, params)
        if i % 3 == 2:  # three requests at a time: batches of 1-6 sequences
            while engine.has_unfinished_requests():
                engine.step()
    engine.close()

    ts, ss, bs = {16, 32}, {1, 2, 4}, {2, 4}  # ragged tokens, sequences and blocks per sequence: the buckets
    shapes = {shape for shape, _ in seen}
    for shape in shapes:
        assert shape.copies in (None, shape.tables[0]) and shape.stop_width in (None, *STOP_ID_WIDTHS)
        assert shape.num_top_logprobs in (None, *TOP_LOGPROBS_SIZES)
        assert (shape.prompt_targets, shape.num_prompt_top_logprobs) in {(False, 0)} | {
            (True, k) for k in TOP_LOGPROBS_SIZES}
        assert shape.tables[0] in ss and shape.tables[1] in bs and shape.tokens in (ts | ss)
    per_size = {}
    for shape in shapes:
        per_size.setdefault(shape[1:3], set()).add(shape)
    assert max(map(len, per_size.values())) <= variants_bound() == 1296  # 648 variants, doubled by logits
    bound = (len(ts) + 1) * len(ss) * len(bs) * variants_bound()  # ragged T's, and decode-only steps (T = S)
    assert len(shapes) <= bound and engine.stats().compiled_programs <= bound
    assert {s.stop_width for s in shapes} >= {8, 512} and {s.num_top_logprobs for s in shapes} >= {5, 20}
    assert any(s.copies for s in shapes) and any(s.prompt_targets for s in shapes) and any(s.token_mask for s in shapes)
    assert any(s.pool for s in shapes)
    assert engine.stats().stand_in_steps > 0


# ------------------------------------------------------------------------------------- stand-ins, exactly
def test_after_warmup_a_new_combination_runs_on_a_stand_in_with_its_own_programs_tokens(monkeypatch):
    """A never-seen parameter combination (forks, penalties, stop ids, log-probabilities of the samples and the
    prompt, fused decode) runs its first step on a warm-up program, not waiting for a compile, and its tokens
    are those of an engine that compiled each step's own program (log-probabilities within rounding). Then the
    same with the warm-up in the background (`_background_warmup_serves_at_once`)."""
    params = SamplingParams(max_tokens=7, n=2, temperature=0.8, seed=5, logprobs=3, prompt_logprobs=2,
                            presence_penalty=0.4, stop_token_ids=[7, 8, 9], ignore_eos=True)
    prompt = list(range(40, 61))
    exact = make_engine(decode_steps_per_call=4, compile_in_background=False)
    want = exact.generate([prompt], params, use_tqdm=False)[0]
    assert exact.stats().stand_in_steps == 0

    warm = make_engine(decode_steps_per_call=4)
    scheduler_before = warm.stats().scheduler
    warm.warmup()
    assert warm.stats().scheduler == scheduler_before
    assert not any(np.any(x) for x in jax.tree.leaves(jax.device_get(warm.runner.kv_cache)))  # nothing written
    seen = _recording_lookups(monkeypatch, warm)
    monkeypatch.setattr(warm.runner.programs, "compile", _no_compile)
    got = warm.generate([prompt], params, use_tqdm=False)[0]
    warm.close()

    assert seen[0][0] != seen[0][1]  # the first step ran on a stand-in
    assert {s.kind for s, ran in seen if s != ran} == {"step", "decode_loop"}
    assert warm.stats().stand_in_steps > 0 and warm.stats().fused_decode_calls > 0
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    pairs = [(a.logprobs, b.logprobs) for a, b in zip(got.outputs, want.outputs, strict=True)]
    for lps_a, lps_b in [*pairs, (got.prompt_logprobs[1:], want.prompt_logprobs[1:])]:
        assert [x.token_id for x in lps_a] == [x.token_id for x in lps_b]
        np.testing.assert_allclose([x.logprob for x in lps_a], [x.logprob for x in lps_b], rtol=1e-5, atol=1e-5)
        assert [[t for t, _ in x.top] for x in lps_a] == [[t for t, _ in x.top] for x in lps_b]
    monkeypatch.undo()
    _background_warmup_serves_at_once(monkeypatch, prompt, params, want)


def _background_warmup_serves_at_once(monkeypatch, prompt, params, want) -> None:
    """`start_warmup()` (pagedjax-serve's): the engine answers while the warm-up's programs compile in the
    background (here held back until the request is done): the request's steps compile their own programs, with
    the tokens of an engine without a warm-up. Once compiled, every warm-up program is held, and a new
    combination runs on one of them while its own compiles. Was: the server answered only after the whole warm-up
    (48-65 s on a loaded 2-core machine)."""
    from pagedjax.runner import runner as runner_module

    engine = make_engine(decode_steps_per_call=4)
    gate, compile_ = threading.Event(), runner_module._compile

    def held_back(*args, **kwargs):  # the background thread's compiles wait for the gate; the engine's do not
        if threading.current_thread() is not threading.main_thread():
            gate.wait(60)
        return compile_(*args, **kwargs)

    monkeypatch.setattr(runner_module, "_compile", held_back)
    warmed = engine.start_warmup()
    got = engine.generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    warm_up = engine._warmup_shapes()[0]
    assert not warmed.done() and engine.runner.programs.num_pending == len(warm_up)
    assert engine.stats().stand_in_steps == 0  # nothing to stand in yet: its steps compiled their own
    gate.set()
    assert warmed.result(timeout=120) > 0
    seen = _recording_lookups(monkeypatch, engine)
    engine.generate([list(range(3, 30))], SamplingParams(max_tokens=2, logprobs=20, stop_token_ids=range(20)),
                    use_tqdm=False)  # a new combination: installs the warm-up's programs, runs on one
    assert set(warm_up) <= set(engine.runner.programs.executables)
    assert engine.stats().stand_in_steps > 0 and seen[0][1] in warm_up
    engine.close()


def test_the_warmup_shapes_dominate_every_step_within_the_limits():
    """Every ragged step and fused decode an engine of these limits makes (but those asking for logits) has a
    warm-up program to run on; on the XLA path a ladder of narrower, smaller ones serves the steps of shorter
    sequences with one of at most 4x their tokens (16 at least) and 4x their table's width (8 at least: the
    narrowest rung here). Was: one width, a quarter of the table's, which a server's short sequences ran on at 8x
    their width and more (the hostile soak's steps over 100 ms)."""
    warm = warmup_shapes(max_tokens=512, max_seqs=64, max_blocks=128, block_size=16, decode_steps=8, narrow=True)
    assert [(w.kind, w.tokens if w.kind == "step" else None, w.tables) for w in warm] == [
        ("step", 512, (64, 128)), ("step", 512, (64, 128)), ("step", 512, (64, 32)), ("step", 128, (64, 32)),
        ("step", 32, (32, 32)), ("step", 16, (16, 32)), ("step", 512, (64, 8)), ("step", 128, (64, 8)),
        ("step", 32, (32, 8)), ("step", 16, (16, 8)), ("decode_loop", None, (64, 128))]
    tops, stops = (None, *TOP_LOGPROBS_SIZES), (None, *STOP_ID_WIDTHS)
    for t, s, b, top, stop, prompt in itertools.product([1, 4, 16, 64, 512], [1, 8, 64], [2, 32, 128], tops,
                                                        stops, (None, 5, 20)):
        if s > t:
            continue
        step = StepShape("step", t, (s, b), t == s, False, s if stop else None, stop, prompt is not None, top,
                         prompt or 0)
        serving = [w for w in warm if dominates(w, step)]
        assert serving, step
        if b <= 32 and not prompt:
            assert any(w.tokens <= max(16, 4 * t) and w.tables[1] <= max(8, 4 * b) for w in serving), step
        loop = LoopShape("decode_loop", (s, b), s, stop or 8, 8, stop is not None, top)
        assert dominates(warm[-1], loop)
    # Each is logged as one short line (it was the NamedTuple's repr: ~330 characters a program).
    assert all(len(str(s)) < 100 and str(s).startswith(("step of 512 tokens", "step of 128 tokens", "step of 32",
                                                         "step of 16", "fused decode of 8 steps")) for s in warm)
    small = warmup_shapes(max_tokens=32, max_seqs=4, max_blocks=4, block_size=16, decode_steps=1, narrow=True)
    assert [(w.tokens, w.tables) for w in small] == [(32, (4, 4))] * 2 + [(16, (4, 4))]  # too narrow to narrow
    assert len(warmup_shapes(max_tokens=512, max_seqs=64, max_blocks=128, block_size=16, decode_steps=1,
                             narrow=False)) == 2


def test_generates_bar_says_which_program_it_waits_for(capsys):
    """A first run's compiles (seconds; minutes on a large model) used to leave the bar at 0% with no word: it
    now says which step program the run waits for, and for what it is compiled."""
    from pagedjax.compile_cache import cache_note

    engine = make_engine(compile_in_background=False)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=True)
    err = capsys.readouterr().err
    assert cache_note() == "first run; cached afterwards" or "compile cache is off" in cache_note()
    assert f"compiling step program 1 ({cache_note()})" in err, err
    assert f"compiling step program {engine.stats().compilations} (" in err, err


# ------------------------------------------------------------------------------------- the cache, alone
def _step(tokens: int, seqs: int, blocks: int = 2, **parts) -> StepShape:
    shape = StepShape("step", tokens, (seqs, blocks), False, False, None, None, False, None, 0)
    return shape._replace(**parts)


def _job(shape, calls: list, block: threading.Event | None = None, fail: bool = False, sleep: float = 0.0):
    """A `prepare` for `ProgramCache` whose program is a string; it records the thread that compiles it."""
    def run():
        calls.append((shape, threading.current_thread() is threading.main_thread()))
        time.sleep(sleep)
        if block is not None:
            block.wait(10)
        if fail:
            raise RuntimeError("injected compile failure")
        return f"exe{shape.tokens}x{shape.tables[0]}"
    return lambda: run


def test_a_miss_runs_on_the_fastest_dominating_program_while_its_own_compiles_in_the_background(monkeypatch):
    cache, calls = ProgramCache(8), []
    big, bigger, small = _step(64, 8), _step(128, 8), _step(16, 2)
    for shape, seconds in ((bigger, 0.001), (big, 0.002)):
        cache.compile(shape, _job(shape, calls))
        cache.record_run(shape, seconds)
    assert dominates(big, small) and not dominates(small, big)
    assert cache.lookup(small, _job(small, calls)) == (bigger, "exe128x8")  # the faster of the two
    assert cache.stand_in_steps == 1
    cache.wait()
    assert calls[-1] == (small, False)  # compiled off the engine thread
    assert cache.lookup(small, _job(small, calls)) == (small, "exe16x2") and cache.stand_in_steps == 1
    # Nothing dominates a step that needs a part no program has: it compiles at once, on this thread.
    logits = _step(16, 2, num_top_logprobs=5)
    assert cache.lookup(logits, _job(logits, calls)) == (logits, "exe16x2") and calls[-1] == (logits, True)
    assert cache.num_compilations == 4
    cache.close()


def test_a_full_cache_compiles_a_shape_only_when_it_is_looked_up_more_than_the_program_it_would_drop():
    """Frequency-based admission: with every slot taken, a shape of the long tail runs on its stand-in and compiles
    nothing (it would drop a frequent program, to be compiled again); once it is looked up more often than the least
    recently used program, it gets its own and that one is dropped."""
    cache, calls = ProgramCache(2), []
    big, a, b = _step(64, 8), _step(16, 2), _step(32, 4)
    cache.compile(big, _job(big, calls), pinned=True)  # a warm-up's program: never dropped
    cache.record_run(big, 0.001)
    assert cache.lookup(a, _job(a, calls)) == (big, "exe64x8")  # room: a compiles in the background
    cache.wait()
    for _ in range(3):
        assert cache.lookup(a, _job(a, calls)) == (a, "exe16x2")  # a: 4 lookups
    for i in range(4):  # b: 1-4 lookups, never more than a's
        assert cache.lookup(b, _job(b, calls)) == (big, "exe64x8")
        cache.wait()
        assert b not in cache.executables and cache.num_compilations == 2, i
    assert cache.lookup(b, _job(b, calls)) == (big, "exe64x8")  # its 5th: more than a's 4, b gets in
    cache.wait()
    assert cache.lookup(b, _job(b, calls)) == (b, "exe32x4") and a not in cache.executables
    assert cache.num_compilations == 3
    cache.close()


def test_a_stand_in_is_used_however_slow_and_the_compile_thread_yields_the_cpu():
    """A step on a stand-in stalls the streams for one run of it, a compile on the engine thread for the whole
    compile (after a warm-up from the persistent cache, a budget of an eighth of the recent compiles refused a
    126 ms stand-in and a step compiled for 4.9 s); on Linux the background compile runs at a lower priority."""
    cache, calls = ProgramCache(8), []
    big, small = _step(64, 8), _step(16, 2)
    cache.compile(big, _job(big, calls, sleep=0.01))
    cache.record_run(big, 60.0)  # a minute a step, against a compile of 10 ms
    niceness = []
    def job():
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return "exe16x2"
    assert cache.lookup(small, lambda: job) == (big, "exe64x8") and cache.stand_in_steps == 1
    cache.wait()
    assert cache.lookup(small, lambda: job) == (small, "exe16x2")
    if sys.platform.startswith("linux"):
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert niceness == [min(19, mine + programs.COMPILE_NICENESS)]
    cache.close()


def test_compiling_a_held_program_returns_it_and_may_pin_it():
    """`warmup()` after steps had compiled the held programs again."""
    cache, calls = ProgramCache(1), []
    a, b = _step(16, 1), _step(32, 2)
    assert cache.compile(a, _job(a, calls)) == cache.compile(a, _job(a, calls), pinned=True) == "exe16x1"
    assert len(calls) == 1 and cache.num_compilations == 1
    cache.compile(b, _job(b, calls))  # over the cap: `a`, now pinned, stays
    assert a in cache.executables and b in cache.executables
    cache.close()


def test_a_failed_background_compile_is_logged_and_compiles_on_the_engine_thread_next_time(caplog):
    cache, calls = ProgramCache(8), []
    cache.compile(_step(64, 8), _job(_step(64, 8), calls))
    cache.record_run(_step(64, 8), 0.0)
    small = _step(16, 2)
    assert cache.lookup(small, _job(small, calls, fail=True))[0] == _step(64, 8)
    with caplog.at_level(logging.ERROR, logger="pagedjax.runner.programs"):
        cache.wait()
    assert "background compile" in caplog.text and "injected compile failure" in caplog.text
    assert small not in cache.executables
    assert cache.lookup(small, _job(small, calls)) == (small, "exe16x2")  # not a stand-in again: compiled now
    assert calls[-1] == (small, True) and cache.stand_in_steps == 1
    cache.close()


def test_background_compiles_are_capped_and_cancelled_on_close():
    cache, calls, gate = ProgramCache(8), [], threading.Event()
    cache.compile(_step(128, 8), _job(_step(128, 8), calls))
    cache.record_run(_step(128, 8), 0.0)
    misses = [_step(16, s) for s in (1, 2, 4, 8)]
    for shape in misses:  # every one runs on the stand-in; MAX_PENDING compiles are queued, no more
        assert cache.lookup(shape, _job(shape, calls, block=gate))[0] == _step(128, 8)
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:  # the first has begun (and waits at the gate)
            time.sleep(0.01)
    assert cache.num_pending == MAX_PENDING and cache.num_compilations == 1 + MAX_PENDING
    cache.close()  # the waiting one is cancelled; the running one ends unused
    gate.set()
    assert cache.num_pending == 0 and cache.num_compilations == 2  # the warm one and the one that ran
    assert cache.lookup(misses[-1], _job(misses[-1], calls)) == (misses[-1], "exe16x8")  # closed: compiled now
    assert calls[-1] == (misses[-1], True)


def test_pinned_programs_are_never_dropped():
    cache, calls = ProgramCache(2), []
    warm = _step(128, 8)
    cache.compile(warm, _job(warm, calls), pinned=True)
    shapes = [_step(16, s) for s in (1, 2, 4)]
    for shape in shapes:
        cache.compile(shape, _job(shape, calls))
    assert list(cache.executables) == [warm, shapes[-1]]  # the least recently used unpinned ones went
    tiny = ProgramCache(1)  # a cap below the pinned programs holds them and the latest
    for shape in (warm, *shapes):
        tiny.compile(shape, _job(shape, calls), pinned=shape == warm)
    assert list(tiny.executables) == [warm, shapes[-1]]


def test_programs_loaded_from_the_persistent_cache_are_told_from_compiled_ones_per_thread():
    """JAX records its persistent-cache events, and the duration of every program XLA compiles or loads from that
    cache, on the compiling thread: a job whose compile found its program is counted loaded, one that looked and
    missed (or never looked: the cache off) compiled, and one in which XLA built nothing (the program still in
    JAX's memory) loaded, on either thread."""
    from jax import monitoring

    def job(result, *events):
        def run():
            for event in events:
                if event == programs.BACKEND_COMPILE_EVENT:
                    monitoring.record_event_duration_secs(event, 0.5)
                else:
                    monitoring.record_event(event)
            return result
        return lambda: run

    lookup, hit, built = programs.CACHE_LOOKUP_EVENT, programs.CACHE_HIT_EVENT, programs.BACKEND_COMPILE_EVENT
    cache = ProgramCache(8)
    big, small, other = _step(64, 8), _step(16, 2), _step(32, 4)
    cache.compile(big, job("exe-big", lookup, hit, built))
    cache.record_run(big, 0.0)
    assert (cache.num_compilations, cache.num_loaded) == (1, 1)
    cache.compile(other, job("exe-other", lookup, built))  # looked, missed: compiled
    assert (cache.num_compilations, cache.num_loaded) == (2, 1)
    monitoring.record_event(hit)  # outside any compile job: not counted
    assert cache.lookup(small, job("exe-small", lookup, hit, built))[0] == big  # its own loads in the background
    cache.wait()
    assert (cache.num_compilations, cache.num_loaded) == (3, 2)
    cache.compile(_step(16, 1), job("exe-off", built))  # the cache is off: compiled
    assert (cache.num_compilations, cache.num_loaded) == (4, 2)
    cache.compile(_step(16, 4), job("exe-held"))  # nothing built: in JAX's memory
    assert (cache.num_compilations, cache.num_loaded) == (5, 3)
    cache.close()


def test_a_second_engine_of_the_same_structure_compiles_nothing_its_predecessor_compiled():
    """Runners of one model structure share their jitted programs (`runner._jitted`), and so JAX's in-memory
    caches: an engine made after another of the same structure (the first one gone) runs the same steps without
    XLA compiling anything, counts its programs loaded, and gives the same tokens; one of another structure
    compiles its own."""
    from jax import monitoring

    compiled = []
    listener = lambda event, seconds, **kw: compiled.append(event) if event == programs.BACKEND_COMPILE_EVENT else None
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(block_size=BLOCK_SIZE):
        engine = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=block_size, num_blocks=64),
                           scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_LEN,
                                                            max_num_batched_tokens=MAX_BATCHED), seed=3)
        start = len(compiled)
        tokens = [out.outputs[0].token_ids for out in engine.generate(prompts, params, use_tqdm=False)]
        stats = engine.runner.programs
        return tokens, len(compiled) - start, (stats.num_compilations, stats.num_loaded)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        first, _, (obtained, _) = run()
        second, built, counts = run()
        assert second == first and built == 0 and counts == (obtained, obtained)
        _, built, _ = run(block_size=8)  # another structure: its own programs
        assert built > 0
    finally:
        monitoring.unregister_event_duration_listener(listener)


def test_steps_in_which_no_sequence_emits_compute_no_logits_and_give_the_same_tokens(monkeypatch):
    """A prompt's chunks before its last, and pooling requests, emit no token: their steps leave the LM head and
    sampling out (`StepShape.sample` False); the tokens are the same as with every step sampling."""
    engine = make_engine(compile_in_background=False)
    seen = _recording_lookups(monkeypatch, engine)
    prompt = list(range(3, 53))  # two chunks of the 32-token budget: the first without a sampled token
    params = SamplingParams(temperature=0.0, max_tokens=4)
    got = engine.generate([prompt], params, use_tqdm=False)[0].output_token_ids
    engine.embed([prompt[:5]])
    assert any(not s.sample and not s.pool for s, _ in seen) and any(not s.sample and s.pool for s, _ in seen)
    assert all(s.sample for s, _ in seen if s.decode_only)
    everything = make_engine(compile_in_background=False, batch_invariant=True)  # one program: sampling on
    assert everything.generate([prompt], params, use_tqdm=False)[0].output_token_ids == got


_SORT = re.compile(r"\bsort\(")  # an HLO sort op (the draw's top-k / top-p cut sorts the vocabulary)


def test_greedy_steps_leave_the_draw_out_and_run_on_a_held_drawing_twin(monkeypatch):
    """A step whose rows are all greedy compiles without the random draw (`StepShape.draws` off: the vocabulary
    sort and per-row keys were about half of a small model's step program, and so of its compile time), a fused
    decode likewise; the tokens are those of the drawing program. Where the drawing twin of a greedy step is held
    (a sampled request ran at that shape), the greedy step runs on it instead of compiling its own."""
    engine = make_engine(compile_in_background=False, decode_steps_per_call=4)
    seen = _recording_lookups(monkeypatch, engine)
    prompt, greedy = list(range(3, 43)), SamplingParams(temperature=0.0, max_tokens=12)
    got = engine.generate([prompt], greedy, use_tqdm=False)[0].output_token_ids
    sampling = [s for s, _ in seen if s.kind == "decode_loop" or s.sample]
    assert {s.kind for s in sampling} == {"step", "decode_loop"} and not any(s.draws for s in sampling)
    programs = engine.runner.programs.executables
    assert not any(_SORT.search(programs[s].as_text()) for s in sampling)
    everything = make_engine(compile_in_background=False, batch_invariant=True)  # one program: the draw in it
    assert everything.runner.fixed_shape.draws
    assert everything.generate([prompt], greedy, use_tqdm=False)[0].output_token_ids == got

    twins = make_engine(compile_in_background=False, decode_steps_per_call=4)
    seen = _recording_lookups(monkeypatch, twins)
    twins.generate([prompt], SamplingParams(temperature=0.8, seed=1, max_tokens=12), use_tqdm=False)
    drawing = {s for s, _ in seen if s.kind == "decode_loop" or s.sample}
    assert all(s.draws for s in drawing) and all(_SORT.search(twins.runner.programs.executables[s].as_text())
                                                for s in drawing)
    compiled, seen[:] = twins.stats().compilations, []
    assert twins.generate([prompt], greedy, use_tqdm=False)[0].output_token_ids == got
    assert twins.stats().compilations == compiled and {s for s, _ in seen if s.kind == "decode_loop" or s.sample} \
        <= drawing
    assert dominates(_step(16, 1), _step(16, 1, draws=False)) and not dominates(_step(16, 1, draws=False), _step(16, 1))
    loop = LoopShape("decode_loop", (1, 2), 1, 8, 8, False, None)
    assert dominates(loop, loop._replace(draws=False)) and not dominates(loop._replace(draws=False), loop)
    assert "greedy" in str(_step(16, 1, draws=False)) and "greedy" in str(loop._replace(draws=False))


def test_an_optional_lookup_skips_while_its_program_compiles_in_the_background(caplog):
    """`lookup_optional` (an MTP head's calls): a miss returns None and compiles off the engine thread (no stand-in
    needed), then the program; a failed background compile compiles on the engine thread next time; without
    background compiles (or after `close`) a miss compiles at once."""
    cache, calls = ProgramCache(8), []
    a, b = _step(16, 2), _step(32, 4)
    assert cache.lookup_optional(a, _job(a, calls)) is None and cache.num_pending == 1
    cache.wait()
    assert calls == [(a, False)] and cache.lookup_optional(a, _job(a, calls)) == "exe16x2"
    assert cache.lookup_optional(b, _job(b, calls, fail=True)) is None
    with caplog.at_level(logging.ERROR, logger="pagedjax.runner.programs"):
        cache.wait()
    assert "injected compile failure" in caplog.text
    assert cache.lookup_optional(b, _job(b, calls)) == "exe32x4" and calls[-1] == (b, True)
    assert cache.compile_seconds > 0.0 and cache.stand_in_steps == 0
    cache.close()
    c = _step(64, 8)
    assert cache.lookup_optional(c, _job(c, calls)) == "exe64x8" and calls[-1] == (c, True)
    now = ProgramCache(8, background=False)
    assert now.lookup_optional(a, _job(a, calls)) == "exe16x2" and calls[-1] == (a, True)
