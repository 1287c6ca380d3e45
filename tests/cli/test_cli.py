"""The `pagedjax-generate` / `python -m pagedjax` command line."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedjax import cli
from pagedjax.cli.args import build_parser
from pagedjax.cli.engine_setup import memory_available
from pagedjax.cli.prompts import BUILT_IN_MAX_TOKENS, DEMO_PREFIX, DEMO_SUFFIXES, collect_prompts, read_prompts_file
from pagedjax.cli.sizes import parse_size
from pagedjax.cli.warm_start import CompileCache
from pagedjax.config.cache import DEFAULT_NUM_BLOCKS
from pagedjax.model.hf_tokenizer import HFTokenizer
from pagedjax.model.loading.checkpoint import bundled_model_path

ROOT = Path(__file__).resolve().parents[2]


def _bundled_token_count(text: str) -> int:
    """Prompt tokens of `text` for the bundled model: BOS + its BPE tokens."""
    return len(HFTokenizer.from_pretrained(bundled_model_path()).encode(text))


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "pagedjax", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_demo_end_to_end_prints_completions_and_statistics(capsys):
    # In this process (CI time: a process costs ~3 s of imports; `python -m pagedjax` runs in the compile-cache
    # and Ctrl-C tests).
    assert cli.main(["--demo", "--max-tokens", "4", "--num-blocks", "64"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert out.count("--- [") == len(DEMO_SUFFIXES)
    for row in ("prompt tokens", "generated tokens", "tokens/s", "KV blocks used", "KV waste",
                "prefix-cache hit rate", "preemptions", "step programs", "compile time", "compile cache"):
        assert re.search(rf"^{re.escape(row)}\s", out, re.MULTILINE), f"no '{row}' row in:\n{out}"
    assert re.search(r"^generated tokens\s+\d+$", out, re.MULTILINE), out
    assert re.search(r"KV blocks used\s+\d+ of 64", out), out
    hit = float(re.search(r"prefix-cache hit rate\s+([\d.]+) %", out).group(1))
    assert hit > 30.0  # four of the five prompts reuse the shared prefix's full blocks
    cached = [int(m) for m in re.findall(r"(\d+) of \d+ prompt tokens from the prefix cache", out)]
    full_prefix_blocks = _bundled_token_count(DEMO_PREFIX) // 16 * 16  # every full block of the shared prefix
    assert full_prefix_blocks >= 32 and cached[0] == 0 and all(c >= full_prefix_blocks for c in cached[1:]), cached


def test_without_max_tokens_a_prompt_runs_to_the_end_of_the_context(capsys):
    """The one rule of every entry point (it was 64 here, 16 in Python and /v1/completions, the context in chat);
    the built-in prompts keep their own 64."""
    argv = ["--prompt", "def f(x):\n", "--max-model-len", "24", "--json", "--num-blocks", "16", "--ignore-eos"]
    assert cli.main(argv) == 0
    (c,) = json.loads(capsys.readouterr().out)["completions"]
    assert (c["num_prompt_tokens"] + c["num_tokens"], c["finish_reason"]) == (24, "length")
    parser = build_parser()
    for given, length in (([], BUILT_IN_MAX_TOKENS), (["--demo"], BUILT_IN_MAX_TOKENS), (["--prompt", "x"], None)):
        args = parser.parse_args(given)
        assert args.max_tokens is None and collect_prompts(args, parser).max_tokens == length


def test_single_prompt_json(capsys):
    # The default pool: the README's `pagedjax-generate` command (tests/test_docs.py) runs on these programs too.
    argv = ["--prompt", "def f(x):\n", "--max-tokens", "6", "--json", "--ignore-eos"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    (c,) = result["completions"]
    assert c["prompt"] == "def f(x):\n" and c["num_tokens"] == 6 and c["finish_reason"] == "length"
    num_prompt_tokens = _bundled_token_count("def f(x):\n")
    assert c["num_prompt_tokens"] == num_prompt_tokens
    stats = result["stats"]
    # Numbers, not text; units in the key names.
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in stats.values()), stats
    assert stats["generated_tokens"] == 6 and stats["prompt_tokens"] == num_prompt_tokens and stats["requests"] == 1
    assert stats["kv_blocks"] == DEFAULT_NUM_BLOCKS
    assert 1 <= stats["kv_blocks_used_peak"] <= 2  # the prompt (7 tokens) + 6 generated tokens, blocks of 16
    assert stats["tokens_per_s"] > 0 and stats["elapsed_s"] >= stats["compile_s"] >= 0 and stats["wall_s"] > 0
    assert 0 <= stats["kv_waste_pct"] < 100 and 0 <= stats["prefix_cache_hit_pct"] <= 100
    # The prefill step samples the first token; one fused decode call (8 steps by default) the other 5.
    assert stats["compilations"] >= 1 and stats["engine_steps"] == 2
    assert stats["compile_cache_hits"] >= 0 and stats["compile_cache_misses"] >= 0
    assert "compile_cache_dir" in result  # a folder, or null when off; see test_cli_compile_cache.py
    # A line on stderr for each program the run waited for (it used to wait in silence: seconds on the first run).
    lines = err.splitlines()
    assert len(lines) == stats["compilations"], err
    for i, line in enumerate(lines, 1):
        assert re.fullmatch(rf"pagedjax-generate: compiling step program {i} \((first run; cached afterwards|the "
                            r"compile cache is off: every run compiles)\): (step of|fused decode of) .+ \.\.\. "
                            r"(compiled|loaded from the compile cache) in \d+\.\d\d s", line), line


def test_a_compile_under_a_streamed_line_is_a_note_erased_when_it_is_done():
    """On a terminal, while a streamed completion's line is open, the compile notice is a note after its text,
    erased once the program is ready (a line on stderr there would break the streamed text); elsewhere (a pipe, a
    log) it is a line, numbered, on a line of its own."""
    import io
    from types import SimpleNamespace

    from pagedjax.cli.generation import Generation
    from pagedjax.cli.prompts import Prompts
    from pagedjax.runner.programs import CompileEvent

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    args = SimpleNamespace(no_stream=False, json=False, n=1, beam_width=None, demo=False, max_tokens=8,
                           temperature=0.0, top_k=None, top_p=None, seed=0, ignore_eos=False, logprobs=None)
    out, err = io.StringIO(), Terminal()
    gen = Generation(None, None, Prompts(["def f("]), args, out, err=err)
    shape = "step of 16 tokens, 1 x 2 table"
    gen._write("def f(")  # the prompt's echo: the line is open
    gen.on_compile(CompileEvent(shape))
    note = err.getvalue()
    assert note.startswith(" [compiling (") and note.endswith("...]") and out.getvalue() == "def f("
    gen.on_compile(CompileEvent(shape, 1.5, False))
    assert err.getvalue() == note + "\b" * len(note) + " " * len(note) + "\b" * len(note)  # erased
    piped = io.StringIO()
    gen.err = piped
    gen.on_compile(CompileEvent(shape, note="warm-up 2 of 6"))
    gen.on_compile(CompileEvent(shape, 0.25, True, "warm-up 2 of 6"))
    assert re.fullmatch(r"\npagedjax-generate: compiling warm-up 2 of 6 \(.+\): step of 16 tokens, 1 x 2 table \.\.\. "
                        r"loaded from the compile cache in 0\.25 s\n", piped.getvalue()), piped.getvalue()


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: False)" not in text
    # One chunk per option ("  --name ..." up to the next option), whitespace folded.
    chunks = [" ".join(c.split()) for c in re.split(r"\n(?=\s{2}-)", text)]
    for chunk in chunks:
        assert chunk.count("default") <= 1, chunk
    by_flag = {c.split()[0]: c for c in chunks if c.startswith("-")}
    assert "(default: until the model stops or the context is full, the rule of every entry point" in by_flag[
        "--max-tokens"]
    assert "(default: 512)" in by_flag["--num-blocks"]
    assert "default" not in by_flag["--kv-memory"]
    assert "(default: $PAGEDJAX_COMPILE_CACHE" in by_flag["--compile-cache"]
    assert "default" not in by_flag["--no-compile-cache"]


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--max-tokens", "many"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-2"], "--top-k"),
    (["--backend", "cuda"], "--backend"),
    (["--block-size", "0"], "--block-size"),
    (["--kv-memory", "lots"], "--kv-memory"),
    (["--num-blocks", "8", "--kv-memory", "1MiB"], "not allowed"),
    (["--model", "/no/such/model"], "no such file"),
    (["--prompts-file", "/no/such/prompts.txt"], "--prompts-file"),
    (["--demo", "--prompt", "x"], "--demo"),
    (["--compile-cache", "/tmp/x", "--no-compile-cache"], "not allowed"),
    (["--no-such-flag"], "unrecognized"),
])
def test_bad_arguments_give_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pagedjax-generate" in err and message in err


def test_quantization_flag_takes_any_case_and_its_error_lists_every_name(capsys):
    from pagedjax.cli.args import build_parser
    from pagedjax.config.quant import QuantConfig

    assert build_parser().parse_args(["--quantization", "INT4:32"]).quantization == QuantConfig("int4", group_size=32)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "int3"])
    err = capsys.readouterr().err
    assert "argument --quantization: QuantConfig.scheme 'int3' is not supported; accepted names: int8, fp8, int4 " \
        in err and "int4:<N>" in err and "int4:32" in err


@pytest.mark.parametrize("prog", ["pagedjax-generate", "pagedjax-serve"])
def test_argument_errors_are_short(prog, capsys):
    """Every argument error used to come under argparse's 22-line usage block of every option."""
    from pagedjax.serve.cli import main as serve_main

    with pytest.raises(SystemExit) as e:
        (cli.main if prog == "pagedjax-generate" else serve_main)(["--max-num-seqs", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"usage: {prog} [options]", f"{prog}: error: argument --max-num-seqs: must be >= 1, got 0",
        f"(run '{prog} --help' for every option)"]


def test_model_class_resolves_from_the_current_folder_as_python_m_would(tmp_path, monkeypatch):
    """A console script's sys.path starts with its bin folder, not the current one: `mymodule:load` next to the
    user was 'no module'."""
    from pagedjax.cli.engine_setup import load_model_class

    (tmp_path / "fc_cwd_factory.py").write_text("def load(path):\n    return ('model of', path), 'tokenizer'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "fc_cwd_factory", raising=False)
    assert load_model_class("fc_cwd_factory:load", "DIR") == (("model of", "DIR"), "tokenizer")
    del sys.modules["fc_cwd_factory"]


def test_bad_arguments_in_a_subprocess_give_no_traceback():
    r = _run("--model", "/no/such/model", timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "no such file" in r.stderr


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pagedjax-generate: error: "), err
    assert "usage:" not in err and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x" * 100, "--max-model-len", "64"], "longer than max_model_len=64"),  # prompt too long
    (["--prompt", "def f():", "--num-blocks", "2", "--max-tokens", "64"], "more than the whole pool"),
    (["--kv-memory", "1B"], "holds no block"),
    (["--kv-memory", "1000000000000T"], "does not fit"),  # an OverflowError once
])
def test_runtime_errors_are_one_line_without_usage(argv, message, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert message in _one_line_error(captured.err)
    assert captured.out == ""  # not even the echo of a streamed prompt


def test_max_tokens_past_the_context_is_refused_as_the_server_refuses_it(capsys):
    """--max-tokens 100 with --max-model-len 64 used to stop short at the context's end, silently (2046 tokens
    of --max-tokens 5000 at the default context); pagedjax-serve answers the same request 400."""
    n = _bundled_token_count("def f():")
    assert cli.main(["--prompt", "def f():", "--max-model-len", "64", "--max-tokens", "100", "--num-blocks", "16"]) == 2
    captured = capsys.readouterr()
    assert _one_line_error(captured.err) == (
        f"pagedjax-generate: error: prompt 1: this model's maximum context length is 64 tokens, but {n + 100} were "
        f"asked for ({n} in the prompt, --max-tokens 100); lower --max-tokens to {64 - n} or less, or raise "
        "--max-model-len")
    assert captured.out == ""


def test_one_context_length_and_one_sampling_default_per_model_in_python_the_cli_and_the_server():
    """The CLI and the server defaulted to min(2048, max_position_embeddings), Python to the model's own; the
    default temperature was 0.0 in Python, 0.8 (top_p 0.95) in the CLI and 1.0 in the server: now the model's
    generation_config.json's everywhere (the bundled model's: 0.8, top_p 0.95)."""
    from pagedjax import CacheConfig, LLMEngine
    from pagedjax.cli.args import build_parser
    from pagedjax.cli.engine_setup import build_engine, load_model_for_cli
    from pagedjax.serve.cli import build_parser as serve_parser

    python = LLMEngine.from_pretrained(None, cache_config=CacheConfig(num_blocks=16), compile_cache=False)
    want = python.model_config.max_position_embeddings
    assert python.scheduler_config.max_model_len == want
    defaults = python.config.sampling_defaults
    assert (defaults.temperature, defaults.top_p) == (0.8, 0.95)
    for parser in (build_parser(), serve_parser()):
        args = parser.parse_args(["--num-blocks", "16", "--no-warmup"])
        engine = build_engine(args, load_model_for_cli(args), compile_cache=False)
        assert engine.scheduler_config.max_model_len == want and engine.config.sampling_defaults == defaults
        args = parser.parse_args(["--num-blocks", "16", "--no-warmup", "--max-model-len", "100"])
        assert build_engine(args, load_model_for_cli(args), compile_cache=False).scheduler_config.max_model_len == 100


def test_kv_pool_bigger_than_memory_is_refused_before_allocating(capsys):
    import jax

    free, _ = memory_available(jax.local_devices()[0])
    if free >= 300 * 2**30:
        pytest.skip("this machine has 300 GiB free")
    assert cli.main(["--kv-memory", "300GiB"]) == 2  # RESOURCE_EXHAUSTED (or the OOM killer) once
    line = _one_line_error(capsys.readouterr().err)
    assert "300.0 GiB does not fit" in line and "--kv-memory" in line


def test_parse_size_any_number_of_digits():
    assert parse_size("1000000000000T") == 10**12 * 2**40
    assert parse_size("9" * 400) == int("9" * 400)  # float() would overflow
    assert parse_size("0.5KiB") == 512


def test_parse_size():
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size("64M") == 64 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512k") == 512 * 1024
    assert parse_size("2kB") == 2000
    assert parse_size("1048576") == 1048576
    for bad in ("", "MiB", "-1M", "1 parsec", "0"):
        with pytest.raises(Exception):  # noqa: B017 - argparse.ArgumentTypeError
            parse_size(bad)


def test_prompts_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text('import os\n\n"def f():\\n    return 1"\n"""docstring\n')
    assert read_prompts_file(f) == ["import os", "def f():\n    return 1", '"""docstring']


# ----------------------------------------------------- compile cache: each run a subprocess (one setting per process)
CACHE_ARGS = ["--prompt", "def f(x):\n", "--max-tokens", "2", "--ignore-eos", "--num-blocks", "16", "--json"]


def _run_json(*args: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "PAGEDJAX_COMPILE_CACHE")}
    environ.update(JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), PYTHONWARNINGS="ignore", **env)
    r = subprocess.run([sys.executable, "-m", "pagedjax", *CACHE_ARGS, *args], capture_output=True, text=True,
                       timeout=240, cwd=ROOT, env=environ)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_second_run_loads_what_the_first_compiled(tmp_path):
    cache, elsewhere = tmp_path / "cache", tmp_path / "env-cache"
    # --compile-cache wins over $PAGEDJAX_COMPILE_CACHE.
    cold = _run_json("--compile-cache", str(cache), PAGEDJAX_COMPILE_CACHE=str(elsewhere))
    assert _files(cache) and not _files(elsewhere)
    assert cold["compile_cache_dir"] == str(cache)
    assert cold["stats"]["compile_cache_hits"] == 0 and cold["stats"]["compile_cache_misses"] > 0
    assert cold["stats"]["compile_s"] > 0
    # One count of programs: each step program is compiled (cold) or loaded (warm), never both, never others.
    assert cold["stats"]["programs_compiled"] == cold["stats"]["compilations"] == \
        cold["stats"]["compile_cache_misses"] and cold["stats"]["programs_loaded"] == 0

    warm = _run_json("--compile-cache", str(cache))
    assert warm["compile_cache_dir"] == str(cache)
    assert warm["stats"]["compile_cache_hits"] > 0 and warm["stats"]["compile_cache_misses"] == 0
    assert warm["stats"]["programs_loaded"] == warm["stats"]["compilations"] == cold["stats"]["compilations"]
    assert warm["stats"]["programs_compiled"] == 0
    assert [(c["text"], c["num_tokens"]) for c in warm["completions"]] == \
        [(c["text"], c["num_tokens"]) for c in cold["completions"]]
    assert warm["completions"][0]["num_tokens"] == 2


def test_no_compile_cache_writes_nothing(tmp_path):
    # Off even where the environment names a folder: pagedjax's variable and JAX's own.
    ours, jaxs = tmp_path / "pagedjax-cache", tmp_path / "jax-cache"
    result = _run_json("--no-compile-cache", PAGEDJAX_COMPILE_CACHE=str(ours), JAX_COMPILATION_CACHE_DIR=str(jaxs))
    assert not _files(ours) and not _files(jaxs)
    assert result["compile_cache_dir"] is None
    assert result["stats"]["compile_cache_hits"] == result["stats"]["compile_cache_misses"] == 0
    assert result["completions"][0]["num_tokens"] == 2


def test_compile_cache_description():
    assert CompileCache(None).describe(3, 0) == "off: every program compiled"
    assert CompileCache(None).start(3, 0) == "off"
    folder = Path("/tmp/c")
    assert CompileCache(folder).describe(4, 4) == "warm start: 4 of 4 step programs loaded from /tmp/c"
    assert CompileCache(folder).describe(4, 0) == "cold start: 0 of 4 step programs loaded from /tmp/c"
    assert CompileCache(folder).start(4, 1) == "partly warm"
    assert CompileCache(folder).start(0, 0) == "no compilation"
    assert CompileCache(folder).engine_arg == "/tmp/c" and CompileCache(None).engine_arg is False


def test_the_header_says_what_is_on(capsys):
    """It said "float32" under --quantization int8 (the compute dtype), counted the scales as parameters (2.36 M ->
    2.37 M) and named neither the KV dtype's source, the speculative method nor tp/dp."""
    argv = ["--prompt", "def f", "--max-tokens", "1", "--num-blocks", "16", "--quantization", "int8",
            "--kv-dtype", "int8", "--speculative-method", "ngram", "--speculative-num-tokens", "2"]
    assert cli.main(argv) == 0
    header = capsys.readouterr().out.split("\n\n")[0]
    assert re.search(r"^  2\.36 M params: 0\.53 M float32 \([\d.]+ MiB\), 1\.84 M int8 \([\d.]+ MiB\), "
                     r"scales [\d.]+ KiB; compute float32, weights int8, KV cache int8$", header, re.MULTILINE), header
    assert re.search(r"^  speculative decoding ngram, 2 tokens; tensor parallel 1 x data parallel 1; context 4,096 "
                     r"tokens$", header, re.MULTILINE), header
    assert re.search(r"^  sampling defaults: temperature 0.8, top_p 0.95 \(.*generation_config.json\)$", header,
                     re.MULTILINE), header
