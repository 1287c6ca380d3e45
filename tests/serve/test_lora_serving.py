"""Multi-LoRA serving over HTTP: a request's `model` names the base model or an adapter, and an adapter's tokens are
`LLMEngine.generate(..., lora_request=...)`'s (completions and chat, streamed or not, base and adapters at once);
`/v1/models` lists adapters under their parent; adapters load and unload at runtime only when enabled, behind the
API key, from under the operator's root, at most `MAX_REGISTERED` at once; every refusal is its own status and
says what is wrong (adapters with NaN or overflowing numbers, a config nested 100,000 deep), and the server serves
on after each. One server for the module (a tiny random model, adapters of a few KB)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pagedjax import LoRARequest, SamplingParams
from pagedjax.config import LoRAConfig
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.serve.app import build_app
from pagedjax.serve.async_engine import AsyncLLMEngine
from pagedjax.serve.chat_template import ChatTemplate
from pagedjax.serve.logprobs import chat_logprobs, completion_logprobs
from pagedjax.serve.lora import RuntimeLoRAUpdates
from tests.lora.adapters import write_adapter
from tests.serve.server_utils import CFG, MODEL_NAME, make_engine, running_server, sse_events

API_KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_LORA_RANK = 8
MAX_LORA_BYTES = 64 * 2**10
MAX_REGISTERED = 3  # sql, chat and one more at a time (the tests below load one more at most)
NAN_TENSOR = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
PROMPT = [256, 100, 101, 102, 10, 32, 32]
MESSAGES = [{"role": "user", "content": "def parse("}]
MAX_TOKENS = 10
LONG_TOKENS = 200  # the request an unload finds running
ENGINE_LORA = dict(lora_config=LoRAConfig(max_loras=2, max_lora_rank=MAX_LORA_RANK))


def _engine():
    return make_engine(**ENGINE_LORA)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The LoRA root's adapters (good and bad ones, links in and out of it) and one adapter outside it."""
    base = tmp_path_factory.mktemp("lora")
    root, outside = base / "root", base / "outside"
    write_adapter(outside / "evil", CFG, rank=4, seed=9)
    good = {"sql": write_adapter(root / "sql", CFG, rank=4, seed=1, targets="all-linear"),
            "chat": write_adapter(root / "chat", CFG, rank=8, seed=2, targets=("q_proj", "v_proj", "down_proj"))}
    write_adapter(root / "rank16", CFG, rank=16, seed=3, targets=("q_proj",))
    write_adapter(root / "dora", CFG, rank=4, seed=3, use_dora=True)
    bad_json = write_adapter(root / "badjson", CFG, rank=4, seed=3)
    (bad_json / "adapter_config.json").write_text('{"r": 4,')
    corrupt = write_adapter(root / "corrupt", CFG, rank=4, seed=3)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    shapes = write_adapter(root / "shapes", CFG, rank=4, seed=3, targets=("q_proj",))
    tensors = load_file(str(shapes / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 63), np.float32)
    save_file(tensors, str(shapes / "adapter_model.safetensors"))
    nan = write_adapter(root / "nan", CFG, rank=4, seed=3)
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    tensors[NAN_TENSOR][1, 2] = np.nan
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    write_adapter(root / "alpha", CFG, rank=4, seed=3, alpha=float("inf"))  # "lora_alpha": Infinity
    deep = write_adapter(root / "deep", CFG, rank=4, seed=3)
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    big = write_adapter(root / "big", CFG, rank=4, seed=3)
    (big / "adapter_model.safetensors").write_bytes(bytes(MAX_LORA_BYTES + 1))
    (root / "empty").mkdir()
    (root / "escape").symlink_to(outside / "evil", target_is_directory=True)
    (root / "inner").mkdir()
    (root / "inner" / "up").symlink_to(outside, target_is_directory=True)
    file_link = root / "filelink"
    file_link.mkdir()
    (file_link / "adapter_config.json").write_text((outside / "evil" / "adapter_config.json").read_text())
    (file_link / "adapter_model.safetensors").symlink_to(outside / "evil" / "adapter_model.safetensors")
    (root / "linked").symlink_to(root / "chat", target_is_directory=True)  # a link inside the root is fine
    return {"root": root, "outside": outside, **good}


@pytest.fixture(scope="module")
def expected(folders):
    """The engine's own tokens (`LLMEngine.generate`) for the base model and each adapter, as the server shows
    them: the completions format's token strings, the chat format's token bytes."""
    llm = _engine()
    tokenizer = ByteTokenizer()
    template = ChatTemplate.from_model(None)
    chat_prompt = template.encode(tokenizer, template.render(MESSAGES, add_generation_prompt=True))
    loras = {MODEL_NAME: None, "sql": LoRARequest("sql", 1, str(folders["sql"])),
             "chat": LoRARequest("chat", 2, str(folders["chat"]))}
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    out = {}
    for name, lora in loras.items():
        completion, chat = llm.generate([PROMPT, chat_prompt], greedy, lora_request=lora, use_tqdm=False)
        out[name] = completion_logprobs(tokenizer, completion.outputs[0].logprobs)["tokens"]
        out[name, "chat"] = [e["bytes"] for e in chat_logprobs(tokenizer, chat.outputs[0].logprobs)["content"]]
    long = llm.generate([PROMPT], SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True,
                                                 logprobs=0), lora_request=loras["chat"], use_tqdm=False)[0]
    out["chat", "long"] = completion_logprobs(tokenizer, long.outputs[0].logprobs)["tokens"]
    assert len({tuple(out[name]) for name in loras}) == 3  # the adapters change the tokens
    return out


@pytest.fixture(scope="module")
def server(folders):
    updates = RuntimeLoRAUpdates(folders["root"], max_bytes=MAX_LORA_BYTES)
    with running_server(_engine(), api_key=API_KEY, lora_modules={"sql": str(folders["sql"])},
                        lora_updates=updates, max_registered_loras=MAX_REGISTERED) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def chat_loaded(http):
    """Adapter "chat" loaded at runtime (the tests below use it)."""
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "chat"})
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'chat' added successfully."


def completion(http, model: str, *, stream: bool = False, max_tokens: int = MAX_TOKENS) -> list[str]:
    """The completion's tokens (the completions format's strings) for `PROMPT` under `model`, greedy."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": stream}
    if not stream:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        return response.json()["choices"][0]["logprobs"]["tokens"]
    tokens = []
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for data in sse_events(response.iter_lines()):
            if data != "[DONE]":
                chunk = json.loads(data)
                assert chunk["model"] == model, chunk
                tokens += chunk["choices"][0]["logprobs"]["tokens"]
    return tokens


def chat(http, model: str, *, stream: bool = False) -> list[list[int]]:
    """The chat reply's tokens (their bytes) for `MESSAGES` under `model`, greedy."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "stream": stream}
    if not stream:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        return [e["bytes"] for e in response.json()["choices"][0]["logprobs"]["content"]]
    tokens = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for data in sse_events(response.iter_lines()):
            if data != "[DONE]" and json.loads(data)["choices"][0]["logprobs"] is not None:
                tokens += [e["bytes"] for e in json.loads(data)["choices"][0]["logprobs"]["content"]]
    return tokens


def assert_error(response: httpx.Response, status: int, code: str | None, param: str | None, says: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert says.lower() in error["message"].lower(), error["message"]


def assert_still_serving(http) -> None:
    response = http.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 2,
                                                  "temperature": 0, "logprobs": 0})  # the programs above
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------------------------------------- serving
def test_adapter_tokens_equal_the_engines(http, expected, chat_loaded):
    for model in (MODEL_NAME, "sql", "chat"):
        assert completion(http, model) == expected[model], model
        assert chat(http, model) == expected[model, "chat"], model
    assert completion(http, "sql", stream=True) == expected["sql"]
    assert chat(http, "chat", stream=True) == expected["chat", "chat"]


def test_base_and_adapters_at_once(http, expected, chat_loaded):
    results: dict = {}

    def run(key, model, stream):
        results[key] = completion(http, model, stream=stream)

    jobs = [(f"{m}-{s}", m, s) for m in (MODEL_NAME, "sql", "chat") for s in (False, True)]
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for key, model, _ in jobs:
        assert results[key] == expected[model], key


def test_models_lists_each_adapter_under_its_parent(http, folders, chat_loaded):
    response = http.get("/v1/models")
    assert response.status_code == 200
    cards = {c["id"]: c for c in response.json()["data"]}
    assert list(cards) == [MODEL_NAME, "sql", "chat"]
    assert (cards[MODEL_NAME]["parent"], cards[MODEL_NAME]["root"]) == (None, MODEL_NAME)
    for name in ("sql", "chat"):
        assert (cards[name]["parent"], cards[name]["root"], cards[name]["object"]) == (MODEL_NAME, name, "model")
        assert cards[name]["max_model_len"] == cards[MODEL_NAME]["max_model_len"]
    assert str(folders["root"]) not in response.text  # no server path leaks
    one = http.get("/v1/models/sql")
    assert one.status_code == 200 and one.json()["parent"] == MODEL_NAME


def test_unknown_model_names_the_field(http):
    for route, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        response = http.post(route, json={"model": "no-such-adapter", "max_tokens": 2, **body})
        assert_error(response, 404, "model_not_found", "model", "`no-such-adapter` does not exist")
        assert "sql" in response.json()["error"]["message"]  # what is served instead
    assert_error(http.get("/v1/models/no-such-adapter"), 404, "model_not_found", "model", "does not exist")
    assert_still_serving(http)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("body", "status", "code", "param", "says"), [
    ({"lora_name": "x", "lora_path": "../outside/evil"}, 403, "lora_path_not_allowed", "lora_path", "contains '..'"),
    ({"lora_name": "x", "lora_path": "sql/../../outside/evil"}, 403, "lora_path_not_allowed", "lora_path", "'..'"),
    ({"lora_name": "x", "lora_path": "OUTSIDE/evil"}, 403, "lora_path_not_allowed", "lora_path",
     "absolute path outside"),
    ({"lora_name": "x", "lora_path": "escape"}, 403, "lora_path_not_allowed", "lora_path",
     "'escape' is a symbolic link that leaves"),
    ({"lora_name": "x", "lora_path": "inner/up/evil"}, 403, "lora_path_not_allowed", "lora_path",
     "'inner/up' is a symbolic link that leaves"),
    ({"lora_name": "x", "lora_path": "filelink"}, 403, "lora_path_not_allowed", "lora_path",
     "adapter_model.safetensors is a symbolic link that leaves"),
    ({"lora_name": "x", "lora_path": "big"}, 413, "lora_adapter_too_large", "lora_path",
     f"{MAX_LORA_BYTES + 1:,} bytes, more than the {MAX_LORA_BYTES:,} bytes this server reads (--max-lora-bytes)"),
    ({"lora_name": "x", "lora_path": "corrupt"}, 400, "invalid_lora_adapter", "lora_path",
     "'corrupt': adapter_model.safetensors is not a valid safetensors file"),
    ({"lora_name": "x", "lora_path": "badjson"}, 400, "invalid_lora_adapter", "lora_path",
     "'badjson': adapter_config.json is not valid JSON"),
    ({"lora_name": "x", "lora_path": "shapes"}, 400, "invalid_lora_adapter", "lora_path", "has shape (4, 63)"),
    ({"lora_name": "x", "lora_path": "rank16"}, 400, "invalid_lora_adapter", "lora_path",
     f"field 'r' is 16, above the engine's max_lora_rank {MAX_LORA_RANK}"),
    ({"lora_name": "x", "lora_path": "dora"}, 400, "invalid_lora_adapter", "lora_path", "field 'use_dora'"),
    ({"lora_name": "x", "lora_path": "nan"}, 400, "invalid_lora_adapter", "lora_path",
     f"'nan': tensor '{NAN_TENSOR}' holds NaN"),
    ({"lora_name": "x", "lora_path": "alpha"}, 400, "invalid_lora_adapter", "lora_path",
     "field 'lora_alpha' must be a finite number"),
    ({"lora_name": "x", "lora_path": "deep"}, 400, "invalid_lora_adapter", "lora_path",
     "'deep': adapter_config.json is nested too deeply to read"),
    ({"lora_name": "x", "lora_path": "empty"}, 400, "invalid_lora_adapter", "lora_path", "no adapter_config.json"),
    ({"lora_name": "x", "lora_path": "missing"}, 404, "lora_adapter_not_found", "lora_path", "no adapter folder"),
    ({"lora_name": "sql", "lora_path": "chat"}, 400, "lora_adapter_exists", "lora_name", "already been loaded"),
    ({"lora_name": MODEL_NAME, "lora_path": "chat"}, 400, "invalid_lora_name", "lora_name", "the base model's"),
    ({"lora_name": "two words", "lora_path": "chat"}, 400, "invalid_lora_name", "lora_name", "without spaces"),
    ({"lora_name": "x"}, 400, None, "lora_path", "lora_path: Field required"),
    ({"lora_name": "x", "lora_path": "chat", "lora_int_id": 3}, 400, None, "lora_int_id", "unknown field"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 24 else None)
def test_load_refusals(http, folders, body, status, code, param, says):
    if body.get("lora_path", "").startswith("OUTSIDE"):
        body = {**body, "lora_path": str(folders["outside"] / "evil")}
    response = http.post("/v1/load_lora_adapter", json=body)
    assert_error(response, status, code, param, says)
    assert str(folders["root"]) not in response.text  # the client's path, never the server's
    assert "x" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
    assert_still_serving(http)


def test_loads_past_max_registered_loras_are_refused(http, chat_loaded):
    """sql, chat and one more: a fourth load is refused before anything is read, and taken once one is unloaded."""
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": "chat"}).status_code == 200
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "fourth", "lora_path": "chat"}), 400,
                 "too_many_lora_adapters", None,
                 f"serves at most {MAX_REGISTERED} LoRA adapters at once (--max-registered-loras) and holds 3")
    assert "fourth" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "third"}).status_code == 200
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "fourth", "lora_path": "chat"}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "fourth"}).status_code == 200
    assert_still_serving(http)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_runtime_updates_need_the_api_key(server, headers):
    for route, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "chat"}),
                        ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
        response = httpx.post(f"{server.url}{route}", json=body, headers=headers)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_unload_refusals(http):
    assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}), 404, "lora_adapter_not_found",
                 "lora_name", "'nope' cannot be found")
    assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": MODEL_NAME}), 400, "invalid_lora_name",
                 "lora_name", "cannot be unloaded")
    assert_still_serving(http)


def test_load_by_links_and_absolute_paths_inside_the_root(http, folders, expected):
    for name, path in (("by-link", "linked"), ("by-absolute-path", str(folders["root"] / "chat"))):
        response = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert response.status_code == 200, response.text
        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
        assert cards[name]["root"] == "chat"  # the real folder, relative to the root
        assert completion(http, name) == expected["chat"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def test_unload_lets_running_requests_finish(server, http, expected, monkeypatch):
    """Unloading an adapter that a request is generating under: new requests get 404 at once, the running one
    finishes under the adapter (its tokens the engine's), then the engine drops the adapter; loading the name
    again serves it afresh. The engine thread is held before a step while the unload is sent, so that the
    request is certainly still running when the engine thread gets the unload."""
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "temp", "lora_path": "chat"}).status_code == 200
    temp = {r.lora_int_id for r in server.llm.list_loras() if r.lora_name == "temp"}
    gate = threading.Event()
    gate.set()
    step = server.llm.step

    def gated_step():
        gate.wait()
        return step()

    monkeypatch.setattr(server.llm, "step", gated_step)
    body = {"model": "temp", "prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True}
    tokens, unloaded = [], {}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response.iter_lines())
        tokens += json.loads(next(events))["choices"][0]["logprobs"]["tokens"]
        gate.clear()  # the engine thread stops before its next step
        unload = threading.Thread(target=lambda: unloaded.update(
            response=http.post("/v1/unload_lora_adapter", json={"lora_name": "temp"})))
        unload.start()
        while "temp" in {c["id"] for c in http.get("/v1/models").json()["data"]}:  # gone before the engine hears
            assert unload.is_alive() or "response" in unloaded
        assert_error(http.post("/v1/completions", json={"model": "temp", "prompt": PROMPT, "max_tokens": 2}),
                     404, "model_not_found", "model", "`temp` does not exist")
        gate.set()
        unload.join(timeout=120)
        assert unloaded["response"].status_code == 200, unloaded["response"].text
        assert "Requests already running under it finish under it" in unloaded["response"].text
        for data in events:
            if data != "[DONE]":
                tokens += json.loads(data)["choices"][0]["logprobs"]["tokens"]
    assert tokens == expected["chat", "long"]
    # The engine thread removes it right after the step that finished the request, before it takes another
    # command: once a later request is answered, the engine holds it no more.
    assert_still_serving(http)
    assert not temp & {r.lora_int_id for r in server.llm.list_loras()}
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "temp", "lora_path": "chat"}).status_code == 200
    assert completion(http, "temp") == expected["chat"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "temp"}).text == \
        "Success: LoRA adapter 'temp' removed successfully."


def test_runtime_updates_are_off_unless_enabled(folders):
    """A server with LoRA but without --enable-runtime-lora-updates, and one without LoRA: both routes answer
    404 saying what enables them (even to a malformed body), and requests naming adapters are unknown models."""
    for kwargs, says in ((dict(engine=_engine(), lora_modules={"sql": str(folders["sql"])}),
                          "--enable-runtime-lora-updates"),
                         (dict(engine=make_engine()), "--enable-lora")):
        with running_server(kwargs.pop("engine"), **kwargs) as s:
            for route, body in (("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "chat"}),
                                ("/v1/unload_lora_adapter", {"lora_name": "sql"}), ("/v1/load_lora_adapter", {})):
                assert_error(httpx.post(f"{s.url}{route}", json=body), 404, "lora_updates_disabled", None, says)
            models = [c["id"] for c in httpx.get(f"{s.url}/v1/models").json()["data"]]
            assert models == ([MODEL_NAME, "sql"] if "lora_modules" in kwargs else [MODEL_NAME])


# -------------------------------------------------------------------------------------------- start-up
def test_bad_start_up_adapters_are_refused_by_name(folders):
    llm = _engine()
    for modules, says in (({"bad": str(folders["root"] / "rank16")}, "LoRA module bad="),
                          ({MODEL_NAME: str(folders["sql"])}, "the base model's name")):
        with pytest.raises(ValueError, match=says):
            build_app(AsyncLLMEngine(llm), model_name=MODEL_NAME, lora_modules=modules)
    with pytest.raises(ValueError, match="lora_config"):
        build_app(AsyncLLMEngine(make_engine()), model_name=MODEL_NAME, lora_modules={"sql": str(folders["sql"])})
    with pytest.raises(ValueError, match="is not a folder"):
        RuntimeLoRAUpdates(Path(os.devnull))
    with pytest.raises(ValueError, match="2 LoRA modules, more than the 1 adapters this server serves at once"):
        build_app(AsyncLLMEngine(llm), model_name=MODEL_NAME, max_registered_loras=1,
                  lora_modules={"sql": str(folders["sql"]), "chat": str(folders["chat"])})
