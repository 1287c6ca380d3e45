"""What an output constraint may ask of the grammar compiler, checked in Python before any native code sees it.

llguidance compiles recursively on the calling thread's stack and bounds neither the nesting it reaches through
`$ref`s nor chains of grammar rules. Measured with llguidance 1.9.1 on an 8 MiB stack: a chain of 1,000 `$ref`s
(`$defs` d0 -> d1 -> ...; 900 compile) and a right-recursive Lark grammar of 3,000 rules (2,500 compile) overflow
it: SIGSEGV, the whole server gone. 100,000 choices take 15 s to compile; a pattern of 100,000 alternatives 0.5 s.
Each limit of `StructuredLimits` bounds one such cost; a constraint past one is refused (`LimitError`, the
server's 400) naming the limit and its value. The defaults stay well inside the measured failures (a $ref chain
of 42 against 900; 512 rules against 2,500; 1,024 choices compile in 5 ms) and take the schemas OpenAI's
structured outputs take (10 levels of nesting, 1,000 enum values, 128 tools) up to 64 KiB each.

These checks are the first guard; `pagedjax.structured_output.isolation` is the second (each new constraint is
test-compiled in a worker process, which may crash or run out of time, before the server compiles it).

    limits = StructuredLimits(max_schema_depth=64)
    check_structured(StructuredOutput(json=schema), limits)        # LimitError, or None
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedjax.config.structured import DEFAULT_LIMITS, StructuredLimits  # noqa: F401 - re-exported
from pagedjax.errors import InvalidRequest
from pagedjax.sampling_params import StructuredOutput


class LimitError(InvalidRequest):
    """A constraint over one of `StructuredLimits`: what is over (`detail`), the limit's name and its value; a
    request error about its constraint (param "structured", code `structured_output_limit`)."""

    code = "structured_output_limit"

    def __init__(self, detail: str, limit: str, value: int):
        super().__init__(f"{detail}, over the limit {limit} = {value:,} (--{limit.replace('_', '-')})",
                         param="structured")
        self.detail, self.limit, self.value = detail, limit, value

    def within(self, where: str) -> LimitError:
        """The same error about a part of the request (`where`: e.g. "tools[2].function.parameters")."""
        return LimitError(f"{where}: {self.detail}", self.limit, self.value)


def _check(limits: StructuredLimits, name: str, got: int, detail: str) -> None:
    value = getattr(limits, name)
    if got > value:
        raise LimitError(detail.format(got=f"{got:,}"), name, value)


def check_structured(structured: StructuredOutput, limits: StructuredLimits) -> None:
    """LimitError if `structured` is over a limit (its message says what; the caller prefixes the field)."""
    kind = structured.kind
    if kind == "json":
        _check(limits, "max_schema_bytes", len(structured.json), "the schema has {got} bytes")
        check_schema(json.loads(structured.json), limits)
    elif kind == "regex":
        check_regex(structured.regex, limits, "the regex")
    elif kind == "choice":
        _check(limits, "max_choices", len(structured.choice), "{got} choices")
        _check(limits, "max_choice_bytes", sum(len(c.encode()) for c in structured.choice),
               "the choices have {got} bytes")
    elif kind == "grammar":
        check_grammar(structured.grammar, limits)


def check_tools(parameters: list[dict | None], limits: StructuredLimits) -> None:
    """LimitError if the tools (their `parameters` schemas, None for none) are over a limit: their number, each
    schema, and all schemas together (a forced call's grammar holds them all)."""
    _check(limits, "max_tools", len(parameters), "{got} tools")
    total = 0
    for i, schema in enumerate(parameters):
        if schema is None:
            continue
        where = f"tools[{i}].function.parameters"
        try:
            text = json.dumps(schema, separators=(",", ":"))
        except RecursionError:
            raise LimitError(f"{where} nests too deeply to serialize", "max_schema_depth",
                             limits.max_schema_depth) from None
        total += len(text)
        try:
            _check(limits, "max_schema_bytes", len(text), "the schema has {got} bytes")
            check_schema(schema, limits)
        except LimitError as e:
            raise e.within(where) from None
    _check(limits, "max_schema_bytes", total, "the tools' parameters have {got} bytes together")


# ------------------------------------------------------------------------------------------------ schemas
def check_schema(schema: Any, limits: StructuredLimits) -> None:
    """LimitError if the (parsed) JSON schema is over a limit of depth, $refs, enums or patterns. Iterative (a
    schema nested past Python's recursion limit is measured, not a RecursionError); linear in its size."""
    nodes: list[Any] = []  # the schema's objects and arrays
    index: dict[int, int] = {}  # id(container) -> its node
    edges: list[list[int]] = []  # node -> the containers in it, and for a {"$ref": ...} what it points to
    refs: list[tuple[int, str]] = []
    enum_values = 0

    def add(obj) -> int:
        index[id(obj)] = len(nodes)
        nodes.append(obj)
        edges.append([])
        return len(nodes) - 1

    add(schema)
    todo = [0] if isinstance(schema, dict | list) else []
    while todo:
        i = todo.pop()
        obj = nodes[i]
        values = obj.values() if isinstance(obj, dict) else obj
        for value in values:
            if isinstance(value, dict | list):
                j = add(value)
                edges[i].append(j)
                todo.append(j)
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("$ref"), str):
            refs.append((i, obj["$ref"]))
        if isinstance(obj.get("enum"), list):
            enum_values += len(obj["enum"])
        if isinstance(obj.get("pattern"), str):
            check_regex(obj["pattern"], limits, "a pattern")
        if isinstance(obj.get("patternProperties"), dict):
            for key in obj["patternProperties"]:
                check_regex(key, limits, "a patternProperties key")
    _check(limits, "max_refs", len(refs), "the schema has {got} $refs")
    _check(limits, "max_enum_values", enum_values, "the schema's enums hold {got} values")
    is_ref = [False] * len(nodes)
    for i, ref in refs:
        target = _local_target(schema, ref)
        if isinstance(target, dict | list) and id(target) in index:
            edges[i].append(index[id(target)])
            is_ref[i] = True
    depth, ref_depth = _longest_paths(edges, is_ref)
    _check(limits, "max_schema_depth", depth, "the schema nests {got} levels deep (counting through its $refs)")
    _check(limits, "max_ref_depth", ref_depth, "the schema follows {got} $refs in a row")


def _local_target(schema: Any, ref: str) -> Any:
    """What a local `$ref` ("#", "#/$defs/name", JSON pointer escapes) points to in `schema`, or None (another
    document, or nothing: the compiler reports those)."""
    if not ref.startswith("#"):
        return None
    target = schema
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def _longest_paths(edges: list[list[int]], is_ref: list[bool]) -> tuple[int, int]:
    """The longest path from node 0, in nodes and in $ref nodes, of a graph that may have cycles (a recursive
    schema): Tarjan's strongly connected components, each counted whole (a compiler walks a cycle's nodes once:
    an upper bound on what it walks), then the longest path of the acyclic graph of components."""
    n = len(edges)
    order, low, component = [-1] * n, [0] * n, [-1] * n
    stack: list[int] = []
    on_stack = [False] * n
    components: list[list[int]] = []  # in reverse topological order: a component after all it reaches
    counter = 0
    work = [(0, 0)]
    while work:
        v, k = work.pop()
        if k == 0:
            order[v] = low[v] = counter
            counter += 1
            stack.append(v)
            on_stack[v] = True
        if k < len(edges[v]):
            work.append((v, k + 1))
            w = edges[v][k]
            if order[w] < 0:
                work.append((w, 0))
            elif on_stack[w]:
                low[v] = min(low[v], order[w])
            continue
        if low[v] == order[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack[w] = False
                component[w] = len(components)
                members.append(w)
                if w == v:
                    break
            components.append(members)
        if work:  # v's caller takes its low link
            parent = work[-1][0]
            low[parent] = min(low[parent], low[v])
    depth = [0] * len(components)
    ref_depth = [0] * len(components)
    for c, members in enumerate(components):
        below = [component[w] for v in members for w in edges[v] if component[w] != c]
        depth[c] = len(members) + max((depth[d] for d in below), default=0)
        ref_depth[c] = sum(is_ref[v] for v in members) + max((ref_depth[d] for d in below), default=0)
    return depth[component[0]], ref_depth[component[0]]


# ---------------------------------------------------------------------------------------- regexes, grammars
_COUNT = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")  # {m}, {m,n}, {m,}, {,n}


def check_regex(pattern: str, limits: StructuredLimits, what: str) -> None:
    _check(limits, "max_pattern_length", len(pattern), what + " has {got} characters")
    _check(limits, "max_regex_repeat", repeat_product(pattern), what + " repeats {got} times (counted repetitions "
                                                                       "multiplied)")


def repeat_product(text: str, *, lark: bool = False) -> int:
    """The largest product of nested counted repetitions (`{m}`, `{m,n}`, `{m,}`, `{,n}`: by their largest bound) in a
    regex, or with `lark` in a Lark grammar (its `[...]` and `(...)` groups; its "strings" and /regexes/, the
    latter measured as regexes). Linear in the text."""
    groups = [1]  # per open group: the largest product inside it so far
    last = 1  # the product of the atom a quantifier would repeat
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "{" and (m := _COUNT.match(text, i)) and (m.group(1) or m.group(2)):
            bound = int(m.group(2) or m.group(1))
            last *= max(bound, 1)
            groups[-1] = max(groups[-1], last)
            i = m.end()
            continue
        if c == "\\":
            i += 2
            last = 1
        elif c == "(" or (lark and c == "["):
            groups.append(1)
            i += 1
            continue
        elif c == ")" or (lark and c == "]"):
            last = groups.pop() if len(groups) > 1 else 1
            i += 1
        elif c == "[":  # a regex's character class: one atom
            i = _class_end(text, i)
            last = 1
        elif lark and c == '"':
            i = _literal_end(text, i, '"')
            last = 1
        elif lark and text.startswith("//", i):  # a comment, to the end of its line
            end = text.find("\n", i)
            i = n if end < 0 else end
            last = 1
        elif lark and c == "/":
            end = _literal_end(text, i, "/")
            last = repeat_product(text[i + 1:end - 1])
            i = end
        else:
            i += 1
            last = 1
        groups[-1] = max(groups[-1], last)
    return max(groups)


def _class_end(text: str, i: int) -> int:
    """The index past a regex character class starting at `text[i]` ("[")."""
    j = i + 1
    if j < len(text) and text[j] == "^":
        j += 1
    if j < len(text) and text[j] == "]":
        j += 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _literal_end(text: str, i: int, quote: str) -> int:
    """The index past a Lark literal ("string" or /regex/) starting at `text[i]`."""
    j = i + 1
    while j < len(text) and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return j + 1


_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:", re.M)
_JSON_DIRECTIVE = re.compile(r"%json\s*")
_REGEX_LITERAL = re.compile(r'/(?:[^/\\\n]|\\.)+/')


def check_grammar(grammar: str, limits: StructuredLimits) -> None:
    """LimitError if a Lark grammar is over a limit: its size, its rules, its counted repetitions, its /regexes/,
    and each JSON schema it embeds (`%json {...}`, checked as a schema)."""
    _check(limits, "max_grammar_bytes", len(grammar.encode()), "the grammar has {got} bytes")
    _check(limits, "max_grammar_rules", len(_RULE.findall(grammar)), "the grammar has {got} rules")
    decoder = json.JSONDecoder()
    rest, start = [], 0
    for m in _JSON_DIRECTIVE.finditer(grammar):
        if m.start() < start:
            continue
        try:
            schema, end = decoder.raw_decode(grammar, m.end())
        except (ValueError, RecursionError):
            continue  # not JSON: the compiler's parse error to report
        check_schema(schema, limits)
        rest.append(grammar[start:m.start()])
        start = end
    rest.append(grammar[start:])
    lark = "".join(rest)  # the grammar without its schemas (their braces are not repetitions)
    for m in _REGEX_LITERAL.finditer(lark):
        _check(limits, "max_pattern_length", len(m.group()) - 2, "a /regex/ of the grammar has {got} characters")
    _check(limits, "max_regex_repeat", repeat_product(lark, lark=True),
           "the grammar repeats {got} times (counted repetitions multiplied)")
