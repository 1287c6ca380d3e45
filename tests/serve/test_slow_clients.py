"""Clients that are slow on purpose cost the server a bounded amount: a request head that trickles in (or never
comes) is cut off after --header-timeout, while other clients are served meanwhile; a streaming client that stops
reading costs its stream one pending snapshot however long the output grows."""

from __future__ import annotations

import gc
import json
import select
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from pagedjax.outputs import RequestOutput
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


def _timely(seconds: float) -> bool:
    """Closed after about --header-timeout (timed from just after the connection opened)."""
    return 0.8 * HEADER_TIMEOUT <= seconds < HEADER_TIMEOUT + MARGIN


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
    # A small send buffer: a client that stops reading blocks the server's writes within ~100 KB (this one and
    # uvicorn's 64 KiB write buffer), not after the megabytes loopback's autotuned buffers would take first.
    with running_server(make_engine(), header_timeout=HEADER_TIMEOUT, send_buffer=8192) as s:
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
    assert _timely(outcome["seconds"]), outcome


def test_a_client_still_sending_when_its_head_times_out_gets_the_408(server):
    """Bytes arriving at a closed socket make the kernel reset the connection, which could destroy the 408
    before the client read it (a soak saw it); the server half-closes, and discards the rest for a while."""
    port = urlparse(server.url).port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        start = time.monotonic()
        while time.monotonic() - start < HEADER_TIMEOUT + 0.5:  # writing on past the timeout, reading nothing
            sock.sendall(b"a")
            time.sleep(0.01)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408 "), reply


def test_a_silent_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", urlparse(server.url).port), timeout=10) as sock:
        reply, seconds = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and _timely(seconds), (reply, seconds)


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
    assert reply.startswith(b"HTTP/1.1 408 ") and _timely(seconds), (reply, seconds)


def _live_snapshots(request_ids: set[str]) -> tuple[int, int]:
    """RequestOutput snapshots of these requests alive in this process (the server runs in it; other tests of the
    same process may keep outputs of their own), and the output tokens they hold."""
    outs = [o for o in gc.get_objects() if type(o) is RequestOutput and o.request_id in request_ids]
    return len(outs), sum(len(c.token_ids) for o in outs for c in o.outputs)


def test_stalled_streaming_clients_cost_one_snapshot_each_however_long_the_output(server):
    """Streaming clients (n=4 with log-probabilities) that read the response head and then stop reading, their
    sockets open, while their requests generate to the end: the server holds, per stream, at most one pending
    snapshot (a queue of every step's cumulative snapshot grew quadratically with the output), and the clients
    that read again get the whole response."""
    clients, n, max_tokens = 4, 4, 120
    streams = []
    engine = server.engine
    add_request = engine.add_request

    async def recording_add(*args, **kwargs):
        stream = await add_request(*args, **kwargs)
        streams.append(stream)
        return stream

    engine.add_request = recording_add  # the server's calls go through the instance attribute
    port = urlparse(server.url).port
    body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": max_tokens, "n": n, "logprobs": 3,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    socks = []
    try:
        generated_before = engine.stats().generated_tokens
        for _ in range(clients):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: no autotuning
            sock.settimeout(30)
            sock.connect(("127.0.0.1", port))
            sock.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(1024)
            assert head.startswith(b"HTTP/1.1 200 "), head
            socks.append((sock, head.partition(b"\r\n\r\n")[2]))  # and read no more for now
        samples = []  # (most undelivered items of a stream, live snapshots, tokens they hold)
        deadline = time.monotonic() + 60
        while engine.stats().generated_tokens < generated_before + clients * n * max_tokens:
            assert time.monotonic() < deadline, "the requests did not finish generating"
            samples.append((max(s.num_undelivered for s in streams), *_live_snapshots({s.request_id for s in streams})))
            time.sleep(0.2)
        time.sleep(0.3)  # the last outputs reach their streams
        samples.append((max(s.num_undelivered for s in streams), *_live_snapshots({s.request_id for s in streams})))
        assert len(streams) == clients
        # Every handler is stuck writing (the clients stopped reading long before the end), its stream holding
        # the finished snapshot: the stall was real.
        assert [s.num_undelivered for s in streams] == [1] * clients
        assert max(u for u, _, _ in samples) == 1, samples
        # A few snapshots per stream at any time (the pending one, the one its handler is converting), never one
        # per step: the tokens they hold are a few outputs' worth, not the sum over every step.
        assert max(c for _, c, _ in samples) <= 3 * clients, samples
        assert max(t for _, _, t in samples) <= 3 * clients * n * max_tokens, samples
        for sock, data in socks:  # reading again: the rest of the response, complete
            while chunk := sock.recv(65536):
                data += chunk
            events = [line[6:] for line in data.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] == n * max_tokens
    finally:
        engine.add_request = add_request
        for sock, _ in socks:
            sock.close()
