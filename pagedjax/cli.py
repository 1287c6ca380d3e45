"""`pagedjax-generate` (also `python -m pagedjax`): decode text with the paged engine and show its statistics.

    pagedjax-generate                                  # a few prompts on the bundled byte-level model
    pagedjax-generate --demo                           # prompts sharing a long prefix: prefix-cache hits
    pagedjax-generate --prompt "def parse(" --prompt "import os" --max-tokens 64 --temperature 0.8 --top-p 0.95
    pagedjax-generate --model path/to/checkpoint --prompts-file prompts.txt --kv-memory 64MiB

A single prompt streams as it is generated; with several, each completion is printed when it finishes.
The run ends with a table of the engine's statistics (`--json`: one JSON object, numbers with their unit in
the key name).

Exit status: 0 on success; 1 if a request failed; 2 for a usage error (with the usage block) or an error found
while running (one line `pagedjax-generate: error: ...`: a model that cannot be loaded, a KV pool that cannot
fit, a prompt that is too long, ...); 130 after Ctrl-C, which stops the run between two engine steps (a second
Ctrl-C, or one before generation starts, exits at once).
"""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TextIO

PROG = "pagedjax-generate"
EXIT_OK, EXIT_REQUEST_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_NUM_BLOCKS = 512  # CacheConfig's default when neither --num-blocks nor --kv-memory is given

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


class CLIError(Exception):
    """A problem found while running (not in the arguments' syntax): shown as one line, exit status 2."""


class Interrupted(Exception):  # noqa: N818 - a signal, not an error
    """Ctrl-C stopped the run between two engine steps."""


# --------------------------------------------------------------------------------------------------- arguments
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64MiB', '1.5GB', '512k', '1048576' -> bytes. KiB/MiB/GiB and bare K/M/G are binary; kB/MB/GB decimal.

    Exact integer arithmetic: any number of digits parses (whether the size fits is checked later)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 64MiB, 1GB, 512k, 1048576)")
    number, unit, binary, b = m.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    base = 1024 if binary or (unit and not b) else 1000
    value = int(Fraction(number) * base ** power)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return value


def format_size(num_bytes: int) -> str:
    """Bytes for people: '64.0 MiB', '1.2 TiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{num_bytes} B" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" once: not to flags or options without a default, nor where the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Generate text with pagedjax's paged-attention engine (default model: the bundled "
                    "byte-level model trained on Python's standard library).",
        formatter_class=_HelpFormatter)
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
                   help="a pagedjax checkpoint folder or a Hugging Face folder (config.json + *.safetensors); "
                        "default: the bundled model")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="parameter dtype (default: the checkpoint's)")
    g.add_argument("--backend", choices=["auto", "pallas", "xla"], default="auto",
                   help="attention backend: auto = Pallas on GPU, XLA elsewhere")
    g.add_argument("--block-size", type=_int_at_least(1), default=16, help="tokens per KV block")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=_int_at_least(1), default=None,
                    help=f"KV blocks in the pool (default: {DEFAULT_NUM_BLOCKS})")
    kv.add_argument("--kv-memory", type=parse_size, default=None, metavar="SIZE",
                    help="size the KV pool by memory instead, e.g. 64MiB")
    g.add_argument("--num-steps", type=_int_at_least(1), default=1,
                   help="decode iterations per device call when every sequence is decoding")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--max-num-seqs", type=_int_at_least(1), default=64, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=512, help="tokens per step")
    g.add_argument("--max-model-len", type=_int_at_least(1), default=None,
                   help="longest prompt + completion (default: min(2048, the model's max positions))")
    g = p.add_argument_group("output")
    g.add_argument("--no-stream", action="store_true", help="print a single prompt's completion at the end")
    g.add_argument("--json", action="store_true",
                   help="print completions and statistics as one JSON object (units in the key names)")
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


@dataclass
class Prompts:
    texts: list[str]
    shared_prefix: str = ""  # --demo: the prefix every prompt starts with


def collect_prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Prompts:
    """The prompts the arguments ask for (usage errors through `parser`)."""
    if args.demo:
        if args.prompt or args.prompts_file:
            parser.error("--demo uses its own prompts; drop --prompt/--prompts-file")
        return Prompts([DEMO_PREFIX + s for s in DEMO_SUFFIXES], DEMO_PREFIX)
    texts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            texts += read_prompts_file(args.prompts_file)
        except OSError as e:
            parser.error(f"--prompts-file: {e.strerror or e}: {args.prompts_file}")
    if not texts:
        if args.prompt is not None or args.prompts_file is not None:
            parser.error("no prompts (empty --prompt or --prompts-file)")
        texts = list(DEFAULT_PROMPTS)
    if any(t == "" for t in texts):
        parser.error("empty prompt")
    return Prompts(texts)


# ----------------------------------------------------------------------------------------------- model, engine
def load_model(path: str | None, dtype: str | None):
    """(ModelConfig, params, tokenizer) through the project's loader; CLIError (one line naming the file) if
    the model cannot be loaded or has no tokenizer for text prompts."""
    from pagedjax.model.loader import ModelLoadError, load_pretrained

    where = path or "the bundled model"
    try:
        cfg, params, tokenizer = load_pretrained(path, dtype=dtype)
    except ModelLoadError as e:
        raise CLIError(f"cannot load the model: {e}") from None
    except OSError as e:
        raise CLIError(f"cannot load {where}: {e.strerror or e}" + (f": {e.filename}" if e.filename else "")) \
            from None
    except (TypeError, ValueError) as e:
        raise CLIError(f"cannot load {where}: {' '.join(str(e).split())}") from None
    if tokenizer is None:
        raise CLIError(f"{where} has no tokenizer pagedjax can use for text prompts (tokenizer.json, or the "
                       "byte-level vocabulary)")
    return cfg, params, tokenizer


def memory_available(device) -> tuple[int, str] | None:
    """(bytes free for new arrays on `device`, what that is) or None when unknown. Accelerators report their
    allocator's limit through `memory_stats()`; on the CPU it is the machine's available memory."""
    try:
        mem = device.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        mem = None
    if mem and mem.get("bytes_limit"):
        limit = int(mem["bytes_limit"])
        return limit - int(mem.get("bytes_in_use", 0)), f"{device.platform} device memory ({format_size(limit)})"
    if device.platform != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024, "available host memory"
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    except (AttributeError, OSError, ValueError):
        return None


def check_kv_pool_fits(cache_config, model_config, device) -> None:
    """CLIError if the KV pool the cache config asks for is bigger than the device's free memory (checked
    before allocating: allocating it would fail with RESOURCE_EXHAUSTED, or get the process killed)."""
    try:
        num_blocks = cache_config.resolve_num_blocks(model_config)
    except ValueError as e:
        raise CLIError(f"--kv-memory: {e}") from None
    block_bytes = cache_config.block_bytes(model_config)
    need = num_blocks * block_bytes
    available = memory_available(device)
    if available is not None and need > available[0]:
        free, what = available
        raise CLIError(f"a KV pool of {num_blocks:,} blocks x {format_size(block_bytes)} = {format_size(need)} "
                       f"does not fit in the {what}: {format_size(max(free, 0))} free; lower --kv-memory or "
                       "--num-blocks")


def build_engine(args: argparse.Namespace, cfg, params, tokenizer):
    """The engine the arguments describe, its KV pool checked against the device's memory first."""
    import jax

    from pagedjax.config import CacheConfig, SchedulerConfig
    from pagedjax.engine import LLMEngine

    try:
        cache_config = CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                                   kv_memory_bytes=args.kv_memory, enable_prefix_caching=not args.no_prefix_caching)
        scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len or min(2048, cfg.max_position_embeddings))
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from None
    check_kv_pool_fits(cache_config, cfg, jax.local_devices()[0])
    try:
        return LLMEngine(cfg, cache_config, scheduler_config, params=params, seed=args.seed, backend=args.backend,
                         decode_steps_per_call=args.num_steps, tokenizer=tokenizer)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from None
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise CLIError(f"out of device memory building the engine (KV pool of {cache_config.pool_bytes(cfg):,} "
                       "bytes); lower --kv-memory or --num-blocks") from None


# ------------------------------------------------------------------------------------------------- generation
@dataclass
class Peak:
    """The fullest moment of the KV pool during the run (stats at the end show an idle pool)."""

    blocks_used: int = 0
    kv_waste_pct: float = 0.0
    running: int = 0

    def observe(self, stats) -> None:
        memory = stats.scheduler.memory
        self.running = max(self.running, stats.scheduler.num_running)
        if memory.num_used_blocks >= self.blocks_used:
            self.blocks_used = memory.num_used_blocks
            self.kv_waste_pct = 100.0 * memory.waste_fraction


@dataclass
class Completion:
    index: int
    prompt: str
    text: str = ""
    num_prompt_tokens: int = 0
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"), repr=False)


class Generation:
    """Feeds prompts to the engine and steps it, printing completions as they come (streaming one prompt).

    While it runs, Ctrl-C only sets `ctrl_c.requested`; it is checked between engine steps (raising
    Interrupted), so a step is never cut off half-way."""

    def __init__(self, engine, tokenizer, prompts: Prompts, args: argparse.Namespace, out: TextIO,
                 ctrl_c: CtrlC | None = None):
        from pagedjax.core.request import SamplingParams

        self.engine, self.tokenizer, self.prompts, self.args, self.out = engine, tokenizer, prompts, args, out
        self.ctrl_c = ctrl_c if ctrl_c is not None else CtrlC(exit_process=False)
        self.completions = [Completion(i, p) for i, p in enumerate(prompts.texts)]
        self.by_id: dict[str, Completion] = {}
        self.peak = Peak()
        self.stream = len(prompts.texts) == 1 and not args.no_stream and not args.json
        self._start = time.perf_counter()
        self._later: list[int] = []  # the demo's prompts queued once the first is done
        self._sampling = lambda i: SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed + i, ignore_eos=args.ignore_eos)

    def start(self) -> None:
        """Queue the prompts that go first, before anything is printed: a prompt the engine refuses (too
        long, bigger than the pool) is a CLIError. The demo queues its first prompt alone: it computes (and
        caches) the shared prefix, and the others, queued once it is done, find it in the cache."""
        self._start = time.perf_counter()
        everything = list(range(len(self.completions)))
        first = everything[:1] if self.args.demo and not self.args.no_prefix_caching else everything
        self._later = everything[len(first):]
        self.submit(first)

    def run(self) -> float:
        """Generate every completion (after `start`); returns the wall time since `start` in seconds."""
        with self.ctrl_c.stopping_between_steps():
            if self._later and not self.args.json:
                prefix = self.prompts.shared_prefix
                print(f"demo: the first prompt fills the prefix cache, the other {len(self._later)} share its "
                      f"{len(self.tokenizer.encode(prefix))}-token prefix\n", file=self.out)
                print("shared prefix:\n" + prefix, file=self.out)
            if self.stream:
                self.out.write(self.completions[0].prompt)
                self.out.flush()
            self.drain()
            if self._later:
                self.submit(self._later)
                self.drain()
        return time.perf_counter() - self._start

    def submit(self, indices: list[int]) -> None:
        for i in indices:
            c = self.completions[i]
            ids = self.tokenizer.encode(c.prompt)
            c.num_prompt_tokens = len(ids)
            rid = f"prompt-{i}"
            try:
                self.engine.add_request(rid, ids, self._sampling(i))
            except (TypeError, ValueError) as e:
                raise CLIError(f"prompt {i + 1}: {e}") from None
            self.by_id[rid] = c

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            if self.ctrl_c.requested:
                raise Interrupted
            for o in self.engine.step():
                self._take(o)
            self.peak.observe(self.engine.stats())
        if self.ctrl_c.requested:
            raise Interrupted

    def _take(self, o) -> None:
        c = self.by_id[o.request_id]
        ids = o.output_token_ids
        if hasattr(self.tokenizer, "decode_bytes"):
            piece = c._decoder.decode(self.tokenizer.decode_bytes(ids[c.num_tokens:]), final=o.finished)
        else:
            piece = self.tokenizer.decode(ids)[len(c.text):]
        c.text += piece
        c.num_tokens = len(ids)
        c.num_cached_tokens = o.num_cached_tokens
        if self.stream and piece:
            self.out.write(piece)
            self.out.flush()
        if o.finished:
            c.finish_reason, c.error = o.finish_reason, o.error
            self._show_finished(c)

    def _show_finished(self, c: Completion) -> None:
        if self.args.json:
            return
        out, prefix = self.out, self.prompts.shared_prefix
        if self.stream:
            print(file=out)
        else:
            label = f"[{c.index + 1}] " + ("(shared prefix) + " if prefix else "")
            print(f"{label}{c.prompt[len(prefix):]}{c.text}", file=out)
        finish = c.finish_reason + (f" ({c.error})" if c.error else "")
        cached = f", {c.num_cached_tokens} of {c.num_prompt_tokens} prompt tokens from the prefix cache"
        print(f"--- [{c.index + 1}] {c.num_tokens} tokens, finish: {finish}{cached}", file=out)
        print(file=out)
        out.flush()


# ---------------------------------------------------------------------------------------------------- report
def stats_summary(stats, peak: Peak, wall_s: float, num_requests: int) -> dict[str, int | float]:
    """The run's statistics as numbers, each key naming its unit (`_s` seconds, `_pct` percent, ...)."""
    num_blocks = stats.scheduler.memory.num_blocks
    return {
        "requests": num_requests,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "tokens_per_s": stats.tokens_per_s,  # generated tokens over step time, compilation excluded
        "step_time_s": stats.elapsed_s - stats.compile_s,
        "elapsed_s": stats.elapsed_s,  # inside engine steps, compilation included
        "compile_s": stats.compile_s,
        "compilations": stats.compilations,
        "engine_steps": stats.steps,
        "kv_blocks": num_blocks,
        "kv_blocks_used_peak": peak.blocks_used,
        "kv_blocks_used_peak_pct": 100.0 * peak.blocks_used / num_blocks if num_blocks else 0.0,
        "kv_waste_pct": peak.kv_waste_pct,  # unfilled slots of held blocks, at the peak
        "prefix_cache_hit_pct": 100.0 * stats.scheduler.prefix_cache_hit_rate,
        "preemptions": stats.scheduler.num_preemptions,
        "running_peak": peak.running,
        "wall_s": wall_s,
    }


def stats_rows(s: dict[str, int | float]) -> list[tuple[str, str]]:
    """`stats_summary` as the table's (label, text) rows."""
    return [
        ("requests", f"{s['requests']:,}"),
        ("prompt tokens", f"{s['prompt_tokens']:,}"),
        ("generated tokens", f"{s['generated_tokens']:,}"),
        ("tokens/s", f"{s['tokens_per_s']:,.1f} (generated, over {s['step_time_s']:.2f} s of steps)"),
        ("KV blocks used", f"{s['kv_blocks_used_peak']:,} of {s['kv_blocks']:,} (peak), "
                           f"{s['kv_blocks_used_peak_pct']:.1f} %"),
        ("KV waste", f"{s['kv_waste_pct']:.1f} % (unfilled slots of held blocks, at peak)"),
        ("prefix-cache hit rate", f"{s['prefix_cache_hit_pct']:.1f} %"),
        ("preemptions", f"{s['preemptions']:,}"),
        ("compilations", f"{s['compilations']:,} ({s['compile_s']:.2f} s)"),
        ("engine steps", f"{s['engine_steps']:,}"),
        ("wall time", f"{s['wall_s']:.2f} s"),
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


def print_header(args: argparse.Namespace, cfg, params, engine, load_s: float, out: TextIO) -> None:
    import jax

    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    print(f"model: {args.model or 'bundled tiny model'} ({n_params / 1e6:.2f} M params, {cfg.num_layers} layers, "
          f"{cfg.num_q_heads}q/{cfg.num_kv_heads}kv heads, {cfg.dtype}; loaded in {load_s:.2f} s)", file=out)
    print(f"engine: {engine.backend} attention on {jax.default_backend()}, {engine.num_blocks} KV blocks x "
          f"{args.block_size} tokens, prefix caching {'off' if args.no_prefix_caching else 'on'}, "
          f"{args.num_steps} decode step(s) per call", file=out)
    print(file=out)


def report(gen: Generation, wall_s: float, json_output: bool, out: TextIO) -> None:
    stats = gen.engine.stats()
    gen.peak.observe(stats)
    summary = stats_summary(stats, gen.peak, wall_s, len(gen.completions))
    if json_output:
        completions = [{"prompt": c.prompt, "text": c.text, "num_prompt_tokens": c.num_prompt_tokens,
                        "num_tokens": c.num_tokens, "num_cached_tokens": c.num_cached_tokens,
                        "finish_reason": c.finish_reason, "error": c.error} for c in gen.completions]
        print(json.dumps({"completions": completions, "stats": summary}, indent=2), file=out)
    else:
        print_table(stats_rows(summary), out)


# ------------------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None,
        ctrl_c: CtrlC | None = None) -> int:
    """The whole command once the arguments are parsed. Raises CLIError (one-line errors) and Interrupted."""
    out = sys.stdout if out is None else out
    if args.model is not None and not Path(args.model).exists():
        parser.error(f"--model: no such file or directory: {args.model}")
    prompts = collect_prompts(args, parser)

    t0 = time.perf_counter()
    cfg, params, tokenizer = load_model(args.model, args.dtype)
    load_s = time.perf_counter() - t0
    engine = build_engine(args, cfg, params, tokenizer)
    gen = Generation(engine, tokenizer, prompts, args, out, ctrl_c)
    gen.start()
    if not args.json:
        print_header(args, cfg, params, engine, load_s, out)
    wall_s = gen.run()
    report(gen, wall_s, args.json, out)
    return EXIT_REQUEST_FAILED if any(c.finish_reason == "error" for c in gen.completions) else EXIT_OK


# ------------------------------------------------------------------------------------------------- Ctrl-C
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
        _flush_quietly()  # we are between two bytecodes of the main thread: flushing is safe
        _exit_interrupted()

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
                    _exit_interrupted()
                if seen == 1:  # the main thread's handler flushes and exits, unless it is stuck in a C call
                    timer = threading.Timer(self.GRACE_S if self.soft else 0.5, _exit_interrupted)
                    timer.daemon = True
                    timer.start()


def _exit_interrupted() -> None:
    """Leave now: a one-line message straight to file descriptor 2 (no Python buffer, which another thread
    may hold), then `os._exit(130)`."""
    os.write(2, b"\ninterrupted\n")
    os._exit(EXIT_INTERRUPTED)


def _flush_quietly() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe, or a flush re-entered from a signal handler
            pass


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
    """The console script. `argv` None means this is the process (sys.argv): an interrupted run then leaves
    with `os._exit(130)` once its output is flushed, so nothing of JAX is torn down behind XLA's threads;
    called with `argv`, it returns 130 instead. One-line errors (CLIError) return 2."""
    exit_process = argv is None
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_libraries()
    with CtrlC(exit_process) as ctrl_c:
        try:
            return run(args, parser, ctrl_c=ctrl_c)
        except CLIError as e:
            _flush_quietly()
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return EXIT_ERROR
        except (Interrupted, KeyboardInterrupt):
            _flush_quietly()
            if exit_process:
                _exit_interrupted()
            print("\ninterrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # e.g. piped into `head`: stop quietly, and let the exit not flush again
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):  # no file descriptor behind sys.stdout
                pass
            return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
