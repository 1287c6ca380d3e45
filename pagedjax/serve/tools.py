"""Tool calling in `/v1/chat/completions`: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The call format is Hermes / Qwen's, one call per tag, the JSON written as `json.dumps` writes it:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

- `tool_choice` "none": the tools are not shown to the model and nothing is parsed (as if none were given).
- "auto" (the default when tools are given): the model is not constrained; it answers in text, and the tagged
  calls it writes become `message.tool_calls` (the text around them stays `content`). A tag not followed by
  `{"name": "...", "arguments": `, or whose arguments are not a JSON object closed by `}</tool_call>`, is text.
- "required" or a named function: the output is constrained (an llguidance Lark grammar, through
  `SamplingParams.structured`) to one tagged call of the offered functions, whose `arguments` validate against
  the function's `parameters` schema made finite (`bounded_arguments`: an object that does not say
  `additionalProperties` takes no other keys, and a string without `maxLength` has at most
  `max_string_length` characters, `pagedjax-serve --max-tool-string-length`, default 4,096), so even a random
  model writes a valid call that ends; then the end of the text. With "required" and `parallel_tool_calls`
  (OpenAI's default) the grammar allows, after each complete call, only the end or another call, up to
  `max_parallel_calls` calls (`--max-parallel-tool-calls`, default 4): a model that would chain calls for ever
  ends there instead of running into `max_tokens`. A named function is called once. Such a choice ends with
  finish reason "tool_calls" unless its token budget cuts a call short ("length", with the calls completed
  before); its `content` is None either way: the grammar allows no text outside the calls, and a tag cut short
  is not text (`ToolCallParser(forced=True)`).

No response carries a call whose arguments do not parse: a call is emitted whole (id, name and arguments in one
delta when streamed) once its `</tool_call>` has come and its arguments are a JSON object. A call that
`max_tokens` cuts short is dropped from a forced choice (finish reason "length" says the text was cut, as the
`openai` client's `parse` helpers read it: they raise `LengthFinishReasonError`), and is text in an "auto" one.

A chat template that reads `tools` (as Hugging Face templates with tool support do) gets OpenAI's tool dicts,
and assistant messages' `tool_calls` with their arguments as objects (transformers' convention). Any other
template gets `TOOLS_PREAMBLE` as (the start of) the system message, and assistant calls written in the tagged
format into their content. A finished choice with a call has `finish_reason` "tool_calls" (unless cut by length).

`ToolCallParser` reads a choice's text as it grows: the content, then each call once it is complete; a whole
response is the same parser fed once, so a stream's deltas always reassemble to the non-streamed message.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from pagedjax.sampling_params import StructuredOutput
from pagedjax.serve.admission import DEFAULT_MAX_PARALLEL_TOOL_CALLS, DEFAULT_MAX_TOOL_STRING_LENGTH
from pagedjax.serve.errors import bad_request
from pagedjax.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    TextContent,
    ToolCall,
)
from pagedjax.structured_output.isolation import JSON_STYLE
from pagedjax.structured_output.limits import DEFAULT_LIMITS, LimitError, StructuredLimits, check_tools

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS_PREAMBLE = (
    "You may call these functions (OpenAI tool definitions; `parameters` is the JSON schema of the arguments):\n"
    "{tools}\n"
    'To call a function, reply with <tool_call>{{"name": <function name>, "arguments": <arguments object>}}'
    "</tool_call>, one tag per call."
)
# A call's head, up to its arguments' first character (any JSON whitespace, as an unconstrained model writes it),
# and every prefix of one (a tag whose text stops being one is text, decided as soon as it is known).
_HEAD_PARTS = [r"\s*", r"\{", r"\s*", *'"name"', r"\s*", ":", r"\s*", '"', r'(?:[^"\\]|\\.)*\\?', '"', r"\s*",
               ",", r"\s*", *'"arguments"', r"\s*", ":", r"\s*"]
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _prefixes_of(parts: list[str]) -> re.Pattern:
    """A pattern whose full matches are the prefixes of the concatenation of `parts` (each a regex matching a
    piece that may itself stop anywhere: one character, or a starred class)."""
    nested = ""
    for part in reversed(parts):
        nested = f"(?:{part}{nested})?"
    return re.compile(nested)


_HEAD_PREFIX = _prefixes_of(_HEAD_PARTS)


@dataclass(frozen=True)
class ToolPlan:
    """A request's validated tools ("none" has no plan)."""

    tools: list[dict]  # OpenAI's tool dicts, as the chat template sees them
    constraint: StructuredOutput | None  # the forced call's grammar ("required", "named"); None for "auto"
    # (where, JSON text) of each tool's parameters schema: the compile stage has the grammar library validate
    # them (`OpenAIServing.compile`), in a worker process, as the schemas may crash it
    schemas: tuple[tuple[str, str], ...] = ()


def tool_plan(request: ChatCompletionRequest, limits: StructuredLimits = DEFAULT_LIMITS, *,
              max_parallel_calls: int = DEFAULT_MAX_PARALLEL_TOOL_CALLS,
              max_string_length: int = DEFAULT_MAX_TOOL_STRING_LENGTH) -> ToolPlan | None:
    """The request's tools, checked (400 naming `tools` or `tool_choice`; their schemas against `limits`, in
    Python: the grammar library's validation of them is the compile stage's), or None when it offers none to
    call. A forced choice makes at most `max_parallel_calls` calls with `parallel_tool_calls`, one without, each
    under `bounded_arguments(parameters, max_string_length)`."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise bad_request(f"tool_choice {_choice_name(choice)!r} needs tools", "tool_choice")
        return None
    try:
        check_tools([t.function.parameters for t in request.tools], limits)
    except LimitError as e:
        raise bad_request(str(e), "tools", "structured_output_limit") from None
    seen: set[str] = set()
    for i, tool in enumerate(request.tools):
        fn = tool.function
        if fn.name in seen:
            raise bad_request(f"tools[{i}].function.name: {fn.name!r} is given twice", "tools")
        seen.add(fn.name)
        if fn.parameters is not None:
            if fn.parameters.get("type", "object") != "object":
                raise bad_request(f"tools[{i}].function.parameters: the arguments must be an object (type "
                                  f"\"object\"), got type {fn.parameters.get('type')!r}", "tools")
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in request.tools]
    schemas = tuple((f"tools[{i}].function.parameters", json.dumps(t.function.parameters))
                    for i, t in enumerate(request.tools) if t.function.parameters is not None)
    if choice is None or choice == "auto":
        return ToolPlan(tools, None, schemas)
    if choice == "required":
        max_calls = max_parallel_calls if request.parallel_tool_calls else 1
        return ToolPlan(tools, call_grammar(request.tools, max_calls=max_calls, max_string_length=max_string_length),
                        schemas)
    named = [t for t in request.tools if t.function.name == choice.function.name]
    if not named:
        raise bad_request(f"tool_choice.function.name: no tool is named {choice.function.name!r} (tools: "
                          f"{', '.join(sorted(seen))})", "tool_choice")
    return ToolPlan(tools, call_grammar(named, max_calls=1, max_string_length=max_string_length), schemas)


def _choice_name(choice) -> str:
    return choice if isinstance(choice, str) else f"function {choice.function.name}"


def call_grammar(tools, *, max_calls: int, max_string_length: int = DEFAULT_MAX_TOOL_STRING_LENGTH
                 ) -> StructuredOutput:
    """A Lark grammar (llguidance's dialect) of 1 to `max_calls` tagged calls in a row, each of one of `tools`
    (ChatTool models), and nothing else: each call's JSON is a `%json` schema with the name as a constant and the
    arguments under `bounded_arguments(parameters, max_string_length)`, their local `$ref`s ("#/$defs/x", "#")
    rebased to where the arguments are in the call's schema. The text may end (EOS) after each complete call and
    nowhere else; after the last allowed call only EOS is."""
    for name, value in (("max_calls", max_calls), ("max_string_length", max_string_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"call_grammar: {name} must be an int >= 1, got {value!r}")
    rules = []
    for i, tool in enumerate(tools):
        arguments = _rebased(bounded_arguments(tool.function.parameters or NO_PARAMETERS, max_string_length),
                             "/properties/arguments")
        schema = {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
                  "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_STYLE}
        rules.append(f"fn_{i}: %json {json.dumps(schema)}")
    start = "start: call" if max_calls == 1 else f"start: call{{1,{max_calls}}}"
    call = f'call: "{CALL_START}" ({" | ".join(f"fn_{i}" for i in range(len(tools)))}) "{CALL_END}"'
    return StructuredOutput(grammar="\n".join([start, call, *rules]))


# JSON Schema keywords whose value is one schema, a list of schemas, or a map of names to schemas (2020-12, and
# draft 7's `definitions`, list-valued `items` and `additionalItems`). `not` and `if` are left out: a schema under
# them does not say what the value may be, and bounding it would change what they exclude or select.
_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "unevaluatedItems",
           "unevaluatedProperties", "then", "else")
_SCHEMAS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords that apply other schemas to the same value: an object schema with one of them may take keys the others
# declare, so it is not closed (and a branch of allOf, then, else or dependentSchemas is never closed either).
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else", "not", "dependentSchemas",
             "dependencies", "unevaluatedProperties")
_PARTIAL_BRANCHES = ("allOf", "then", "else", "dependentSchemas")
# Keywords that give an object schema its own keys: an anyOf / oneOf branch under such a schema is not closed.
_OBJECT_KEYS = ("properties", "patternProperties", "additionalProperties", "required")


def _subschemas(node: dict) -> list[Any]:
    """The schemas directly inside schema `node`, those under `not` and `if` included."""
    out = [node[key] for key in (*_SCHEMA, "not", "if") if isinstance(node.get(key), dict)]
    out += [branch for key in _SCHEMAS if isinstance(node.get(key), list) for branch in node[key]]
    out += [sub for key in _SCHEMA_MAPS if isinstance(node.get(key), dict) for sub in node[key].values()]
    return out


def _rebased(schema: Any, base: str) -> Any:
    """`schema` (changed in place) with each local `$ref` ("#", "#/$defs/x") pointing under `base` (a JSON
    pointer, "/properties/arguments"): the same target once the schema is embedded there."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            node["$ref"] = "#" + base + ref[1:]
        todo.extend(_subschemas(node))
    return schema


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(kind, list) \
        else set()


def bounded_arguments(schema: Any, max_string_length: int) -> Any:
    """A forced call's `parameters` schema made finite (a copy; `schema` is left as it is), so that a model cannot
    write one call for ever (a free key after a free key, or a string that never closes):

    - an object schema (`"type": "object"`, or `properties` without a type) that says nothing of
      `additionalProperties` gets `"additionalProperties": false`: only its declared keys (xgrammar's strict mode,
      vLLM's default for constrained JSON, and what OpenAI's strict function calling asks of every object). An
      object combined with other schemas (`allOf`, `anyOf`, `oneOf`, `$ref`, `if` / `then` / `else`, ...) or
      that is a branch of `allOf` / `then` / `else` / `dependentSchemas` stays open: a key it does not declare
      may be another schema's;
    - a string schema (`"type": "string"`, or a list of types with "string") without `maxLength`, `enum` or
      `const` gets `"maxLength": max(max_string_length, minLength)`.

    A schema's own `additionalProperties` and `maxLength` are kept, and nothing under `not` or `if` changes. A
    value the schema leaves free of type (`{}`, `true`) is any JSON and stays unbounded (the grammar library
    cannot bound the keys of a free object): such a call may still run until `max_tokens`, which then drops it.
    A `$defs` (or `definitions`) entry that a branch of `allOf` / `then` / `else` / `dependentSchemas` refers to
    stays open as well (through a chain of `$ref`s too). Iterative: a schema as deep as `StructuredLimits`
    allows is walked without recursion."""
    out = copy.deepcopy(schema)
    shared = _shared_definitions(out)
    todo: list[tuple[Any, bool]] = [(out, True)]  # (a schema, whether it may be closed)
    while todo:
        node, closable = todo.pop()
        if not isinstance(node, dict):
            continue
        types = _types(node)
        if closable and ("object" in types or (not types and "properties" in node)) \
                and "additionalProperties" not in node and not any(k in node for k in _COMBINED):
            node["additionalProperties"] = False
        if "string" in types and "maxLength" not in node and "enum" not in node and "const" not in node:
            least = node.get("minLength")
            node["maxLength"] = max(max_string_length, least if isinstance(least, int) else 0)
        own_keys = any(k in node for k in _OBJECT_KEYS)
        for key in _SCHEMA:
            if isinstance(node.get(key), dict):
                todo.append((node[key], key not in _PARTIAL_BRANCHES))
        for key in _SCHEMAS:
            if isinstance(node.get(key), list):
                todo.extend((branch, key not in _PARTIAL_BRANCHES and not own_keys) for branch in node[key])
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                todo.extend((sub, key not in _PARTIAL_BRANCHES and f"#/{key}/{name}" not in shared)
                            for name, sub in node[key].items())
    return out


def _shared_definitions(schema: Any) -> set[str]:
    """The `$ref`s ("#/$defs/<name>", "#/definitions/<name>") that a branch of `allOf` / `then` / `else` /
    `dependentSchemas` refers to, and those such a definition refers to in turn (a definition that is itself a
    `$ref`): definitions that share their value with other schemas."""
    refs: set[str] = set()
    defs: dict[str, Any] = {}
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                defs.update((f"#/{key}/{name}", sub) for name, sub in node[key].items())
        for key in _PARTIAL_BRANCHES:
            value = node.get(key)
            branches = value if isinstance(value, list) else value.values() if key == "dependentSchemas" and \
                isinstance(value, dict) else [value]
            refs.update(b["$ref"] for b in branches if isinstance(b, dict) and isinstance(b.get("$ref"), str))
        todo.extend(node.values())
    todo_refs = list(refs)
    while todo_refs:
        target = defs.get(todo_refs.pop())
        ref = target.get("$ref") if isinstance(target, dict) else None
        if isinstance(ref, str) and ref not in refs:
            refs.add(ref)
            todo_refs.append(ref)
    return refs


# ---------------------------------------------------------------------------------------------- the prompt
def template_messages(messages: list[ChatMessage], plan: ToolPlan | None, *, supports_tools: bool,
                      content_parts: bool = False) -> list[dict]:
    """The messages as the chat template gets them (see the module docstring for the two kinds of template). A
    message with images has its content as a list of `{"type": "text", "text"}` and `{"type": "image"}` parts (as
    transformers gives Hugging Face templates); with `content_parts`, every message's text is a list of parts
    (`pagedjax.serve.chat_template`), else a string."""
    out = []
    for m in messages:
        content = _parts(m) if m.image_parts() else m.text()
        d = {"role": m.role, "content": content, **({"name": m.name} if m.name else {})}
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [_replayed_call(c) for c in m.tool_calls]
            if supports_tools:
                d["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                    "function": {"name": name, "arguments": args}} for c, (name, args) in
                                   zip(m.tool_calls, calls, strict=True)]
            else:
                d["content"] += "".join(f"{CALL_START}{json.dumps({'name': n, 'arguments': a})}{CALL_END}"
                                        for n, a in calls)
        out.append(d)
    if plan is not None and not supports_tools:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{preamble}\n\n{out[0]['content']}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    if content_parts:
        out = [{**d, "content": [{"type": "text", "text": d["content"]}] if d["content"] else []}
               if isinstance(d["content"], str) else d for d in out]
    return out


def _parts(message: ChatMessage) -> list[dict]:
    return [{"type": "text", "text": part.text} if isinstance(part, TextContent) else {"type": "image"}
            for part in message.content]


def _replayed_call(call: dict) -> tuple[str, object]:
    """(name, arguments) of an assistant message's earlier call; its arguments (JSON text) as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("messages: an assistant message's tool_calls[].function needs a name", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise bad_request(f"messages: the arguments of tool call {fn['name']!r} are not JSON: {args[:80]!r}",
                              "messages") from None
    return fn["name"], args


# ------------------------------------------------------------------------------------------------- output
@dataclass
class ParsedDelta:
    """What a choice's new text adds to its message: content, and the tool calls completed in it (each whole)."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """One choice's text -> content and tool calls, incrementally (see the module docstring).

    Invariants: the content emitted so far is a prefix of what the whole text gives, and each call is emitted
    once, whole (its id, name and arguments in one `DeltaToolCall`), when its `</tool_call>` has come and its
    arguments parse as a JSON object: no call is ever emitted that the rest of the text could still cut short.
    Text that may still turn out to be part of a call (a partial `<tool_call>`, a call's head, its arguments) is
    held until it is decided or the text ends (`final`). The end of a call is the first `</tool_call>` after its
    arguments that is not inside one of their JSON strings; a call whose text there is not
    `<arguments object>}` (whitespace allowed) is not a call but text.

    `forced`: the text is a forced choice's (a grammar of calls only, see the module docstring), so what is held
    when it ends (a tag, a call's head or a call cut short by `max_tokens`) is dropped instead of becoming
    content."""

    def __init__(self, *, forced: bool = False):
        self.forced = forced
        self.calls: list[ToolCall] = []
        self._state = "text"  # "text" | "head" (inside a tag, before the arguments) | "args"
        self._buf = ""  # text not emitted yet ("args": the call's text from its arguments on)
        self._tag = ""  # "args": the call's tag and head (text again if the call turns out not to be one)
        self._name = ""  # "args": the called function
        self._scan = 0  # "args": characters of _buf scanned for the call's end
        self._in_string = False  # "args": the scan is inside a JSON string ...
        self._escaped = False  # ... right after a backslash

    def feed(self, text: str, *, final: bool = False) -> ParsedDelta:
        """The message's new parts given `text`, the choice's next piece; `final` when the text is complete."""
        self._buf += text
        out = ParsedDelta()
        while getattr(self, f"_{self._state}")(out, final):
            pass
        return out

    def _text(self, out: ParsedDelta, final: bool) -> bool:
        at = self._buf.find(CALL_START)
        if at >= 0:
            out.content += self._buf[:at]
            self._buf, self._state = self._buf[at + len(CALL_START):], "head"
            return True
        keep = _partial_tag(self._buf, CALL_START)
        if final and not (self.forced and keep == len(self._buf)):
            keep = 0
        out.content += self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _head(self, out: ParsedDelta, final: bool) -> bool:
        m = _HEAD.match(self._buf)
        name = None
        if m is not None and m.end() < len(self._buf):  # the arguments have begun
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                name = None
        if name is not None:
            self._tag, self._name = CALL_START + self._buf[:m.end()], name
            self._buf, self._scan, self._in_string, self._escaped = self._buf[m.end():], 0, False, False
            self._state = "args"
            return True
        if final and self.forced and _HEAD_PREFIX.fullmatch(self._buf):  # a call's head cut short: no call
            self._buf, self._state = "", "text"
            return False
        if final or not _HEAD_PREFIX.fullmatch(self._buf):  # not a call after all: the tag is text (and what
            out.content += CALL_START                           # follows it is read as text again)
            self._state = "text"
            return True
        return False

    def _args(self, out: ParsedDelta, final: bool) -> bool:
        buf, i = self._buf, self._scan
        while i < len(buf):  # to the first </tool_call> outside the arguments' strings
            c = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c == "<" and buf.startswith(CALL_END, i):
                return self._close(out, i)
            elif c == "<" and CALL_END.startswith(buf[i:]):  # the text stops inside what may be the end tag
                break
            i += 1
        self._scan = i
        if final:  # cut short (by max_tokens): no call; an unforced choice's text
            if not self.forced:
                out.content += self._tag + buf
            self._buf, self._state = "", "text"
        return False

    def _close(self, out: ParsedDelta, end: int) -> bool:
        """The call's text ends at `end` (its `</tool_call>`): a call if it is `<arguments object>}`, else text."""
        region = self._buf[:end].rstrip()
        arguments = region[:-1].rstrip() if region.endswith("}") else ""  # the call object's own "}"
        try:
            is_object = isinstance(json.loads(arguments), dict)
        except (ValueError, RecursionError):
            is_object = False
        if is_object:
            call = ToolCall(id=f"call_{secrets.token_hex(12)}",
                            function=FunctionCall(name=self._name, arguments=arguments))
            self.calls.append(call)
            out.tool_calls.append(DeltaToolCall(index=len(self.calls) - 1, id=call.id, type="function",
                                                function=DeltaFunctionCall(name=self._name, arguments=arguments)))
        elif not self.forced:
            out.content += self._tag + self._buf[:end + len(CALL_END)]
        self._buf, self._state = self._buf[end + len(CALL_END):], "text"
        return True


def parse_message(text: str, *, forced: bool = False) -> tuple[str | None, list[ToolCall]]:
    """A whole choice's content (None when it only called tools, or is forced and has none: what its stream's
    content deltas join to) and tool calls; `forced` as `ToolCallParser`'s."""
    parser = ToolCallParser(forced=forced)
    content = parser.feed(text, final=True).content
    return (None if (parser.calls or forced) and not content else content), parser.calls


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish reason of a choice that called tools: "tool_calls" when it ended on its own."""
    return "tool_calls" if has_calls and reason == "stop" else reason
