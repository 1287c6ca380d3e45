"""Bad requests, missing or wrong API keys, a full queue and failed requests: each gets its documented status and
an OpenAI-style error object, and the server keeps serving afterwards."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.serve.server_utils import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    make_engine,
    metric,
    running_server,
    sse_events,
    wait_for_metrics,
)

API_KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_PENDING = 2
POISON = (7, 7, 7, 7)  # a prompt holding this run of token ids makes the device call fail


@pytest.fixture(scope="module")
def server():
    with running_server(make_engine(), api_key=API_KEY, max_pending=MAX_PENDING) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


def good(**overrides) -> dict:
    return {"model": MODEL_NAME, "prompt": "x = ", "max_tokens": 4, "temperature": 0, **overrides}


def assert_error(response: httpx.Response, status: int, *, type_: str, param: str | None = None,
                 code: str | None = None, says: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert error["param"] == param
    assert error["code"] == code
    assert says.lower() in error["message"].lower(), error["message"]
    return error


def assert_still_serving(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=good())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("content", [b"{not json", b'{"model": "pagedjax-tiny", "prompt": "x",', b"", b"\xff\xfe"])
def test_malformed_json(http, content):
    response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_error(response, 400, type_="invalid_request_error", says="not valid JSON")
    assert_still_serving(http)


def test_body_not_an_object(http):
    response = http.post("/v1/completions", json=[1, 2])
    assert_error(response, 400, type_="invalid_request_error", says="object")


def test_json_without_content_type_is_parsed(http):  # curl -d sends application/x-www-form-urlencoded
    response = http.post("/v1/completions", content=json.dumps(good()).encode(),
                         headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("field", "value", "says"), [
    ("max_tokens", "ten", "valid integer"),
    ("max_tokens", 4.0, "valid integer"),
    ("max_tokens", -1, "greater than or equal to 1"),
    ("max_tokens", 0, "greater than or equal to 1"),
    ("temperature", -0.5, "greater than or equal to 0"),
    ("temperature", "hot", "valid number"),
    ("top_p", 0, "greater than 0"),
    ("top_p", 1.5, "less than or equal to 1"),
    ("seed", -3, "greater than or equal to 0"),
    ("seed", 2**63, "less than"),
    ("presence_penalty", 3.0, "less than or equal to 2"),
    ("stream", "yes", "valid boolean"),
    ("stop", 5, "stop: must be a string or a list of strings (got 5)"),
    ("stop", ["a"] * 17, "at most 16 items"),  # the limit is named
    ("stop", "s" * 1025, "at most 1024 characters"),
    ("prompt", [1, 2.5], "prompt: must be a string, a list of integers, a list of strings or a list of lists of "
                         "integers"),
    ("prompt", None, "prompt: must be a string"),
    ("n", 0, "greater than or equal to 1"),
])
def test_invalid_field(http, field, value, says):
    response = http.post("/v1/completions", json=good(**{field: value}))
    assert_error(response, 400, type_="invalid_request_error", param=field, says=f"{field}")
    assert says in response.json()["error"]["message"]


def test_a_huge_value_is_not_sent_back(http):
    response = http.post("/v1/completions", json=good(temperature="x" * 1_000_000))
    assert_error(response, 400, type_="invalid_request_error", param="temperature", says="1,000,002 characters")
    assert len(response.content) < 1000


def test_null_is_the_default_as_openai_clients_send_it(http):
    body = good(n=None, stream=None, stop=None, echo=None, best_of=None, logprobs=None, max_tokens=None)
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    chat = {"model": MODEL_NAME, "n": None, "stream": None, "logprobs": None, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"}], "max_tokens": 3}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    required = http.post("/v1/completions", json=good(model=None))
    assert_error(required, 400, type_="invalid_request_error", param="model", says="model")


def test_missing_field(http):
    body = good()
    del body["prompt"]
    assert_error(http.post("/v1/completions", json=body), 400, type_="invalid_request_error", param="prompt",
                 says="prompt: Field required")


def test_unknown_field(http):
    response = http.post("/v1/completions", json=good(temprature=0.5))
    assert_error(response, 400, type_="invalid_request_error", param="temprature", says="unknown field 'temprature'")
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "hi", "mood": "happy"}]})
    assert_error(response, 400, type_="invalid_request_error", param="messages", says="messages.0.mood")


def test_token_ids_outside_the_vocabulary(http):
    response = http.post("/v1/completions", json=good(prompt=[1, 2, 100000]))
    assert_error(response, 400, type_="invalid_request_error", param="prompt", says="outside the vocabulary")
    assert "cmpl-" not in response.json()["error"]["message"]  # no internal request id
    response = http.post("/v1/completions", json=good(stop_token_ids=[100000]))
    assert_error(response, 400, type_="invalid_request_error", param="stop_token_ids", says="stop_token_ids")


def test_a_pool_smaller_than_the_context_clips_the_default_max_tokens():
    """A pool of one 128-token block: a chat request without max_tokens used to be refused ("may need ...
    blocks, more than the whole pool") while /v1/models advertised the whole context; now the default is what
    the pool holds, and so is the advertised length."""
    from pagedjax import CacheConfig, LLMEngine, SchedulerConfig
    from pagedjax.model.tokenizer import ByteTokenizer
    from tests.serve.server_utils import BLOCK_SIZE, CFG, MAX_MODEL_LEN, SEED

    llm = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=1),
                    scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                     max_model_len=MAX_MODEL_LEN), seed=SEED, tokenizer=ByteTokenizer())
    assert llm.max_request_tokens == BLOCK_SIZE + 1
    with running_server(llm) as s:
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["max_model_len"] == BLOCK_SIZE + 1
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        response = httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=120)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["total_tokens"] == BLOCK_SIZE + 1
        too_many = httpx.post(s.url + "/v1/chat/completions", json={**chat, "max_tokens": BLOCK_SIZE})
        assert_error(too_many, 400, type_="invalid_request_error", param="max_tokens",
                     code="context_length_exceeded", says=f"maximum context length is {BLOCK_SIZE + 1}")


def test_prompt_too_long(http):
    response = http.post("/v1/completions", json=good(prompt="y" * MAX_MODEL_LEN))
    assert_error(response, 400, type_="invalid_request_error", param="prompt", code="context_length_exceeded",
                 says=f"maximum context length is {MAX_MODEL_LEN} tokens")
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "y" * MAX_MODEL_LEN}]})
    assert_error(response, 400, type_="invalid_request_error", param="messages", code="context_length_exceeded",
                 says="maximum context length")


def test_max_tokens_past_the_context(http):
    response = http.post("/v1/completions", json=good(max_tokens=MAX_MODEL_LEN))
    assert_error(response, 400, type_="invalid_request_error", param="max_tokens", code="context_length_exceeded",
                 says="in the completion")


def test_unknown_model(http):
    response = http.post("/v1/completions", json=good(model="gpt-5"))
    assert_error(response, 404, type_="invalid_request_error", param="model", code="model_not_found", says="gpt-5")
    assert_error(http.get("/v1/models/gpt-5"), 404, type_="invalid_request_error", param="model",
                 code="model_not_found")


def test_unknown_path_and_method(http):
    assert_error(http.get("/v1/nothing"), 404, type_="invalid_request_error", says="no such endpoint")
    assert_error(http.get("/v1/completions"), 405, type_="invalid_request_error")


def test_stream_options_without_stream(http):
    response = http.post("/v1/completions", json=good(stream_options={"include_usage": True}))
    assert_error(response, 400, type_="invalid_request_error", param="stream_options", says="stream: true")


def test_no_messages(http):
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": []})
    assert_error(response, 400, type_="invalid_request_error", param="messages", says="at least 1")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_api_key_required(server, headers):
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/metrics")):
        response = httpx.request(method, server.url + path, headers=headers, json=good())
        assert_error(response, 401, type_="authentication_error", code="invalid_api_key", says="API key")
    assert httpx.get(f"{server.url}/health").status_code == 200  # for load balancers: no key


@pytest.mark.parametrize("authorization", [f"bearer {API_KEY}", f"BEARER  {API_KEY}", f"Bearer {API_KEY}"])
def test_the_bearer_scheme_is_case_insensitive(server, authorization):
    response = httpx.post(server.url + "/v1/completions", headers={"Authorization": authorization}, json=good())
    assert response.status_code == 200, response.text


def test_an_empty_api_key_is_refused_at_build_time():
    from pagedjax.serve.app import build_app
    from pagedjax.serve.async_engine import AsyncLLMEngine

    with pytest.raises(ValueError, match="empty"):
        build_app(AsyncLLMEngine(make_engine()), model_name=MODEL_NAME, api_key="")


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1:1"])
def test_a_browser_page_cannot_drive_the_server(server, http, origin):
    """A web page's fetch carries its Origin (a text/plain POST needs no CORS preflight): refused, whatever the
    content type, before any work; a client without an Origin (curl, SDKs) is served."""
    for content_type in ("text/plain", "application/json"):
        response = http.post("/v1/completions", content=json.dumps(good()),
                             headers={"Origin": origin, "Content-Type": content_type})
        assert_error(response, 403, type_="permission_error", code="origin_not_allowed", says="cross-origin")
    assert http.post("/v1/completions", content=json.dumps(good()),
                     headers={"Content-Type": "text/plain"}).status_code == 200


def test_allowed_origins_and_hosts():
    """DNS rebinding makes a page's requests carry the attacker's Host: on loopback only loopback names are
    answered (the CLI's default); an allowed origin is served."""
    with running_server(make_engine(), allowed_origins=["https://app.example"],
                        allowed_hosts=["localhost", "127.0.0.1", "::1"]) as s:
        ok = httpx.post(s.url + "/v1/completions", json=good(), headers={"Origin": "https://app.example"})
        assert ok.status_code == 200, ok.text
        rebound = httpx.post(s.url + "/v1/completions", json=good(), headers={"Host": "attacker.example:8000"})
        assert_error(rebound, 403, type_="permission_error", code="host_not_allowed", says="attacker.example")
        assert httpx.get(s.url + "/docs").status_code == 404  # interactive docs are off by default
        assert httpx.get(s.url + "/openapi.json").status_code == 404


def test_host_name_strips_ports_and_brackets():
    from pagedjax.serve.app import host_name

    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:80", "LocalHost", "::1", "[::1]")] == \
        ["127.0.0.1", "::1", "localhost", "::1", "::1"]


def _poison_device_calls(llm):
    """Make the engine's device calls raise when their input holds POISON (as tests/engine's fault injection)."""
    runner = llm.runner
    original = runner.execute

    def execute(inputs, *args, **kwargs):
        tokens = np.asarray(inputs.token_ids).tolist()
        if any(tuple(tokens[i:i + len(POISON)]) == POISON for i in range(len(tokens))):
            raise RuntimeError("injected device fault")
        return original(inputs, *args, **kwargs)

    runner.execute = execute
    return lambda: setattr(runner, "execute", original)


@pytest.mark.parametrize("stream", [False, True])
def test_failed_request_is_an_engine_error(server, http, stream):
    restore = _poison_device_calls(server.llm)
    try:
        body = good(prompt=[256, *POISON, 10], stream=stream)
        if not stream:
            response = http.post("/v1/completions", json=body)
            assert_error(response, 500, type_="server_error", code="engine_error", says="injected device fault")
        else:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200  # the failure comes after the stream started
                events = list(sse_events(response.iter_lines()))
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_error" and "injected device fault" in error["message"]
        assert_still_serving(http)
    finally:
        restore()


def test_full_queue_is_503_and_then_serves(server, http):
    """With the engine thread held inside a step, MAX_PENDING requests fill the server; the next gets 503."""
    gate = threading.Event()
    llm = server.llm
    step = llm.step

    def held_step():
        gate.wait(timeout=60)
        return step()

    llm.step = held_step
    try:
        with ThreadPoolExecutor(MAX_PENDING) as pool:
            waiting = [pool.submit(http.post, "/v1/completions", json=good()) for _ in range(MAX_PENDING)]
            metrics_text = ""
            for _ in range(2000):  # until both are in the server (not a timing assertion: it only waits)
                metrics_text = http.get("/metrics").text
                if metric(metrics_text, "pagedjax_num_requests_pending") == MAX_PENDING:
                    break
                gate.wait(0.01)
            assert metric(metrics_text, "pagedjax_num_requests_pending") == MAX_PENDING
            response = http.post("/v1/completions", json=good())
            assert_error(response, 503, type_="server_error", code="queue_full", says="overloaded")
            assert response.headers["retry-after"] == "1"
            gate.set()
            assert [f.result().status_code for f in waiting] == [200] * MAX_PENDING
    finally:
        llm.step = step
        gate.set()
    assert_still_serving(http)


def test_client_leaving_a_non_streaming_request_aborts_it(server, http):
    """The engine thread is held inside a step, so the request cannot finish before its client leaves."""
    gate = threading.Event()
    llm = server.llm
    step = llm.step

    def held_step():
        gate.wait(timeout=60)
        return step()

    def aborted(text: str) -> float:
        label = 'finish_reason="abort"'
        return metric(text, "pagedjax_request_success_total", label) if label in text else 0.0

    before = aborted(http.get("/metrics").text)
    llm.step = held_step
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=good(max_tokens=100), headers=AUTH, timeout=1.0)
    finally:
        llm.step = step
        gate.set()
    text = wait_for_metrics(server.url, lambda t: aborted(t) > before, headers=AUTH)
    assert aborted(text) == before + 1
    text = wait_for_metrics(server.url, lambda t: metric(t, "pagedjax_num_requests_running") == 0, headers=AUTH)
    assert metric(text, "pagedjax_kv_blocks_used") == 0
    assert metric(text, "pagedjax_num_requests_pending") == 0
    assert_still_serving(http)


def test_health_and_requests_once_the_engine_stopped():
    from fastapi.testclient import TestClient

    from pagedjax.serve.app import build_app
    from pagedjax.serve.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(make_engine())
    with TestClient(build_app(engine, model_name=MODEL_NAME)) as client:
        assert client.get("/health").json() == {"status": "ok"}
        engine.stop()
        response = client.get("/health")
        assert (response.status_code, response.json()) == (503, {"status": "unavailable"})
        assert_error(client.post("/v1/completions", json=good()), 503, type_="server_error", code="unavailable",
                     says="not taking requests")


def test_log_probability_work_per_request_is_bounded(http):
    """n=32 x 500 tokens x 20 alternatives used to build a 20 MB response (5.6 GB at the allowed maximum)."""
    response = http.post("/v1/completions", json=good(n=128, max_tokens=200, logprobs=20))
    assert_error(response, 400, type_="invalid_request_error", param="logprobs", says="537,600")
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "n": 128, "max_tokens": 200,
            "logprobs": True, "top_logprobs": 20}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, type_="invalid_request_error",
                 param="top_logprobs", says="500,000")


def test_an_oversized_body_is_refused_before_it_is_read(server, http):
    """A 16 MiB prompt used to be read whole and tokenized on the event loop (17 s, /health stalled, 3 GB kept)."""
    big = json.dumps(good(prompt="x" * (5 * 2**20)))
    response = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert_error(response, 413, type_="invalid_request_error", code="request_too_large", says="5,242,")

    def chunks():  # no Content-Length: refused once the limit is passed
        for i in range(0, len(big), 2**16):
            yield big[i:i + 2**16].encode()

    response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(response, 413, type_="invalid_request_error", code="request_too_large", says="over 4,194,304")
    assert http.get("/health").status_code == 200


def test_a_body_that_trickles_in_times_out_and_a_client_that_leaves_mid_body_logs_nothing(caplog):
    """A client sending its body a byte at a time (or never finishing it) used to hold its connection and task
    for ever; one that disconnected mid-body logged a whole traceback (23,000 log lines for 200 of them)."""
    import socket
    import time
    from urllib.parse import urlparse

    with running_server(make_engine(), body_timeout=0.5) as s:
        host, port = urlparse(s.url).hostname, urlparse(s.url).port
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                "Content-Length: 100\r\n\r\n{").encode()
        with socket.create_connection((host, port), timeout=10) as slow:
            slow.sendall(head)  # and nothing more
            start = time.monotonic()
            reply = ""
            while "request_timeout" not in reply and (chunk := slow.recv(4096)):  # h11 may send head and body apart
                reply += chunk.decode()
            assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply, reply
            assert time.monotonic() - start < 5
        with caplog.at_level("ERROR"):
            for _ in range(20):
                with socket.create_connection((host, port), timeout=10) as gone:
                    gone.sendall(head)
            time.sleep(1.0)
            assert httpx.get(s.url + "/health").status_code == 200
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text[-2000:]
