"""What the server tests share: a small random model (every module uses the same shapes, so engines after the
first load their compiled steps from JAX's persistent cache), and a server on 127.0.0.1 in a thread."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SchedulerConfig
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.serve.app import build_app
from pagedjax.serve.async_engine import AsyncLLMEngine
from pagedjax.serve.head_timeout import head_timeout_protocol

MODEL_NAME = "pagedjax-tiny"
# A byte-level model (the bundled model's tokenizer) of one small layer: random weights emit random bytes,
# invalid UTF-8 included, which is what the detokenizer must survive.
CFG = ModelConfig(vocab_size=259, hidden_size=64, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=32,
                  intermediate_size=128, bos_token_id=256, eos_token_ids=(257,))
MAX_MODEL_LEN = 256
SEED = 0


# Compiling a step shape costs a second or more, and every engine, server and test shares these settings:
# blocks of half the context, a small token budget and batch keep the shape buckets (sequences x tokens x
# blocks per sequence) few. 64 clients still stream at once: 16 of them in the running batch, the rest queued.
BLOCK_SIZE, NUM_BLOCKS, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 128, 64, 16, 64


def make_engine(**kwargs) -> LLMEngine:
    """The test model's engine (`kwargs`: more of `LLMEngine`'s keywords; the byte tokenizer unless one is given)."""
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
                     scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                                      max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                                      max_model_len=MAX_MODEL_LEN), seed=SEED,
                     **{"tokenizer": ByteTokenizer(), **kwargs})



@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    engine: AsyncLLMEngine
    app: Any = None  # the FastAPI app (`app.state.serving`: its OpenAIServing)

    @property
    def llm(self) -> LLMEngine:
        return self.engine.engine


@contextlib.contextmanager
def running_server(llm: LLMEngine, *, max_pending: int | None = None, header_timeout: float | None = None,
                   send_buffer: int | None = None, **app_kwargs) -> Iterator[Server]:
    """A server over `llm` on a free port of 127.0.0.1, in a thread, stopped (and its engine) on exit;
    `header_timeout`: as pagedjax-serve's --header-timeout (None: uvicorn's own protocol, no head deadline);
    `send_buffer`: the kernel's send buffer of each connection, in bytes (a small one makes a client that stops
    reading block the server's writes within kilobytes; the default, autotuned on loopback, takes megabytes)."""
    engine = AsyncLLMEngine(llm, max_pending=max_pending)
    app = build_app(engine, model_name=MODEL_NAME, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:  # accepted connections inherit it from the listening socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    http = "auto" if header_timeout is None else head_timeout_protocol(header_timeout)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=1,
                                           http=http))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield Server(f"http://127.0.0.1:{port}", engine, app)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def metric(text: str, name: str, labels: str = "") -> float:
    """A sample's value in Prometheus text (`labels` as written, e.g. 'finish_reason="abort"')."""
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)$"
    match = re.search(pattern, text, flags=re.M)
    if match is None:
        raise AssertionError(f"no metric {name}{{{labels}}} in:\n{text}")
    return float(match.group(1))


def wait_for_metrics(url: str, condition, *, timeout: float = 60.0, headers=None) -> str:
    """Scrape /metrics until `condition(text)` holds (the engine thread applies aborts asynchronously);
    the last scrape's text. Fails the test if it never does."""
    deadline = time.monotonic() + timeout
    with httpx.Client(headers=headers) as client:  # one for every scrape: `httpx.get` builds one (20 ms of CPU) each
        while True:
            text = client.get(f"{url}/metrics").text
            if condition(text) or time.monotonic() > deadline:
                return text
            time.sleep(0.05)


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]
