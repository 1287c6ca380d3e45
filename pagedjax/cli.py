"""`pagedjax-generate` (also `python -m pagedjax`): decode text with the paged engine and show its statistics.

    pagedjax-generate                                  # a few prompts on the bundled byte-level model
    pagedjax-generate --demo                           # prompts sharing a long prefix: prefix-cache hits
    pagedjax-generate --prompt "def parse(" --prompt "import os" --max-tokens 64 --temperature 0.8 --top-p 0.95
    pagedjax-generate --model path/to/checkpoint --prompts-file prompts.txt --kv-memory 64MiB

A single prompt streams as it is generated; with several, each completion is printed when it finishes.
The run ends with a table of the engine's statistics.
"""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
]

# --demo: one long shared prefix (a module header) and several different continuations.
DEMO_PREFIX = '''"""Read settings from configuration files."""

import os
import sys

__all__ = ["read_config", "Config"]

ENCODING = "utf-8"

'''
DEMO_SUFFIXES = [
    "def read_config(path):\n",
    "def parse_args(argv=None):\n",
    "class Config(OrderedDict):\n",
    "def _strip_comment(line):\n",
    "def write_config(path, config):\n",
]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64MiB', '1.5GB', '512k', '1048576' -> bytes. KiB/MiB/GiB and bare K/M/G are binary; kB/MB/GB decimal."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 64MiB, 1GB, 512k, 1048576)")
    number, unit, binary, b = m.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    base = 1024 if binary or (unit and not b) else 1000
    value = int(float(number) * base ** power)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return value


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def _float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
        if not (lo < v if lo_open else lo <= v) or not v <= hi:
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
        return v

    parse.__name__ = "float"
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedjax-generate",
        description="Generate text with pagedjax's paged-attention engine (default model: the bundled "
                    "byte-level model trained on Python's standard library).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt (repeatable); without any, a few built-in prompts are used")
    g.add_argument("--prompts-file", type=Path, default=None, metavar="FILE",
                   help="one prompt per line ('-' reads stdin); a line that is a JSON string is decoded, so "
                        "\"def f():\\n\" gives a multi-line prompt")
    g.add_argument("--demo", action="store_true",
                   help="several prompts sharing a long prefix: shows prefix-cache hits")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=_int_at_least(1), default=64, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=_float_in(0.0, 100.0), default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=_int_at_least(0), default=0, help="0 = off")
    g.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=0.95, help="1 = off")
    g.add_argument("--seed", type=_int_at_least(0), default=0,
                   help="sampling seed: prompt i uses seed + i, so runs are reproducible")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None, metavar="PATH",
                   help="a pagedjax checkpoint folder (or a Hugging Face folder where supported); "
                        "default: the bundled model")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="parameter dtype (default: the checkpoint's)")
    g.add_argument("--backend", choices=["auto", "pallas", "xla"], default="auto",
                   help="attention backend: auto = Pallas on GPU, XLA elsewhere")
    g.add_argument("--block-size", type=_int_at_least(1), default=16, help="tokens per KV block")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=_int_at_least(1), default=None, help="KV blocks in the pool")
    kv.add_argument("--kv-memory", type=parse_size, default=None, metavar="SIZE",
                    help="size the KV pool by memory instead, e.g. 64MiB (default: 512 blocks)")
    g.add_argument("--num-steps", type=_int_at_least(1), default=1,
                   help="decode iterations per device call when every sequence is decoding")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--max-num-seqs", type=_int_at_least(1), default=64, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=512, help="tokens per step")
    g.add_argument("--max-model-len", type=_int_at_least(1), default=None,
                   help="longest prompt + completion (default: min(2048, the model's max positions))")
    g = p.add_argument_group("output")
    g.add_argument("--no-stream", action="store_true", help="print a single prompt's completion at the end")
    g.add_argument("--json", action="store_true", help="print completions and statistics as one JSON object")
    return p


def read_prompts_file(path: Path) -> list[str]:
    text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8", errors="surrogateescape")
    prompts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                value = json.loads(line)
            except ValueError:
                value = None
            if isinstance(value, str):
                line = value
        prompts.append(line)
    return prompts


# ------------------------------------------------------------------------------------------------- model
def load_model(path: str | None, dtype: str | None):
    """(ModelConfig, params, tokenizer or None) through the project's loader when present."""
    try:
        from pagedjax.model.loader import load_pretrained
    except ImportError:
        load_pretrained = None
    if load_pretrained is not None:
        return load_pretrained(path, dtype=dtype)
    from pagedjax.model.checkpoint import bundled_model_path, load_checkpoint
    from pagedjax.tokenizer import ByteTokenizer

    cfg, state = load_checkpoint(path if path is not None else bundled_model_path(), dtype=dtype)
    return cfg, state, ByteTokenizer() if cfg.vocab_size == ByteTokenizer.vocab_size else None


# --------------------------------------------------------------------------------------------------- run
@dataclass
class Peak:
    """The fullest moment of the KV pool during the run (stats at the end show an idle pool)."""

    blocks_used: int = 0
    kv_waste_pct: float | None = None
    running: int = 0

    def observe(self, stats) -> None:
        used = getattr(stats, "blocks_used", 0) or 0
        self.running = max(self.running, getattr(stats, "num_running", 0) or 0)
        if used >= self.blocks_used:
            self.blocks_used = used
            self.kv_waste_pct = getattr(stats, "kv_waste_pct", None)


@dataclass
class Completion:
    index: int
    prompt: str
    text: str = ""
    num_prompt_tokens: int = 0
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"), repr=False)


def _fmt_int(v) -> str:
    return "n/a" if v is None else f"{int(v):,}"


def _fmt_pct(v) -> str:
    return "n/a" if v is None else f"{float(v):.1f} %"


def stats_rows(stats, peak: Peak, wall_s: float, num_requests: int) -> list[tuple[str, str]]:
    g = lambda name: getattr(stats, name, None)
    num_blocks = g("num_blocks")
    used = f"{peak.blocks_used:,} of {_fmt_int(num_blocks)} (peak)"
    if num_blocks:
        used += f", {100.0 * peak.blocks_used / num_blocks:.1f} %"
    hit = g("prefix_cache_hit_rate")
    tps = g("tokens_per_s")
    return [
        ("requests", f"{num_requests:,}"),
        ("prompt tokens", _fmt_int(g("prompt_tokens"))),
        ("generated tokens", _fmt_int(g("generated_tokens"))),
        ("tokens/s", "n/a" if tps is None else
         f"{tps:,.1f} (generated, over {(g('elapsed_s') or 0) - (g('compile_s') or 0):.2f} s of steps)"),
        ("KV blocks used", used),
        ("KV waste", _fmt_pct(peak.kv_waste_pct) + " (unfilled slots of held blocks, at peak)"),
        ("prefix-cache hit rate", "n/a" if hit is None else f"{100.0 * hit:.1f} %"),
        ("preemptions", _fmt_int(g("preemptions"))),
        ("compilations", f"{_fmt_int(g('compilations'))} ({g('compile_s') or 0:.2f} s)"),
        ("engine steps", _fmt_int(g("steps"))),
        ("wall time", f"{wall_s:.2f} s"),
    ]


def print_table(rows: list[tuple[str, str]], out: TextIO, title: str = "statistics") -> None:
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 40)
    print(rule, file=out)
    print(title, file=out)
    print(rule, file=out)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=out)
    print(rule, file=out)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    if args.model is not None and not Path(args.model).exists():
        parser.error(f"--model: no such file or directory: {args.model}")

    # Prompts
    shared_prefix = ""
    if args.demo:
        if args.prompt or args.prompts_file:
            parser.error("--demo uses its own prompts; drop --prompt/--prompts-file")
        shared_prefix = DEMO_PREFIX
        prompts = [DEMO_PREFIX + s for s in DEMO_SUFFIXES]
    else:
        prompts = list(args.prompt or [])
        if args.prompts_file is not None:
            try:
                prompts += read_prompts_file(args.prompts_file)
            except OSError as e:
                parser.error(f"--prompts-file: {e.strerror or e}: {args.prompts_file}")
        if not prompts:
            if args.prompt is not None or args.prompts_file is not None:
                parser.error("no prompts (empty --prompt or --prompts-file)")
            prompts = list(DEFAULT_PROMPTS)
    if any(p == "" for p in prompts):
        parser.error("empty prompt")

    import jax

    from pagedjax.config import CacheConfig, SchedulerConfig
    from pagedjax.core.request import SamplingParams
    from pagedjax.engine import LLMEngine

    t0 = time.perf_counter()
    try:
        cfg, params, tokenizer = load_model(args.model, args.dtype)
    except FileNotFoundError as e:
        parser.error(f"--model: {e}")
    except ValueError as e:
        parser.error(f"--model: cannot load {args.model or 'the bundled model'}: {e}")
    if tokenizer is None:
        parser.error(f"--model: {args.model} has no tokenizer pagedjax can use for text prompts")
    load_s = time.perf_counter() - t0

    max_len = args.max_model_len or min(2048, cfg.max_position_embeddings)
    try:
        cache_config = CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                                   kv_memory_bytes=args.kv_memory, enable_prefix_caching=not args.no_prefix_caching)
        scheduler_config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens,
                                           max_model_len=max_len)
        cache_config.resolve_num_blocks(cfg)
        engine = LLMEngine(cfg, cache_config, scheduler_config, params=params, seed=args.seed,
                           backend=args.backend, num_steps=args.num_steps, tokenizer=tokenizer)
    except ValueError as e:
        parser.error(str(e))

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed + i, ignore_eos=args.ignore_eos)

    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    if not args.json:
        model_name = args.model or "bundled tiny model"
        print(f"model: {model_name} ({n_params / 1e6:.2f} M params, {cfg.num_layers} layers, "
              f"{cfg.num_q_heads}q/{cfg.num_kv_heads}kv heads, {cfg.dtype}; loaded in {load_s:.2f} s)", file=out)
        print(f"engine: {engine.backend} attention on {jax.default_backend()}, {engine.num_blocks} KV blocks x "
              f"{args.block_size} tokens, prefix caching {'off' if args.no_prefix_caching else 'on'}, "
              f"{args.num_steps} decode step(s) per call", file=out)
        print(file=out)

    completions = [Completion(i, p) for i, p in enumerate(prompts)]
    by_id: dict[str, Completion] = {}
    peak = Peak()
    stream = len(prompts) == 1 and not args.no_stream and not args.json
    start = time.perf_counter()

    def submit(indices: list[int]) -> None:
        for i in indices:
            c = completions[i]
            ids = tokenizer.encode(c.prompt)
            c.num_prompt_tokens = len(ids)
            rid = f"prompt-{i}"
            try:
                engine.add_request(rid, ids, sampling(i))
            except ValueError as e:
                parser.error(f"prompt {i + 1}: {e}")
            by_id[rid] = c

    def show_finished(c: Completion) -> None:
        if args.json:
            return
        if stream:
            print(file=out)
        else:
            shown = c.prompt[len(shared_prefix):] if shared_prefix else c.prompt
            label = f"[{c.index + 1}] " + ("(shared prefix) + " if shared_prefix else "")
            print(f"{label}{shown}{c.text}", file=out)
        cached = f", {c.num_cached_tokens} of {c.num_prompt_tokens} prompt tokens from the prefix cache"
        print(f"--- [{c.index + 1}] {c.num_tokens} tokens, finish: {c.finish_reason}{cached}", file=out)
        print(file=out)
        out.flush()

    def drain() -> None:
        while engine.has_unfinished_requests():
            for o in engine.step():
                c = by_id[o.request_id]
                ids = o.output_token_ids
                new = tokenizer.decode_bytes(ids[c.num_tokens:]) if hasattr(tokenizer, "decode_bytes") else None
                if new is not None:
                    piece = c._decoder.decode(new, final=o.finished)
                else:
                    piece = tokenizer.decode(ids)[len(c.text):]
                c.text += piece
                c.num_tokens = len(ids)
                c.num_cached_tokens = o.num_cached_tokens
                if stream and piece:
                    out.write(piece)
                    out.flush()
                if o.finished:
                    c.finish_reason = o.finish_reason
                    show_finished(c)
            peak.observe(engine.stats())

    if stream:
        out.write(prompts[0])
        out.flush()
    if args.demo and not args.no_prefix_caching:
        # The first request computes (and caches) the shared prefix; the others then find it in the cache.
        if not args.json:
            print("demo: the first prompt fills the prefix cache, the other "
                  f"{len(prompts) - 1} share its {len(tokenizer.encode(shared_prefix))}-token prefix\n", file=out)
            print("shared prefix:\n" + shared_prefix, file=out)
        submit([0])
        drain()
        submit(list(range(1, len(prompts))))
    else:
        submit(list(range(len(prompts))))
    drain()
    wall = time.perf_counter() - start
    stats = engine.stats()
    peak.observe(stats)

    rows = stats_rows(stats, peak, wall, len(prompts))
    if args.json:
        result = {
            "completions": [{"prompt": c.prompt, "text": c.text, "num_prompt_tokens": c.num_prompt_tokens,
                             "num_tokens": c.num_tokens, "num_cached_tokens": c.num_cached_tokens,
                             "finish_reason": c.finish_reason} for c in completions],
            "stats": dict(rows),
            "peak_blocks_used": peak.blocks_used,
            "peak_kv_waste_pct": peak.kv_waste_pct,
        }
        print(json.dumps(result, indent=2), file=out)
    else:
        print_table(rows, out)
    return 0


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        import absl.logging

        absl.logging.set_verbosity(absl.logging.ERROR)
    except ImportError:
        pass
    for name in ("absl", "orbax", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_libraries()
    try:
        return run(args, parser)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
