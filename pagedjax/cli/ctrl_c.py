"""Ctrl-C while `pagedjax-generate` runs: stop between two engine steps, or leave at once; exit status 130."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from pagedjax.cli.errors import EXIT_INTERRUPTED


class Interrupted(Exception):  # noqa: N818 - a signal, not an error
    """Ctrl-C stopped the run between two engine steps."""


class CtrlC:
    """SIGINT while the command runs, without a KeyboardInterrupt raised inside JAX.

    A KeyboardInterrupt can surface anywhere: inside a garbage-collection callback or a finalizer (Python
    prints "Exception ignored" there and the run goes on), or while XLA's threads are mid-computation, and
    the interpreter then tears modules down under those threads (the SIGSEGV after "interrupted"). So:

    - during generation (`stopping_between_steps`), Ctrl-C only sets `requested`: the loop stops after the
      step in flight, and the process leaves with `os._exit(130)` after flushing its output (no interpreter
      teardown, no finalizers);
    - before generation (imports, loading, compiling the engine), or a second time, it leaves at once;
    - Python runs signal handlers only between bytecodes, not while the main thread is inside a long XLA
      call (a compilation): a watcher thread, woken through `signal.set_wakeup_fd`, exits on a second
      Ctrl-C, or `GRACE_S` after the first (half a second outside generation), whatever the main thread
      is doing.

    With `exit_process=False` (in-process calls of `main(argv)`) there is no watcher and the immediate cases
    raise KeyboardInterrupt instead of exiting.
    """

    GRACE_S = 5.0

    def __init__(self, exit_process: bool):
        self.exit_process = exit_process
        self.requested = False
        self.soft = False
        self._previous = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_wakeup_fd = -1

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        if self.exit_process:
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer)
            threading.Thread(target=self._watch, args=(reader,), name="pagedjax-ctrl-c", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is None:
            return
        signal.signal(signal.SIGINT, self._previous)
        self._previous = None
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self._wakeup[1].close()  # the watcher's recv returns b"" and it ends
            self._wakeup = None

    @contextmanager
    def stopping_between_steps(self) -> Iterator[None]:
        self.soft = True
        try:
            yield
        finally:
            self.soft = False

    def _on_sigint(self, signum, frame) -> None:
        if self.soft and not self.requested:
            self.requested = True
            return
        if not self.exit_process:
            raise KeyboardInterrupt
        flush_quietly()  # we are between two bytecodes of the main thread: flushing is safe
        exit_interrupted()

    def _watch(self, reader: socket.socket) -> None:
        seen = 0
        with reader:
            while True:
                try:
                    data = reader.recv(64)
                except OSError:
                    return
                if not data:  # __exit__ closed the other end
                    return
                seen += data.count(bytes([signal.SIGINT]))
                if seen >= 2:
                    exit_interrupted()
                if seen == 1:  # the main thread's handler flushes and exits, unless it is stuck in a C call
                    timer = threading.Timer(self.GRACE_S if self.soft else 0.5, exit_interrupted)
                    timer.daemon = True
                    timer.start()


def exit_interrupted() -> None:
    """Leave now: a one-line message straight to file descriptor 2 (no Python buffer, which another thread
    may hold), then `os._exit(130)`."""
    os.write(2, b"\ninterrupted\n")
    os._exit(EXIT_INTERRUPTED)


def flush_quietly() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe, or a flush re-entered from a signal handler
            pass
