"""The compiled programs of one runner, by shape (`pagedjax.runner.shapes`): held up to a cap, and compiled
without stalling a step that a program already held can run.

`lookup(shape, prepare)` gives the program a step runs on:
  - its own, when held;
  - else, when held programs dominate the step (`shapes.dominates`), the one whose runs were fastest (a warm-up
    program compiled in the background and not run yet first, when it is smaller than that one: `shapes.
    run_cost`; its run then measures it): the step runs there now (a *stand-in* step, counted in
    `stand_in_steps`) while its own program compiles in a background thread, to be used from the first lookup
    after it finished; but when the cache is full, only if the shape was looked up more often lately than the
    program its install would drop (the least recently used one not pinned): a shape of the workload's long tail
    keeps running on its stand-in instead of evicting a frequent one that would be compiled again (frequency-based
    admission, as TinyLFU's; the counts halve every `AGING_LOOKUPS` lookups per held program, so the frequent
    shapes of a changed workload get in);
  - else its own, compiled now on the caller's thread (and timed in `compile_seconds`; `listeners` hear of it as
    it starts and ends, so that a front end can say why nothing happens meanwhile).
Run times are what the caller reports (`record_run`: the fastest run of each program). A stand-in is used however
slow it is: a step on it stalls the streams for one run of it, a compile on the caller's thread for the whole
compile, which is longer (the bundled model on a 2-core CPU: warm-up stand-ins 14-250 ms a step, the widest
1.1 s; compiles 0.5-5 s). (An earlier rule refused stand-ins slower than an
eighth of the recent compiles; after a warm-up loaded from the persistent compilation cache, whose compiles took
0.5-0.9 s, it refused the bundled model's 126 ms stand-in, and the step compiled its own program for 4.9 s.)
The warm-up gives the XLA path a ladder of stand-ins of growing size (`shapes.warmup_shapes`), so a step's is
near its own size. The background compile thread runs at a lower scheduling priority (Linux: the thread's nice
value, `COMPILE_NICENESS`), so that on a CPU backend the steps it shares the cores with go first.
Only the caller's (the engine's) thread touches the held programs: a background compile hands back a future,
which the next lookup installs (the compile thread only logs it when it is done). A background compile that fails
is logged, and its shape is compiled on the caller's thread the next time it is needed (where a compile error fails
the step, as ever). At most `MAX_PENDING` compiles of steps' own programs wait or run at once; a miss beyond them
runs on its stand-in and asks again next time.

`lookup_optional(shape, prepare)` is for work a step can do without (an MTP head's proposals): its own program,
or, with background compiles, None while that compiles.

`warm_in_background(jobs)` queues a warm-up's programs behind them (a server's: it answers at once, its first
steps compiling their own programs, while the stand-ins compile): the one compile thread always takes a step's own
program first, then the warm-up's in the order given; each is pinned when installed, and `warm_in_background`'s
future completes once all of them are compiled. `close()` (or the cache's garbage collection) cancels the compiles
still waiting.

Programs are counted one way: `num_compilations` programs obtained (compiled on either thread, dropped ones
included), `num_loaded` of them found in JAX's persistent compilation cache or still in its memory (an earlier
engine's of the same structure) instead of compiled (told by JAX's monitoring events of the thread that ran the
compile, see `_timed`), and `compile_seconds` the caller's waits.

At most `max_programs` programs are held: past it the least recently used is dropped (its executable, and so
its memory, freed once no step runs it), except pinned ones (`compile(..., pinned=True)`, the warm-up's) and the
one just compiled, so a cap below the pinned programs holds them and one more.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import numpy as np

from pagedjax.runner.shapes import dominates, run_cost

logger = logging.getLogger(__name__)

MAX_PENDING = 2  # steps' own programs, one compiling, one waiting: a burst of new shapes is compiled by the latest
AGING_LOOKUPS = 8  # per held program: the lookup counts halve every AGING_LOOKUPS * max_programs lookups
#                 need, not its order (a warm-up's programs wait behind them, uncounted)
COMPILE_NICENESS = 10  # added to the background compile thread's nice value (Linux), see the module's docstring

# JAX's monitoring events: a compile that looks in the persistent cache, and one that finds its program there; and
# the duration event around every program XLA compiles or loads from that cache (none when JAX's in-memory caches
# hold the program: a runner of the same structure made it, `runner._jitted`).
CACHE_LOOKUP_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# A compile job: runs on any thread, so it holds abstract arguments and compile options, never live arrays (the
# KV cache is donated to every step) nor the runner (it may outlive it).
Job = Callable[[], Any]


def lower_priority() -> None:
    """Lower the calling thread's scheduling priority by `COMPILE_NICENESS` (a thread's nice value is its own on
    Linux, and the threads it starts inherit it); elsewhere a no-op. The initializer of this module's compile thread
    and of the server's image decoding threads (`pagedjax.serve.images`): work that must not slow the steps."""
    if sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS)


# The persistent-cache events of the compile job this thread runs (None: none runs); JAX records them on the thread
# that compiles, so concurrent compiles (the background thread's, the caller's) are told apart.
_compiling = threading.local()
_listening = threading.Lock()
_listener_registered = False


def _on_jax_event(event: str, *args, **kwargs) -> None:
    events = getattr(_compiling, "events", None)
    if events is not None and event in (CACHE_LOOKUP_EVENT, CACHE_HIT_EVENT, BACKEND_COMPILE_EVENT):
        events.append(event)


def _listen() -> None:
    """Register `_on_jax_event` with JAX's monitoring (events and duration events), once per process."""
    global _listener_registered
    with _listening:
        if not _listener_registered:
            from jax import monitoring

            monitoring.register_event_listener(_on_jax_event)
            monitoring.register_event_duration_secs_listener(_on_jax_event)
            _listener_registered = True


class CompileEvent(NamedTuple):
    """A program the caller waits for (`ProgramCache.compile`, heard on the caller's thread by the cache's
    `listeners`): as it starts (`seconds` None), then when it is ready, in `seconds`, loaded from the persistent
    compilation cache or compiled. `note`: the caller's (a warm-up's "3 of 6"), or ""."""

    shape: Hashable
    seconds: float | None = None
    loaded: bool = False
    note: str = ""


class _CompileThread:
    """The one background compile thread of a cache: a step's own programs first (`urgent`), then the warm-up's,
    each kind in the order submitted; at a lower scheduling priority (`lower_priority`). A `ThreadPoolExecutor`'s
    one worker runs them (the interpreter waits at exit for the compile it runs: a thread ended inside XLA aborts
    the process), each of its tasks taking the first job of the priority queue; a job's future completes with its
    result, and one cancelled before its job began is skipped."""

    def __init__(self):
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedjax-compile",
                                            initializer=lower_priority)

    def submit(self, job: Callable[[], Any], *, urgent: bool) -> Future:
        future: Future = Future()
        self._jobs.put((0 if urgent else 1, next(self._order), future, job))
        self._executor.submit(_run_first, self._jobs)
        return future

    def stop(self) -> None:
        """Run no more jobs (the one running finishes)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _run_first(jobs: queue.PriorityQueue) -> None:
    """Run the first job of `jobs` (one task per job submitted: every job is taken by one)."""
    _, _, future, job = jobs.get_nowait()
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(job())
        except BaseException as e:  # noqa: BLE001 - the future carries it to the caller's thread
            future.set_exception(e)


def _timed(job: Job) -> tuple[Any, float, bool]:
    """(the job's program, its seconds, whether it was loaded rather than compiled: XLA built nothing (JAX's
    in-memory caches held the program), or every compile the job ran looked in the persistent compilation cache
    and found its program there)."""
    _listen()
    _compiling.events = events = []
    start = time.perf_counter()
    try:
        exe = job()
    finally:
        _compiling.events = None
    lookups, hits = events.count(CACHE_LOOKUP_EVENT), events.count(CACHE_HIT_EVENT)
    built = BACKEND_COMPILE_EVENT in events
    return exe, time.perf_counter() - start, not built or (lookups > 0 and hits == lookups)


class _WarmUp:
    """A `warm_in_background` call's programs: how many, how many are done (compiled, or failed: counted by the
    compile thread, or by the caller's when it compiled one itself), since when, and the future that completes
    with the seconds they took once all are done."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.future: Future = Future()
        self._lock = threading.Lock()

    def finished_one(self) -> None:
        with self._lock:
            self.done += 1
            last = self.done == self.total
        if last:
            seconds = time.perf_counter() - self.start
            logger.info("warm-up: %d programs ready in %.1f s (in the background)", self.total, seconds)
            self.future.set_result(seconds)


class ProgramCache:
    """Compiled programs by shape (see the module's docstring). `prepare()`, called on the caller's thread only
    when a shape must be compiled, returns its `Job`. `background=False`: every miss compiles at once.
    `listeners`: called with a `CompileEvent` as each compile the caller waits for starts and ends."""

    def __init__(self, max_programs: int, *, background: bool = True, on_drop: Callable[[], None] | None = None):
        self.max_programs = max_programs
        self._on_drop = on_drop  # called after programs were dropped (to free what else holds them)
        self.executables: OrderedDict[Hashable, Any] = OrderedDict()  # least recently used first
        self.num_compilations = 0  # compiles started (background ones included), dropped programs included
        self.num_loaded = 0  # of those finished, programs loaded from the persistent compilation cache
        self.compile_seconds = 0.0  # the caller's wait for compiles inside `lookup`
        self.stand_in_steps = 0
        self.listeners: list[Callable[[CompileEvent], None]] = []
        self._background = background
        self._pinned: set[Hashable] = set()
        self._pending: dict[Hashable, Future] = {}
        self._warming: set[Hashable] = set()  # pending or compiling for a warm-up: pinned once held
        self._failed: set[Hashable] = set()  # background compile failed: compile on the caller's thread next
        self._thread: _CompileThread | None = None
        self._shutdown: weakref.finalize | None = None
        self._run_seconds: dict[Hashable, float] = {}  # the fastest run of each held program
        self._lookups: dict[Hashable, int] = {}  # recent lookups of each shape (halved as they age: `_count`)
        self._num_lookups = 0

    def __len__(self) -> int:
        return len(self.executables)

    @property
    def num_pending(self) -> int:
        """Background compiles waiting or running (a warm-up's included)."""
        return len(self._pending)

    def lookup(self, shape: Hashable, prepare: Callable[[], Job]) -> tuple[Hashable, Any]:
        """(the shape of the program to run the step on, that program): `shape`'s own or a stand-in's."""
        self._install_finished()
        self._count(shape)
        exe = self.executables.get(shape)
        if exe is not None:
            self.executables.move_to_end(shape)
            return shape, exe
        stand_in = self._stand_in(shape)
        if stand_in is not None:
            if self._admits(shape):
                self._compile_in_background(shape, prepare)
            self.stand_in_steps += 1
            self.executables.move_to_end(stand_in)
            return stand_in, self.executables[stand_in]
        return shape, self._compile_now(shape, prepare)

    def lookup_optional(self, shape: Hashable, prepare: Callable[[], Job]) -> Any | None:
        """`shape`'s own program, or None while it compiles in the background (for work a step can go without,
        such as a speculative proposer's: it skips this step instead of waiting; a miss beyond `MAX_PENDING`
        compiles asks again next time). Without background compiles, a miss compiles now, as `lookup`."""
        self._install_finished()
        self._count(shape)
        exe = self.executables.get(shape)
        if exe is not None:
            self.executables.move_to_end(shape)
            return exe
        if self._background and shape not in self._failed:
            self._compile_in_background(shape, prepare)
            return None
        return self._compile_now(shape, prepare)

    def compile(self, shape: Hashable, prepare: Callable[[], Job], *, pinned: bool = False, note: str = "") -> Any:
        """Compile `shape`'s program now on this thread (or take it from its background compile, if that has
        begun), hold it (`pinned`: for good) and return it. A program already held is returned as it is.
        `note` (a warm-up's "3 of 6") goes with its log line and `CompileEvent`s."""
        held = self.executables.get(shape)
        if held is not None:
            self.executables.move_to_end(shape)
            if pinned:
                self._pinned.add(shape)
            return held
        self._tell(CompileEvent(shape, note=note))
        future = self._pending.pop(shape, None)
        exe, warm_up = None, None
        if future is not None and future.cancel():
            self.num_compilations -= 1  # never begun
            warm_up = future.warm_up  # a warm-up's program, compiled here instead: one of its done
        elif future is not None:  # begun: it is the quicker way
            try:
                exe, seconds, loaded = future.result()
                self.num_loaded += loaded
            except Exception:  # noqa: BLE001 - logged; compiled here instead, where its error fails the step
                logger.exception("the background compile of %s failed; compiling it again", shape)
        if exe is None:
            exe, seconds, loaded = _timed(prepare())
            self.num_compilations += 1
            self.num_loaded += loaded
            logger.info("%s: %s in %.2f s%s", shape, _verb(loaded), seconds, f" ({note})" if note else "")
        self._install(shape, exe, pinned)
        if warm_up is not None:
            warm_up.finished_one()
        self._tell(CompileEvent(shape, seconds, loaded, note))
        return exe

    def warm_in_background(self, jobs: Sequence[tuple[Hashable, Callable[[], Job]]]) -> Future:
        """Compile each `(shape, prepare)` in the background, after every step's own program that waits (see the
        module's docstring), in this order; pin each when installed. Returns a future of the seconds until the
        last was compiled (already held ones count as done). RuntimeError for a cache without background
        compiles."""
        if not self._background:
            raise RuntimeError("warm_in_background needs a cache with background compiles (closed, or "
                               "background=False)")
        todo = [(shape, prepare) for shape, prepare in jobs if shape not in self.executables]
        for shape, _ in jobs:
            if shape in self.executables:
                self._pinned.add(shape)
        warm_up = _WarmUp(len(todo))
        if not todo:
            warm_up.future.set_result(0.0)
        for shape, prepare in todo:
            self._warming.add(shape)
            if shape not in self._pending:
                self._submit(shape, prepare, urgent=False, warm_up=warm_up)
            else:  # a step's own compile already asked for it
                self._pending[shape].add_done_callback(lambda _, w=warm_up: w.finished_one())
        return warm_up.future

    def record_run(self, shape: Hashable, seconds: float) -> None:
        """A run of `shape`'s program took `seconds` (for choosing stand-ins)."""
        if shape in self.executables:
            self._run_seconds[shape] = min(seconds, self._run_seconds.get(shape, seconds))

    def wait(self) -> None:
        """Wait for the background compiles and hold their programs (for tests and benchmarks: a server never
        waits)."""
        futures.wait(list(self._pending.values()))
        self._install_finished()

    def close(self) -> None:
        """Cancel the background compiles still waiting (the one running finishes, unused); misses compile on the
        caller's thread from now on."""
        self._background = False
        self.num_compilations -= sum(future.cancel() for future in self._pending.values())
        self._pending.clear()
        self._warming.clear()
        if self._shutdown is not None:
            self._shutdown()

    # --------------------------------------------------------------------------------------------- internals
    def _compile_now(self, shape: Hashable, prepare: Callable[[], Job]) -> Any:
        """A lookup's miss compiled on the caller's thread, its wait counted in `compile_seconds`."""
        start = time.perf_counter()
        exe = self.compile(shape, prepare)
        self.compile_seconds += time.perf_counter() - start
        return exe

    def _tell(self, event: CompileEvent) -> None:
        for listener in self.listeners:
            listener(event)

    def _count(self, shape: Hashable) -> None:
        self._lookups[shape] = self._lookups.get(shape, 0) + 1
        self._num_lookups += 1
        if self._num_lookups >= AGING_LOOKUPS * self.max_programs:
            self._num_lookups = 0
            self._lookups = {s: n // 2 for s, n in self._lookups.items() if n > 1}

    def _admits(self, shape: Hashable) -> bool:
        """Whether a missed shape with a stand-in gets its own program: while the cache has room (counting the
        compiles on their way), or when it was looked up more often lately than the program its install would
        drop."""
        coming = sum(s not in self.executables for s in self._pending)
        if len(self.executables) + coming < self.max_programs:
            return True
        victim = next((s for s in self.executables if s not in self._pinned), None)
        return victim is None or self._lookups.get(shape, 0) > self._lookups.get(victim, 0)

    def _stand_in(self, shape: Hashable) -> Hashable | None:
        if not self._background or shape in self._failed:
            return None
        fits = [held for held in self.executables if dominates(held, shape)]
        measured = [(self._run_seconds[held], held) for held in fits if held in self._run_seconds]
        fastest = min(measured, key=lambda m: m[0])[1] if measured else None
        # A warm-up program not run yet (compiled in the background) stands in when it is smaller than the fastest
        # one run: its run measures it.
        fresh = [held for held in fits if held in self._pinned and held not in self._run_seconds
                 and (fastest is None or run_cost(held) < run_cost(fastest))]
        return min(fresh, key=run_cost) if fresh else fastest

    def _compile_in_background(self, shape: Hashable, prepare: Callable[[], Job]) -> None:
        future = self._pending.get(shape)
        if future is not None:
            if shape in self._warming and future.cancel():  # a step needs it now: ahead of the warm-up's others
                del self._pending[shape]
                self.num_compilations -= 1
                self._submit(shape, prepare, urgent=True, warm_up=future.warm_up)
            return
        if sum(s not in self._warming for s in self._pending) >= MAX_PENDING:
            return
        self._submit(shape, prepare, urgent=True)

    def _submit(self, shape: Hashable, prepare: Callable[[], Job], *, urgent: bool,
                warm_up: _WarmUp | None = None) -> None:
        if self._thread is None:
            self._thread = _CompileThread()
            # An engine dropped without close() must not leave compiles queued behind it.
            self._shutdown = weakref.finalize(self, self._thread.stop)
        job = prepare()

        def compile_and_log():  # on the compile thread: logs as soon as it is done (it is installed later)
            try:
                exe, seconds, loaded = result = _timed(job)
                logger.info("%s: %s in %.2f s (in the background%s)", shape, _verb(loaded), seconds,
                            "" if warm_up is None else f", warm-up {warm_up.done + 1} of {warm_up.total}")
                return result
            finally:
                if warm_up is not None:
                    warm_up.finished_one()

        future = self._thread.submit(compile_and_log, urgent=urgent)
        future.warm_up = warm_up  # kept for a resubmission (`_compile_in_background`)
        self._pending[shape] = future
        self.num_compilations += 1

    def _install_finished(self) -> None:
        for shape, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[shape]
            error = future.exception()
            if error is not None:
                logger.error("the background compile of %s failed (it compiles on the engine thread when next "
                             "needed): %s: %s", shape, type(error).__name__, error, exc_info=error)
                self._failed.add(shape)
                self._warming.discard(shape)
                continue
            exe, _, loaded = future.result()
            self.num_loaded += loaded
            self._install(shape, exe, pinned=False)

    def _install(self, shape: Hashable, exe: Any, pinned: bool) -> None:
        self.executables[shape] = exe
        self._failed.discard(shape)
        if pinned or shape in self._warming:
            self._pinned.add(shape)
            self._warming.discard(shape)
        any_dropped = False
        while len(self.executables) > self.max_programs:
            dropped = next((s for s in self.executables if s not in self._pinned and s != shape), None)
            if dropped is None:
                break
            del self.executables[dropped]
            self._run_seconds.pop(dropped, None)
            any_dropped = True
            logger.info("dropped the least recently used program %s (at most %d are kept)", dropped,
                        self.max_programs)
        if any_dropped and self._on_drop is not None:
            self._on_drop()


def all_done(pending: Sequence[Future]) -> Future:
    """A future that completes once every one of `pending` (warm-ups' futures of seconds) has, with the largest
    result (they ran at once)."""
    together: Future = Future()
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            together.set_result(max(f.result() for f in pending))

    for future in pending:
        future.add_done_callback(one_done)
    return together


def abstract_value(x) -> Any:
    """An argument's shape, dtype (and a device array's sharding): all that compiling for it needs (what a `Job`
    holds instead of live arrays)."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _verb(loaded: bool) -> str:
    return "loaded from the compilation cache" if loaded else "compiled"
