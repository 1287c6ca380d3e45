"""Serving benchmark: pagedjax-serve under Poisson arrivals, like vLLM's `benchmark_serving.py`.

    python scripts/bench_serving.py                          # starts pagedjax-serve on the bundled model
    python scripts/bench_serving.py --rates 1,4,inf --num-prompts 128
    python scripts/bench_serving.py --server-args "--model path/to/hf --kv-memory 256MiB"
    python scripts/bench_serving.py --url http://127.0.0.1:8000 --model-name pagedjax-tiny   # a running server

Workload: `--num-prompts` requests with ShareGPT-like lengths (log-normal prompt and output lengths, medians
`--prompt-median` and `--output-median` tokens, clipped to the context), prompts cut from Python's standard
library sources and sent as token ids (so their lengths are exact whatever the tokenizer), greedy, each
generating exactly its output length (`ignore_eos`). For each request rate (requests/s; `inf` sends them all at
once) the requests arrive as a Poisson process and stream from `/v1/completions`; reported: throughput
(requests/s, output tokens/s), time to first token (TTFT), time per output token after the first (TPOT) and
inter-token latency between streamed chunks (ITL), each as mean, p50 and p99.

In the same run the same requests go through `LLMEngine.generate` in this process (same model and engine
options as the server, no HTTP, all at once): the last column is the server's output tokens/s over the offline
engine's; at rate `inf` that is what HTTP, streaming, detokenization and the async engine cost. No row includes
compilation: each rate runs up to `--max-runs` times until a run compiles no new step shape (Poisson arrivals
make new batch shapes) and that run is reported, the offline engine likewise. The server's prefix cache is off by
default, so that the repeated runs compute their prompts. With `--url`, pass the server's model and engine
options in `--server-args` too: the prompts are tokenized and the offline engine built from them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Request:
    prompt_ids: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""


def make_workload(tokenizer, *, num_prompts: int, prompt_median: int, output_median: int, max_model_len: int,
                  seed: int) -> list[Request]:
    """ShareGPT-like lengths: log-normal (sigma 0.8, as the dataset's spread), clipped to fit the context."""
    rng = np.random.default_rng(seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    corpus = tokenizer.encode("\n".join(f.read_text(errors="replace") for f in files[:40]))
    requests = []
    for _ in range(num_prompts):
        out_len = int(np.clip(rng.lognormal(math.log(output_median), 0.8), 4, max_model_len // 2))
        prompt_len = int(np.clip(rng.lognormal(math.log(prompt_median), 0.8), 4, max_model_len - out_len))
        start = int(rng.integers(0, len(corpus) - prompt_len))
        requests.append(Request([int(t) for t in corpus[start:start + prompt_len]], out_len))
    return requests


async def _one(client, url: str, model: str, req: Request, delay: float) -> Result:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = Result(ok=False, start=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                res.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return res
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                elif data.get("choices") and data["choices"][0]["text"]:
                    res.chunk_times.append(now)
                elif "error" in data:
                    res.error = data["error"]["message"]
                    return res
    except Exception as e:  # noqa: BLE001 - a benchmark reports failures, it does not stop at them
        res.error = f"{type(e).__name__}: {e}"
        return res
    if res.chunk_times:
        res.ttft = res.chunk_times[0] - res.start
        res.latency = res.chunk_times[-1] - res.start
        res.ok = True
    return res


async def run_rate(url: str, model: str, requests: list[Request], rate: float, seed: int) -> tuple[list[Result], float]:
    import httpx

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(requests)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(requests))
    delays = np.cumsum(gaps) - gaps[0]
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, model, r, float(d))
                                         for r, d in zip(requests, delays, strict=True)))
    return list(results), time.perf_counter() - start


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = np.array([r.ttft for r in ok]) * 1e3
    tpot = np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]) * 1e3
    itl = np.array([b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]) * 1e3
    out_tokens = sum(r.output_tokens for r in ok)

    def stats(x):
        return (float(x.mean()), float(np.percentile(x, 50)), float(np.percentile(x, 99))) if len(x) else (0,) * 3

    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "req_per_s": len(ok) / duration, "out_tok_per_s": out_tokens / duration,
            "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl),
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


def run_offline(engine, requests: list[Request], max_runs: int) -> float:
    """Output tokens/s of `LLMEngine.generate` on all the requests at once, from a run that compiled nothing."""
    from pagedjax import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    prompts = [r.prompt_ids for r in requests]
    for _ in range(max_runs):
        before = engine.stats().compilations
        start = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - start
        if engine.stats().compilations == before:
            break
    return sum(len(o.output_token_ids) for o in outs) / duration


def compilations(url: str) -> int:
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("pagedjax_compilations_total "):
            return int(float(line.split()[1]))
    raise SystemExit(f"{url}/metrics has no pagedjax_compilations_total: not a pagedjax-serve?")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(server_args: list[str], *, port: int | None = None,
                 log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m pagedjax.serve` on 127.0.0.1 (`port`, default a free one) with `server_args`, its output to
    `log_path` (default: ours); returns (process, url) once /health answers. SystemExit if it exits or does not
    come up within 10 minutes (a cold start compiles)."""
    import httpx

    port = free_port() if port is None else port
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "pagedjax.serve", "--host", "127.0.0.1", "--port", str(port), "--log-level",
               "warning", *server_args]
    if log_path is None:
        proc = subprocess.Popen(command)
    else:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "" if log_path is None else ":\n" + log_path.read_text()[-2000:]
            raise SystemExit(f"pagedjax-serve exited with {proc.returncode}{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("pagedjax-serve did not start")


def _fmt(triple) -> str:
    return " / ".join(f"{v:.1f}" for v in triple)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start pagedjax-serve)")
    p.add_argument("--server-args", default="--no-prefix-caching",
                   help="pagedjax-serve options (model and engine), quoted; the default keeps the repeated runs "
                        "from finding their prompts in the prefix cache")
    p.add_argument("--model-name", default=None, help="the served model id (default: asked from /v1/models)")
    p.add_argument("--rates", default="2,8,32,inf", help="request rates, requests/s (inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-median", type=int, default=96, help="median prompt length, tokens")
    p.add_argument("--output-median", type=int, default=48, help="median output length, tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-offline", action="store_true", help="skip the offline generate() comparison")
    p.add_argument("--max-runs", type=int, default=4,
                   help="runs per rate (and offline) until one compiles nothing; the last is reported")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = p.parse_args(argv)

    from pagedjax.cli.engine_setup import build_engine, load_model_for_cli
    from pagedjax.serve.cli import build_parser as serve_parser

    server_args = shlex.split(args.server_args)
    sargs = serve_parser().parse_args(server_args)
    loaded = load_model_for_cli(sargs)
    max_model_len = sargs.max_model_len or min(2048, loaded.spec.max_position_embeddings)
    requests = make_workload(loaded.tokenizer, num_prompts=args.num_prompts, prompt_median=args.prompt_median,
                             output_median=args.output_median, max_model_len=max_model_len, seed=args.seed)
    rates = [float(r) for r in args.rates.split(",")]

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(server_args)
    try:
        import httpx

        model = args.model_name or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        prompt_median = int(np.median([len(r.prompt_ids) for r in requests]))
        print(f"# {len(requests)} requests: prompt tokens median {prompt_median}, output tokens median "
              f"{int(np.median([r.output_len for r in requests]))}, total output {sum(r.output_len for r in requests)}"
              f"; server {url} ({model})", flush=True)
        rows = []
        for rate in rates:
            for attempt in range(1, args.max_runs + 1):  # until a run compiled nothing (arrivals vary the shapes)
                before = compilations(url)
                results, duration = asyncio.run(run_rate(url, model, requests, rate, args.seed))
                compiled = compilations(url) - before
                print(f"# rate {rate:g}, run {attempt}: {duration:.1f} s, {compiled} new step shapes (compiled or "
                      "loaded from the compilation cache)", flush=True)
                if compiled == 0:
                    break
            rows.append((rate, summarize(results, duration), compiled))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)

    offline = None
    if not args.no_offline:
        engine = build_engine(sargs, loaded)
        if sargs.warmup:  # as the server warms up, but before the runs
            engine.warmup()
        offline = run_offline(engine, requests, args.max_runs)

    print()
    print("| rate (req/s) | done | req/s | output tok/s | TTFT ms mean / p50 / p99 | TPOT ms mean / p50 / p99 "
          "| ITL ms mean / p50 / p99 | vs offline generate |")
    print("|---|---|---|---|---|---|---|---|")
    for rate, s, compiled in rows:
        ratio = f"{s['out_tok_per_s'] / offline:.2f}x" if offline else "-"
        if compiled:
            ratio += f" ({compiled} new step shapes in the run)"
        print(f"| {rate:g} | {s['completed']}/{s['completed'] + s['failed']} | {s['req_per_s']:.2f} | "
              f"{s['out_tok_per_s']:.0f} | {_fmt(s['ttft_ms'])} | {_fmt(s['tpot_ms'])} | {_fmt(s['itl_ms'])} | "
              f"{ratio} |")
    if offline:
        print(f"| offline `generate` (all at once) | {len(requests)}/{len(requests)} | - | {offline:.0f} | - | - | - "
              "| 1.00x |")
    for rate, s, _ in rows:
        if s["errors"]:
            print(f"rate {rate:g}: errors: {s['errors']}")
    if args.json:
        print(json.dumps({"rows": [{"rate": r, "compiled": c, **s} for r, s, c in rows],
                          "offline_out_tok_per_s": offline}))


if __name__ == "__main__":
    main()
