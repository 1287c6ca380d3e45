"""`pagedjax-serve` as a process: its options are pagedjax-generate's engine options plus the server's, and a
SIGTERM lets the request in flight finish, then exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pagedjax.cli.args import ENGINE_GROUP
from pagedjax.cli.args import build_parser as generate_parser
from pagedjax.serve.cli import BUNDLED_MODEL_NAME, build_parser, main


def _options(parser, group_title=None) -> set[str]:
    groups = [g for g in parser._action_groups if group_title is None or g.title == group_title]
    return {o for g in groups for a in g._group_actions for o in a.option_strings}


def test_engine_options_are_pagedjax_generates():
    engine_options = _options(generate_parser(), ENGINE_GROUP)
    assert {"--model", "--block-size", "--kv-memory", "--decode-steps-per-call", "--backend", "--seed",
            "--tensor-parallel-size", "--data-parallel-size"} <= engine_options
    assert engine_options <= _options(build_parser())
    args = build_parser().parse_args(["--kv-memory", "64MiB", "--port", "9001", "--api-key", "k"])
    assert (args.kv_memory, args.port, args.api_key, args.host) == (64 * 2**20, 9001, "k", "127.0.0.1")
    with pytest.raises(SystemExit):  # still mutually exclusive
        build_parser().parse_args(["--kv-memory", "64MiB", "--num-blocks", "8"])


def test_fused_decode_is_generates_default_and_not_the_servers(capsys):
    # A server admits requests between device calls, so it decodes one step per call unless told otherwise;
    # pagedjax-generate fuses 8.
    assert build_parser().parse_args([]).decode_steps_per_call == 1
    assert build_parser().parse_args(["--decode-steps-per-call", "4"]).decode_steps_per_call == 4
    assert generate_parser().parse_args([]).decode_steps_per_call == 8
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):  # the deprecated spelling is gone
        generate_parser().parse_args(["--num-steps", "3"])


def test_python_and_both_command_lines_have_the_same_defaults():
    """One definition of each option: the `EngineConfig` both command lines build from no flags is Python's
    `EngineConfig()` but for each front end's stated choices (pagedjax-generate fuses 8 decode steps per call,
    pagedjax-serve compiles in the background) and what a CLI sets up itself (JAX's compile cache, the model
    folder's sampling defaults, a built-in model's shape). Each engine flag's help is its field's."""
    import dataclasses

    from pagedjax.cli.args import add_field_option
    from pagedjax.cli.engine_setup import engine_config_of
    from pagedjax.config import EngineConfig, SamplingDefaults

    python = EngineConfig(compile_cache=False)
    for parser, choices in ((generate_parser(), {"decode_steps_per_call": 8}),
                            (build_parser(), {"compile_in_background": True})):
        built = engine_config_of(parser.parse_args([]), compile_cache=False, sampling_defaults=SamplingDefaults())
        assert built == dataclasses.replace(python, **choices)
    # a flag's help and default are read from its field
    import argparse

    probe = argparse.ArgumentParser(prog="probe")
    add_field_option(probe, EngineConfig, "max_compiled_programs", type=int)
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == "max_compiled_programs")
    assert probe.parse_args([]).max_compiled_programs == field.default == 64
    assert field.metadata["help"] in " ".join(probe.format_help().split())
    assert field.metadata["help"] in " ".join(generate_parser().format_help().split())


def test_warmup_is_the_servers_default_and_not_generates():
    # A server's running streams must not stall while a new request's step compiles; a one-off generate run
    # compiles what its prompts need.
    assert build_parser().parse_args([]).warmup and not build_parser().parse_args(["--no-warmup"]).warmup
    assert not generate_parser().parse_args([]).warmup and generate_parser().parse_args(["--warmup"]).warmup


@pytest.mark.parametrize("argv", [["--model", "/no/such/model"], ["--chat-template", "/no/such/file"],
                                  ["--max-queue", "-1"], ["--shutdown-timeout", "soon"], ["--header-timeout", "0"]])
def test_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "pagedjax-serve: error:" in capsys.readouterr().err


def test_missing_serve_extra_is_explained(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` fails as if not installed
    assert main([]) == 2
    assert "uvicorn is not installed" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, *extra: str) -> subprocess.Popen:
    """The bundled model, as `pagedjax-serve` serves it by default; a small engine (two step shapes to compile
    for the requests below: one prefill, one decode; 64 tokens a step, so that the warm-up compiles 3 programs
    instead of the default 512's 5, of 8x the tokens: 2.5 s of CPU time instead of 6)."""
    cmd = [sys.executable, "-m", "pagedjax.serve", "--port", str(port), "--block-size", "64", "--num-blocks", "16",
           "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "256", "--log-level", "warning",
           *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 180
    # One client for every poll: `httpx.get` builds a client (and its SSL context) each time, 20 ms of CPU time
    # each, which at 10 polls a second took a third of a core from the server it waited for.
    with httpx.Client(timeout=1) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not become healthy")


def _stream_then_signal(url: str, proc: subprocess.Popen, sig: int, max_tokens: int) -> tuple[list[dict], bool]:
    """Start a streaming completion, send `sig` once its first chunk arrived, read the rest."""
    body = {"model": BUNDLED_MODEL_NAME, "prompt": "def main():\n", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks, done = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        try:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunks.append(json.loads(line[len("data: "):]))
                if len(chunks) == 1:
                    proc.send_signal(sig)
        except httpx.RemoteProtocolError:  # the server closed the connection mid-stream
            pass
    return chunks, done


def test_sigterm_finishes_the_request_in_flight_and_exits_0():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(port, "--shutdown-timeout", "60", "--header-timeout", "0.5")  # warmed up, as served by default
    try:
        _wait_healthy(proc, url)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:  # --header-timeout reached uvicorn
            assert silent.recv(4096).startswith(b"HTTP/1.1 408 ")
        assert build_parser().parse_args([]).header_timeout == 10.0
        chunks, done = _stream_then_signal(url, proc, signal.SIGTERM, max_tokens=48)
        assert done
        assert chunks[-1]["usage"]["completion_tokens"] == 48
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# (CI time) The server's INFO lines showing once (orbax's root handler used to swallow them) are checked on process 0
# of tests/serve/test_serve_multihost.py's server.


def test_server_logging_leaves_the_processes_logging_as_it_was(capsys, caplog):
    """`main()`'s logging (`server_logging`) touches only the `pagedjax` logger, and only while it runs: the root
    logger's handlers (pytest's among them) stay, and the `pagedjax` logger propagates to them again after."""
    import logging

    from pagedjax.serve.cli import server_logging

    logger = logging.getLogger("pagedjax")
    root_before, before = list(logging.root.handlers), (logger.level, logger.propagate, list(logger.handlers))
    with server_logging("info"):
        logging.getLogger("pagedjax.serve.app").info("serving %s", "a model")
        logging.getLogger("pagedjax.serve.app").debug("not at info")
        assert logging.root.handlers == root_before
    err = capsys.readouterr().err
    assert err.count("INFO pagedjax.serve.app: serving a model\n") == 1 and "not at info" not in err, err
    assert (logger.level, logger.propagate, list(logger.handlers)) == before
    assert logging.root.handlers == root_before
    with caplog.at_level("INFO", logger="pagedjax"):
        logging.getLogger("pagedjax.serve.app").info("after")
    assert [r.getMessage() for r in caplog.records] == ["after"] and capsys.readouterr().err == ""


def _long_requests(url: str, results: dict) -> list[threading.Thread]:
    """Two streaming and one non-streaming completion of 200 tokens, in threads, into `results`."""
    body = {"model": BUNDLED_MODEL_NAME, "prompt": "def main():\n", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}

    def stream(key):
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
        results[key] = lines

    def whole(key):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        results[key] = (r.status_code, r.headers.get("content-type"), r.json())

    threads = [threading.Thread(target=stream, args=(f"stream{i}",)) for i in range(2)]
    threads.append(threading.Thread(target=whole, args=("whole",)))
    for t in threads:
        t.start()
    return threads


# (CI time) one SIGTERM in the slow run: its shutdown ends the streams as the second signal's does, and SIGTERM's
# handling runs in test_sigterm_finishes_the_request_in_flight_and_exits_0
@pytest.mark.parametrize("signals", [pytest.param([signal.SIGTERM], marks=pytest.mark.slow),
                                     [signal.SIGINT, signal.SIGINT]])
def test_shutdown_past_the_timeout_ends_every_request_cleanly_and_exits_0(signals):
    """Past --shutdown-timeout (or at once, on a second signal), every stream ends with an error event and [DONE]
    and a non-streaming request gets OpenAI's JSON 503 (they used to be cut mid-body, and get a plain-text 500,
    with ~2,000 log lines of tracebacks); the log stays clean and the exit status is 0 (two signals used to abort
    the process: status -6)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(port, "--shutdown-timeout", "0.5", "--no-warmup")  # the test above starts the default way
    try:
        _wait_healthy(proc, url)
        results: dict = {}
        threads = _long_requests(url, results)
        deadline = time.monotonic() + 60
        with httpx.Client() as client:  # one for every poll (see _wait_healthy)
            while not _generating(client, url) and time.monotonic() < deadline:
                time.sleep(0.05)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.2)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
        assert "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for key in ("stream0", "stream1"):
        lines = results[key]
        assert lines[-1] == "[DONE]", lines[-3:]
        assert json.loads(lines[-2])["error"]["code"] == "unavailable", lines[-2]
    status, content_type, body = results["whole"]
    assert (status, content_type) == (503, "application/json"), (status, body)
    assert body["error"]["code"] == "unavailable"


def _generating(client: httpx.Client, url: str) -> bool:
    """Whether the server has generated any token yet (its Prometheus counter)."""
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith("pagedjax_generation_tokens_total"):
            return float(line.split()[-1]) > 0
    return False


def test_api_key_sources_and_an_empty_key(tmp_path, monkeypatch):
    from pagedjax.cli.errors import CLIError
    from pagedjax.serve.cli import allowed_hosts, api_key

    monkeypatch.delenv("PAGEDJAX_API_KEY", raising=False)
    assert api_key(build_parser().parse_args([])) is None  # open
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert api_key(build_parser().parse_args(["--api-key-file", str(key_file)])) == "s3cret"
    monkeypatch.setenv("PAGEDJAX_API_KEY", "from-env")
    assert api_key(build_parser().parse_args([])) == "from-env"
    monkeypatch.setenv("PAGEDJAX_API_KEY", "")  # set but empty used to lock every client out, silently
    with pytest.raises(CLIError, match="PAGEDJAX_API_KEY gives an empty API key"):
        api_key(build_parser().parse_args([]))
    key_file.write_text("")
    with pytest.raises(CLIError, match="--api-key-file"):
        api_key(build_parser().parse_args(["--api-key-file", str(key_file)]))
    assert allowed_hosts(build_parser().parse_args([])) == ["localhost", "127.0.0.1", "::1", "127.0.0.1"]
    assert allowed_hosts(build_parser().parse_args(["--host", "0.0.0.0"])) is None
    assert allowed_hosts(build_parser().parse_args(["--allowed-host", "llm.internal"])) == ["llm.internal"]


def test_lora_options(tmp_path):
    from pagedjax.cli.args import LORA_GROUP
    from pagedjax.cli.engine_setup import lora_config_of
    from pagedjax.cli.errors import CLIError
    from pagedjax.config import LoRAConfig

    assert {"--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-modules",
            "--enable-runtime-lora-updates", "--lora-root", "--max-lora-bytes",
            "--max-registered-loras"} <= _options(build_parser(), LORA_GROUP)
    args = build_parser().parse_args(["--enable-lora", "--max-loras", "2", "--lora-modules", "a=x/a", "b=/y=z",
                                      "--lora-modules", '{"name": "c", "path": "p", "base_model_name": "m"}'])
    assert args.lora_modules == [("a", "x/a", None), ("b", "/y=z", None), ("c", "p", "m")]
    assert lora_config_of(args) == LoRAConfig(max_loras=2)
    assert lora_config_of(build_parser().parse_args([])) is None
    assert lora_config_of(generate_parser().parse_args([])) is None  # pagedjax-generate has no LoRA flags
    with pytest.raises(CLIError, match="--max-lora-rank needs --enable-lora"):
        lora_config_of(build_parser().parse_args(["--max-lora-rank", "8"]))
    for bad in ("noequals", "=path", "name=", '{"name": "c"}', '{"name": "c", "path": "p", "extra": 1}', "{bad"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--lora-modules", bad])


@pytest.mark.parametrize(("argv", "says"), [
    (["--lora-modules", "a=/no/such/adapter"], "--lora-modules a=/no/such/adapter: no such folder"),
    (["--lora-modules", "a=."], "--lora-modules needs --enable-lora"),
    (["--enable-runtime-lora-updates"], "--enable-runtime-lora-updates needs --enable-lora"),
    (["--enable-lora", "--enable-runtime-lora-updates"], "needs --lora-root DIR"),
    (["--enable-lora", "--lora-root", "."], "--lora-root applies to runtime loading"),
    (["--enable-lora", "--max-lora-bytes", "1MiB"], "--max-lora-bytes applies to runtime loading"),
    (["--enable-lora", "--enable-runtime-lora-updates", "--lora-root", "/no/such/root"], "is not a folder"),
    (["--enable-lora", "--lora-modules", "a=.", "a=."], "the name 'a' is given twice"),
    (["--max-registered-loras", "4"], "--max-registered-loras needs --enable-lora"),
    (["--enable-lora", "--max-registered-loras", "1", "--lora-modules", "a=.", "b=."],
     "--lora-modules: 2 adapters, more than --max-registered-loras 1"),
    (["--enable-lora", "--lora-modules", f"{BUNDLED_MODEL_NAME}=."], "is the served model's name"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": ".", "base_model_name": "other"}'],
     "base_model_name 'other' is not the served model"),
])
def test_lora_flag_errors_stop_start_up(argv, says, capsys):
    """Said in one line, exit status 2, before the model loads."""
    with contextlib.suppress(SystemExit):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pagedjax-serve: error: " in err and says in err, err


def test_a_bad_start_up_adapter_stops_start_up_before_anything_compiles(tmp_path, capsys, monkeypatch):
    """An adapter that does not fit the model is refused by name when the server registers it, before the warm-up
    compiles anything: exit status 2 (it used to come after the whole warm-up, a minute on a loaded machine). A
    good start-up then starts the warm-up in the background and serves at once, never waiting for it."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    import uvicorn

    from pagedjax.engine import LLMEngine
    from pagedjax.serve import cli as serve_cli
    from tests.lora.adapters import write_adapter
    from tests.serve.server_utils import CFG

    events = []
    monkeypatch.setattr(LLMEngine, "warmup", lambda self: pytest.fail("the server waited for a warm-up"))
    monkeypatch.setattr(LLMEngine, "start_warmup", lambda self: events.append("warm-up started") or Future(),
                        raising=False)
    # No uvicorn: its Config would point the logging configuration at this test's captured streams.
    monkeypatch.setattr(uvicorn, "Config", lambda app, **options: None)
    monkeypatch.setattr(serve_cli, "_Server", lambda config, drain, timeout, unavailable: SimpleNamespace(
        run=lambda: events.append("serving") or True))
    engine = ["--num-blocks", "8", "--block-size", "64", "--max-model-len", "256", "--log-level", "error"]
    folder = write_adapter(tmp_path / "other", CFG, rank=4, seed=0, targets=("q_proj",))  # another model's shapes
    code = main(["--enable-lora", "--lora-modules", f"other={folder}", *engine])
    err = capsys.readouterr().err
    assert code == 2 and events == [], err
    assert f"pagedjax-serve: error: LoRA module other={folder}: LoRA adapter '{folder}': tensor " in err, err
    assert "has shape" in err and len(err.strip().splitlines()) == 1, err
    assert main(engine) == 0 and events == ["warm-up started", "serving"]
