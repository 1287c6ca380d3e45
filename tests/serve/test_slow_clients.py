"""Clients that are slow on purpose cost the server a bounded amount: a request head that trickles in (or never
comes) is cut off after --header-timeout, while other clients are served meanwhile."""

from __future__ import annotations

import select
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.serve.server_utils import MODEL_NAME, make_engine, running_server

HEADER_TIMEOUT = 0.5
MARGIN = 2.0  # a shared 2-core machine compiling a step can hold the event loop back this long


def _read_until_closed(sock: socket.socket, *, trickle: bytes = b"", every: float = 0.05,
                       limit: float = 10.0) -> tuple[bytes, float]:
    """Send `trickle` a byte at a time (one per `every` seconds) while reading, until the server closes the
    connection; (what it sent, seconds from the call to its close). Fails the test if it never closes."""
    start, reply, sent = time.monotonic(), b"", 0
    while time.monotonic() - start < limit:
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
                sent += 1
            except OSError:  # closed by the server while we were writing
                return reply, time.monotonic() - start
        if select.select([sock], [], [], every)[0]:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return reply, time.monotonic() - start
            reply += data
    raise AssertionError(f"the connection is still open after {limit} s ({sent} bytes sent, got {reply!r})")


def _get(path: str, port: int) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()


def _response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length, read off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.fixture(scope="module")
def server():
    with running_server(make_engine(), header_timeout=HEADER_TIMEOUT) as s:
        yield s


def test_a_head_that_trickles_in_is_cut_off_while_others_are_served(server):
    """A client sending its headers a byte every 50 ms (8 s for this head) used to hold its connection for as long
    as it kept sending; now it gets a 408 and is closed after --header-timeout."""
    port = urlparse(server.url).port
    head = _get("/health", port)[:-2] + b"X-Slow: " + b"a" * 150 + b"\r\n\r\n"
    outcome: dict = {}

    def slow():
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            outcome["reply"], outcome["seconds"] = _read_until_closed(sock, trickle=head)

    thread = threading.Thread(target=slow)
    thread.start()
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
    served = 0
    while thread.is_alive():  # normal clients meanwhile
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        served += 1
    thread.join()
    assert served >= 1
    assert outcome["reply"].startswith(b"HTTP/1.1 408 Request Timeout\r\n"), outcome["reply"]
    assert b'"code":"request_timeout"' in outcome["reply"].replace(b" ", b""), outcome["reply"]
    assert HEADER_TIMEOUT <= outcome["seconds"] < HEADER_TIMEOUT + MARGIN, outcome


def test_a_silent_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", urlparse(server.url).port), timeout=10) as sock:
        reply, seconds = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and HEADER_TIMEOUT <= seconds < HEADER_TIMEOUT + MARGIN, (reply, seconds)


def test_a_kept_alive_connection_idles_past_the_head_timeout_but_its_next_head_is_timed(server):
    """Between requests only uvicorn's keep-alive timeout (5 s) applies; a next head, once begun, has
    --header-timeout to be complete."""
    port = urlparse(server.url).port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_get("/health", port))
        assert _response(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(2 * HEADER_TIMEOUT)  # idle, kept alive
        sock.sendall(_get("/health", port))
        assert _response(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /hea")  # and no more
        reply, seconds = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and HEADER_TIMEOUT <= seconds < HEADER_TIMEOUT + MARGIN, (reply, seconds)
