"""Soak of pagedjax-serve (not in CI): a bounded mix of well- and ill-behaved clients on loopback, watching the
server's memory, its compiled programs and the streams' pacing.

    python scripts/soak_serve.py                      # 10 minutes, the bundled model, any free port
    python scripts/soak_serve.py --minutes 2 --server-args "--max-num-seqs 16"

It starts `pagedjax-serve` on the bundled model in a subprocess (on 127.0.0.1 only; `--port 0`: a free port),
and until the time is up runs, concurrently:

  stream       streaming completions (`ignore_eos`, so they end at max_tokens); the gaps between their chunks
               are what the pacing check measures
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

Every `--sample-seconds` it records the server's RSS (VmRSS of /proc/<pid>/status), its compiled step programs
and compilations (/metrics) and the chunk gaps of the streams meanwhile, and prints a row. Exit status 1 if the
RSS grows by more than `--rss-tolerance-mib` from its baseline (the first sample after `--warmup-minutes` at which
the server holds its `--max-compiled-programs` programs, else the first after the warm-up: each program holds
memory, and the clients' variety compiles new step shapes all along), if a chunk gap after the warm-up exceeds
`--max-gap-seconds`, if any client got an answer other than the one expected, or if the server logged a traceback
or died.
"""

from __future__ import annotations

import argparse
import asyncio
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
CLIENTS = {"stream": 3, "whole": 1, "variants": 3, "stalled": 2, "disconnect": 1, "oversized": 1, "slow_header": 1,
           "hostile": 1}
PROMPTS = ["def fib(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
           "# parse a CSV file\n", "for i in range(10):\n"]
# the most a client waits before its next request (else 0.3 s)
PAUSE_S = {"oversized": 2.0, "slow_header": 1.0, "hostile": 0.5}
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
    outcomes: dict[str, dict] = field(default_factory=dict)  # kind -> {"ok", "failed", "errors"}
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (monotonic time, seconds) between chunks

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


async def _stream(client, soak: Soak, body: dict, *, chunks: int | None = None, pace: bool = False) -> str | None:
    """A streaming request read to [DONE] (or, with `chunks`, left after that many); None if all was as
    expected, else what was not. `pace`: record the gaps between its chunks."""
    times = []
    async with client.stream("POST", f"{soak.url}/v1/{'chat/' if 'messages' in body else ''}completions",
                             json=body) as response:
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
            if pace and len(times) > 1:
                soak.gaps.append((times[-1], times[-1] - times[-2]))
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
    return await _stream(client, soak, body, pace=True)


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


KINDS = {"stream": stream_client, "whole": whole_client, "variants": variants_client, "stalled": stalled_client,
         "disconnect": disconnect_client, "oversized": oversized_client, "slow_header": slow_header_client,
         "hostile": hostile_client}


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
def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def server_metrics(url: str) -> dict:
    """The compiled programs, compilations and the step-time histogram's cumulative counts by upper edge."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = {"pagedjax_compiled_programs": "compiled_programs", "pagedjax_compilations_total": "compilations"}
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


async def sampler(soak: Soak, pid: int, start: float, every: float, rows: list[dict], workers) -> None:
    """A row every `every` seconds until the workers are done, and one at the end (times from `start`)."""
    last, steps_le = start, (await asyncio.to_thread(server_metrics, soak.url))["steps_le"]
    while True:
        _, running = await asyncio.wait(workers, timeout=max(0.0, last + every - time.monotonic()))
        now = time.monotonic()
        metrics = await asyncio.to_thread(server_metrics, soak.url)
        gaps = [g for t, g in soak.gaps if last <= t < now]
        step_max_s = longest_step_s(steps_le, metrics["steps_le"])
        steps_le = metrics.pop("steps_le")
        row = {"t_s": now - start, "rss_mib": rss_mib(pid), **metrics, "step_max_ms": step_max_s * 1e3,
               "requests_ok": sum(o["ok"] for o in soak.outcomes.values()),
               "requests_failed": sum(o["failed"] for o in soak.outcomes.values()),
               "gap_p50_ms": percentile_ms(gaps, 50), "gap_p99_ms": percentile_ms(gaps, 99),
               "gap_max_ms": max(gaps, default=0.0) * 1e3}
        rows.append(row)
        print(_row(row), flush=True)
        last = now
        if not running:
            return


async def soak_run(soak: Soak, pid: int, start: float, every: float) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    rows: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        workers = [asyncio.create_task(worker(kind, client, soak)) for kind, k in CLIENTS.items() for _ in range(k)]
        await sampler(soak, pid, start, every, rows, workers)
    return rows


# --------------------------------------------------------------------------------------------------- verdict
def baseline(rows: list[dict], warmup_s: float, max_programs: int) -> int | None:
    """The index of the row the RSS is measured from: the first after the warm-up at which the server holds its
    `max_programs` compiled programs (from then on a compilation replaces a program, it adds none), else the first
    after the warm-up; None if no row is."""
    after = [i for i, r in enumerate(rows) if r["t_s"] >= warmup_s]
    full = [i for i in after if rows[i].get("compiled_programs", 0) >= max_programs]
    return (full or after or [None])[0]


def verdict(rows: list[dict], gaps_after_warmup: list[float], outcomes: dict, *, warmup_s: float, max_programs: int,
            rss_tolerance_mib: float, max_gap_s: float, tracebacks: int, server_exit: int | None,
            gap_over_step_s: float = float("inf")) -> list[str]:
    """What failed (empty: the soak passed): RSS growth from the `baseline` row on, a chunk gap over the bound, a
    row (after the warm-up) whose longest chunk gap exceeds its longest engine step by more than
    `gap_over_step_s`, a client that got another answer than expected, a traceback in the server's log, a server
    that died (`server_exit` not None)."""
    problems = []
    start = baseline(rows, warmup_s, max_programs)
    if start is not None:
        growth = max(r["rss_mib"] for r in rows[start:]) - rows[start]["rss_mib"]
        if growth > rss_tolerance_mib:
            problems.append(f"RSS grew {growth:.1f} MiB from t={rows[start]['t_s']:.0f} s (tolerance "
                            f"{rss_tolerance_mib:g} MiB)")
    if gaps_after_warmup and max(gaps_after_warmup) > max_gap_s:
        problems.append(f"a chunk gap of {max(gaps_after_warmup):.2f} s after the warm-up (bound {max_gap_s:g} s)")
    for r in rows:
        if r["t_s"] >= warmup_s and "step_max_ms" in r and r["gap_max_ms"] > r["step_max_ms"] + gap_over_step_s * 1e3:
            problems.append(f"a chunk gap of {r['gap_max_ms']:.0f} ms up to t={r['t_s']:.0f} s, whose longest step "
                            f"took at most {r['step_max_ms']:.0f} ms (bound: + {gap_over_step_s * 1e3:.0f} ms)")
    for kind, o in sorted(outcomes.items()):
        if o["failed"]:
            problems.append(f"{kind}: {o['failed']} of {o['ok'] + o['failed']} failed, e.g. {o['errors'][0]}")
    if tracebacks:
        problems.append(f"{tracebacks} tracebacks in the server's log")
    if server_exit is not None:
        problems.append(f"the server exited during the soak (status {server_exit})")
    return problems


def _row(r: dict) -> str:
    return (f"| {r['t_s']:.0f} | {r['rss_mib']:.1f} | {r.get('compiled_programs', 0):.0f} | "
            f"{r.get('compilations', 0):.0f} | {r['requests_ok']} / {r['requests_failed']} | "
            f"{r['gap_p50_ms']:.1f} / {r['gap_p99_ms']:.1f} / {r['gap_max_ms']:.1f} | {r['step_max_ms']:.0f} |")


# ------------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the clients run")
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="default: a third of --minutes (most step shapes compile then, and the allocator settles "
                        "once programs start being replaced)")
    p.add_argument("--sample-seconds", type=float, default=None, help="default: a tenth of the run, 1-30 s")
    p.add_argument("--port", type=int, default=0, help="the server's port on 127.0.0.1 (0: a free one)")
    p.add_argument("--server-args", default="", help="more pagedjax-serve options (model, engine), quoted")
    p.add_argument("--header-timeout", type=float, default=2.0, help="the server's --header-timeout, seconds")
    p.add_argument("--max-request-bytes", type=int, default=65536, help="the server's --max-request-bytes")
    p.add_argument("--max-tokens", type=int, default=128, help="the most tokens a client asks for")
    p.add_argument("--max-compiled-programs", type=int, default=16,
                   help="the server's --max-compiled-programs: the clients' variety makes ever new step shapes, so a "
                        "small cache fills early and the rest of the soak checks that replacing programs keeps "
                        "memory flat (each holds ~12 MiB for the bundled model)")
    p.add_argument("--rss-tolerance-mib", type=float, default=64.0,
                   help="the most the server's RSS may grow after the warm-up")
    p.add_argument("--max-gap-seconds", type=float, default=10.0,
                   help="the longest gap between two chunks of a stream after the warm-up (a new step shape stalls "
                        "every stream while it compiles: seconds on a CPU)")
    p.add_argument("--gap-over-step-seconds", type=float, default=0.1,
                   help="the most a sample's longest chunk gap (after the warm-up) may exceed its longest engine "
                        "step (pagedjax_engine_step_seconds: the upper edge of its bucket)")
    p.add_argument("--server-log", type=Path, default=None,
                   help="where the server's output goes (default: a new temporary folder's server.log, kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the report as one JSON line at the end")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    seconds = args.minutes * 60
    warmup_s = (args.warmup_minutes * 60) if args.warmup_minutes is not None else seconds / 3
    every = args.sample_seconds or max(1.0, min(30.0, seconds / 10))

    log_path = args.server_log or Path(tempfile.mkdtemp(prefix="soak_serve-")) / "server.log"
    server_args = ["--header-timeout", str(args.header_timeout), "--max-request-bytes", str(args.max_request_bytes),
                   "--max-compiled-programs", str(args.max_compiled_programs), *shlex.split(args.server_args)]
    proc, url = start_server(server_args, port=args.port or None, log_path=log_path)
    try:
        import httpx

        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        start = time.monotonic()
        soak = Soak(url=url, model=model, deadline=start + seconds, max_tokens=args.max_tokens,
                    header_timeout=args.header_timeout, max_request_bytes=args.max_request_bytes,
                    rng=random.Random(args.seed))
        logger.info("soaking pagedjax-serve (pid %d, %s, log %s) for %.1f min, warm-up %.1f min", proc.pid, url,
                    log_path, seconds / 60, warmup_s / 60)
        print("| t (s) | RSS MiB | compiled programs | compilations | requests ok / failed "
              "| chunk gap ms p50 / p99 / max | longest step ms (at most) |\n|---|---|---|---|---|---|---|", flush=True)
        rows = asyncio.run(soak_run(soak, proc.pid, start, every))
        server_exit = proc.poll()
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    gaps = [g for t, g in soak.gaps if t - start >= warmup_s]
    tracebacks = log_path.read_text().count("Traceback")
    problems = verdict(rows, gaps, soak.outcomes, warmup_s=warmup_s, max_programs=args.max_compiled_programs,
                       rss_tolerance_mib=args.rss_tolerance_mib, max_gap_s=args.max_gap_seconds,
                       tracebacks=tracebacks, server_exit=server_exit, gap_over_step_s=args.gap_over_step_seconds)
    start_row = baseline(rows, warmup_s, args.max_compiled_programs)
    after = rows[start_row:] if start_row is not None else rows[-1:]
    report = {"rows": rows, "clients": soak.outcomes, "warmup_s": warmup_s, "rss_baseline_t_s": after[0]["t_s"],
              "rss_baseline_mib": after[0]["rss_mib"], "rss_max_mib": max(r["rss_mib"] for r in after),
              "gaps_after_warmup": len(gaps), "gap_p50_ms": percentile_ms(gaps, 50),
              "gap_p99_ms": percentile_ms(gaps, 99), "gap_max_ms": max(gaps, default=0.0) * 1e3,
              "tracebacks": tracebacks, "problems": problems}
    print()
    for kind in KINDS:
        o = soak.outcomes.get(kind, {"ok": 0, "failed": 0, "errors": []})
        print(f"{kind}: {o['ok']} ok, {o['failed']} failed" + (f" (e.g. {o['errors'][0]})" if o["errors"] else ""))
    print(f"RSS from t={report['rss_baseline_t_s']:.0f} s (after the warm-up, with the program cache full if it "
          f"filled): {report['rss_baseline_mib']:.1f} MiB, at most {report['rss_max_mib']:.1f} MiB "
          f"(+{report['rss_max_mib'] - report['rss_baseline_mib']:.1f}, tolerance {args.rss_tolerance_mib:g} MiB)")
    print(f"chunk gaps after the warm-up ({len(gaps)}): p50 {report['gap_p50_ms']:.1f} ms, p99 "
          f"{report['gap_p99_ms']:.1f} ms, max {report['gap_max_ms']:.1f} ms (bounds: {args.max_gap_seconds:g} s, "
          f"and in each row the longest step + {args.gap_over_step_seconds * 1e3:g} ms)")
    print(f"server log: {tracebacks} tracebacks ({log_path})")
    print("FAIL: " + "; ".join(problems) if problems else "PASS")
    if args.json:
        print(json.dumps(report))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
