"""Grammar compiles that cannot take the server down: each new constraint is test-compiled in a worker process
(which may crash, overrun its time or run out of memory) before the server compiles it in-process.

llguidance is native code: a grammar it cannot handle may overflow its stack (SIGSEGV), allocate without bound,
take seconds, or panic. `StructuredLimits` (`limits.py`) refuse what is known to do so; `CompileGuard` catches
what is left. A worker (`python -m pagedjax.structured_output.isolation`: stdlib and llguidance only, no JAX)
holds the server's vocabulary as llguidance's tokenizer and makes exactly the calls the engine's compile makes
(`grammar_of`, then `LLMatcher(tokenizer, grammar)`), under an address-space limit, on a thread with half the
stack the server's threads have (`compile_stack_bytes`). The server waits `timeout_s` for its answer:

  compiled       the grammar is safe to compile in-process (the matcher must live in the engine's process: it
                 is advanced per token and masks are filled from it; llguidance cannot serialize one)
  refused        llguidance's own error, shortened (never a panic message or backtrace): a 400
  died, timeout  the worker is killed (SIGKILL) and replaced on the next compile; a 400 saying which

Verdicts are kept per constraint (its SHA-256, `VERDICTS` of them), so a constraint is test-compiled once however
often it is asked for, and one that killed a worker or ran out of time is refused at once the next time (a
hostile client cannot make the server restart workers by repeating one). At most `workers`
compiles run at once; a compile that waits longer than `timeout_s` for a worker is `CompilerBusy` (a 503).

    guard = CompileGuard(worker_tokenizer(tokenizer, vocab_size, eos_token_ids), CompileGuardConfig())
    guard.check("json", schema_text)        # CompileRefused (400) / CompilerBusy (503), or None: compile it
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# JSON is written as `json.dumps` writes it: ", " and ": ", no other whitespace. Free whitespace (llguidance's
# default) lets a model pad forever between tokens of structure (a known failure of constrained decoding); a
# schema may still ask for it with its own "x-guidance": {"whitespace_flexible": true}.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
VERDICTS = 4096  # constraints whose test-compile's verdict is kept (32-byte keys)
MAX_ERROR_CHARS = 300  # of a library error in a response


def grammar_of(kind: str, value: Any) -> str:
    """llguidance's grammar for a constraint (`StructuredOutput.kind` and its value: a schema's JSON text, a
    regex, the choices, a Lark grammar; json_object takes any value). Native code (it parses the Lark), so the
    worker runs it too; ValueError / RuntimeError / TypeError for what the library rejects."""
    import llguidance

    matcher = llguidance.LLMatcher
    if kind == "json":
        return matcher.grammar_from_json_schema(value, defaults=JSON_STYLE)
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_STYLE)
    if kind == "regex":
        return matcher.grammar_from_regex(value)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    return matcher.grammar_from_lark(value)


def short_error(text: str) -> str:
    """A library error as a response may carry it: its first line, at most MAX_ERROR_CHARS characters; a Rust
    panic's message and backtrace become one sentence."""
    text = str(text).strip()
    if "panicked" in text or "stack backtrace" in text or "PanicException" in text:
        return "the grammar library failed on this constraint (an internal error)"
    line = text.splitlines()[0] if text else "rejected"
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 3] + "..."


class CompileRefused(ValueError):
    """The constraint cannot be compiled: llguidance's error, or its test-compile crashed or ran out of time."""


class CompilerBusy(RuntimeError):
    """No grammar worker was free within the time limit."""


@dataclass(frozen=True)
class CompileGuardConfig:
    """workers: test-compiles at once (each a process: ~30 MiB, and a CPU while it compiles); timeout_s: the
    longest one may take, waiting for a worker included; memory_bytes: a worker's address space (0: no limit);
    max_queued: compiles a server lets wait or run at once (more get 503 at once)."""

    workers: int = 2
    timeout_s: float = 10.0
    memory_bytes: int = 2 * 2**30
    max_queued: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"CompileGuardConfig.workers must be an int >= 1, got {self.workers!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"CompileGuardConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        if not isinstance(self.max_queued, int) or self.max_queued < 1:
            raise ValueError(f"CompileGuardConfig.max_queued must be an int >= 1, got {self.max_queued!r}")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < 0:
            raise ValueError(f"CompileGuardConfig.memory_bytes must be an int >= 0, got {self.memory_bytes!r}")


def worker_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> dict | None:
    """What a worker needs to build the engine's llguidance tokenizer (as `ConstraintCompiler` builds it): a
    Hugging Face tokenizer's JSON, or a byte tokenizer's size; None for another tokenizer (the worker then
    validates the grammar without a vocabulary: the same compile but for the lexer's token trie)."""
    eos = list(eos_token_ids)
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "to_str"):
        return {"kind": "hf", "json": inner.to_str(), "n_vocab": vocab_size, "eos": eos}
    if type(tokenizer).__name__ == "ByteTokenizer":
        return {"kind": "bytes", "n_vocab": vocab_size, "eos": eos,
                "special": sorted(getattr(tokenizer, "special_token_ids", ())),
                "bos": getattr(tokenizer, "bos_token_id", None)}
    return None


def compile_stack_bytes() -> int:
    """The stack a worker compiles on: half what a thread of this process gets (glibc gives a new thread the
    soft RLIMIT_STACK, 8 MiB by default; 2 MiB when it is unlimited, taken as the smaller), so a grammar that
    compiled in a worker compiles in the server's threads with its stack use at most half of theirs."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    thread_stack = 2 * 2**20 if soft == resource.RLIM_INFINITY else soft
    return max(thread_stack // 2, 256 * 2**10)


# ------------------------------------------------------------------------------------------- the server side
class _Worker:
    """One worker process and its pipes; `compile` from one thread at a time."""

    def __init__(self, spec: dict | None, config: CompileGuardConfig):
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the pagedjax package
        env = dict(os.environ, RUST_BACKTRACE="0",
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedjax.structured_output.isolation", str(config.memory_bytes),
             str(compile_stack_bytes())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        self._send({"tokenizer": spec})
        self._receive(time.monotonic() + max(config.timeout_s, 60.0))  # its "ready" (a vocabulary: ~1 s)

    def compile(self, kind: str, value: Any, deadline: float) -> str | None:
        """llguidance's error for the constraint, or None if it compiled; OSError / TimeoutError when the worker
        died or did not answer by `deadline` (it is then dead or to be killed)."""
        self._send({"kind": kind, "value": value})
        return self._receive(deadline)["error"]

    def _send(self, message: dict) -> None:
        data = json.dumps(message).encode()
        self.process.stdin.write(struct.pack(">I", len(data)) + data)
        self.process.stdin.flush()

    def _receive(self, deadline: float) -> dict:
        size = struct.unpack(">I", self._read(4, deadline))[0]
        return json.loads(self._read(size, deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        fd, out = self.process.stdout.fileno(), bytearray()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError("the grammar worker exited")
            out += chunk
        return bytes(out)

    def death(self) -> str:
        """How the (killed or crashed) worker ended, in words."""
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "did not exit"
        if code < 0:
            try:
                return f"died of {signal.Signals(-code).name}"
            except ValueError:
                return f"died of signal {-code}"
        return f"exited with status {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class CompileGuard:
    """Test-compiles constraints in `config.workers` worker processes; see the module docstring. Thread-safe.
    Workers start on first use and after one died; `close` ends them."""

    def __init__(self, tokenizer_spec: dict | None, config: CompileGuardConfig | None = None):
        self.config = config or CompileGuardConfig()
        self.tokenizer_spec = tokenizer_spec
        self.num_test_compiles = 0  # sent to a worker (verdicts reused are not counted)
        self.num_worker_deaths = 0  # crashed, over the time limit, or out of memory
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(self.config.workers):
            self._idle.put(None)  # a slot: its worker starts when first needed
        self._lock = threading.Lock()  # guards _verdicts and the counters
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # key -> error (None: compiled)

    def check(self, kind: str, value: Any) -> None:
        """Return when the constraint compiled in a worker (or did before); CompileRefused with a short reason
        when it did not, CompilerBusy when no worker was free within the time limit."""
        key = hashlib.sha256(json.dumps([kind, value]).encode()).digest()
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                error = self._verdicts[key]
                if error is not None:
                    raise CompileRefused(error)
                return
        deadline = time.monotonic() + self.config.timeout_s
        try:
            worker = self._idle.get(timeout=self.config.timeout_s)
        except queue.Empty:
            raise CompilerBusy(f"all {self.config.workers} grammar compilers stayed busy for "
                               f"{self.config.timeout_s:g} s") from None
        try:
            worker, error = self._test_compile(worker, kind, value, deadline)
        finally:
            self._idle.put(worker)
        with self._lock:
            self._verdicts[key] = error
            while len(self._verdicts) > VERDICTS:
                self._verdicts.popitem(last=False)
        if error is not None:
            raise CompileRefused(error)

    def _test_compile(self, worker: _Worker | None, kind: str, value: Any,
                      deadline: float) -> tuple[_Worker | None, str | None]:
        """(the worker to keep, None if it died; the constraint's error or None). CompilerBusy when no worker
        could be started (nothing to say about the constraint)."""
        start = time.perf_counter()
        if worker is None:
            try:
                worker = _Worker(self.tokenizer_spec, self.config)
            except (OSError, EOFError, TimeoutError, ValueError, struct.error) as e:
                logger.error("a grammar worker could not start: %r", e)
                raise CompilerBusy(f"the grammar compiler could not start ({type(e).__name__})") from None
        with self._lock:
            self.num_test_compiles += 1
        try:
            error = worker.compile(kind, value, deadline)
        except TimeoutError:
            self._lost(worker, kind, "timed out")
            return None, (f"compiling the constraint took more than the {self.config.timeout_s:g} s limit "
                          "(--grammar-compile-timeout)")
        except (OSError, EOFError, ValueError, struct.error):  # died mid-compile
            how = worker.death()
            self._lost(worker, kind, how)
            memory = self.config.memory_bytes
            needs = f"more than the compiler's {memory / 2**20:,.0f} MiB of memory" if memory else "too much memory"
            return None, (f"compiling the constraint crashed the grammar compiler ({how}: it nests too deeply, "
                          f"or needs {needs})")
        logger.debug("test-compiled a %s constraint in %.1f ms", kind, 1e3 * (time.perf_counter() - start))
        return worker, None if error is None else short_error(error)

    def _lost(self, worker: _Worker, kind: str, how: str) -> None:
        with self._lock:
            self.num_worker_deaths += 1
        logger.warning("a grammar worker %s compiling a %s constraint; the constraint is refused and the worker "
                       "replaced", how, kind)
        worker.kill()

    def close(self) -> None:
        """End the idle workers (a compile in progress keeps its worker until it returns it)."""
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


# ------------------------------------------------------------------------------------------- the worker side
def _llg_tokenizer(spec: dict | None):
    import llguidance

    if spec is None:
        return None
    eos = spec["eos"] or None
    if spec["kind"] == "hf":
        return llguidance.LLTokenizer(spec["json"], n_vocab=spec["n_vocab"], eos_token=eos)

    class Bytes:  # `ByteTokenizer` as llguidance's TokenizerWrapper sees it (`structured._Vocabulary`'s tokens)
        special_token_ids = spec["special"]
        eos_token_id = eos[0] if eos else None
        bos_token_id = spec["bos"]
        tokens = [b"\xff" + f"<special_{i}>".encode() if i >= 256 else bytes([i]) for i in range(spec["n_vocab"])]

        def __call__(self, text: str | bytes) -> list[int]:
            return list(text.encode() if isinstance(text, str) else text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()), n_vocab=spec["n_vocab"], eos_token=eos)


def _compile(tokenizer, kind: str, value: Any) -> str | None:
    import llguidance

    try:
        grammar = grammar_of(kind, value)
        if tokenizer is None:
            return llguidance.LLMatcher.validate_grammar(grammar) or None
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        return matcher.get_error() if matcher.is_error() else None
    except BaseException as e:  # noqa: BLE001 - pyo3's PanicException is a BaseException: an answer too
        return f"{type(e).__name__}: {e}" if "Panic" in type(e).__name__ else str(e)


def _serve(memory_bytes: int, stack_bytes: int) -> None:
    """The worker's loop: length-prefixed JSON messages on stdin, answers on (the original) stdout; each compile
    on a thread of `stack_bytes` of stack."""
    import resource

    threading.stack_size(stack_bytes)
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    out = os.dup(1)
    os.dup2(2, 1)  # whatever the library prints goes where stderr goes, never into the answers

    def read(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = os.read(0, n - len(data))
            if not chunk:
                raise SystemExit(0)  # the server closed the pipe
            data += chunk
        return bytes(data)

    def write(message: dict) -> None:
        data = json.dumps(message).encode()
        os.write(out, struct.pack(">I", len(data)) + data)

    tokenizer = _llg_tokenizer(json.loads(read(struct.unpack(">I", read(4))[0]))["tokenizer"])
    write({"ready": True})
    while True:
        request = json.loads(read(struct.unpack(">I", read(4))[0]))
        answer: dict = {}

        def run(request=request, answer=answer):
            answer["error"] = _compile(tokenizer, request["kind"], request["value"])

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        write(answer)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
