"""AsyncLLMEngine: an `LLMEngine` driven by one background thread, for asyncio servers.

    engine = AsyncLLMEngine(LLMEngine.from_pretrained(), max_pending=256)
    engine.start()
    async for out in engine.generate(prompt_ids, SamplingParams(max_tokens=32)):
        ...                                     # RequestOutput snapshots (cumulative token ids and text)
    await engine.shutdown(timeout=10)

The engine is not thread-safe, so exactly one thread touches it: the engine thread. It takes commands (add,
abort, stop) from a queue, runs `step()` while any request is unfinished and sleeps on the queue otherwise.
Each step's outputs go back to the event loop that asked for them with `loop.call_soon_threadsafe`, so the
event loop never waits for device work.

`add_request` returns a `RequestStream` once the engine has accepted the request (its validation errors,
`pagedjax.errors.InvalidRequest` and its kinds naming the field, are raised there). Iterating the stream yields one
`RequestOutput` per step that advanced the request (when the consumer falls behind, only the newest snapshot: they
are cumulative, so a stream holds at most one), the last one finished. Closing the stream early (`async with`,
`aclose()`, or cancelling the task that iterates it, e.g. when an HTTP client goes away) aborts the request; the
engine frees its blocks before its next step.

Failures: a request the engine finished with finish_reason "error" comes out like any other finished output
(`RequestOutput.error` says why). If `step()` itself raises, every request in flight is aborted and its stream
raises `EngineStepError`; the engine keeps serving new requests. An engine that can serve nothing any more
(`pagedjax.errors.EngineUnavailable`, e.g. a lost host of a multi-host engine, raised by a step or handed to `fail`)
ends the engine thread: every request in flight raises `EngineStoppedError` saying why, and `is_running` turns
False (a server's /health says 503; `pagedjax-serve` then exits).

LoRA adapters (an engine with a `lora_config`): `add_request(..., lora_request=...)` runs a request under an
adapter; `add_lora` registers one and `remove_lora` forgets one, both on the engine thread. An adapter that
unfinished requests still use is never removed under them: `remove_lora` then retires it, and the engine thread
removes it after the step in which the last of them finished (the caller stops sending new requests for it
first).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pagedjax.engine import EngineStats, LLMEngine
from pagedjax.engine.image_prompts import EncodedPrompt
from pagedjax.engine.summary import summarize
from pagedjax.errors import EngineUnavailable
from pagedjax.outputs import RequestOutput
from pagedjax.pooling_params import PoolingParams
from pagedjax.sampling_params import LoRARequest, SamplingParams
from pagedjax.serve.metrics import DurationHistogram

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine's step raised while this request was in flight; the request was aborted."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or stopped) and takes no new requests; in-flight ones get it when aborted."""


class QueueFullError(RuntimeError):
    """`max_pending` requests are already in the engine."""


@dataclass(frozen=True)
class _Add:
    stream: RequestStream
    prompt: list[int] | EncodedPrompt  # token ids, or with images their pixels and hashes (`encode_prompt`)
    params: SamplingParams | PoolingParams  # a pooling request's (an embedding) samples nothing
    done: concurrent.futures.Future
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class _AddLoRA:
    lora_request: LoRARequest
    done: concurrent.futures.Future


@dataclass(frozen=True)
class _RemoveLoRA:
    lora_int_id: int
    done: concurrent.futures.Future


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _FailAll:
    error: BaseException


@dataclass(frozen=True)
class _Die:
    error: EngineUnavailable


_STOP = object()


class RequestStream:
    """The outputs of one request, in the event loop that added it; see the module docstring.

    Holds at most one undelivered item, the newest: outputs are cumulative snapshots, so a consumer that falls
    behind (a client that stopped reading) costs one snapshot, never a backlog that grows with every step. An
    error or the finished output, once held, is never replaced."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self.loop = loop  # the event loop that reads it
        self._latest: RequestOutput | BaseException | None = None  # undelivered, newest
        self._ready = asyncio.Event()
        self.finished = False  # the last output was yielded, or it failed or was aborted

    def put(self, item: RequestOutput | BaseException) -> None:  # in the event loop
        held = self._latest
        if isinstance(held, BaseException) or (held is not None and held.finished):
            return  # the end is already waiting to be read
        self._latest = item
        self._ready.set()

    @property
    def num_undelivered(self) -> int:
        """Items waiting for the consumer: 0 or 1."""
        return int(self._latest is not None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            await self._ready.wait()
        except BaseException:  # cancelled (e.g. the client went away): nobody will read the rest
            self.abort()
            raise
        item, self._latest = self._latest, None
        self._ready.clear()
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.release(self)

    def abort(self) -> None:
        """Stop the request (no-op once finished); the engine frees its blocks before its next step."""
        if not self.finished:
            self._end()
            self._engine.send(_Abort(self.request_id))

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


def random_request_id(prefix: str) -> str:
    """`<prefix>-<32 hex digits>`: the server's request (and response) ids, unique across requests and restarts
    (an engine's own ids are deterministic instead: `pagedjax.core.request.RequestIds`)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class AsyncLLMEngine:
    """An `LLMEngine` owned by a background thread; see the module docstring.

    max_pending: the most requests in the engine at once (added and not yet finished, waiting ones included);
    `add_request` raises QueueFullError beyond it. None: no limit.
    """

    def __init__(self, engine: LLMEngine, *, max_pending: int | None = None):
        if max_pending is not None and (not isinstance(max_pending, int) or max_pending < 1):
            raise ValueError(f"max_pending must be None or an int >= 1, got {max_pending!r}")
        self.engine = engine
        self.max_pending = max_pending
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread: the requests it has accepted
        self._num_pending = 0  # event loop side: streams created and not yet finished
        self._idle = threading.Event()  # set while no stream is pending
        self._idle.set()
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None  # the engine thread ended on this unexpected error
        self._retiring: set[int] = set()  # engine thread: LoRA ids to remove once no request uses them
        self._stats: EngineStats = engine.stats()
        self.step_durations = DurationHistogram()  # of every `step()` call (the engine thread's)

    # ------------------------------------------------------------------------------------------ public side
    @property
    def num_pending(self) -> int:
        """Requests added (or being added) and not yet finished."""
        return self._num_pending

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def unavailable(self) -> EngineUnavailable | None:
        """The `EngineUnavailable` the engine thread ended on (e.g. a lost host), None otherwise."""
        return self._dead if isinstance(self._dead, EngineUnavailable) else None

    def stats(self) -> EngineStats:
        """The engine's statistics after the engine thread's latest step or command."""
        return self._stats

    # What the server reads of the engine (fixed at construction, so read from any thread): this class is the
    # server's only door to it.
    @property
    def tokenizer(self):
        """The engine's tokenizer (None without one)."""
        return self.engine.tokenizer

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request may hold (`LLMEngine.max_request_tokens`)."""
        return self.engine.max_request_tokens

    @property
    def model_spec(self):
        """The served model's `ModelSpec`."""
        return self.engine.model_spec

    @property
    def model_config(self):
        """The served model's config (what a LoRA adapter is checked against)."""
        return self.engine.model_config

    @property
    def classifier(self):
        """A sequence classifier's head (`pagedjax.model.classifier`), None for other models."""
        return self.engine.classifier

    @property
    def image_processor(self):
        """The engine's image processor (None for a model without images)."""
        return getattr(self.engine, "image_processor", None)

    @property
    def lora_config(self):
        """The engine's `LoRAConfig` (None: it serves no adapters)."""
        lora = getattr(self.engine, "lora", None)
        return None if lora is None else lora.config

    def compile_constraint(self, structured):
        """`LLMEngine.compile_constraint`: compile (and cache) a request's output constraint; thread-safe, off the
        engine thread (`InvalidConstraint`, an `InvalidRequest`, for one that does not compile)."""
        return self.engine.compile_constraint(structured)

    def summary(self):
        """The engine's `pagedjax.engine.summary.EngineSummary` (what the server's start-up line says)."""
        return summarize(self.engine)

    def add_lora_before_start(self, lora_request: LoRARequest) -> None:
        """Register an adapter on this thread, before the engine thread starts (a server's --lora-modules);
        RuntimeError once it runs (then: `add_lora`), else what `LLMEngine.add_lora` raises."""
        if self._thread is not None:
            raise RuntimeError("the engine thread runs: adapters are added through add_lora")
        self.engine.add_lora(lora_request)

    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
        self._thread.start()

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise EngineStoppedError("the engine is shutting down" if self._dead is None
                                     else f"the engine thread died: {self._dead!r}")
        if self._thread is None:
            raise EngineStoppedError("the engine is not started: call start()")

    async def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | PoolingParams, *,
                          request_id: str | None = None, lora_request: LoRARequest | None = None,
                          images: Sequence = ()) -> RequestStream:
        """Queue a request (under `lora_request`'s adapter, or the base model); returns its stream once the engine
        accepted it. With `images` (one per image in the prompt, in order: PIL images, or the model's pixels with the
        prompt's placeholders expanded, as the server gives them), the prompt is
        `{"prompt_token_ids": ..., "multi_modal_data": {"image": [...]}}` (`make_request`), encoded (each image made
        into pixels and hashed: `LLMEngine.encode_prompt`) in a worker thread, so that neither the engine thread
        nor the event loop waits on it. `PoolingParams` make a pooling request (an embedding: its final output's
        `embedding`). Raises what `LLMEngine.add_request` raises for a bad request
        (`InvalidRequest` and its kinds, nothing queued), QueueFullError at `max_pending`, and EngineStoppedError
        while shutting down."""
        self._check_accepting()
        if self.max_pending is not None and self._num_pending >= self.max_pending:
            raise QueueFullError(f"{self._num_pending} requests are already queued or running "
                                 f"(the limit is {self.max_pending}); retry later")
        request_id = request_id or random_request_id("req")
        prompt: list[int] | EncodedPrompt = list(prompt_token_ids)
        if images:
            prompt = await asyncio.to_thread(self.engine.encode_prompt, request_id, {
                "prompt_token_ids": prompt, "multi_modal_data": {"image": list(images)}})
            self._check_accepting()  # (shutting down since)
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        self._num_pending += 1
        self._idle.clear()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.send(_Add(stream, prompt, params, done, lora_request))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:  # the caller left while the engine was busy: undo the add
            stream.abort()
            raise
        except BaseException:
            stream.finished = True
            self.release(stream)
            raise
        return stream

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter on the engine thread (`LLMEngine.add_lora`: its folder read and checked there);
        raises what that raises (ValueError for a bad adapter) and EngineStoppedError while shutting down."""
        await self._engine_call(_AddLoRA(lora_request, concurrent.futures.Future()))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget adapter `lora_int_id` on the engine thread: at once when no unfinished request uses it (True),
        else after the step in which the last of them finished (False: retired; the caller must not start new
        requests under it). ValueError for an id the engine does not hold."""
        return await self._engine_call(_RemoveLoRA(lora_int_id, concurrent.futures.Future()))

    async def _engine_call(self, command):
        self._check_accepting()
        self.send(command)
        return await asyncio.wrap_future(command.done)

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       request_id: str | None = None, lora_request: LoRARequest | None = None,
                       images: Sequence = ()) -> AsyncIterator[RequestOutput]:
        """`add_request` and iterate its stream. Leaving the loop early aborts the request once the generator
        is closed: at once under `contextlib.aclosing(...)` or when the iterating task is cancelled, else when
        the generator is garbage-collected (Python closes async generators lazily)."""
        async with await self.add_request(prompt_token_ids, params, request_id=request_id,
                                          lora_request=lora_request, images=images) as stream:
            async for out in stream:
                yield out

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Take no new requests, let those in flight finish for up to `timeout` seconds, abort the rest (their
        streams raise EngineStoppedError) and stop the engine thread."""
        self._accepting = False
        if self._num_pending and timeout > 0:
            await asyncio.get_running_loop().run_in_executor(None, self._idle.wait, timeout)
        self.send(_STOP)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    async def drain(self, timeout: float) -> None:
        """Take no new requests, let those in flight finish for up to `timeout` seconds, then end the rest: their
        streams raise EngineStoppedError (a server answers each with an error, and a stream with its error event
        and [DONE]). The engine thread keeps running until `shutdown` / `stop`."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        if self._num_pending and timeout > 0:
            await loop.run_in_executor(None, self._idle.wait, timeout)
        if self._num_pending:
            logger.warning("shutting down: ending %d requests still in flight", self._num_pending)
            self.send(_FailAll(EngineStoppedError("the server shut down before the request finished")))

    def stop(self) -> None:
        """Synchronous `shutdown(timeout=0)` (from outside the event loop)."""
        self._accepting = False
        self.send(_STOP)
        if self._thread is not None:
            self._thread.join()

    def fail(self, error: EngineUnavailable) -> None:
        """The engine can serve nothing any more (from any thread: e.g. a multi-host engine's `on_lost`): the engine
        thread ends as if its step had raised `error` (see the module docstring)."""
        self.send(_Die(error))

    def send(self, command) -> None:
        """Hand the engine thread a command (its streams' interface, as theirs is `put`)."""
        self._commands.put(command)

    def release(self, stream: RequestStream) -> None:  # event loop: a stream ended
        """A stream ended: one request fewer pending."""
        self._num_pending -= 1
        if self._num_pending == 0:
            self._idle.set()

    # ----------------------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                commands = [self._commands.get()] if idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if isinstance(command, _FailAll):
                        self._publish(self._fail_all(command.error, drain=True))
                        continue
                    if isinstance(command, _Die):
                        raise command.error
                    if command is _STOP:
                        failed = self._fail_all(EngineStoppedError("the server shut down before the request "
                                                                   "finished"), drain=True)
                        self._publish(failed)
                        self._save_kv_tiers()
                        return
                    self._apply(command)
                self._publish(self._step() if self.engine.has_unfinished_requests() else [])
                if self._retiring:
                    self._retire()
        except EngineUnavailable as e:  # the engine cannot go on: fail everything, take no more requests
            logger.error("the engine stopped: %s", e)
            self._dead = e
            self._accepting = False
            self._publish(self._fail_all(EngineStoppedError(f"the engine stopped: {e}"), drain=True, abort=False))
        except BaseException as e:  # a bug outside step(): the same
            logger.exception("the engine thread died")
            self._dead = e
            self._accepting = False
            self._publish(self._fail_all(EngineStoppedError(f"the engine thread died: {e!r}"), drain=True))
        finally:
            self._accepting = False

    def _save_kv_tiers(self) -> None:
        """At shutdown: the device's cached blocks to the disk tier, for the next start (a failure is logged: the
        server stops either way)."""
        try:
            self.engine.save_kv_tiers()
        except Exception:  # noqa: BLE001 - shutting down regardless
            logger.exception("shutdown: saving the KV cache to the disk tier failed")

    def _apply(self, command) -> None:
        if isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                self.engine.abort(command.request_id)
            return
        if isinstance(command, _AddLoRA | _RemoveLoRA):
            self._apply_lora(command)
            return
        stream = command.stream
        if stream.finished:  # aborted before the engine got to it
            command.done.cancel()
            return
        lora = command.lora_request
        params, pooling = command.params, {}
        if isinstance(params, PoolingParams):
            params, pooling = None, {"pooling": params}
        try:
            if isinstance(command.prompt, EncodedPrompt):
                self.engine.add_prepared_request(self.engine.make_request(stream.request_id, command.prompt, params,
                                                                          lora_request=lora, **pooling))
            else:
                self.engine.add_request(stream.request_id, command.prompt, params, lora_request=lora, **pooling)
        except EngineUnavailable as e:  # not the request's fault: the engine thread ends
            command.done.set_exception(EngineStoppedError(f"the engine stopped: {e}"))
            raise
        except Exception as e:  # noqa: BLE001 - the caller's to handle (a bad request)
            command.done.set_exception(e)
            return
        self._streams[stream.request_id] = stream
        command.done.set_result(None)

    def _apply_lora(self, command: _AddLoRA | _RemoveLoRA) -> None:
        try:
            if isinstance(command, _AddLoRA):
                self.engine.add_lora(command.lora_request)
                command.done.set_result(None)
                return
            i = command.lora_int_id
            if not any(r.lora_int_id == i for r in self.engine.list_loras()):
                raise ValueError(f"LoRA adapter {i} is not registered")
            removed = self._try_remove_lora(i)
            if not removed:
                self._retiring.add(i)
                logger.info("LoRA adapter %d retired: removed once the requests using it finish", i)
            command.done.set_result(removed)
        except Exception as e:  # noqa: BLE001 - the caller's to report (a bad adapter, an unknown id)
            command.done.set_exception(e)

    def _try_remove_lora(self, lora_int_id: int) -> bool:
        """Remove registered adapter `lora_int_id` unless an unfinished request runs under it (False then:
        `LLMEngine.remove_lora` refuses)."""
        try:
            self.engine.remove_lora(lora_int_id)
        except ValueError:
            return False
        return True

    def _retire(self) -> None:
        """Remove the retired adapters that no unfinished request uses any more."""
        for i in sorted(self._retiring):
            if self._try_remove_lora(i):
                self._retiring.discard(i)
                logger.info("LoRA adapter %d removed: the last request using it finished", i)

    def _publish(self, items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """Take the statistics snapshot, then hand the items to their streams' event loops: whoever sees an
        output also sees statistics at least as new as it."""
        self._stats = self.engine.stats()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            batches.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in batches.items():
            _deliver_soon(loop, batch)

    def _step(self) -> list[tuple[RequestStream, RequestOutput | BaseException]]:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except EngineUnavailable:
            raise  # the engine thread ends (`_run`)
        except Exception as e:  # noqa: BLE001 - the engine could not recover: fail what was in flight
            logger.exception("engine step failed; aborting %d requests", len(self._streams))
            return self._fail_all(EngineStepError(f"the engine step failed: {type(e).__name__}: {e}"))
        self.step_durations.observe(time.perf_counter() - start)
        items = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            items.append((stream, out))
        return items

    def _fail_all(self, error: BaseException, *, drain: bool = False,
                  abort: bool = True) -> list[tuple[RequestStream, BaseException]]:
        """Abort every accepted request (in the engine too unless `abort` is False: an unavailable engine); their
        streams are to raise `error`. `drain`: also fail the adds still queued (when the thread is about to end)."""
        items = []
        for request_id, stream in list(self._streams.items()):
            try:
                if abort:
                    self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - keep failing the others
                logger.exception("aborting %s failed", request_id)
            items.append((stream, error))
        self._streams.clear()
        while drain:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add) and not command.done.done():
                command.done.set_exception(error)
        return items


def _deliver_soon(loop: asyncio.AbstractEventLoop, batch: list) -> None:
    def deliver() -> None:
        for stream, item in batch:
            stream.put(item)

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        logger.debug("dropped %d outputs for a closed event loop", len(batch))
