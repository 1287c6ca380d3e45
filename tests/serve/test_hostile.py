"""Hostile inputs to the server's native dependencies (the grammar library, the tokenizer): each is refused with a
short 400 naming the limit, or caught in a grammar worker that may crash, and the server answers and serves
afterwards. One test per reproduction of issue 47 (scaled to run fast), and a fuzz test."""

from __future__ import annotations

import functools
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedjax.structured_output.isolation import CompileGuardConfig
from pagedjax.structured_output.limits import StructuredLimits
from tests.serve.server_utils import MAX_MODEL_LEN, MODEL_NAME, make_engine, running_server

NO_LIMITS = StructuredLimits(**{name: 10**9 for name in StructuredLimits.__dataclass_fields__})
COMPILE_TIMEOUT_S = 2.0
MESSAGES = [{"role": "user", "content": "Hi."}]


def ref_chain(n: int) -> dict:
    """`$defs` d0 -> d1 -> ... -> dn, each an object whose property refers to the next (1,000: llguidance's
    stack overflows)."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def right_recursive_grammar(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "b"'


@pytest.fixture(scope="module")
def servers():
    """(the server with the default limits, one with no limits whose grammar worker is all that guards it)."""
    with running_server(make_engine()) as limited, \
            running_server(make_engine(), structured_limits=NO_LIMITS,
                           compile_config=CompileGuardConfig(timeout_s=COMPILE_TIMEOUT_S)) as unlimited:
        yield limited, unlimited


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def unlimited(servers):
    return servers[1]


@functools.cache
def _client() -> httpx.Client:
    """One client for the module's requests: `httpx.post` builds one (and its SSL context), 20 ms of CPU, each time."""
    return httpx.Client()


def post(server, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
    return _client().post(f"{server.url}{path}", json={"model": MODEL_NAME, **body}, timeout=timeout)


def chat(server, **body) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **body})


def completion(server, **body) -> httpx.Response:
    return post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **body})


def assert_refused(response: httpx.Response, param: str, says: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert len(error["message"]) < 600 and "panicked" not in error["message"], error  # short, no backtrace
    return error["message"]


def assert_serving(server) -> None:
    assert _client().get(f"{server.url}/health").status_code == 200
    response = completion(server, guided_regex="[a-c]{2}")
    assert response.status_code == 200, response.text


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# ------------------------------------------------------------------- 1. a chain of $refs (response_format, ...)
def test_a_ref_chain_is_refused_by_the_limits_on_every_surface(server):
    assert_refused(chat(server, response_format=schema_format(ref_chain(1000))), "response_format",
                   "max_schema_bytes = 65,536")  # the 94 KB body
    schema = ref_chain(600)
    assert_refused(chat(server, response_format=schema_format(schema)), "response_format", "max_refs = 512")
    assert_refused(completion(server, guided_json=schema), "guided_json", "max_refs = 512")
    assert_refused(completion(server, guided_json=json.dumps(schema)), "guided_json", "max_refs = 512")
    assert_refused(chat(server, tools=[tool(schema)], tool_choice="auto"), "tools", "max_refs")
    assert_refused(chat(server, tools=[tool(schema)], tool_choice="required"), "tools", "max_refs")
    assert_refused(completion(server, guided_grammar=f'start: "x" %json {json.dumps(ref_chain(100))}'),
                   "guided_grammar", "max_schema_depth = 128")
    assert_refused(chat(server, response_format=schema_format(ref_chain(60))), "response_format",
                   "max_schema_depth = 128")
    assert chat(server, response_format=schema_format(ref_chain(30))).status_code == 200
    assert_serving(server)


def test_a_ref_chain_past_the_limits_crashes_only_a_grammar_worker(unlimited):
    schema = ref_chain(1000)
    start = time.monotonic()
    says = "crashed the grammar compiler (died of SIGSEGV"
    assert_refused(chat(unlimited, response_format=schema_format(schema)), "response_format", says)
    assert_serving(unlimited)
    assert_refused(completion(unlimited, guided_json=schema), "guided_json", says)  # the same: refused at once
    # (the tools' text alone is longer than this model's context: refused as too long, before the compile stage)
    assert chat(unlimited, tools=[tool(schema)], tool_choice="auto").status_code == 400
    assert_refused(completion(unlimited, guided_grammar=f'start: "x" %json {json.dumps(schema)}'), "guided_grammar",
                   says)
    assert time.monotonic() - start < 10
    assert_serving(unlimited)


# -------------------------------------------------------------------------------- 2. huge prompts and chats
def health_latencies(server, work):
    """/health's latencies (seconds) polled while `work()` runs, and its result."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=server.url) as client:
            while not stop.is_set():
                t = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.002)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        time.sleep(0.05)
        result = work()
        time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
    return latencies, result


def test_the_largest_prompt_and_chat_are_refused_without_tokenizing_or_stalling_health(server, monkeypatch):
    calls = []
    tokenizer = server.llm.tokenizer
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    # The bodies are made before the clock starts (the test client shares the server's process and GIL).
    bodies = {
        "prompt": json.dumps({"model": MODEL_NAME, "prompt": "é" * (2**21 - 100), "max_tokens": 1},
                              ensure_ascii=False).encode(),
        "long chat": json.dumps({"model": MODEL_NAME, "max_tokens": 1, "messages": [
            {"role": "user", "content": "y" * 3000}] * 1024}).encode(),
        "many messages": json.dumps({"model": MODEL_NAME, "max_tokens": 1, "messages": [
            {"role": "user", "content": "y"}] * 40_000}).encode(),
    }
    assert all(len(b) < 4 * 2**20 for b in bodies.values())
    idle, _ = health_latencies(server, lambda: time.sleep(0.5))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name, body in bodies.items():
            path = "/v1/completions" if name == "prompt" else "/v1/chat/completions"
            latencies, response = health_latencies(server, lambda path=path, body=body: client.post(path,
                                                                                                    content=body))
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert ("max-chat-messages" if name == "many messages" else "maximum context length") in error["message"]
            extra = max(latencies) - statistics.median(idle)
            print(f"{name}: {len(body):,} bytes; /health {1e3 * max(latencies):.1f} ms at most over "
                  f"{len(latencies)} polls (idle: median {1e3 * statistics.median(idle):.1f} ms)")
            # The target (under 100 ms extra) is measured and printed; on a shared CI machine a timed bound that
            # tight flakes, so the assertion is one only a stall fails (the tokenizer holding the GIL: 6.35 s).
            assert extra < 1.0, (name, latencies)
    assert calls == [], "a prompt that cannot fit was tokenized"
    response = completion(server, prompt="y" * (MAX_MODEL_LEN - 2), max_tokens=1)  # the largest that fits
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def bundled_tokenizer():
    from pagedjax.model.hf_tokenizer import HFTokenizer
    from pagedjax.model.loading.checkpoint import bundled_model_path

    return HFTokenizer.from_pretrained(bundled_model_path())


# Any text a JSON body can carry (pydantic refuses lone surrogates), its longest tokens and special tokens' text
# included.
TEXTS = st.lists(st.one_of(st.text(st.characters(exclude_categories=("Cs",))),
                           st.sampled_from(["<|bos|>", "<|eos|>", "<|pad|>", "\n\n\n", " " * 40, "é" * 20])),
                 max_size=30).map("".join)


@given(text=TEXTS)
def test_the_byte_bound_holds_for_the_bundled_tokenizer(bundled_tokenizer, text):
    """Every token of the bundled BPE stands for at most `longest_token_bytes` bytes of text, so a text of more
    than (n - 1) x that many bytes has at least n tokens; and the tokenizer takes any such text, through the
    encode that releases the GIL, as its plain encode does."""
    from pagedjax.serve.admission import encode_text, longest_token_bytes, utf8_length

    per_token = longest_token_bytes(bundled_tokenizer)
    assert 1 < per_token <= 64
    ids = encode_text(bundled_tokenizer, text)
    assert ids == bundled_tokenizer.encode(text)
    assert len(ids) >= utf8_length(text) / per_token


def test_the_longest_tokens_repeated_meet_the_bound(bundled_tokenizer):
    from pagedjax.serve.admission import longest_token_bytes, utf8_length

    per_token = longest_token_bytes(bundled_tokenizer)
    longest = max(range(bundled_tokenizer.vocab_size), key=lambda i: len(bundled_tokenizer.decode_bytes([i])))
    text = bundled_tokenizer.decode([longest]) * 200
    assert len(bundled_tokenizer.encode(text)) >= utf8_length(text) / per_token


def _ticking_share(encode) -> float:
    """Run `encode()` 5 times in a thread while this one ticks (sleeps 1 ms, counts): the share of the thread's
    life this one ran, as ticks x 1 ms over it (about 1 when `encode` releases the GIL, near 0 when it holds it:
    only the moments between calls tick)."""
    ticks = 0
    worker = threading.Thread(target=lambda: [encode() for _ in range(5)])
    start = time.perf_counter()
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        ticks += 1
    worker.join()
    return ticks * 0.001 / (time.perf_counter() - start)


def test_the_largest_admitted_prompt_is_tokenized_without_holding_the_gil(bundled_tokenizer):
    """The bundled model's byte bound (2,047 x 32 bytes) as one prompt, tokenized in a thread: this thread keeps
    running meanwhile, where the tokenizer's plain `encode` holds the GIL throughout (1 MB stopped the event loop
    1 s). Measured as shares of time, against that plain `encode` in the same run, not as a gap in seconds: a
    2-core machine under load delays every thread's wake-ups by tens of milliseconds."""
    from pagedjax.serve.admission import encode_text, longest_token_bytes

    text = ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 2000)[
        :2047 * longest_token_bytes(bundled_tokenizer)]
    released = _ticking_share(lambda: encode_text(bundled_tokenizer, text))
    held = _ticking_share(lambda: bundled_tokenizer.encode(text))
    assert released > 0.2 and held < released / 2, (released, held)


# ----------------------------------------------------------------------------------- 3. recursive grammars
def test_a_right_recursive_grammar_is_refused_and_one_past_the_limits_crashes_only_a_worker(server, unlimited):
    grammar = right_recursive_grammar(5000)
    assert_refused(completion(server, guided_grammar=grammar), "guided_grammar", "max_grammar_bytes")
    assert_refused(completion(server, guided_grammar=right_recursive_grammar(600)), "guided_grammar",
                   "max_grammar_rules = 512")
    assert completion(server, guided_grammar=right_recursive_grammar(300)).status_code == 200
    assert_refused(completion(unlimited, guided_grammar=grammar), "guided_grammar", "crashed the grammar compiler")
    assert_serving(server)
    assert_serving(unlimited)


# ------------------------------------------------------------------------------------ 4. huge choice lists
def test_huge_choice_lists_are_refused_at_once_and_delay_nobody(server):
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1,
                       "guided_choice": [f"choice number {i}" for i in range(100_000)]}).encode()
    with ThreadPoolExecutor(8) as pool, httpx.Client(base_url=server.url, timeout=60) as client:
        start = time.monotonic()
        refused = [pool.submit(client.post, "/v1/completions", content=body) for _ in range(8)]
        assert_serving(server)
        for future in refused:
            assert_refused(future.result(), "guided_choice", "max_choices = 1,024")
        assert time.monotonic() - start < 10


def test_a_compile_past_its_time_limit_is_a_short_400_and_other_requests_go_on(unlimited):
    choices = [f"choice number {i}" for i in range(100_000)]  # 15 s to compile
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        slow = pool.submit(completion, unlimited, guided_choice=choices)
        time.sleep(0.3)
        t = time.monotonic()
        assert completion(unlimited, max_tokens=1).status_code == 200  # tokenized and admitted meanwhile
        assert time.monotonic() - t < COMPILE_TIMEOUT_S
        message = assert_refused(slow.result(), "guided_choice", f"more than the {COMPILE_TIMEOUT_S:g} s limit")
        assert time.monotonic() - start < COMPILE_TIMEOUT_S + 5, message
    assert_serving(unlimited)


# --------------------------------------------------------------------------------------- 5. huge regexes
def test_huge_repetitions_and_alternations_are_refused(server):
    assert_refused(completion(server, guided_regex="[a-z]{100000}"), "guided_regex", "max_regex_repeat = 1,000")
    assert_refused(completion(server, guided_regex="(([a-z]{10}){10}){11}"), "guided_regex", "max_regex_repeat")
    alternatives = {"type": "string", "pattern": "^(" + "|".join(f"w{i}" for i in range(100_000)) + ")$"}
    assert_refused(completion(server, guided_json=alternatives), "guided_json", "max_schema_bytes = 65,536")
    long_pattern = {"type": "string", "pattern": "|".join(f"w{i}" for i in range(1000))}
    assert_refused(completion(server, guided_json=long_pattern), "guided_json", "max_pattern_length = 4,096")
    assert_refused(completion(server, guided_grammar='start: /[a-z]{5000}/'), "guided_grammar", "max_regex_repeat")
    assert completion(server, guided_regex="[a-z]{3}").status_code == 200


# ------------------------------------------------------------------------------- 6. memory under huge prompts
@pytest.mark.slow  # ~60 s: pagedjax-serve on the bundled model in a subprocess (its own RSS), 60 prompts of 4 MB
def test_huge_prompts_leave_the_servers_memory_flat(tmp_path):
    """Tokenizing a 4 MB prompt (to refuse it) kept ~1.3 GiB of freed memory in the tokenizing threads' malloc
    arenas, more with each round (495 -> 2,160 MiB in 60 s, /health up to 8.6 s); refused by its size instead,
    nothing is tokenized."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from bench_serving import start_server
    from soak_serve import rss_mib

    proc, url = start_server(["--max-request-bytes", "8MB"], log_path=tmp_path / "server.log")
    try:
        body = json.dumps({"model": MODEL_NAME, "max_tokens": 1,
                           "prompt": ("alpha béta 日本語 " * 300_000)[:4_000_000]}, ensure_ascii=False).encode()
        with httpx.Client(base_url=url, timeout=120) as client:
            assert client.post("/v1/completions", content=body).status_code == 400
            start = rss_mib(proc.pid)
            with ThreadPoolExecutor(3) as pool:
                codes = list(pool.map(lambda _: client.post("/v1/completions", content=body).status_code, range(60)))
            latency = time.perf_counter()
            assert client.get("/health").status_code == 200
            latency = time.perf_counter() - latency
        assert codes == [400] * 60
        assert rss_mib(proc.pid) - start < 150, (start, rss_mib(proc.pid))
        assert latency < 1.0
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ------------------------------------------------------------------------------------------ the fuzz test
def _schemas():
    leaf = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"enum": [1, "a"]},
                            {"type": "string", "pattern": "(a+)+$"}, {"$ref": "#"}, {"$ref": "#/$defs/missing"},
                            {"type": "objectx"}, {"minLength": -1}, {"type": "string", "pattern": "(["}])

    def nest(inner):
        return st.one_of(
            st.builds(lambda p: {"type": "object", "properties": p}, st.dictionaries(st.text("ab", min_size=1,
                                                                                             max_size=3), inner,
                                                                                     max_size=3)),
            st.builds(lambda i: {"type": "array", "items": i}, inner),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)))

    nested = st.recursive(leaf, nest, max_leaves=8)
    chains = st.builds(ref_chain, st.integers(0, 1200))
    deep = st.builds(lambda n: json.loads('{"items":' * n + "{}" + "}" * n), st.integers(100, 400))
    huge_enum = st.builds(lambda n: {"enum": list(range(n))}, st.integers(1000, 5000))
    return st.one_of(nested, chains, deep, huge_enum)


REGEXES = st.one_of(
    st.sampled_from(["(a+)+$", "(a|aa)*b", "(.*a){20}", "((a{30}){30}){30}", "[", "a{2,1}", "\\", "(?P<x>a)(?P=x)",
                     "[a-z]{1000}", "[a-z]{1001}", "(a|b|c|d)*" * 50]),
    st.text(st.sampled_from("ab()[]{}|*+?.\\^$0123456789,"), min_size=1, max_size=40))
GRAMMARS = st.one_of(
    st.builds(right_recursive_grammar, st.integers(1, 3000)),
    st.builds(lambda n: "start: " + "(" * n + '"a"' + ")" * n, st.integers(1, 3000)),
    st.builds(lambda n: f'start: "x" %json {json.dumps(ref_chain(n))}', st.integers(0, 1200)),
    st.sampled_from(["start: missing", "start: (", 'start: "a"{1001}', "start: start", "%json {", "start: /(a+)+$/"]),
    st.text(st.sampled_from('start:"a|()[]{}%json/\n 0123456789'), min_size=1, max_size=60))


@given(kind=st.sampled_from(["guided_json", "response_format", "tool", "guided_regex", "guided_grammar"]),
       data=st.data())
def test_fuzzed_constraints_are_answered_and_the_server_serves_afterwards(servers, kind, data):
    for server in servers:
        if kind in ("guided_json", "response_format", "tool"):
            schema = data.draw(_schemas(), label="schema")
            if kind == "guided_json":
                response = completion(server, guided_json=schema, max_tokens=1)
            elif kind == "response_format":
                response = chat(server, response_format=schema_format(schema), max_tokens=1)
            else:
                response = chat(server, tools=[tool({"type": "object", "properties": {"x": schema}})], max_tokens=1)
        elif kind == "guided_regex":
            response = completion(server, guided_regex=data.draw(REGEXES, label="regex"), max_tokens=1)
        else:
            response = completion(server, guided_grammar=data.draw(GRAMMARS, label="grammar"), max_tokens=1)
        assert response.status_code in (200, 400), response.text
        if response.status_code == 400:
            message = response.json()["error"]["message"]
            assert len(message) < 600 and "panicked" not in message and "backtrace" not in message, message
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_after_the_fuzz_both_servers_serve(servers):
    for server in servers:
        assert_serving(server)
