"""A deadline on every request head (request line and headers), which uvicorn does not have.

uvicorn closes a kept-alive connection that stays idle for `timeout_keep_alive` seconds, but any byte it receives
cancels that timer and nothing times the head itself: a client sending its head a byte at a time, or never
ending it (or connecting and sending nothing), holds its connection, one of `--max-connections`, for ever; a few
hundred such clients lock everyone out. The app's `--body-timeout` cannot help: the app only sees a request once
its head is complete.

`head_timeout_protocol(seconds)` is uvicorn's h11 protocol with one timer per head: armed when the connection
opens and when the first bytes of a next head arrive on a kept-alive connection, cancelled as soon as h11 has
parsed the whole head. When it fires the client gets a 408 (OpenAI's error JSON, as the app's errors) and the
connection is closed (the server's side at once, the rest after `LINGER_S`, the bytes still coming discarded so
that they do not reset it). A kept-alive connection waiting for its next request has no head timer, only
uvicorn's keep-alive one, so the two limits stay independent.

Why h11 and not httptools (uvicorn's "auto" takes httptools when it is installed): the hooks used here are
uvicorn's h11 protocol's, and h11's parser state says exactly when a head is complete; h11 is a dependency of
uvicorn itself while httptools is optional, so forcing h11 makes the server parse HTTP the same way wherever it
is installed. A model server's time goes to the model, not to parsing headers.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# After a 408 the client may still be sending its head: closing with bytes arriving makes the kernel reset the
# connection, which can destroy the 408 before the client reads it. So the server ends its side (FIN), discards
# what still comes for this long, then closes.
LINGER_S = 1.0


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol; a request head not complete within `head_timeout` seconds of its start (the
    connection's opening, or a later head's first bytes) gets a 408 and its connection is closed.

    Invariant: the timer is armed exactly while the client's side of the connection is IDLE (no complete head
    parsed) and either no request was served on it yet or some bytes of the next head have arrived."""

    head_timeout: float = 10.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._timed_out = False  # answered 408: what still comes is discarded until the connection closes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._timed_out:
            return
        super().data_received(data)
        # IDLE after parsing what came: a head has begun (bytes are buffered) but is not complete.
        waiting_for_head = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting_for_head and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)
        elif not waiting_for_head:
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        logger.debug("closing the connection of %s: its request head did not arrive within %g s", self.client,
                     self.head_timeout)
        message = f"the request head did not arrive within {self.head_timeout:g} s"
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "request_timeout"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:  # h11 lets a server answer before the request has come (its state allows a Response from IDLE)
            for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response already begun on this connection: closing is all there is
            self.transport.close()
            return
        self._timed_out = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:  # TLS cannot half-close
            self.transport.close()


def head_timeout_protocol(seconds: float) -> type[HeadTimeoutProtocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`: request heads must arrive within `seconds`."""
    if not seconds > 0:
        raise ValueError(f"header timeout must be > 0 seconds, got {seconds}")
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout": float(seconds)})
