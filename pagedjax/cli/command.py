"""The command itself: `main` (the console script) and `run` (everything once the arguments are parsed)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TextIO

from pagedjax.cli import multihost
from pagedjax.cli.args import build_parser
from pagedjax.cli.ctrl_c import CtrlC, Interrupted, exit_interrupted, flush_quietly
from pagedjax.cli.engine_setup import build_engine, load_model_for_cli
from pagedjax.cli.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_REQUEST_FAILED, CLIError
from pagedjax.cli.generation import Generation
from pagedjax.cli.prompts import collect_prompts
from pagedjax.cli.report import print_header, report
from pagedjax.cli.warm_start import compile_cache
from pagedjax.errors import EngineUnavailable


def run(args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None,
        ctrl_c: CtrlC | None = None) -> int:
    """The whole command once the arguments are parsed. Raises CLIError (one-line errors) and Interrupted."""
    out = sys.stdout if out is None else out
    if args.model is not None and not Path(args.model).exists():
        parser.error(f"--model: no such file or directory: {args.model}")
    prompts = collect_prompts(args, parser)
    rank = multihost.start(args)  # before anything uses JAX's devices (None: one process)

    with compile_cache(args) as cache:  # before anything is loaded: loading compiles too
        t0 = time.perf_counter()
        loaded = load_model_for_cli(args)
        load_s = time.perf_counter() - t0
        engine = build_engine(args, loaded, compile_cache=cache.engine_arg)
        loaded = loaded.without_weights()  # the engine holds them
        if rank:  # another process of a multi-host run: steps with process 0, prints nothing
            return multihost.follower(engine, args, parser.prog)
        if rank == 0:
            engine = multihost.leader(engine, args)
        try:
            gen = Generation(engine, loaded.tokenizer, prompts, args, out, ctrl_c)
            gen.start()
            if not args.json:
                print_header(args, loaded, engine, load_s, out)
            # A line on stderr for each program the run waits for: the first run compiles for seconds (minutes
            # on a large model) before the first token, which used to pass in silence.
            with engine.compile_notices(gen.on_compile):
                if args.warmup:
                    engine.warmup()
                wall_s = gen.run()
        finally:
            engine.close()  # a compile still queued in the background would hold the exit back
    report(gen, wall_s, cache, args.json, out)
    return EXIT_REQUEST_FAILED if any(c.finish_reason == "error" for c in gen.completions) else EXIT_OK


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
            flush_quietly()
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return EXIT_ERROR
        except EngineUnavailable as e:  # a multi-host run lost a process: JAX's teardown would wait for it
            flush_quietly()
            if exit_process:
                multihost.exit_lost(e, parser.prog)
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return EXIT_ERROR
        except (Interrupted, KeyboardInterrupt):
            flush_quietly()
            if exit_process:
                exit_interrupted()
            print("\ninterrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # e.g. piped into `head`: stop quietly, and let the exit not flush again
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):  # no file descriptor behind sys.stdout
                pass
            return EXIT_OK
