"""Host time per engine step as outputs grow: what `LLMEngine.step()` costs besides the device call.

    python scripts/bench_host.py                          # 64 requests x 2048 tokens on the bundled model
    python scripts/bench_host.py --stop "@@@" --stop "<|x|>"   # with stop strings that never match
    python scripts/bench_host.py --requests 8 --max-tokens 256  # seconds

Each step is timed around `step()` (scheduling, input building, the device call, output building and text);
the device and compile time the engine reports are taken off, leaving the host's share, of which the "outputs"
column is the output layer's (text, stop strings, `RequestOutput`s: `engine.output_processor`, or in a checkout
from before it existed the engine's `_progressed` and `_output`, timed by wrapping them). Rows group the steps
by how many tokens each request had generated, so a per-step cost that grows with output length shows as a
growing column. One step per device call (no fused decode), greedy, EOS ignored. The same script measures an
older checkout too (`PYTHONPATH=old/checkout python scripts/bench_host.py`).
"""

from __future__ import annotations

import argparse
import time

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig


def time_output_layer(engine) -> list[float]:
    """Wrap the engine's output-building methods so that their time adds up in the returned one-item list."""
    spent = [0.0]
    owner, names = ((engine.output_processor, ("find_stops", "outputs")) if hasattr(engine, "output_processor")
                    else (engine, ("_progressed", "_output")))

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    for name in names:
        setattr(owner, name, timed(getattr(owner, name)))
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8, help="output-length groups in the table")
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    args = ap.parse_args()

    prompt = "def main():\n    "
    probe = LLMEngine.from_pretrained(cache_config=CacheConfig(num_blocks=16), compile_cache=False)
    prompt_len = len(probe.tokenizer.encode(prompt))
    del probe
    block = 16
    blocks = args.requests * (-(-(prompt_len + args.max_tokens) // block) + 1)
    engine = LLMEngine.from_pretrained(
        cache_config=CacheConfig(block_size=block, num_blocks=blocks),
        scheduler_config=SchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=args.requests * 32,
                                         max_model_len=prompt_len + args.max_tokens),
        compile_cache=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, stop=args.stop)
    for i in range(args.requests):
        engine.add_request(f"r{i}", engine.tokenizer.encode(prompt), params)
    output_s = time_output_layer(engine)

    per_row = args.max_tokens // args.rows
    rows = [[0, 0.0, 0.0, 0.0] for _ in range(args.rows)]  # steps, host s, outputs s, device s
    generated = 0  # tokens each request has (they all advance together once decoding)
    while engine.has_unfinished_requests():
        before = engine.stats()
        output_before = output_s[0]
        start = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - start
        after = engine.stats()
        device = after.device_s - before.device_s
        compile_s = after.compile_s - before.compile_s
        if outs:
            generated = max(len(o.output_token_ids) for o in outs)
        if compile_s or generated == 0:
            continue  # steps that compiled, and the prefill, are not what this measures
        row = rows[min((generated - 1) // per_row, args.rows - 1)]
        row[0] += 1
        row[1] += wall - device - compile_s
        row[2] += output_s[0] - output_before
        row[3] += device
    stops = f", {len(args.stop)} stop strings" if args.stop else ""
    print(f"host time per step: {args.requests} requests x {args.max_tokens} tokens, bundled model{stops}")
    print(f"{'tokens generated':>18} {'steps':>6} {'host ms/step':>13} {'of which outputs':>17} "
          f"{'device ms/step':>15}")
    for i, (steps, host, outputs, device) in enumerate(rows):
        if steps:
            span = f"{i * per_row + 1}-{(i + 1) * per_row}"
            print(f"{span:>18} {steps:>6} {1e3 * host / steps:>13.2f} {1e3 * outputs / steps:>17.2f} "
                  f"{1e3 * device / steps:>15.2f}")


if __name__ == "__main__":
    main()
