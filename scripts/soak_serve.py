"""Soak of pagedjax-serve (not in CI): a bounded mix of well- and ill-behaved clients on loopback, watching the
servers' memory, their compiled programs and the streams' pacing.

    python scripts/soak_serve.py                      # 10 minutes, the bundled model and a tiny LLaVA, free ports
    python scripts/soak_serve.py --minutes 2 --server-args "--max-num-seqs 16"

It starts `pagedjax-serve` on the bundled model (with runtime LoRA updates under a temporary --lora-root) and, for
the image clients, a second one on a tiny random LLaVA folder (written with transformers; `--no-vision` skips it),
each in a subprocess on 127.0.0.1 only (`--port 0`: a free port), and until the time is up runs, concurrently:

  stream       streaming completions (`ignore_eos`, so they end at max_tokens); the gaps between their chunks
               are what the pacing check measures
  probe        one streaming completion after another: its chunk gaps are the pacing figure the verdict holds to
               one step (the engine's mean step after the warm-up) + --gap-over-step-seconds at the 99th percentile
  whole        non-streaming completions
  variants     completions and chats with random logprobs / top_logprobs, n, presence_penalty, stop_token_ids
               lists, streamed or not; a few ask for prompt log-probabilities (`echo`), which the server does not
               support yet: they must get 400
  stalled      streaming requests (n=2, log-probabilities) whose client reads the response head, then stops
               reading for seconds with its socket open, then leaves
  disconnect   streaming requests whose client leaves after a few chunks
  oversized    bodies over --max-request-bytes: must get 413
  slow_header  a request head sent a byte at a time: the server must close the connection after --header-timeout
  hostile      issue 47's inputs, each as large as --max-request-bytes lets it be: a chain of $refs (as a
               response_format and as a tool's parameters), a right-recursive grammar, a huge guided_choice, a
               regex of 100,000 repetitions, a prompt and a chat too long to fit: each must get a short 400
  adapters     adapter churn: load a LoRA adapter under a new name, stream requests under it, unload it while they
               run (they must finish), then a request naming it must get 404; now and then an adapter with a NaN
               weight, which must get 400
and on the LLaVA server:
  image        chats with 1-3 images of random sizes and formats
  image_bomb   chats with 8 highly compressed 4096 x 4096 PNGs (a 0.6 MiB body, within every default limit)
  image_probe  one streaming text chat after another: the vision server's pacing figure, as `probe`'s

Every `--sample-seconds` it records each server's RSS (VmRSS of /proc/<pid>/status), the bundled model's compiled
step programs and compilations (/metrics) and the chunk gaps meanwhile, and prints a row. Exit status 1 if a
server's RSS grows by more than `--rss-tolerance-mib` from its baseline (the first sample after `--warmup-minutes`
at which the server holds its `--max-compiled-programs` programs, else the first after the warm-up: each program
holds memory, and the clients' variety compiles new step shapes all along), or by more than
`--last-half-growth-percent` over the second half of the run (its last sample, after every client stopped, against
the least of that half); if a chunk gap after the warm-up exceeds `--max-gap-seconds`, or a probe's 99th
percentile exceeds its server's mean step + `--gap-over-step-seconds`; if any client got an answer other than the
one expected, or if a server logged a traceback or died.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import random
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import start_server  # noqa: E402  (its server start-up, shared)

logger = logging.getLogger("soak_serve")

# Concurrent clients of each kind.
CLIENTS = {"stream": 3, "probe": 1, "whole": 1, "variants": 3, "stalled": 2, "disconnect": 1, "oversized": 1,
           "slow_header": 1, "hostile": 1, "adapters": 1, "image": 1, "image_bomb": 1, "image_probe": 1}
VISION_KINDS = ("image", "image_bomb", "image_probe")  # the LLaVA server's clients
ADAPTER_FOLDERS = 4  # random adapters of the bundled model under the LoRA root, loaded again and again
ADAPTER_RANK = 8
# The LLaVA server's chat template: its Hugging Face templates' shape (text only from content parts)
VISION_TEMPLATE = ("{% for m in messages %}{{ m['role'].upper() }}: "
                   "{% for p in m['content'] | selectattr('type', 'equalto', 'image') %}<image>\n{% endfor %}"
                   "{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p['text'] }} {% endfor %}"
                   "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
BOMB_SIDE, BOMB_IMAGES = 4096, 8
PROMPTS = ["def fib(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
           "# parse a CSV file\n", "for i in range(10):\n"]
# the most a client waits before its next request (else 0.3 s)
PAUSE_S = {"oversized": 2.0, "slow_header": 1.0, "hostile": 0.5, "probe": 0.0, "image_probe": 0.0,
           "image_bomb": 2.0}
HEADER_MARGIN_S = 5.0  # how late past --header-timeout a slow head's connection may close (a busy event loop)


@dataclass
class Soak:
    """What the clients share: where the server is, the limits they test, and what they saw."""

    url: str
    model: str
    deadline: float
    max_tokens: int
    header_timeout: float
    max_request_bytes: int
    rng: random.Random
    lora_root: Path | None = None  # adapter folders: ADAPTER_FOLDERS good ones ("a0", ...) and "poisoned"
    vision_url: str | None = None  # the LLaVA server, or None (`--no-vision`)
    vision_model: str = ""
    bomb: list[str] = field(default_factory=list)  # the image_bomb clients' data URLs
    outcomes: dict[str, dict] = field(default_factory=dict)  # kind -> {"ok", "failed", "errors"}
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (monotonic time, seconds) between chunks
    # the probes' chunk gaps, by server ("text", "vision")
    probe_gaps: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: {"text": [], "vision": []})
    adapters_loaded: int = 0

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def record(self, kind: str, error: str | None) -> None:
        o = self.outcomes.setdefault(kind, {"ok": 0, "failed": 0, "errors": []})
        if error is None:
            o["ok"] += 1
        else:
            o["failed"] += 1
            if len(o["errors"]) < 3:
                o["errors"].append(error[:200])


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else 0.0


# ------------------------------------------------------------------------------------------------------ clients
def _completion(soak: Soak, **fields) -> dict:
    return {"model": soak.model, "prompt": soak.rng.choice(PROMPTS), "ignore_eos": True, **fields}


async def _stream(client, soak: Soak, body: dict, *, chunks: int | None = None,
                  gaps: list[tuple[float, float]] | None = None, url: str | None = None,
                  started: asyncio.Event | None = None) -> str | None:
    """A streaming request read to [DONE] (or, with `chunks`, left after that many); None if all was as
    expected, else what was not. `gaps`: where to record the gaps between its chunks; `url`: the server (default
    the bundled model's); `started`: set once the response's head arrived (the request is in the engine)."""
    times = []
    url = url or soak.url
    async with client.stream("POST", f"{url}/v1/{'chat/' if 'messages' in body else ''}completions",
                             json=body) as response:
        if started is not None:
            started.set()
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
        usage, done = None, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[6:])
            if "error" in data:
                return f"error event: {data['error']}"
            usage = data.get("usage") or usage
            times.append(time.monotonic())
            if gaps is not None and len(times) > 1:
                gaps.append((times[-1], times[-1] - times[-2]))
            if chunks is not None and len(times) >= chunks:
                return None  # leaving: the response is closed with its connection
    if not done:
        return "no [DONE]"
    expected = body["max_tokens"] * body.get("n", 1)
    if (body.get("stream_options") or {}).get("include_usage") and (usage is None
                                                                    or usage["completion_tokens"] != expected):
        return f"usage {usage}, expected {expected} completion tokens"
    return None


async def stream_client(client, soak: Soak) -> str | None:
    body = _completion(soak, max_tokens=soak.rng.randint(8, soak.max_tokens), temperature=0.7, stream=True,
                       stream_options={"include_usage": True})
    return await _stream(client, soak, body, gaps=soak.gaps)


async def probe_client(client, soak: Soak) -> str | None:
    body = _completion(soak, max_tokens=soak.max_tokens, temperature=0.7, stream=True)
    return await _stream(client, soak, body, gaps=soak.probe_gaps["text"])


async def whole_client(client, soak: Soak) -> str | None:
    body = _completion(soak, max_tokens=soak.rng.randint(8, soak.max_tokens), temperature=0.7)
    r = await client.post(f"{soak.url}/v1/completions", json=body)
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    return None if r.json()["usage"]["completion_tokens"] == body["max_tokens"] else f"usage {r.json()['usage']}"


async def variants_client(client, soak: Soak) -> str | None:
    rng = soak.rng
    n = rng.choice([1, 1, 2, 4])
    common = {"max_tokens": rng.randint(1, soak.max_tokens), "n": n, "seed": rng.randrange(2**31),
              "temperature": rng.choice([0.0, 0.5, 1.0]), "ignore_eos": True}
    if rng.random() < 0.5:
        common["presence_penalty"] = round(rng.uniform(-2.0, 2.0), 2)
    if rng.random() < 0.5:
        common["stop_token_ids"] = [rng.randrange(2048) for _ in range(rng.randint(0, 16))]
        common["ignore_eos"] = False  # a stop id may end a sample early: no usage check then
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        body = _completion(soak, **common)
        if rng.random() < 0.6:
            body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.1:  # prompt log-probabilities: not supported yet, refused clearly
            r = await client.post(f"{soak.url}/v1/completions", json={**body, "echo": True, "logprobs": 1})
            return None if r.status_code == 400 else f"echo: HTTP {r.status_code}, expected 400"
    else:
        body = {"model": soak.model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], **common}
        if rng.random() < 0.6:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    if stream:
        body.update(stream=True, stream_options={"include_usage": common["ignore_eos"]})
        return await _stream(client, soak, body)
    path = "chat/completions" if "messages" in body else "completions"
    r = await client.post(f"{soak.url}/v1/{path}", json=body)
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    return None if len(r.json()["choices"]) == n else f"{len(r.json()['choices'])} choices, expected {n}"


async def disconnect_client(client, soak: Soak) -> str | None:
    body = _completion(soak, max_tokens=soak.max_tokens, stream=True)
    return await _stream(client, soak, body, chunks=soak.rng.randint(1, 4))


async def oversized_client(client, soak: Soak) -> str | None:
    content = b'{"prompt": "' + b"x" * (soak.max_request_bytes + 1024) + b'"}'
    r = await client.post(f"{soak.url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
    return None if r.status_code == 413 else f"HTTP {r.status_code}, expected 413"


async def stalled_client(client, soak: Soak) -> str | None:
    """Read the head, then nothing for seconds with the socket open (a small receive buffer, so that the server's
    writes block within kilobytes), then leave."""
    body = json.dumps(_completion(soak, max_tokens=soak.max_tokens, n=2, logprobs=5, stream=True)).encode()
    host, port = soak.host_port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        await asyncio.sleep(max(0.0, min(soak.rng.uniform(3.0, 15.0), soak.deadline - time.monotonic())))
        return None if head.startswith(b"HTTP/1.1 200 ") else f"head {head[:40]!r}"
    finally:
        writer.transport.abort()


async def slow_header_client(client, soak: Soak) -> str | None:
    """A head sent a byte every 0.2 s: the server must answer 408 and close within --header-timeout (+ margin)."""
    host, port = soak.host_port
    reader, writer = await asyncio.open_connection(host, port)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nX-Slow: {'a' * 400}\r\n\r\n".encode()

    async def trickle():
        for i in range(len(head)):
            writer.write(head[i:i + 1])
            await asyncio.sleep(0.2)

    sender = asyncio.create_task(trickle())
    start = time.monotonic()
    try:
        reply = await asyncio.wait_for(reader.read(), soak.header_timeout + HEADER_MARGIN_S)  # to EOF: closed
    except TimeoutError:
        return f"still open after {time.monotonic() - start:.1f} s"
    except ConnectionResetError:
        reply = b""
    finally:
        sender.cancel()
        writer.transport.abort()
    return None if reply.startswith(b"HTTP/1.1 408 ") else f"closed with {reply[:40]!r}, expected a 408"


def _hostile_body(soak: Soak, what: str) -> tuple[str, dict]:
    """(path, body) of one of the hostile inputs, as large as the body limit lets it be (a little less)."""
    room, tag = soak.max_request_bytes - 2048, soak.rng.randrange(10**6)  # the tag: no two bodies alike
    chat = {"model": soak.model, "max_tokens": 4, "messages": [{"role": "user", "content": f"Hi {tag}"}]}
    if what in ("ref_chain", "tool_ref_chain"):
        n = max(1, min(5000, room // 90))  # ~85 bytes per $def
        defs = {f"d{i}": {"type": "object", "properties": {f"a{tag}": {"$ref": f"#/$defs/d{i + 1}"}}}
                for i in range(n)}
        schema = {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}
        if what == "ref_chain":
            return "chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": schema}}}
        return "chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "f",
                                                                                         "parameters": schema}}]}
    completion = {"model": soak.model, "prompt": f"Hi {tag}", "max_tokens": 4}
    if what == "grammar":
        n = max(1, min(20_000, room // 20))
        return "completions", {**completion, "guided_grammar": "start: r0\n" + "\n".join(
            f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "b{tag}"'}
    if what == "choice":
        return "completions", {**completion, "guided_choice": [f"{tag} {i}" for i in range(max(2, room // 20))]}
    if what == "regex":
        return "completions", {**completion, "guided_regex": f"[a-z]{{{100_000 + tag}}}"}
    if what == "prompt":
        return "completions", {**completion, "prompt": "x" * room}
    return "chat/completions", {**chat, "messages": [{"role": "user", "content": ""}] * (room // 33)}


HOSTILE = ("ref_chain", "tool_ref_chain", "grammar", "choice", "regex", "prompt", "messages")


async def hostile_client(client, soak: Soak) -> str | None:
    what = soak.rng.choice(HOSTILE)
    path, body = _hostile_body(soak, what)
    r = await client.post(f"{soak.url}/v1/{path}", json=body)
    if r.status_code != 400:
        return f"{what}: HTTP {r.status_code}, expected 400: {r.text[:200]}"
    message = r.json()["error"]["message"]
    return None if len(message) < 600 and "panicked" not in message else f"{what}: a long error: {message[:200]}"


async def adapters_client(client, soak: Soak) -> str | None:
    """Load an adapter under a new name, stream 1-3 requests under it, unload it once they run (they must finish
    whole: the engine removes it after them), then a request naming it must get 404. One time in ten, an adapter
    with a NaN weight instead: 400 (issue 63)."""
    rng = soak.rng
    soak.adapters_loaded += 1
    name = f"churn-{soak.adapters_loaded}"
    if rng.random() < 0.1:
        r = await client.post(f"{soak.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "poisoned"})
        return None if r.status_code == 400 else f"poisoned adapter: HTTP {r.status_code}, expected 400"
    r = await client.post(f"{soak.url}/v1/load_lora_adapter",
                          json={"lora_name": name, "lora_path": f"a{rng.randrange(ADAPTER_FOLDERS)}"})
    if r.status_code != 200:
        return f"load: HTTP {r.status_code}: {r.text[:200]}"
    bodies = [_completion(soak, model=name, max_tokens=rng.randint(4, soak.max_tokens), stream=True,
                          stream_options={"include_usage": True}) for _ in range(rng.randint(1, 3))]
    started = [asyncio.Event() for _ in bodies]

    async def run(body: dict, event: asyncio.Event) -> str | None:
        try:
            return await _stream(client, soak, body, started=event)
        finally:
            event.set()  # (also when it failed before its head)

    streams = [asyncio.create_task(run(body, event)) for body, event in zip(bodies, started, strict=True)]
    await asyncio.gather(*(event.wait() for event in started))
    r = await client.post(f"{soak.url}/v1/unload_lora_adapter", json={"lora_name": name})
    errors = [e for e in await asyncio.gather(*streams) if e is not None]
    if r.status_code != 200:
        return f"unload: HTTP {r.status_code}: {r.text[:200]}"
    if errors:
        return f"a request under the adapter: {errors[0]}"
    r = await client.post(f"{soak.url}/v1/completions", json=_completion(soak, model=name, max_tokens=2))
    return None if r.status_code == 404 else f"after the unload: HTTP {r.status_code}, expected 404"


def _png(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# The image client's pictures: 16-512 pixels a side. Three of them, even as PNGs of incompressible noise, stay within
# the vision server's default body limit (3 x 512 x 512 x 3 bytes, 3.1 MB in base64, under 4 MiB); at 700 a side one
# chat in about 1,400 went over it and got 413.
IMAGE_SIDES = (16, 512)


def image_data_url(pixels: np.ndarray, fmt: str) -> str:
    """`pixels` (uint8 `[height, width, 3]`) as a data URL of `fmt` ("PNG", "JPEG" or "WEBP")."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def random_image_url(seed: int) -> str:
    """A data URL of a random image of `IMAGE_SIDES` pixels a side, as PNG, JPEG or WebP (`seed` picks all of it)."""
    rng = random.Random(seed)
    width, height = rng.randint(*IMAGE_SIDES), rng.randint(*IMAGE_SIDES)
    pixels = np.random.default_rng(rng.randrange(2**31)).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return image_data_url(pixels, rng.choice(["PNG", "JPEG", "WEBP"]))


def bomb_urls() -> list[str]:
    """BOMB_IMAGES highly compressed BOMB_SIDE x BOMB_SIDE PNGs (a stripe every 64 rows, each image another
    colour): 16.8 M pixels each, ~75 KB."""
    from PIL import Image

    urls = []
    for i in range(BOMB_IMAGES):
        pixels = np.zeros((BOMB_SIDE, BOMB_SIDE, 3), np.uint8)
        pixels[i::64, :, i % 3] = 255
        urls.append(_png(Image.fromarray(pixels)))
    return urls


def _image_chat(soak: Soak, urls: list[str], **fields) -> dict:
    content = [{"type": "text", "text": "what is this ?"}, *({"type": "image_url", "image_url": {"url": u}}
                                                           for u in urls)]
    return {"model": soak.vision_model, "messages": [{"role": "user", "content": content}], **fields}


async def image_client(client, soak: Soak) -> str | None:
    # Encoded in a thread: tens of ms of PIL work a picture on the event loop would stall the probes' reads, and
    # their gaps would measure this client instead of the server.
    seeds = [soak.rng.randrange(2**31) for _ in range(soak.rng.randint(1, 3))]
    urls = await asyncio.to_thread(lambda: [random_image_url(seed) for seed in seeds])
    r = await client.post(f"{soak.vision_url}/v1/chat/completions", json=_image_chat(soak, urls, max_tokens=8))
    return None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"


async def image_bomb_client(client, soak: Soak) -> str | None:
    r = await client.post(f"{soak.vision_url}/v1/chat/completions", json=_image_chat(soak, soak.bomb, max_tokens=4))
    return None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"


async def image_probe_client(client, soak: Soak) -> str | None:
    body = {"model": soak.vision_model, "messages": [{"role": "user", "content": "what is this ?"}],
            "max_tokens": min(64, soak.max_tokens), "ignore_eos": True, "stream": True}
    return await _stream(client, soak, body, gaps=soak.probe_gaps["vision"], url=soak.vision_url)


KINDS = {"stream": stream_client, "probe": probe_client, "whole": whole_client, "variants": variants_client,
         "stalled": stalled_client, "disconnect": disconnect_client, "oversized": oversized_client,
         "slow_header": slow_header_client, "hostile": hostile_client, "adapters": adapters_client,
         "image": image_client, "image_bomb": image_bomb_client, "image_probe": image_probe_client}


async def worker(kind: str, client, soak: Soak) -> None:
    """Run `kind`'s client again and again until the deadline."""
    while time.monotonic() < soak.deadline:
        try:
            error = await KINDS[kind](client, soak)
        except Exception as e:  # noqa: BLE001 - a soak reports failures, it does not stop at them
            error = f"{type(e).__name__}: {e}"
        soak.record(kind, error)
        await asyncio.sleep(soak.rng.uniform(0.0, PAUSE_S.get(kind, 0.3)))


# ---------------------------------------------------------------------------------------------- measurements
@dataclass(frozen=True)
class Served:
    """One server under the soak: `prefix` names its columns in a row ("" for the bundled model's, "vision_")."""

    prefix: str
    url: str
    pid: int
    log: Path


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def server_metrics(url: str) -> dict:
    """The compiled programs, compilations, the step-time histogram's cumulative counts by upper edge, and its
    sum and count."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = {"pagedjax_compiled_programs": "compiled_programs", "pagedjax_compilations_total": "compilations",
              "pagedjax_engine_step_seconds_sum": "steps_s", "pagedjax_engine_step_seconds_count": "steps"}
    out: dict = {"steps_le": {}}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[wanted[name]] = float(value)
        elif name.startswith('pagedjax_engine_step_seconds_bucket{le="'):
            out["steps_le"][float(name.split('"')[1])] = float(value)
    return out


def longest_step_s(before: dict[float, float], after: dict[float, float]) -> float:
    """An upper bound of the longest step between two scrapes of the step-time histogram: the upper edge of the
    highest bucket that gained steps (0 if none ran; inf if one ran past every edge)."""
    gained = [edge for edge, count in after.items() if count - before.get(edge, 0.0) > 0]
    if not gained:
        return 0.0
    # cumulative counts: the highest bucket with a step of its own is where the gain stops growing
    top = max(after[edge] - before.get(edge, 0.0) for edge in gained)
    return min(edge for edge in gained if after[edge] - before.get(edge, 0.0) == top)


async def sampler(soak: Soak, servers: list[Served], start: float, every: float, rows: list[dict], workers) -> None:
    """A row every `every` seconds until the workers are done, and one at the end (times from `start`)."""
    last = start
    steps_le = {s.prefix: (await asyncio.to_thread(server_metrics, s.url))["steps_le"] for s in servers}
    while True:
        _, running = await asyncio.wait(workers, timeout=max(0.0, last + every - time.monotonic()))
        now = time.monotonic()
        gaps = [g for t, g in soak.gaps if last <= t < now]
        row = {"t_s": now - start, "requests_ok": sum(o["ok"] for o in soak.outcomes.values()),
               "requests_failed": sum(o["failed"] for o in soak.outcomes.values()),
               "gap_p50_ms": percentile_ms(gaps, 50), "gap_p99_ms": percentile_ms(gaps, 99),
               "gap_max_ms": max(gaps, default=0.0) * 1e3}
        for name, probe in soak.probe_gaps.items():
            row[f"{name}_probe_p99_ms"] = percentile_ms([g for t, g in probe if last <= t < now], 99)
        for s in servers:
            metrics = await asyncio.to_thread(server_metrics, s.url)
            step_max_s = longest_step_s(steps_le[s.prefix], metrics["steps_le"])
            steps_le[s.prefix] = metrics.pop("steps_le")
            row.update({f"{s.prefix}{k}": v for k, v in metrics.items()})
            row.update({f"{s.prefix}rss_mib": rss_mib(s.pid), f"{s.prefix}step_max_ms": step_max_s * 1e3})
        rows.append(row)
        print(_row(row), flush=True)
        last = now
        if not running:
            return


async def soak_run(soak: Soak, servers: list[Served], start: float, every: float) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    rows: list[dict] = []
    kinds = [kind for kind in CLIENTS if soak.vision_url is not None or kind not in VISION_KINDS]
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        workers = [asyncio.create_task(worker(kind, client, soak)) for kind in kinds for _ in range(CLIENTS[kind])]
        await sampler(soak, servers, start, every, rows, workers)
    return rows


# --------------------------------------------------------------------------------------------------- verdict
def baseline(rows: list[dict], warmup_s: float, max_programs: int, prefix: str = "") -> int | None:
    """The index of the row the RSS is measured from: the first after the warm-up at which the server holds its
    `max_programs` compiled programs (from then on a compilation replaces a program, it adds none), else the first
    after the warm-up; None if no row is."""
    after = [i for i, r in enumerate(rows) if r["t_s"] >= warmup_s]
    full = [i for i in after if rows[i].get(f"{prefix}compiled_programs", 0) >= max_programs]
    return (full or after or [None])[0]


def last_half_growth(rows: list[dict], prefix: str = "") -> tuple[float, float] | None:
    """(MiB, percent) the server's RSS grew over the second half of the run: its last row (taken after every
    client stopped) against the least RSS of the rows from half-way on (a row taken during a burst of work, e.g.
    an image being decoded, is not where growth is measured from); None with fewer than two such rows."""
    half = [r[f"{prefix}rss_mib"] for r in rows if r["t_s"] >= rows[-1]["t_s"] / 2]
    if len(half) < 2:
        return None
    growth = half[-1] - min(half)
    return growth, 100 * growth / min(half)


def mean_step_s(rows: list[dict], warmup_s: float, prefix: str = "") -> float | None:
    """The server's mean step after the warm-up, from the step-time histogram's sum and count; None without."""
    after = [r for r in rows if r["t_s"] >= warmup_s and f"{prefix}steps" in r]
    before = [r for r in rows if r["t_s"] < warmup_s and f"{prefix}steps" in r]
    if not after:
        return None
    first = before[-1] if before else {f"{prefix}steps": 0.0, f"{prefix}steps_s": 0.0}
    count = after[-1][f"{prefix}steps"] - first[f"{prefix}steps"]
    return (after[-1][f"{prefix}steps_s"] - first[f"{prefix}steps_s"]) / count if count else None


def verdict(rows: list[dict], gaps_after_warmup: list[float], outcomes: dict, *, warmup_s: float, max_programs: int,
            rss_tolerance_mib: float, max_gap_s: float, tracebacks: int, server_exit: int | None,
            gap_over_step_s: float = float("inf"), last_half_growth_percent: float = float("inf"),
            probes: dict[str, tuple[list[float], float | None]] | None = None,
            vision: bool = False, vision_exit: int | None = None) -> list[str]:
    """What failed (empty: the soak passed): a server's RSS growth from its `baseline` row on, or over the second
    half (`last_half_growth`), a chunk gap over the bound, a row (after the warm-up) whose longest chunk gap exceeds
    its longest engine step by more than `gap_over_step_s`, a probe (name -> its gaps after the warm-up, its server's
    mean step) whose 99th percentile exceeds the mean step by more than that, a client that got another answer than
    expected, a traceback in the servers' logs, a server that died (`server_exit`, `vision_exit` not None).
    `vision`: the rows have the LLaVA server's columns too."""
    problems = []
    for prefix, what in (("", "RSS"), *((("vision_", "the vision server's RSS"),) if vision else ())):
        start = baseline(rows, warmup_s, max_programs, prefix)
        if start is not None:
            growth = max(r[f"{prefix}rss_mib"] for r in rows[start:]) - rows[start][f"{prefix}rss_mib"]
            if growth > rss_tolerance_mib:
                problems.append(f"{what} grew {growth:.1f} MiB from t={rows[start]['t_s']:.0f} s (tolerance "
                                f"{rss_tolerance_mib:g} MiB)")
        half = last_half_growth(rows, prefix)
        if half is not None and half[1] > last_half_growth_percent:
            problems.append(f"{what} grew {half[0]:.1f} MiB ({half[1]:.1f}%) over the second half (bound "
                            f"{last_half_growth_percent:g}%)")
    if gaps_after_warmup and max(gaps_after_warmup) > max_gap_s:
        problems.append(f"a chunk gap of {max(gaps_after_warmup):.2f} s after the warm-up (bound {max_gap_s:g} s)")
    for r in rows:
        if r["t_s"] >= warmup_s and "step_max_ms" in r and r["gap_max_ms"] > r["step_max_ms"] + gap_over_step_s * 1e3:
            problems.append(f"a chunk gap of {r['gap_max_ms']:.0f} ms up to t={r['t_s']:.0f} s, whose longest step "
                            f"took at most {r['step_max_ms']:.0f} ms (bound: + {gap_over_step_s * 1e3:.0f} ms)")
    for name, (gaps, step_s) in sorted((probes or {}).items()):
        if gaps and step_s is not None and np.percentile(gaps, 99) > step_s + gap_over_step_s:
            problems.append(f"the {name} probe's p99 chunk gap is {np.percentile(gaps, 99) * 1e3:.0f} ms, its "
                            f"server's mean step {step_s * 1e3:.0f} ms (bound: + {gap_over_step_s * 1e3:.0f} ms)")
    for kind, o in sorted(outcomes.items()):
        if o["failed"]:
            problems.append(f"{kind}: {o['failed']} of {o['ok'] + o['failed']} failed, e.g. {o['errors'][0]}")
    if tracebacks:
        problems.append(f"{tracebacks} tracebacks in the server's log")
    if server_exit is not None:
        problems.append(f"the server exited during the soak (status {server_exit})")
    if vision_exit is not None:
        problems.append(f"the vision server exited during the soak (status {vision_exit})")
    return problems


COLUMNS = ("| t (s) | RSS MiB | vision RSS MiB | compiled programs | compilations | requests ok / failed "
           "| chunk gap ms p50 / p99 / max | probe gap ms p99 (text / vision) | longest step ms (at most) |")


def _row(r: dict) -> str:
    return (f"| {r['t_s']:.0f} | {r['rss_mib']:.1f} | {r.get('vision_rss_mib', 0):.1f} | "
            f"{r.get('compiled_programs', 0):.0f} | {r.get('compilations', 0):.0f} | "
            f"{r['requests_ok']} / {r['requests_failed']} | "
            f"{r['gap_p50_ms']:.1f} / {r['gap_p99_ms']:.1f} / {r['gap_max_ms']:.1f} | "
            f"{r.get('text_probe_p99_ms', 0):.1f} / {r.get('vision_probe_p99_ms', 0):.1f} | {r['step_max_ms']:.0f} |")


# ------------------------------------------------------------------------------------------------------ setup
def write_adapters(root: Path) -> None:
    """ADAPTER_FOLDERS random adapters of the bundled model under `root` ("a0", ...), and "poisoned": one with a
    NaN in a weight."""
    from bench_lora import write_random_adapter
    from safetensors.numpy import load_file, save_file

    from pagedjax import ModelConfig
    from pagedjax.model.loading.checkpoint import bundled_model_path, read_checkpoint_metadata

    cfg = ModelConfig.from_dict(read_checkpoint_metadata(bundled_model_path())["model_config"])
    for i in range(ADAPTER_FOLDERS):
        write_random_adapter(root / f"a{i}", cfg, seed=i, rank=ADAPTER_RANK)
    poisoned = write_random_adapter(root / "poisoned", cfg, seed=ADAPTER_FOLDERS, rank=ADAPTER_RANK)
    tensors = load_file(str(poisoned / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first][0, 0] = np.nan
    save_file(tensors, str(poisoned / "adapter_model.safetensors"))


def write_vision_folder(folder: Path) -> Path:
    """A tiny random LLaVA (CLIP tower of 16 pixels, 16 tokens an image) as transformers saves one, and its chat
    template beside it (the tests' vision folders: needs torch and transformers)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.model.vision_folders import hf_model, save_folder

    save_folder("llava", folder, model=hf_model("llava", 0))
    (folder.parent / "llava_template.jinja").write_text(VISION_TEMPLATE)
    return folder


# ------------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the clients run")
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="default: a third of --minutes (most step shapes compile then, and the allocator settles "
                        "once programs start being replaced)")
    p.add_argument("--sample-seconds", type=float, default=None, help="default: a tenth of the run, 1-60 s")
    p.add_argument("--port", type=int, default=0, help="the server's port on 127.0.0.1 (0: a free one)")
    p.add_argument("--server-args", default="", help="more pagedjax-serve options (model, engine), quoted")
    p.add_argument("--vision-server-args", default="", help="more options of the LLaVA server, quoted")
    p.add_argument("--no-vision", action="store_true",
                   help="no LLaVA server and no image clients (they need torch and transformers to write it)")
    p.add_argument("--header-timeout", type=float, default=2.0, help="the server's --header-timeout, seconds")
    p.add_argument("--max-request-bytes", type=int, default=65536, help="the server's --max-request-bytes")
    p.add_argument("--max-tokens", type=int, default=128, help="the most tokens a client asks for")
    p.add_argument("--max-compiled-programs", type=int, default=32,
                   help="the server's --max-compiled-programs: the clients' variety makes ever new step shapes, so a "
                        "small cache fills early and the rest of the soak checks that replacing programs keeps "
                        "memory flat (each holds ~12 MiB for the bundled model). Half the server's default: the "
                        "warm-up pins 11 of them, and at 16 the 5 left held fewer than the clients' frequent shapes "
                        "(15 of 129 shapes made half of 4,813 lookups in 3 minutes): 60% of the steps ran on stand-ins "
                        "and the compile thread never rested")
    p.add_argument("--rss-tolerance-mib", type=float, default=64.0,
                   help="the most a server's RSS may grow after the warm-up")
    p.add_argument("--last-half-growth-percent", type=float, default=5.0,
                   help="the most a server's RSS may grow over the second half of the run")
    p.add_argument("--max-gap-seconds", type=float, default=10.0,
                   help="the longest gap between two chunks of a stream after the warm-up (a new step shape stalls "
                        "every stream while it compiles: seconds on a CPU)")
    p.add_argument("--gap-over-step-seconds", type=float, default=0.1,
                   help="the most a sample's longest chunk gap (after the warm-up) may exceed its longest engine "
                        "step (pagedjax_engine_step_seconds: the upper edge of its bucket), and a probe's p99 chunk "
                        "gap its server's mean step")
    p.add_argument("--server-log", type=Path, default=None,
                   help="where the server's output goes (default: a new temporary folder's server.log, kept; the "
                        "LLaVA server's beside it, vision_server.log)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the report as one JSON line at the end")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    seconds = args.minutes * 60
    warmup_s = (args.warmup_minutes * 60) if args.warmup_minutes is not None else seconds / 3
    every = args.sample_seconds or max(1.0, min(60.0, seconds / 10))

    work = Path(tempfile.mkdtemp(prefix="soak_serve-"))
    log_path = args.server_log or work / "server.log"
    lora_root = work / "loras"
    write_adapters(lora_root)
    server_args = ["--header-timeout", str(args.header_timeout), "--max-request-bytes", str(args.max_request_bytes),
                   "--max-compiled-programs", str(args.max_compiled_programs), "--enable-lora", "--max-loras", "2",
                   "--max-lora-rank", str(ADAPTER_RANK), "--enable-runtime-lora-updates", "--lora-root",
                   str(lora_root), *shlex.split(args.server_args)]
    procs = []
    try:
        import httpx

        proc, url = start_server(server_args, port=args.port or None, log_path=log_path)
        procs.append(proc)
        servers = [Served("", url, proc.pid, log_path)]
        soak = Soak(url=url, model=httpx.get(f"{url}/v1/models").json()["data"][0]["id"], deadline=0.0,
                    max_tokens=args.max_tokens, header_timeout=args.header_timeout,
                    max_request_bytes=args.max_request_bytes, rng=random.Random(args.seed), lora_root=lora_root)
        if not args.no_vision:
            folder = write_vision_folder(work / "llava")
            vision_log = log_path.with_name("vision_server.log")
            vision_proc, soak.vision_url = start_server(
                ["--model", str(folder), "--chat-template", str(work / "llava_template.jinja"),
                 *shlex.split(args.vision_server_args)], log_path=vision_log)
            procs.append(vision_proc)
            servers.append(Served("vision_", soak.vision_url, vision_proc.pid, vision_log))
            soak.vision_model = httpx.get(f"{soak.vision_url}/v1/models").json()["data"][0]["id"]
            soak.bomb = bomb_urls()
        start = time.monotonic()
        soak.deadline = start + seconds
        logger.info("soaking pagedjax-serve (%s) for %.1f min, warm-up %.1f min",
                    "; ".join(f"pid {s.pid}, {s.url}, log {s.log}" for s in servers), seconds / 60, warmup_s / 60)
        print(COLUMNS + "\n|---|---|---|---|---|---|---|---|---|", flush=True)
        rows = asyncio.run(soak_run(soak, servers, start, every))
        exits = [proc.poll() for proc in procs]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=120)
    gaps = [g for t, g in soak.gaps if t - start >= warmup_s]
    probes = {name: ([g for t, g in probe if t - start >= warmup_s], mean_step_s(rows, warmup_s, prefix))
              for (name, probe), prefix in zip(soak.probe_gaps.items(), ("", "vision_"), strict=True)
              if prefix == "" or len(servers) > 1}
    tracebacks = sum(s.log.read_text().count("Traceback") for s in servers)
    problems = verdict(rows, gaps, soak.outcomes, warmup_s=warmup_s, max_programs=args.max_compiled_programs,
                       rss_tolerance_mib=args.rss_tolerance_mib, max_gap_s=args.max_gap_seconds,
                       tracebacks=tracebacks, server_exit=exits[0], gap_over_step_s=args.gap_over_step_seconds,
                       last_half_growth_percent=args.last_half_growth_percent, probes=probes,
                       vision=len(servers) > 1, vision_exit=exits[1] if len(exits) > 1 else None)
    report = {"rows": rows, "clients": soak.outcomes, "warmup_s": warmup_s, "gaps_after_warmup": len(gaps),
              "gap_p50_ms": percentile_ms(gaps, 50), "gap_p99_ms": percentile_ms(gaps, 99),
              "gap_max_ms": max(gaps, default=0.0) * 1e3, "tracebacks": tracebacks, "problems": problems,
              "probes": {name: {"gaps": len(g), "p50_ms": percentile_ms(g, 50), "p99_ms": percentile_ms(g, 99),
                                "max_ms": max(g, default=0.0) * 1e3,
                                "mean_step_ms": None if step is None else step * 1e3}
                         for name, (g, step) in probes.items()}}
    print()
    for kind in KINDS:
        o = soak.outcomes.get(kind, {"ok": 0, "failed": 0, "errors": []})
        print(f"{kind}: {o['ok']} ok, {o['failed']} failed" + (f" (e.g. {o['errors'][0]})" if o["errors"] else ""))
    for s in servers:
        name = "vision server" if s.prefix else "server"
        start_row = baseline(rows, warmup_s, args.max_compiled_programs, s.prefix)
        after = rows[start_row:] if start_row is not None else rows[-1:]
        base, most = after[0][f"{s.prefix}rss_mib"], max(r[f"{s.prefix}rss_mib"] for r in after)
        half = last_half_growth(rows, s.prefix)
        # the second half's range too: a burst's peak (an image bomb decoding) does not count as growth, but shows
        second = [r[f"{s.prefix}rss_mib"] for r in rows if r["t_s"] >= rows[-1]["t_s"] / 2]
        report[f"{s.prefix}rss"] = {"baseline_t_s": after[0]["t_s"], "baseline_mib": base, "max_mib": most,
                                    "last_half_growth_mib": None if half is None else half[0],
                                    "last_half_growth_percent": None if half is None else half[1],
                                    "last_half_min_mib": min(second), "last_half_max_mib": max(second)}
        print(f"{name} RSS from t={after[0]['t_s']:.0f} s (after the warm-up, with the program cache full if it "
              f"filled): {base:.1f} MiB, at most {most:.1f} MiB (+{most - base:.1f}, tolerance "
              f"{args.rss_tolerance_mib:g} MiB)" + ("" if half is None else
                                                   f"; over the second half +{half[0]:.1f} MiB ({half[1]:.1f}%, "
                                                   f"bound {args.last_half_growth_percent:g}%; range "
                                                   f"{min(second):.1f}-{max(second):.1f} MiB)"))
    print(f"chunk gaps after the warm-up ({len(gaps)}): p50 {report['gap_p50_ms']:.1f} ms, p99 "
          f"{report['gap_p99_ms']:.1f} ms, max {report['gap_max_ms']:.1f} ms (bounds: {args.max_gap_seconds:g} s, "
          f"and in each row the longest step + {args.gap_over_step_seconds * 1e3:g} ms)")
    for name, probe in report["probes"].items():
        step = "no steps" if probe["mean_step_ms"] is None else f"mean step {probe['mean_step_ms']:.1f} ms"
        print(f"{name} probe's chunk gaps after the warm-up ({probe['gaps']}): p50 {probe['p50_ms']:.1f} ms, p99 "
              f"{probe['p99_ms']:.1f} ms, max {probe['max_ms']:.1f} ms; {step} (bound: p99 within it + "
              f"{args.gap_over_step_seconds * 1e3:g} ms)")
    print(f"server logs: {tracebacks} tracebacks ({', '.join(str(s.log) for s in servers)})")
    print("FAIL: " + "; ".join(problems) if problems else "PASS")
    if args.json:
        print(json.dumps(report))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
