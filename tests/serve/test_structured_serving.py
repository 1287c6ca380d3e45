"""Structured output over HTTP: OpenAI's `response_format` (json_object, json_schema, and the client's own
`parse` with a pydantic model) and vLLM's guided_* fields; a bad constraint is a 400 naming its field before
anything is queued."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import openai
import pydantic
import pytest

from tests.serve.server_utils import MODEL_NAME, make_engine, running_server

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a box."}]


@pytest.fixture(scope="module")
def client():
    with running_server(make_engine()) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_response_format_json_schema_and_json_object(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=1,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "box", "schema": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=120, temperature=0.0,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "length" or isinstance(json.loads(out.choices[0].message.content), dict)


def test_the_clients_parse_with_a_pydantic_model(client):
    class Box(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=8)
        size: int = pydantic.Field(ge=0, le=99)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=2, response_format=Box)
    box = out.choices[0].message.parsed
    assert isinstance(box, Box) and 0 <= box.size <= 99


def test_guided_fields_streamed_and_not(client):
    out = client.completions.create(model=MODEL_NAME, prompt="Pick: ", max_tokens=8, n=3, temperature=1.0, seed=3,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert sorted(c.text in ("red", "green", "blue") for c in out.choices) == [True] * 3
    chunks = client.completions.create(model=MODEL_NAME, prompt="Id: ", max_tokens=10, stream=True, seed=4,
                                       temperature=1.0, extra_body={"guided_regex": "[A-F]{2}-[0-9]{3}"})
    assert re.fullmatch("[A-F]{2}-[0-9]{3}", "".join(c.choices[0].text for c in chunks if c.choices))


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "(["}, "guided_regex"),
    ({"guided_grammar": "start: missing"}, "guided_grammar"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_a_grammar_that_cannot_end_is_a_400_naming_its_rule(client):
    """It used to be taken, and its first token failed the request with a 500 carrying the grammar library's parser
    state ("Too many items (limit 50000; ff_tokens) ... <state>")."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                                  extra_body={"guided_grammar": 'start: "b" | "a" item\nitem: "c" item'})
    error = e.value.body
    assert error["param"] == "guided_grammar" and "rule 'item' never ends" in error["message"], error
    assert "<state>" not in error["message"] and len(error["message"]) < 400


def test_constraints_compile_in_the_prepare_stage_and_a_bad_one_leaves_running_requests_alone(client,
                                                                                                monkeypatch):
    from pagedjax.structured_output import manager
    from pagedjax.structured_output.compiler import ConstraintCompiler

    threads, checks = [], []
    real, real_check = ConstraintCompiler._matcher, manager.check_structured

    def matcher(self, structured):
        threads.append(threading.current_thread().name)
        return real(self, structured)

    def check(structured, limits):  # the limits' check: 40 ms of Python for a 64 KiB grammar
        checks.append(threading.current_thread().name)
        return real_check(structured, limits)

    monkeypatch.setattr(ConstraintCompiler, "_matcher", matcher)
    monkeypatch.setattr(manager, "check_structured", check)
    body = {"guided_regex": "[a-f]{3}-[0-9]{2}-prepared"}
    for seed in (5, 6):  # the second request of the same constraint copies the first's compiled matcher
        out = client.completions.create(model=MODEL_NAME, prompt="Id: ", max_tokens=20, temperature=1.0, seed=seed,
                                        extra_body=body)
        assert re.fullmatch("[a-f]{3}-[0-9]{2}-prepared", out.choices[0].text)
    # compiled (and its first mask built: `_matcher`) once, in the grammar pool; the engine thread only copies it,
    # without checking its limits again
    assert len(threads) == 1 and threads[0] != "pagedjax-engine", threads
    assert checks and "pagedjax-engine" not in checks, checks

    free = {"model": MODEL_NAME, "prompt": "Go: ", "max_tokens": 40, "temperature": 1.0, "seed": 9,
            "extra_body": {"ignore_eos": True}}
    want = client.completions.create(**free).choices[0].text
    stream = client.completions.create(stream=True, **free)
    text = next(iter(stream)).choices[0].text
    with pytest.raises(openai.BadRequestError) as e:  # while the free request runs
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body={"guided_grammar": "start: ("})
    assert e.value.body["param"] == "guided_grammar" and "guided_grammar: " in e.value.body["message"]
    text += "".join(c.choices[0].text for c in stream if c.choices)
    assert text == want
