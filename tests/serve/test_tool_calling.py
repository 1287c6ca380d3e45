"""Tool calling over HTTP with the official `openai` client: a forced call ("required", a named function) is
constrained so that even the random test model writes valid calls whose arguments validate (`jsonschema`) and
then ends (finish reason "tool_calls", no content, at most --max-parallel-tool-calls calls, each string at most
--max-tool-string-length characters, an open object closed), a call cut short is never returned (streamed or
not), a stream's tool-call deltas reassemble to the non-streamed message, "auto" parses tagged calls out of the
text, bad tools are a 400 naming the field before anything is queued; and the parser, the bounded schemas and
prompt rendering alone."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.serve.admission import DEFAULT_MAX_PARALLEL_TOOL_CALLS
from pagedjax.serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from pagedjax.serve.protocol import ChatCompletionRequest
from pagedjax.serve.tools import (
    TOOLS_PREAMBLE,
    ToolCallParser,
    bounded_arguments,
    call_grammar,
    parse_message,
    template_messages,
    tool_plan,
)
from pagedjax.structured_output.compiler import ConstraintCompiler
from tests.serve.server_utils import CFG, MODEL_NAME, make_engine, running_server

# ASCII strings: the byte-level model's calls must fit its 256-token context (random text could be \u escapes).
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
PARAMETERS = {"get_weather": WEATHER, "search": SEARCH}
# A conversation that replays an earlier call and its answer (OpenAI clients send these back).
MESSAGES = [{"role": "user", "content": "Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "oslo", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
            {"role": "user", "content": "Rome?"}]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}
SHORT = [{"role": "user", "content": "Rome?"}]
# The server's template: a terse one that reads `tools` (the TOOLS_PREAMBLE would not leave the test model's
# 256-token context room for a call; it is checked below without a server).
SERVER_TEMPLATE = ("{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
                   "{% for m in messages %}{{ m.role[0] }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
                   "{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}\n{% endfor %}"
                   "{% if add_generation_prompt %}a: {% endif %}")


# Two calls of TOOLS fit the test model's context after SHORT's prompt; the default (4) would not. Strings of at
# most 8 characters (up to 32 byte tokens each) let two calls of OPEN fit too; TOOLS' patterns are shorter anyway.
MAX_CALLS = 2
STRING_LENGTH = 8
# An ordinary open schema: no additionalProperties, a free string, a nested object that is open too.
OPEN = {"type": "object", "properties": {"city": {"type": "string"},
                                         "where": {"type": "object", "properties": {"zip": {"type": "integer"}}}},
        "required": ["city"]}
OPEN_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": OPEN}}]


@pytest.fixture(scope="module")
def server():
    with running_server(make_engine(), chat_template=ChatTemplate(SERVER_TEMPLATE),
                        max_parallel_tool_calls=MAX_CALLS, max_tool_string_length=STRING_LENGTH) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(call) -> dict:
    """The call's arguments, after checking them against its function's parameters."""
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMETERS[call.function.name])
    return args


def _stream(client, **kwargs) -> dict[int, tuple]:
    """Per choice: (content or None, [(id, name, arguments)], finish reason, argument pieces per call), streamed."""
    content, calls, pieces, reason = {}, {}, {}, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            i = choice.index
            delta = choice.delta
            assert delta.role or delta.content or delta.tool_calls or choice.finish_reason  # no empty chunks
            reason[i] = choice.finish_reason or reason.get(i)
            content[i] = content.get(i, "") + (choice.delta.content or "")
            for d in choice.delta.tool_calls or ():
                mine = calls.setdefault(i, {})
                if d.id is not None:  # a call's first delta: its id and name
                    assert d.index == len(mine) and d.type == "function" and d.function.name
                    mine[d.index] = [d.id, d.function.name, ""]
                mine[d.index][2] += d.function.arguments or ""
                pieces.setdefault(i, {}).setdefault(d.index, []).append(d.function.arguments or "")
    return {i: (content[i] or None, [tuple(c) for c in calls.get(i, {}).values()], reason[i], pieces.get(i, {}))
            for i in content}


def test_required_calls_validate(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, n=3,
                                         tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=0)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _valid(choice.message.tool_calls[0])


@pytest.mark.parametrize("seed", [3, 4])
def test_required_with_parallel_calls_ends_after_its_calls(client, seed):
    # Unbounded, these seeds chain calls until max_tokens cuts one short (finish "length", a partial tag in the
    # content); the grammar ends the text after at most MAX_CALLS calls.
    kwargs = dict(model=MODEL_NAME, messages=SHORT, tools=TOOLS, n=2, tool_choice="required", temperature=1.0,
                  seed=seed)
    whole = client.chat.completions.create(**kwargs).choices
    streamed = _stream(client, **kwargs)
    for choice in whole:
        calls = choice.message.tool_calls
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        assert 1 <= len(calls) <= MAX_CALLS
        for call in calls:
            _valid(call)
        content, streamed_calls, reason, _ = streamed[choice.index]
        assert (content, reason) == (None, "tool_calls")
        assert [(name, args) for _, name, args in streamed_calls] == [(c.function.name, c.function.arguments)
                                                                      for c in calls]
    assert max(len(c.message.tool_calls) for c in whole) == MAX_CALLS  # parallel calls are made


@pytest.mark.parametrize("max_tokens", [8, 30, 60, 120])
def test_a_forced_call_cut_short_leaves_no_tag_in_the_content(client, max_tokens):
    # Seed 1 writes two calls (92 and 78 tokens). 8: inside the tag; 30: inside the call's head; 60: inside the
    # arguments (a partial call, which used to come back with arguments that do not parse); 120: inside the second
    # call, after a complete first one.
    kwargs = dict(model=MODEL_NAME, messages=SHORT, tools=TOOLS, tool_choice="required", temperature=1.0,
                  seed=1, max_tokens=max_tokens)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert (whole.finish_reason, whole.message.content) == ("length", None)
    assert len(whole.message.tool_calls or ()) == (max_tokens == 120)  # the complete calls only
    for call in whole.message.tool_calls or ():
        _valid(call)
    content, calls, reason, _ = _stream(client, **kwargs)[0]
    assert (content, reason) == (None, "length")
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments)
                                             for c in whole.message.tool_calls or ()]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_forced_calls_of_an_open_schema_end_and_parse(client, tool_choice):
    """An ordinary `parameters` schema (no additionalProperties, a free string) used to run to max_tokens: free keys
    and a string that never closed, the last call's arguments cut short and not JSON. Its objects are closed and
    its strings bounded: every call ends, within the context, streamed or not."""
    kwargs = dict(model=MODEL_NAME, messages=SHORT, tools=OPEN_TOOLS, tool_choice=tool_choice, n=2,
                  temperature=1.0, seed=1)
    whole = client.chat.completions.create(**kwargs).choices
    streamed = _stream(client, **kwargs)
    for choice in whole:
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        calls = choice.message.tool_calls
        assert 1 <= len(calls) <= (MAX_CALLS if tool_choice == "required" else 1)
        for call in calls:
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, OPEN)
            assert set(args) <= {"city", "where"} and set(args.get("where", {})) <= {"zip"}
            assert len(args["city"]) <= STRING_LENGTH
        content, streamed_calls, reason, _ = streamed[choice.index]
        assert (content, reason) == (None, "tool_calls")
        assert [(n, a) for _, n, a in streamed_calls] == [(c.function.name, c.function.arguments) for c in calls]


def _allowed_after(structured, text: str) -> list[int]:
    """The tokens the grammar allows after `text` (byte tokens of the test model's vocabulary)."""
    import numpy as np

    constraint = ConstraintCompiler(ByteTokenizer(), CFG.vocab_size, CFG.eos_token_ids).compile(structured)
    assert constraint.advance(list(ByteTokenizer().encode(text, add_bos=False))) is None
    row = np.zeros(-(-CFG.vocab_size // 32), np.int32)
    constraint.fill(row)
    return [t for t in range(CFG.vocab_size) if row[t // 32] >> (t % 32) & 1]


def test_the_call_grammar_allows_the_end_after_each_call_and_nothing_but_calls():
    call = '<tool_call>{"name": "search", "arguments": {"query": "ab"}}</tool_call>'
    [eos] = CFG.eos_token_ids
    required = tool_plan(_request(tool_choice="required")).constraint
    for n in range(1, DEFAULT_MAX_PARALLEL_TOOL_CALLS):
        assert _allowed_after(required, call * n) == [ord("<"), eos]  # another call, or the end
    assert _allowed_after(required, call * DEFAULT_MAX_PARALLEL_TOOL_CALLS) == [eos]
    for single in (tool_plan(_request(tool_choice="required", parallel_tool_calls=False)).constraint,
                   tool_plan(_request(tool_choice={"type": "function", "function": {"name": "search"}})).constraint):
        assert _allowed_after(single, call) == [eos]
    with pytest.raises(ValueError, match="max_calls"):
        call_grammar(_request().tools, max_calls=0)


def test_a_forced_parse_drops_a_tag_cut_short():
    head = '<tool_call>{"name": "sea'
    for text in ("<tool_c", head, CALL + "<tool", CALL + head):
        content, calls = parse_message(text, forced=True)
        assert content is None and len(calls) == text.count("</tool_call>")
        assert parse_message(text)[0] is not None  # unforced ("auto"), the model's own text stays content
    parser = ToolCallParser(forced=True)
    assert parser.feed(CALL).tool_calls and parser.feed("<tool_", final=True).content == ""


def test_named_calls_validate_and_their_streams_reassemble_to_them(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=5, n=2,
                  tool_choice={"type": "function", "function": {"name": "search"}})
    whole = client.chat.completions.create(**kwargs).choices
    streamed = _stream(client, **kwargs)
    assert sorted(streamed) == [0, 1]
    for choice in whole:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["search"]
        _valid(choice.message.tool_calls[0])
        content, calls, reason, pieces = streamed[choice.index]
        assert (content, reason) == (None, "tool_calls")
        assert [(name, args) for _, name, args in calls] == [(c.function.name, c.function.arguments)
                                                             for c in choice.message.tool_calls]
        assert pieces[0] == [calls[0][2]]  # the call came whole, in the delta that completed it
    assert whole[0].message.tool_calls[0].function.arguments != whole[1].message.tool_calls[0].function.arguments


def test_auto_parses_a_tagged_call_out_of_the_text(client):
    # The random model does not call tools on its own: a one-string guided_choice makes it write a reply in
    # the documented format, which "auto" (unconstrained itself) parses.
    reply = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "rome", "unit": "c"}}'
             "</tool_call>")
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                  extra_body={"guided_choice": [reply]})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check. "
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and _valid(call) == {"city": "rome", "unit": "c"}
    content, calls, reason, _ = _stream(client, **kwargs)[0]
    assert (content, reason) == ("Let me check. ", "tool_calls")
    assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]
    # Without a call, "auto" is plain text; "none" does not parse at all.
    text = client.chat.completions.create(**{**kwargs, "extra_body": {"guided_choice": ["No tools needed."]}})
    assert text.choices[0].message.content == "No tools needed." and not text.choices[0].message.tool_calls
    assert text.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(**{**kwargs, "tool_choice": "none"}).choices[0]
    assert plain.message.content == reply and not plain.message.tool_calls and plain.finish_reason == "stop"


@pytest.mark.parametrize("body, param, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "no tool is named"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "retrieval", "function": TOOLS[0]["function"]}]}, "tools", "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]}, "tools",
     "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "must be an object"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "given twice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one output constraint"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
     "messages", "needs a name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}]},
     "messages", "are not JSON"),
])
def test_bad_tools_are_a_400_naming_the_field(server, client, body, param, says):
    before = server.llm.stats().prompt_tokens  # of every request the engine took
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                       extra_body={"tools": TOOLS, **body})
    assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body
    assert server.llm.stats().prompt_tokens == before


# ------------------------------------------------------------------------------------------- without a server
CALL = '<tool_call>{"name": "search", "arguments": {"query": "a}b</tool", "limit": 2}}</tool_call>'


def _streamed(text: str, cuts: list[int]) -> tuple[str, list[tuple[int, str | None, str]]]:
    """The content and call deltas (index, name, arguments piece) of `text` fed in pieces ending at `cuts`."""
    parser, content, deltas = ToolCallParser(), "", []
    bounds = sorted({c for c in cuts if 0 < c < len(text)} | {len(text)})
    start = 0
    for end in bounds:
        parsed = parser.feed(text[start:end], final=end == len(text))
        content += parsed.content
        deltas += [(d.index, d.function.name, d.function.arguments) for d in parsed.tool_calls]
        start = end
    return content, deltas


def _check_pieces_reassemble(text: str, cuts: list[int]) -> None:
    content, calls = parse_message(text)
    streamed, deltas = _streamed(text, cuts)
    assert (streamed or None if calls else streamed) == content
    names = [name for _, name, _ in deltas if name is not None]
    assert names == [c.function.name for c in calls]
    args = ["".join(a for i, _, a in deltas if i == k) for k in range(len(calls))]
    assert args == [c.function.arguments for c in calls]


@pytest.mark.parametrize("text", [
    "Sure: " + CALL + " done",
    CALL + CALL,
    'x <tool_call>{ "name":"search" ,"arguments" : {"query": "q"} }\n</tool_call>',
    "<tool_call>not a call</tool_call> and <tool_c",  # a tag that is no call, and a partial one, stay text
    "<tool_call>oops " + CALL,  # a tag that is no call is text, and a call after it still a call
    'cut <tool_call>{"name": "search", "arguments": {"query": "abc',  # cut short by max_tokens
])
def test_parser_pieces_reassemble_to_the_whole_parse(text):
    for step in (1, 3):
        _check_pieces_reassemble(text, list(range(step, len(text), step)))
    content, calls = parse_message(text)
    if text.startswith("Sure"):
        assert content == "Sure:  done" and json.loads(calls[0].function.arguments) == {"query": "a}b</tool",
                                                                                        "limit": 2}
    if text.startswith("<tool_call>not"):
        assert content == text and not calls
    if text.startswith("<tool_call>oops"):
        assert content == "<tool_call>oops " and [c.function.name for c in calls] == ["search"]


FRAGMENTS = ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": ', "{", "}", " ", "a", '"', "<", "\\"]


@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12), st.lists(st.integers(1, 80), max_size=6))
def test_any_text_in_any_pieces_parses_as_a_whole(fragments, cuts):
    _check_pieces_reassemble("".join(fragments), cuts)


def test_a_tag_that_cannot_be_a_call_is_released_at_once():
    parser = ToolCallParser()
    assert parser.feed("Hi <tool_").content == "Hi "
    assert parser.feed('call>{"name": "f"').content == ""  # may still be a call: held
    assert parser.feed(" and more").content == '<tool_call>{"name": "f" and more'
    assert not parser.calls


def test_a_call_is_emitted_whole_once_it_ends_and_only_if_it_parses():
    parser = ToolCallParser()
    for piece in ("Hi <tool_call>", '{"name": "search", "arguments": ', '{"query": "a</tool_call>"', ", "):
        assert not parser.feed(piece).tool_calls  # "</tool_call>" in a JSON string does not end the call
    assert parser.feed('"limit": 2}}').tool_calls == []  # nor does its JSON: its end tag does
    [delta] = parser.feed("</tool_call>").tool_calls
    assert (delta.index, delta.function.name) == (0, "search") and delta.id == parser.calls[0].id
    assert json.loads(delta.function.arguments) == {"query": "a</tool_call>", "limit": 2}
    # Unforced: a call whose arguments are not an object, or that the text cuts short, is text.
    bad = '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>'
    cut = '<tool_call>{"name": "f", "arguments": {"a": 1'
    for text in (bad + " then " + CALL, cut, bad + cut):
        content, calls = parse_message(text)
        assert content == text.replace(CALL, "") and len(calls) == text.count(CALL)
        _check_pieces_reassemble(text, list(range(1, len(text), 2)))
    # Forced: such text is dropped (the grammar writes no other); the calls before it stay.
    content, calls = parse_message(CALL + cut, forced=True)
    assert content is None and [c.function.arguments for c in calls] == [parse_message(CALL)[1][0].function.arguments]


def test_bounded_arguments_close_open_objects_and_bound_free_strings():
    schema = {"type": "object", "properties": {
        "name": {"type": "string"},
        "code": {"type": ["string", "null"], "minLength": 20},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "short": {"type": "string", "maxLength": 3},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "map": {"type": "object", "additionalProperties": {"type": "string"}},
        "mixed": {"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"extra": {"type": "integer"}}}]},
        "either": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
        "no": {"not": {"type": "string"}},
    }, "$defs": {"base": {"type": "object", "properties": {"id": {"type": "string"}}},
                 "point": {"properties": {"x": {"type": "number"}}}}}
    original = json.loads(json.dumps(schema))
    out = bounded_arguments(schema, 10)
    assert schema == original  # a copy
    props = out["properties"]
    assert out["additionalProperties"] is False and props["tags"]["items"]["additionalProperties"] is False
    assert out["$defs"]["point"]["additionalProperties"] is False  # an object by its properties
    assert "additionalProperties" not in out["$defs"]["base"]  # an allOf branch's: the other declares "extra"
    assert "additionalProperties" not in props["mixed"]["allOf"][1] and props["map"]["additionalProperties"] == {
        "type": "string", "maxLength": 10}
    assert [props[k].get("maxLength") for k in ("name", "code", "unit", "short")] == [10, 20, None, 3]
    assert out["$defs"]["base"]["properties"]["id"]["maxLength"] == 10 and props["no"] == {"not": {"type": "string"}}
    # The grammar (its $refs rebased under the call's "arguments") takes what the schema declares and no more
    # (without "no": llguidance does not take `not`).
    del schema["properties"]["no"]
    grammar = call_grammar([_request(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}]
                                     ).tools[0]], max_calls=1, max_string_length=10)
    head = '<tool_call>{"name": "f", "arguments": {'
    assert ord('"') in _allowed_after(grammar, head) and _allowed_after(grammar, head + '"') == sorted(
        {ord(k[0]) for k in schema["properties"]})
    assert _allowed_after(grammar, head + '"name": "' + "x" * 10) == [ord('"')]
    with pytest.raises(ValueError, match="max_string_length"):
        call_grammar(_request().tools, max_calls=1, max_string_length=0)


def _request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": TOOLS, **kwargs})


# A template with tool support, in the shape of Qwen 2.5's (tools in the system turn, calls in tags).
TOOL_TEMPLATE = """{% if tools %}<|system|>Tools:{% for t in tools %}
{{ t | tojson }}{% endfor %}<|end|>{% endif %}
{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{
{"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>{% endfor %}<|end|>
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_a_template_with_tools_renders_them_as_transformers_does():
    template = ChatTemplate(TOOL_TEMPLATE, model_template=True)
    assert template.supports_tools and not ChatTemplate(DEFAULT_TEMPLATE).supports_tools
    plan = tool_plan(_request())
    messages = template_messages(_request().messages, plan, supports_tools=True)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "oslo", "unit": "c"}  # an object
    text = template.render(messages, tools=plan.tools)
    transformers = pytest.importorskip("transformers.utils.chat_template_utils")
    assert text == transformers.render_jinja_template([messages], tools=plan.tools, chat_template=TOOL_TEMPLATE,
                                                      add_generation_prompt=True)[0][0]
    assert '"name": "search"' in text and '<tool_call>{"name": "get_weather", "arguments": {"city": "oslo"' in text


def test_a_template_without_tools_gets_the_preamble():
    plan = tool_plan(_request())
    messages = template_messages(_request().messages, plan, supports_tools=False)
    assert messages[0] == {"role": "system",
                           "content": TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in plan.tools))}
    assert messages[2]["content"] == ('<tool_call>{"name": "get_weather", "arguments": {"city": "oslo", "unit": '
                                      '"c"}}</tool_call>')
    assert tool_plan(_request(tool_choice="none")) is None
    assert template_messages(_request().messages, None, supports_tools=False)[0]["role"] == "user"
