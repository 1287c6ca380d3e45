"""One engine over several hosts behind one front: process 0 takes the requests, every process runs the same plans.

    initialize("HOST0:9876", num_processes=N, process_id=i)      # pagedjax.parallel.distributed, on every host
    engine = LLMEngine.from_pretrained(path, parallel_config=ParallelConfig(tensor_parallel_size=8 * N))
    if jax.process_index() == 0:
        engine = MultiHostEngine(engine)        # the Engine protocol: generate, add_request, step, a server, ...
        ...
        engine.close()                          # the others' `follow` returns
    else:
        follow(engine)                          # until process 0 closes; raises RankLostError if it is lost

JAX runs one SPMD program over every host's devices, and each process's deterministic scheduler must make the same
plan before each step. So whatever changes an engine's state between steps (an added request with its token ids and
parameters, an abort, an adapter added or removed: `pagedjax.engine.commands`) is done at once on process 0 (its
errors raised to its caller, nothing sent then) and recorded; each step, warm-up or idle heartbeat is one
exchange (`pagedjax.parallel.distributed.exchange`: JAX's own all-gather) carrying the commands since the last
one, which the other processes apply in the same order before the same step. Invariant: at every exchange, every
process has applied the same commands after the same steps.

Each exchange also carries every process's digest of its scheduler's state after its last step (each request's id,
computed and total tokens, status): a process whose digest differs from process 0's makes every process raise
`RanksDivergedError` naming it, at the same exchange.

Faults: a process that died makes the next collective raise (at once: the connection closes), a process that
stalls makes process 0 wait `timeout_s` (compiles not counted: a step waiting for its program compiles on every
process); either way `RankLostError` is raised from then on by every call, and `on_lost` (given) hears of it, also
when the idle heartbeat (every `heartbeat_s` without a step) found it. The engine cannot go on (the SPMD program
spans the lost host): a front end fails its requests and exits (`pagedjax-serve` does, `pagedjax.serve.cli`).

What needs a process's own inputs refuses here, by name: prompts with images (pixels are not sent), weights or
adapters given as arrays (`update_weights`, `add_lora_adapter`), sleep / wake, beam search (it steers the
scheduler between steps), background compiles (`compile_in_background`: which program runs a step would depend on
each process's timing) and a disk KV tier (each host's own disk would decide its hits).

Start-up: `MultiHostEngine` and `follow` first compare every process's description (`describe`: versions, the
engine's config, the weights' shapes; plus the caller's `extra`, e.g. the model folder's files) and raise
`RanksMismatchError` on every process, naming each field that differs from process 0's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import jax

from pagedjax.engine.commands import Abort, Add, AddLoRA, Command, Message, RemoveLoRA, decode, encode
from pagedjax.engine.generate import classify_batch, embed_batch, generate_batch
from pagedjax.engine.llm_engine import LLMEngine, token_list
from pagedjax.engine.protocol import PreparedRequest
from pagedjax.engine.relevance import relevance_batch
from pagedjax.engine.scoring import completion_logprobs
from pagedjax.errors import EngineUnavailable, UnsupportedFeature
from pagedjax.outputs import RequestOutput
from pagedjax.parallel import distributed
from pagedjax.runner.programs import CompileEvent
from pagedjax.sampling_params import LoRARequest, SamplingParams

logger = logging.getLogger(__name__)


class RankLostError(EngineUnavailable):
    """A process of a multi-host engine died or stopped answering: the engine cannot step any more."""


class RanksDivergedError(EngineUnavailable):
    """A process's scheduler state differs from process 0's (a bug, or a process's own failure): the engine stops."""


class RanksMismatchError(RuntimeError):
    """At start: a process runs another version, config or model than process 0 (each difference named)."""


# What the leader reads of its engine, unchanged (the rest of `LLMEngine` changes state, or needs a process's own
# inputs: named in the module docstring, refused in `__getattr__`).
_READ_ONLY = frozenset({"tokenizer", "model_config", "model_spec", "max_request_tokens", "classifier", "config",
                        "cache_config", "scheduler_config", "parallel_config", "image_processor", "lora", "backend",
                        "num_blocks", "decode_steps_per_call", "fresh_request_ids", "compile_constraint",
                        "encode_prompt", "list_loras", "has_unfinished_requests", "stats", "stats_dict",
                        "compile_notices", "runner", "structured", "speculator", "extra_pools", "pool_block_sizes",
                        "output_processor"})


def describe(engine: LLMEngine, extra: dict | None = None) -> dict:
    """What must be the same on every process, as plain data: the library versions, the process and device
    counts, the engine's config, every weight's path, shape and dtype, and `extra` (the caller's)."""
    from importlib.metadata import version

    import jaxlib

    weights = {jax.tree_util.keystr(path): f"{tuple(leaf.shape)} {leaf.dtype}"
               for path, leaf in jax.tree_util.tree_flatten_with_path(engine.runner.params)[0]}
    return {"pagedjax": version("pagedjax"), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "processes": jax.process_count(), "devices": jax.device_count(),
            "config": json.loads(json.dumps(dataclasses.asdict(engine.config), default=repr)),
            "weights": weights, **(extra or {})}


def check_ranks_agree(description: dict) -> None:
    """Compare every process's `description` with process 0's; RanksMismatchError on every process (the same
    message: each differing field, process by process) if any differs. A collective: every process calls it."""
    mine = json.dumps(description, sort_keys=True).encode()
    theirs = [json.loads(b) for b in distributed.allgather_bytes(mine)]
    lines = []
    for p, other in enumerate(theirs[1:], start=1):
        diffs = _differences(theirs[0], other)
        if diffs:
            shown = "; ".join(f"{k}: {a} (process 0) vs {b}" for k, a, b in diffs[:8])
            lines.append(f"process {p} differs from process 0 in {len(diffs)} fields: {shown}"
                         + ("; ..." if len(diffs) > 8 else ""))
    if lines:
        raise RanksMismatchError("the processes do not run the same engine: " + " | ".join(lines))


def _differences(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if a == b else [(prefix, a, b)]


def state_digest(engine: LLMEngine) -> int:
    """A uint64 of the scheduler's state: each unfinished request's id, computed and total tokens and status, in
    the scheduler's order (the same on every process that made the same plans)."""
    h = hashlib.blake2b(digest_size=8)
    for rid, r in engine.scheduler.requests.items():
        h.update(f"{rid}\0{r.num_computed_tokens}\0{r.num_tokens}\0{r.status.value}\n".encode())
    return int.from_bytes(h.digest(), "little")


def _check_engine(engine) -> None:
    if not isinstance(engine, LLMEngine):
        raise TypeError(f"a multi-host engine runs one LLMEngine per process, got {type(engine).__name__}")
    if engine.config.compile_in_background:
        raise ValueError("a multi-host engine needs compile_in_background=False: which program runs a step would "
                         "depend on each process's compile timing (call warmup() instead of start_warmup())")
    if engine.cache_config.kv_disk_dir is not None:
        raise ValueError("a multi-host engine serves no disk KV tier (kv_disk_dir): each host's disk would decide "
                         "its own prefix hits")


class _Round(threading.Thread):
    """The daemon thread that runs every exchange and step of the leader: the caller waits for it with a deadline
    (a collective that never returns leaves only this thread stuck)."""

    def __init__(self):
        super().__init__(name="pagedjax-multihost", daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn: Callable) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((fn, future))
        return future

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the waiting caller raises it
                future.set_exception(e)


class MultiHostEngine:
    """Process 0's engine of a multi-host run (see the module docstring): `LLMEngine`'s request methods, each
    change recorded for the other processes, each step one exchange with them first.

    timeout_s: how long a step (or an idle exchange) may wait for the other processes, compiles not counted.
    heartbeat_s: with no step for this long, an idle exchange (the others learn nothing new; a lost process is
      found while idle).
    on_lost: called once with the RankLostError / RanksDivergedError, from whichever thread found it.
    extra: more to compare at start (`check_ranks_agree`), e.g. the model folder's files.
    """

    def __init__(self, engine: LLMEngine, *, timeout_s: float = 60.0, heartbeat_s: float = 10.0,
                 on_lost: Callable[[EngineUnavailable], None] | None = None, extra: dict | None = None):
        _check_engine(engine)
        if jax.process_index() != 0:
            raise ValueError("MultiHostEngine runs on process 0; the other processes call follow(engine)")
        if not timeout_s > 0 or not heartbeat_s > 0:
            raise ValueError(f"timeout_s and heartbeat_s must be > 0, got {timeout_s}, {heartbeat_s}")
        check_ranks_agree(describe(engine, extra))
        self.engine = engine
        self.timeout_s, self.heartbeat_s, self.on_lost = timeout_s, heartbeat_s, on_lost
        self._lock = threading.RLock()  # one change or exchange at a time
        self._pending: list[Command] = []  # applied here since the last exchange
        self._digest = state_digest(engine)
        self._lost: EngineUnavailable | None = None
        self._closed = False
        self._last_round = time.monotonic()
        self._compiling = 0  # compiles the running round waits for (not counted against timeout_s)
        self._progress = time.monotonic()
        self.bytes_sent = 0  # payload bytes of every exchange (what the others received)
        self.exchanges = 0
        self.exchange_s = 0.0  # time in exchanges (the collective itself, the step not counted)
        self._round = _Round()
        self._round.start()
        self._idle = threading.Event()  # set on close: ends the heartbeat
        threading.Thread(target=self._heartbeat, name="pagedjax-multihost-heartbeat", daemon=True).start()

    @property
    def pending_commands(self) -> tuple[Command, ...]:
        """The changes made here since the last exchange, which the next one sends."""
        return tuple(self._pending)

    # ------------------------------------------------------------------------------------- what others read
    def __getattr__(self, name: str):
        if name in _READ_ONLY:
            return getattr(self.engine, name)
        raise AttributeError(f"MultiHostEngine has no {name!r}: across hosts it offers the request methods, "
                             "generate / embed / classify / relevance / score, adapters from folders, warmup and "
                             "stats (see pagedjax.engine.multihost)")

    # -------------------------------------------------------------------------------------------- changes
    def make_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None, *,
                     cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                     pooling=None) -> PreparedRequest:
        """`LLMEngine.make_request`; UnsupportedFeature for a prompt with images. An adapter it registers (a
        request may name one first) is registered on every process."""
        def make() -> PreparedRequest:
            lora = self.engine.lora
            fresh = (lora_request is not None and lora is not None and isinstance(lora_request, LoRARequest)
                     and lora.key_of(lora_request.lora_int_id) is None)
            try:
                return self.engine.make_request(request_id, prompt, sampling_params, cache_salt=cache_salt,
                                                lora_request=lora_request, pooling=pooling)
            finally:
                if fresh and lora.key_of(lora_request.lora_int_id) is not None:
                    self._pending.append(AddLoRA(lora_request))

        prepared = self._change(make)
        if prepared.request.images:
            raise UnsupportedFeature(f"request {request_id!r}: a multi-host engine takes no images (each process "
                                     "would need the pixels)", param="images", code="images_not_supported")
        return prepared

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        """`LLMEngine.add_prepared_request`, sent to the other processes with the next exchange."""
        r = prepared.request
        if r.images:
            raise UnsupportedFeature(f"request {r.request_id!r}: a multi-host engine takes no images",
                                     param="images", code="images_not_supported")
        lora = None
        if r.adapter_id is not None:
            lora = next(x for x in self.engine.list_loras() if self.engine.lora.key_of(x.lora_int_id) == r.adapter_id)
        add = Add(r.request_id, tuple(r.prompt_token_ids), None if r.pooling is not None else r.sampling_params,
                  r.cache_salt, lora, r.pooling)
        def queue() -> None:
            self.engine.add_prepared_request(prepared)
            self._pending.append(add)

        self._change(queue)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, pooling=None) -> None:
        """`LLMEngine.add_request` (raises as it does, nothing sent then)."""
        self.add_prepared_request(self.make_request(request_id, token_list(request_id, prompt_token_ids),
                                                    sampling_params, cache_salt=cache_salt,
                                                    lora_request=lora_request, pooling=pooling))

    def abort(self, request_id: str) -> bool:
        """`LLMEngine.abort`, on every process."""
        def abort() -> bool:
            found = self.engine.abort(request_id)
            if found:
                self._pending.append(Abort(str(request_id)))
            return found

        return self._change(abort)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """`LLMEngine.add_lora` on every process (each reads the adapter's folder: the same path on every host)."""
        def add() -> bool:
            added = self.engine.add_lora(lora_request)
            self._pending.append(AddLoRA(lora_request))
            return added

        return self._change(add)

    def remove_lora(self, lora_int_id: int) -> bool:
        """`LLMEngine.remove_lora` on every process."""
        def remove() -> bool:
            removed = self.engine.remove_lora(lora_int_id)
            if removed:
                self._pending.append(RemoveLoRA(lora_int_id))
            return removed

        return self._change(remove)

    def _change(self, fn: Callable):
        """`fn()` (a change to the engine, recorded) on the round thread, between exchanges. Every device call of a
        multi-host engine runs on one thread of its own, on every process: a step run from another thread than the
        other processes' ran it from hung with JAX 0.12.1 (measured: the same program, the main thread on one
        process and a second thread on the other). (With JAX 0.12.1 the first step still hangs: docs/parallel.md.)"""
        with self._lock:
            self._check_alive()
            return self._round.submit(fn).result()

    # --------------------------------------------------------------------------------------------- rounds
    def step(self) -> list[RequestOutput]:
        """One exchange, then `LLMEngine.step` on every process; RankLostError / RanksDivergedError when a
        process is lost or differs (then from every later call too)."""
        def step() -> list[RequestOutput]:
            failed = self.engine.failed_steps
            outputs = self.engine.step()
            self._digest = state_digest(self.engine)
            if self.engine.failed_steps > failed:
                # The device call raised and the engine recovered: a lost process makes the next collective raise
                # at once, so one more (idle) exchange now tells that from this process's own failure.
                self._collective(encode(Message("idle")))
            return outputs

        return self._exchange("step", step)

    def warmup(self) -> float:
        """`LLMEngine.warmup` on every process; its seconds here."""
        return self._exchange("warmup", self.engine.warmup)

    def start_warmup(self):
        raise ValueError("a multi-host engine compiles nothing in the background (each process's timing would "
                         "pick its programs): call warmup()")

    def save_kv_tiers(self) -> int:
        """`LLMEngine.save_kv_tiers` on every process (a multi-host engine has no disk tier: 0)."""
        return self._exchange("save_kv_tiers", self.engine.save_kv_tiers)

    def close(self) -> None:
        """Stop the other processes' `follow` (unless one was lost) and this engine's threads; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._idle.set()
            if self._lost is None:
                try:
                    self._exchange("stop", lambda: None, closing=True)
                except EngineUnavailable:
                    logger.warning("closing: the other processes could not be told to stop")
            if self._lost is None:
                self._round.jobs.put(None)
            self.engine.close()

    def _exchange(self, op: str, then: Callable, *, closing: bool = False):
        """One round: the pending commands and `op` to every process, then `then()` here (on the round thread),
        waited for with the deadline."""
        with self._lock:
            self._check_alive(closing)
            message, self._pending = Message(op, tuple(self._pending)), []
            payload = encode(message)

            def run():
                self._collective(payload)
                return then()

            self._progress = time.monotonic()
            with self.engine.compile_notices(self._heard):
                future = self._round.submit(run)
                try:
                    return self._wait(future, op)
                finally:
                    self._last_round = time.monotonic()

    def _collective(self, payload: bytes) -> None:  # the round thread
        start = time.perf_counter()
        digests = _exchange(payload, self._digest)[1]
        self.exchange_s += time.perf_counter() - start
        self.exchanges += 1
        self.bytes_sent += len(payload)
        _check_digests(digests)

    def _heard(self, event: CompileEvent) -> None:  # the round thread: a compile starts or ends
        self._compiling += 1 if event.seconds is None else -1
        self._progress = time.monotonic()

    def _wait(self, future: concurrent.futures.Future, op: str):
        while True:
            try:
                return future.result(timeout=min(1.0, self.timeout_s))
            except concurrent.futures.TimeoutError:
                if not self._compiling and time.monotonic() - self._progress > self.timeout_s:
                    self._fail(RankLostError(f"a process did not answer within {self.timeout_s:g} s ({op}): "
                                             "lost, or stalled; the engine cannot step any more"))
            except EngineUnavailable as e:
                self._fail(e)

    def _fail(self, error: EngineUnavailable):
        self._lost = error
        logger.error("multi-host engine: %s", error)
        if self.on_lost is not None:
            self.on_lost(error)
        raise error

    def _check_alive(self, closing: bool = False) -> None:
        if self._lost is not None:
            raise type(self._lost)(str(self._lost))
        if self._closed and not closing:
            raise EngineUnavailable("the multi-host engine is closed")

    def _heartbeat(self) -> None:
        while not self._idle.wait(self.heartbeat_s / 2):
            if time.monotonic() - self._last_round < self.heartbeat_s or not self._lock.acquire(timeout=0.1):
                continue
            try:
                if self._closed or self._lost is not None:
                    return
                if time.monotonic() - self._last_round >= self.heartbeat_s:
                    self._exchange("idle", lambda: None)
            except EngineUnavailable:
                return
            finally:
                self._lock.release()

    # ------------------------------------------------------------------------------------ whole batches
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """As `LLMEngine.generate`, every process stepping."""
        return generate_batch(self, prompts, sampling_params, use_tqdm, lora_request)

    def embed(self, prompts, pooling_params=None, use_tqdm: bool = False, lora_request=None):
        """As `LLMEngine.embed`."""
        return embed_batch(self, prompts, pooling_params, use_tqdm, lora_request)

    def classify(self, prompts, use_tqdm: bool = False, lora_request=None):
        """As `LLMEngine.classify`."""
        return classify_batch(self, prompts, use_tqdm, lora_request)

    def relevance(self, text_1, text_2, use_tqdm: bool = False, lora_request=None):
        """As `LLMEngine.relevance`."""
        return relevance_batch(self, text_1, text_2, use_tqdm, lora_request)

    def score(self, prompts, completions, lora_request=None):
        """As `LLMEngine.score`."""
        return completion_logprobs(self, prompts, completions, lora_request)

    def beam_search(self, prompts, params):
        raise UnsupportedFeature("a multi-host engine runs no beam search (it steers the scheduler between steps)",
                                 param="beam_search", code="beam_search_not_supported")


def follow(engine: LLMEngine, *, extra: dict | None = None) -> None:
    """Process i > 0 of a multi-host engine (see the module docstring): apply what process 0 sends and step with
    it, until it closes. Raises RankLostError when process 0 (or another) is lost, RanksDivergedError on a
    differing state, RanksMismatchError at start."""
    _check_engine(engine)
    if jax.process_index() == 0:
        raise ValueError("process 0 leads (MultiHostEngine); follow() runs on the others")
    check_ranks_agree(describe(engine, extra))
    thread = _Round()  # every device call on a thread of its own, as process 0's (`MultiHostEngine._change`)
    thread.start()
    try:
        thread.submit(lambda: _follow(engine)).result()
    finally:
        thread.jobs.put(None)


def _follow(engine: LLMEngine) -> None:
    digest = state_digest(engine)
    while True:
        payload, digests = _exchange(b"", digest)
        _check_digests(digests)
        message = decode(payload)
        for command in message.commands:
            _apply(engine, command)
        if message.op == "step":
            engine.step()
            digest = state_digest(engine)
        elif message.op == "warmup":
            engine.warmup()
        elif message.op == "save_kv_tiers":
            engine.save_kv_tiers()
        elif message.op == "stop":
            engine.close()
            return


def _apply(engine: LLMEngine, command: Command) -> None:
    if isinstance(command, Add):
        engine.add_prepared_request(engine.make_request(
            command.request_id, list(command.prompt_token_ids), command.sampling_params,
            cache_salt=command.cache_salt, lora_request=command.lora_request, pooling=command.pooling))
    elif isinstance(command, Abort):
        engine.abort(command.request_id)
    elif isinstance(command, AddLoRA):
        engine.add_lora(command.lora_request)
    else:
        engine.remove_lora(command.lora_int_id)


def _check_digests(digests: list[int]) -> None:
    bad = [p for p, d in enumerate(digests) if d != digests[0]]
    if bad:
        raise RanksDivergedError(f"processes {bad} hold another scheduler state than process 0 after the same "
                                 "steps: the engine stops (the plans would differ)")


def _exchange(payload: bytes, digest: int) -> tuple[bytes, list[int]]:
    """`distributed.exchange`; RankLostError when it raises: its shapes and programs are fixed, so only the
    collective itself fails it (a process went away: the runtime's error, which JAX raises as JaxRuntimeError or,
    from a jit dispatch, ValueError)."""
    try:
        return distributed.exchange(payload, digest)
    except Exception as e:  # noqa: BLE001 - see the docstring
        raise RankLostError(f"a process was lost (process {jax.process_index()} could not reach the others): "
                            f"{type(e).__name__}: {e}") from None
