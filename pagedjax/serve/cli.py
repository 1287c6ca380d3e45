"""`pagedjax-serve` (also `python -m pagedjax.serve`): the OpenAI-compatible server on uvicorn.

    pagedjax-serve                                   # the bundled model on http://127.0.0.1:8000
    pagedjax-serve --model path/to/hf-folder --port 8001 --kv-memory 1GiB --api-key-file key.txt
    pagedjax-serve --model path/to/llama --enable-lora --lora-modules sql=path/to/sql-adapter   # LoRA adapters

The model and engine options are `pagedjax-generate`'s own (`--model`, `--dtype`, `--backend`, `--block-size`,
`--num-blocks` / `--kv-memory`, `--decode-steps-per-call`, `--max-num-seqs`, ...: added by the same function,
`pagedjax.cli.args.add_engine_options`), and the model and engine are built by the same code
(`pagedjax.cli.engine_setup`). The engine's LoRA options (`--enable-lora`, `--max-loras`, `--max-lora-rank`,
`--max-cpu-loras`) are `pagedjax.cli.args.add_lora_options`', read by the same code; the server adds its own
beside them (`--lora-modules`, runtime loading: `pagedjax.serve.lora`).

SIGINT / SIGTERM shut down gracefully: stop accepting connections, let requests in flight finish for up to
`--shutdown-timeout` seconds, abort the rest, exit 0. A second SIGINT exits at once. Exit status 2 for a usage
error or a model / engine that cannot be set up (one line `pagedjax-serve: error: ...`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

from pagedjax.cli import args as generate_args
from pagedjax.cli import multihost
from pagedjax.cli.errors import EXIT_ERROR, EXIT_OK, CLIError
from pagedjax.cli.sizes import parse_size
from pagedjax.serve.admission import (
    DEFAULT_MAX_CHAT_MESSAGES,
    DEFAULT_MAX_PARALLEL_TOOL_CALLS,
    DEFAULT_MAX_TOOL_STRING_LENGTH,
    ImageLimits,
)

PROG = "pagedjax-serve"
SHUTDOWN_GRACE_S = 5.0  # after the drain, for the last answers and error events to reach their clients
BUNDLED_MODEL_NAME = "pagedjax-tiny"
# pyproject's `serve` extra (pillow: PIL)
SERVE_EXTRA = ("fastapi", "uvicorn", "starlette", "prometheus_client", "jinja2", "pydantic", "PIL")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = generate_args.ArgumentParser(
        prog=PROG,
        description="Serve a model over HTTP with OpenAI's API (completions, chat completions, models), "
                    "streaming included; /health and /metrics (Prometheus) too. A request without max_tokens "
                    "generates until the model stops or the context is full (completions and chat alike, as "
                    "pagedjax-generate and SamplingParams).",
        formatter_class=generate_args.HelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=generate_args.int_at_least(0), default=8000, help="port (0: any free port)")
    key = g.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                     help="require 'Authorization: Bearer KEY' on /v1 and /metrics, KEY being FILE's first line "
                          "(default: $PAGEDJAX_API_KEY; neither: open)")
    key.add_argument("--api-key", default=None, metavar="KEY",
                     help="the key itself (visible to every user in `ps`: prefer --api-key-file or "
                          "$PAGEDJAX_API_KEY)")
    g.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (e.g. https://app.example) whose pages may call the server from a browser "
                        "(repeatable); requests from any other Origin are refused")
    g.add_argument("--allowed-host", action="append", default=None, metavar="HOST",
                   help="a Host header the server answers (repeatable; default when listening on loopback: "
                        "localhost, 127.0.0.1, ::1, against DNS rebinding; otherwise any)")
    g.add_argument("--max-request-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="the largest request body taken (e.g. 8MiB; default: 4 MiB); larger ones get 413 before "
                        "they are read")
    g.add_argument("--body-timeout", type=generate_args.float_in(0.0, 86400.0, lo_open=True), default=30.0,
                   metavar="SECONDS",
                   help="a request body not received within this time gets 408 (a client trickling its body "
                        "would hold its connection for ever)")
    g.add_argument("--header-timeout", type=generate_args.float_in(0.0, 86400.0, lo_open=True), default=10.0,
                   metavar="SECONDS",
                   help="a request's head (request line and headers) not received within this time of its start "
                        "gets 408 and its connection is closed (a client trickling its headers, or sending none, "
                        "would hold its connection for ever)")
    g.add_argument("--max-connections", type=generate_args.int_at_least(1), default=1024, metavar="N",
                   help="open connections (and requests) at once; more get 503 at once")
    g.add_argument("--enable-docs", action="store_true",
                   help="serve the interactive API docs (/docs, /redoc, /openapi.json; open to anyone who can "
                        "reach the server)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help=f"the model id clients ask for (default: {BUNDLED_MODEL_NAME} for the bundled model, "
                        "else --model as given, else --model-class)")
    g.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="a jinja2 chat template (default: the model's own, from tokenizer_config.json, "
                        "chat_template.jinja or its processor's chat_template.json / processor_config.json; else "
                        "the built-in '# role:' template)")
    g.add_argument("--max-queue", type=generate_args.int_at_least(0), default=256,
                   help="requests that may wait beyond --max-num-seqs; more get 503 (queue_full)")
    g.add_argument("--shutdown-timeout", type=_non_negative_float, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long requests in flight may finish before they are aborted")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="the server's own log lines (pagedjax's loggers) and uvicorn's shown from this level on")
    g.add_argument("--max-chat-messages", type=generate_args.int_at_least(1), default=DEFAULT_MAX_CHAT_MESSAGES,
                   metavar="N", help="messages in one chat request; more get 400 before the chat template runs")
    g.add_argument("--max-parallel-tool-calls", type=generate_args.int_at_least(1),
                   default=DEFAULT_MAX_PARALLEL_TOOL_CALLS, metavar="N",
                   help="the most calls of one choice with tool_choice \"required\" and parallel_tool_calls (the "
                        "grammar ends the text there)")
    g.add_argument("--max-tool-string-length", type=generate_args.int_at_least(1),
                   default=DEFAULT_MAX_TOOL_STRING_LENGTH, metavar="N",
                   help="the most characters of a forced tool call's string argument whose schema sets no "
                        "maxLength (a forced call's objects also take only their declared keys unless the schema "
                        "says additionalProperties): every forced call ends")
    _add_structured_options(p)
    _add_image_options(p)
    _add_lora_options(p)
    # A server admits new requests between device calls: a fused decode of N steps would hold a new request's
    # prefill (its first token) back by up to N decode steps, so here one step per call (Python's default) stays.
    # Warm-up: a request's new parameters (log-probabilities, penalties, a batch size not seen yet) never stall
    # the running streams for a compile.
    generate_args.add_engine_options(p, compile_in_background=True)
    return p


def _add_structured_options(p: argparse.ArgumentParser) -> None:
    from pagedjax.structured_output.isolation import CompileGuardConfig
    from pagedjax.structured_output.limits import StructuredLimits

    g = p.add_argument_group("structured output", "limits on output constraints (response_format, guided_*, "
                             "tools), checked before the grammar library sees them (400 naming the limit); then "
                             "each new constraint is test-compiled in a worker process")
    for f in dataclasses.fields(StructuredLimits):
        g.add_argument(f"--{f.name.replace('_', '-')}", type=generate_args.int_at_least(1), default=f.default,
                       metavar="N", help=f.metadata["help"])
    default = CompileGuardConfig()
    g.add_argument("--grammar-workers", type=generate_args.int_at_least(1), default=default.workers, metavar="N",
                   help="grammar compiles at once, each test-compiled in its own worker process first")
    g.add_argument("--grammar-compile-timeout", type=generate_args.float_in(0.0, 3600.0, lo_open=True),
                   default=default.timeout_s, metavar="SECONDS",
                   help="a constraint whose compile (waiting for a worker included) takes longer gets 400 (503 "
                        "when it waited for a worker that long)")
    g.add_argument("--grammar-worker-memory", type=parse_size, default=default.memory_bytes, metavar="SIZE",
                   help="address space of a grammar worker (e.g. 2GiB; 0: no limit); a compile past it is a 400")
    g.add_argument("--max-queued-compiles", type=generate_args.int_at_least(1), default=default.max_queued,
                   metavar="N", help="grammar compiles waiting or running at once; more get 503")


def _add_image_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("images", "limits on a chat request's images (data URLs, for a model that takes "
                             "images), each checked before the work it bounds (400, or 413 for a size, naming it)")
    for f in dataclasses.fields(ImageLimits):
        size = f.metadata["size"]  # a default given as text ("8MiB") is parsed by `type`, and shown so
        g.add_argument(f"--{f.name.replace('_', '-')}", type=parse_size if size else generate_args.int_at_least(1),
                       default=f"{f.default // 2**20}MiB" if size else f.default, metavar="SIZE" if size else "N",
                       help=f.metadata["help"])


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """The server's ImageLimits from the parsed flags."""
    return ImageLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ImageLimits)})


def lora_module(text: str) -> tuple[str, str, str | None]:
    """A --lora-modules value: NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...} (its "base_model_name",
    if given, is checked against the served model's name when the server starts)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {e}") from None
        extra = set(spec) - {"name", "path", "base_model_name"} if isinstance(spec, dict) else set()
        if not isinstance(spec, dict) or extra or not all(isinstance(spec.get(k), str) and spec[k]
                                                          for k in ("name", "path")):
            raise argparse.ArgumentTypeError(f"{text!r}: the JSON form is {{\"name\": ..., \"path\": ...}} (and "
                                             "optionally \"base_model_name\")")
        return spec["name"], spec["path"], spec.get("base_model_name")
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path, None


def _add_lora_options(p: argparse.ArgumentParser) -> None:
    g = generate_args.add_lora_options(p)  # the engine's: --enable-lora, --max-loras, ...
    g.add_argument("--lora-modules", type=lora_module, nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="serve the PEFT adapter folder PATH as the model NAME (repeatable, none by default; needs "
                        "--enable-lora; also vLLM's JSON form '{\"name\": NAME, \"path\": PATH}'); a request's "
                        "\"model\" picks the base model or an adapter")
    g.add_argument("--enable-runtime-lora-updates", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-root; behind "
                        "the API key when there is one); without it they answer 404")
    g.add_argument("--lora-root", type=Path, default=None, metavar="DIR",
                   help="the only folder runtime loads may read adapters from: paths are taken relative to it, and "
                        "'..', absolute paths elsewhere and symbolic links out of it are refused")
    g.add_argument("--max-lora-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="the largest adapter_model.safetensors a runtime load reads (e.g. 256MiB; default: 1 GiB); "
                        "a larger one gets 413 before it is read")
    g.add_argument("--max-registered-loras", type=generate_args.int_at_least(1), default=None, metavar="N",
                   help="the most adapters served at once, --lora-modules included (default: 256; needs "
                        "--enable-lora); a runtime load past it gets 400 (too_many_lora_adapters)")


def lora_setup(args: argparse.Namespace, model_name: str):
    """(the --lora-modules by name, the RuntimeLoRAUpdates or None) of the parsed flags; CLIError for flags that
    need another one, a duplicate or reserved name, more --lora-modules than --max-registered-loras, or a
    --lora-root that is not a folder."""
    from pagedjax.serve.lora import DEFAULT_MAX_LORA_BYTES, DEFAULT_MAX_REGISTERED_LORAS, RuntimeLoRAUpdates

    if not args.enable_lora:
        for given, flag in ((args.lora_modules, "--lora-modules"),
                            (args.enable_runtime_lora_updates, "--enable-runtime-lora-updates"),
                            (args.max_registered_loras is not None, "--max-registered-loras")):
            if given:
                raise CLIError(f"{flag} needs --enable-lora")
    if not args.enable_runtime_lora_updates:
        for given, flag in ((args.lora_root, "--lora-root"), (args.max_lora_bytes, "--max-lora-bytes")):
            if given is not None:
                raise CLIError(f"{flag} applies to runtime loading: add --enable-runtime-lora-updates")
    modules: dict[str, str] = {}
    for name, path, base in args.lora_modules:
        if name in modules:
            raise CLIError(f"--lora-modules: the name {name!r} is given twice")
        if name == model_name:
            raise CLIError(f"--lora-modules: {name!r} is the served model's name; give the adapter another one")
        if base is not None and base != model_name:
            raise CLIError(f"--lora-modules {name}: base_model_name {base!r} is not the served model "
                           f"{model_name!r}")
        modules[name] = path
    most = args.max_registered_loras or DEFAULT_MAX_REGISTERED_LORAS
    if len(modules) > most:
        raise CLIError(f"--lora-modules: {len(modules)} adapters, more than --max-registered-loras {most}")
    if not args.enable_runtime_lora_updates:
        return modules, None
    if args.lora_root is None:
        raise CLIError("--enable-runtime-lora-updates needs --lora-root DIR: the folder adapters may be loaded from")
    try:
        updates = RuntimeLoRAUpdates(args.lora_root, args.max_lora_bytes or DEFAULT_MAX_LORA_BYTES)
    except ValueError as e:
        raise CLIError(f"--lora-root: {e}") from None
    return modules, updates


def structured_config(args: argparse.Namespace):
    """The server's StructuredLimits and CompileGuardConfig from the parsed flags."""
    from pagedjax.structured_output.isolation import CompileGuardConfig
    from pagedjax.structured_output.limits import StructuredLimits

    limits = StructuredLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(StructuredLimits)})
    return limits, CompileGuardConfig(workers=args.grammar_workers, timeout_s=args.grammar_compile_timeout,
                                      memory_bytes=args.grammar_worker_memory, max_queued=args.max_queued_compiles)


class _Server:
    """uvicorn's server, whose shutdown on SIGINT / SIGTERM ends every request cleanly and exits 0 (uvicorn
    itself re-raises the signal once it has shut down, so that the process dies of it).

    An engine that became unavailable (`AsyncLLMEngine.unavailable`: a lost host) stops it as a signal would.

    The first signal runs `drain(timeout)` in the event loop (requests in flight may finish for `timeout`
    seconds; the rest end with an error, a stream with its error event and [DONE]) while uvicorn stops accepting
    and waits for the connections. A second one ends every request now (`drain(0)`) instead of uvicorn's forced
    exit, which would cut responses mid-body; only a third forces it."""

    def __init__(self, config, drain, timeout: float, unavailable=lambda: None):
        import uvicorn

        class Server(uvicorn.Server):
            def __init__(self, config):
                super().__init__(config)
                self.signals = 0
                self.drains: list[asyncio.Task] = []  # referenced until done

            def handle_exit(self, sig, frame):
                self.signals += 1
                if self.signals <= 2:
                    loop = asyncio.get_event_loop()
                    self.drains.append(loop.create_task(drain(timeout if self.signals == 1 else 0.0)))
                if self.signals != 2:
                    super().handle_exit(sig, frame)

            async def on_tick(self, counter: int) -> bool:
                if unavailable() is not None:  # the engine can serve nothing (its requests already failed): exit
                    return True
                return await super().on_tick(counter)

            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                signals = (signal.SIGINT, signal.SIGTERM)
                previous = {s: signal.signal(s, self.handle_exit) for s in signals}
                try:
                    yield
                finally:
                    for s, handler in previous.items():
                        signal.signal(s, handler)

        self.server = Server(config)

    def run(self) -> bool:
        self.server.run()
        return self.server.started


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def server_logging(level: str):
    """The server's log lines (the `pagedjax` loggers') from `level` on, in `LOG_FORMAT`, on stderr, while the
    block runs, whatever configured logging before: importing orbax logs through the root logger, which gives it a
    handler (`logging.basicConfig()`), so a `basicConfig` here did nothing and no INFO line was ever shown. Only the
    `pagedjax` logger is set: its own handler, its level, and no propagation (the root's handlers would print each
    line again); the root logger and every other logger are left as they are, and the `pagedjax` logger is restored
    after (code sharing the process, e.g. tests calling `main()`, keeps its logging)."""
    logger = logging.getLogger("pagedjax")
    saved = logger.level, logger.propagate
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("absl", "orbax", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.ERROR)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def api_key(args: argparse.Namespace) -> str | None:
    """The key clients must send, or None (open); CLIError for an empty one (it would lock every client out)."""
    if args.api_key_file is not None:
        try:
            key, where = args.api_key_file.read_text().splitlines()[0].strip(), f"--api-key-file {args.api_key_file}"
        except (OSError, IndexError, UnicodeDecodeError) as e:
            raise CLIError(f"--api-key-file: cannot read a key from {args.api_key_file}: {e or 'empty file'}") \
                from None
    elif args.api_key is not None:
        key, where = args.api_key, "--api-key"
    elif "PAGEDJAX_API_KEY" in os.environ:
        key, where = os.environ["PAGEDJAX_API_KEY"].strip(), "PAGEDJAX_API_KEY"
    else:
        return None
    if not key:
        raise CLIError(f"{where} gives an empty API key (no client could match it); unset it to serve openly")
    return key


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """The Host headers to answer: --allowed-host, else the loopback names when listening on loopback."""
    if args.allowed_host:
        return list(args.allowed_host)
    if args.host in LOOPBACK_HOSTS or args.host.startswith("127."):
        return [*LOOPBACK_HOSTS, args.host]
    return None


def serve(args: argparse.Namespace) -> int:
    """Load the model, build the engine and the app, and serve until a signal; CLIError for setup problems."""
    import uvicorn

    from pagedjax.cli.engine_setup import build_engine, load_model_for_cli
    from pagedjax.cli.warm_start import compile_cache
    from pagedjax.model.errors import ModelLoadError
    from pagedjax.model.loading.checkpoint import bundled_model_path
    from pagedjax.serve.app import build_app
    from pagedjax.serve.async_engine import AsyncLLMEngine
    from pagedjax.serve.chat_template import ChatTemplate
    from pagedjax.serve.head_timeout import head_timeout_protocol

    # Every argument is checked before the model loads, and every adapter before anything compiles: a mistake
    # is said in seconds, not after the warm-up.
    limits, compile_config = structured_config(args)
    name = args.served_model_name or args.model or args.model_class or BUNDLED_MODEL_NAME
    lora_modules, lora_updates = lora_setup(args, name)
    key, hosts, images = api_key(args), allowed_hosts(args), image_limits(args)
    # A --model-class model without --model has no folder: the built-in template, unless --chat-template.
    folder = Path(args.model) if args.model is not None else (None if args.model_class else bundled_model_path())
    try:
        template = ChatTemplate.from_model(folder, args.chat_template)
    except (OSError, ModelLoadError) as e:
        raise CLIError(f"cannot read the chat template: {e}") from None
    rank = multihost.start(args)  # before anything uses JAX's devices (None: one process)
    with compile_cache(args) as cache:
        # The engine checks every constraint against the server's limits too (its Python API is guarded alike).
        engine = build_engine(args, load_model_for_cli(args), compile_cache=cache.engine_arg, structured_limits=limits)
        if rank:  # another process of a multi-host server: steps with process 0, serves nothing
            return multihost.follower(engine, args, PROG)
        if rank == 0:  # a lost process fails every request, /health turns 503, and the server exits (`_Server`)
            engine = multihost.leader(engine, args, on_lost=lambda error: async_engine.fail(error))
        async_engine = AsyncLLMEngine(engine, max_pending=args.max_num_seqs + args.max_queue)
        try:  # registers the --lora-modules (each folder read and checked)
            app = build_app(async_engine, model_name=name, structured_limits=limits, compile_config=compile_config,
                            max_chat_messages=args.max_chat_messages,
                            max_parallel_tool_calls=args.max_parallel_tool_calls,
                            max_tool_string_length=args.max_tool_string_length, chat_template=template,
                            api_key=key, allowed_origins=args.allowed_origin, allowed_hosts=hosts,
                            docs=args.enable_docs, body_timeout=args.body_timeout, lora_modules=lora_modules,
                            lora_updates=lora_updates, image_limits=images,
                            **({} if args.max_registered_loras is None else
                               {"max_registered_loras": args.max_registered_loras}),
                            **({} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}))
        except ValueError as e:
            raise CLIError(str(e)) from None
        if args.warmup and rank is not None:  # every process compiles each step's one program: now, together
            engine.warmup()
        elif args.warmup:  # in the background: the server answers at once, its first steps compiling their own
            warmed = engine.start_warmup()
            # The warm-up's traces and programs live as long as the server, out of the collector's reach too.
            warmed.add_done_callback(lambda _: gc.freeze())
        # uvicorn waits for the connections a little past the drain: by then every request got its answer
        # (finished, or an error), so it never has to cancel one mid-response.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE_S, access_log=False,
                                limit_concurrency=args.max_connections, http=head_timeout_protocol(args.header_timeout))
        # Everything built so far (the model, the app; the warm-up's traces and programs when it is done: ~290k
        # objects for the bundled model) lives as long as the server: moved out of the garbage collector's
        # generations, a full collection no longer walks it. Such collections, set off by the tracing of later
        # programs, stalled the engine thread for up to 2 s before (measured); after it, 0.1-0.3 s.
        gc.freeze()
        server = _Server(config, async_engine.drain, args.shutdown_timeout, lambda: async_engine.unavailable)
        try:
            started = server.run()
        finally:
            async_engine.stop()  # a second signal skips the app's shutdown: never exit with a device call running
            engine.close()  # and no background compile queued
    if async_engine.unavailable is not None:
        multihost.exit_lost(async_engine.unavailable, PROG)
    return EXIT_OK if started else EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is not None and not Path(args.model).exists():
        parser.error(f"--model: no such file or directory: {args.model}")
    if args.chat_template is not None and not args.chat_template.is_file():
        parser.error(f"--chat-template: no such file: {args.chat_template}")
    for name, path, _ in args.lora_modules:  # before the model loads: the common mistake, said at once
        if not Path(path).is_dir():
            parser.error(f"--lora-modules {name}={path}: no such folder")
    _quiet_libraries()
    try:
        with server_logging(args.log_level):
            return serve(args)
    except ModuleNotFoundError as e:
        if e.name not in SERVE_EXTRA:
            raise
        print(f"{PROG}: error: {e.name} is not installed; pagedjax-serve needs the serve extra: "
              "pip install 'pagedjax[serve]'", file=sys.stderr)
        return EXIT_ERROR
    except CLIError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
