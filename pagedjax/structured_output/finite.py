"""Lark grammars whose rules can never end, refused before the grammar library sees them.

A rule is *productive* when some expansion of it derives a finite text: an expansion is a sequence of items,
each a terminal (a "string", a /regex/, a special token, an embedded `%json` / `%regex` / `%lark` grammar), a
group or a reference to a rule, and it is productive when every item is (an item that may be absent, `x?`,
`x*`, `[x]`, `x{0,n}`, `x ~ 0..n`, always is; a group when one of its alternatives is; a rule when it is
productive). A rule that is not productive (`start: "a" start`: every expansion needs the rule again) matches
no finite text. llguidance compiles such a grammar (llguidance 1.9.1), lets the model start it, and then
forces the rule's text for ever: its parser gives up at 50,000 items in the first token's step with an error
that carries its internal state, so the request failed with a 500 (issue 63). `check_finite` refuses any
reachable rule that is not productive: with the grammar's `start` among them the grammar has no finite sentence
at all; otherwise a model that entered the rule could not leave it.

The scan reads llguidance's Lark dialect as far as productivity needs: rule definitions (`name:`, `?name:`,
`!name:`, `name.2:`, `name[max_tokens=4]:`, continuation lines), alternatives, groups, optional groups,
quantifiers, aliases (`-> name`), terminals, rule references (`@name` subgrammars and undefined, e.g.
`%import`ed, names taken as productive), and `%directive {...}` values skipped as JSON. A rule whose text it
cannot read, or that nests groups deeper than `MAX_NESTING`, is taken as productive: the check only refuses
what it has read, never a grammar it does not understand (the library then reports what is wrong with it).
Linear in the grammar's size per pass, at most one pass per rule.

    check_finite('start: "a" start')     # ValueError: rule 'start' never ends ...
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

MAX_NESTING = 100  # groups inside groups that the scan follows (deeper: the rule is taken as productive)

# A definition: at a line's start, an optional ?/! prefix, the name, an optional template's parameters, priority
# and attributes, then ':'.
_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\{[^}\n]*\})?(?:\.-?\d+)?(?:\[[^\]\n]*\])?[ \t]*:",
                         re.M)
_DIRECTIVE_LINE = re.compile(r"^[ \t]*%(?:ignore|import|declare|override|extend|llguidance)\b", re.M)
_TOKEN = re.compile(r"""
      (?P<space>\s+|//[^\n]*)
    | (?P<literal>"(?:[^"\\\n]|\\.)*"i?(?:\s*\.\.\s*"(?:[^"\\\n]|\\.)*")?|/(?:[^/\\\n]|\\.)+/[a-z]*
                 |<\[[^\]\n]*\]>|<[^<>\s]+>)
    | (?P<directive>%[a-z_]+)
    | (?P<name>@?[A-Za-z_][A-Za-z0-9_]*)
    | (?P<count>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
    | (?P<range>~\s*\d+(?:\s*\.\.\s*\d+)?)
    | (?P<alias>->\s*[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op>[|()\[\]?*+])
""", re.X)
_JSON = json.JSONDecoder()


class Unreadable(ValueError):
    """The scan does not understand this text (the rule is then taken as productive)."""


@dataclass
class _Group:
    """Alternatives (each a list of items); an item is ("terminal",), ("rule", name) or ("group", _Group), with
    whether it may be absent."""

    alternatives: list[list[tuple[tuple, bool]]] = field(default_factory=lambda: [[]])
    optional: bool = False  # a [...] group


def _parse(body: str) -> _Group:
    """A rule's expansions, read iteratively (no recursion: groups nest as deep as the text says, up to
    MAX_NESTING); Unreadable for what the scan does not take."""
    stack = [_Group()]
    i = 0
    while i < len(body):
        m = _TOKEN.match(body, i)
        if m is None:
            raise Unreadable(body[i:i + 20])
        kind, text, i = m.lastgroup, m.group(), m.end()
        items = stack[-1].alternatives[-1]
        if kind in ("space", "alias"):
            continue
        if kind == "literal":
            items.append((("terminal",), False))
        elif kind == "directive":  # %json {...}, %regex {...}, %lark {...}: an embedded grammar's value
            start = len(body) - len(body[i:].lstrip())
            try:
                _, i = _JSON.raw_decode(body, start)
            except (ValueError, RecursionError):
                raise Unreadable(text) from None
            items.append((("terminal",), False))
        elif kind == "name":
            items.append((("terminal",) if text.startswith("@") else ("rule", text), False))
        elif kind in ("count", "range"):
            numbers = re.findall(r"\d+", text)
            if not items or not numbers:
                raise Unreadable(text)
            if int(numbers[0]) == 0 or (kind == "count" and text.replace(" ", "").startswith("{,")):
                items[-1] = (items[-1][0], True)
        elif text in "?*":
            if not items:
                raise Unreadable(text)
            items[-1] = (items[-1][0], True)
        elif text == "+":
            if not items:
                raise Unreadable(text)
        elif text == "|":
            stack[-1].alternatives.append([])
        elif text in "([":
            if len(stack) > MAX_NESTING:
                raise Unreadable("nesting")
            stack.append(_Group(optional=text == "["))
        else:  # ")" or "]"
            group = stack.pop()
            if not stack or group.optional != (text == "]"):
                raise Unreadable(text)
            stack[-1].alternatives[-1].append((("group", group), group.optional))
    if len(stack) != 1:
        raise Unreadable("an unclosed group")
    return stack[0]


def _productive(group: _Group, productive: set[str], defined: set[str]) -> bool:
    """Whether some alternative of `group` has only items that can end, given the rules known to be
    productive (a name not `defined` in the grammar is taken as one)."""
    def item_ends(item: tuple, optional: bool) -> bool:
        if optional or item[0] == "terminal":
            return True
        if item[0] == "rule":
            return item[1] in productive or item[1] not in defined
        return _productive(item[1], productive, defined)

    return any(all(item_ends(item, optional) for item, optional in alternative) for alternative in group.alternatives)


def _references(group: _Group) -> set[str]:
    names: set[str] = set()
    todo = [group]
    while todo:
        g = todo.pop()
        for alternative in g.alternatives:
            for item, _ in alternative:
                if item[0] == "rule":
                    names.add(item[1])
                elif item[0] == "group":
                    todo.append(item[1])
    return names


def _definitions(grammar: str) -> dict[str, str]:
    """Each rule's (and terminal's) name -> its body's text, in order; a name defined twice is the library's
    error to report (the last body is kept)."""
    starts = [(m.start(), m.end(), m.group(1)) for m in _DEFINITION.finditer(grammar)]
    ends = sorted([s for s, _, _ in starts] + [m.start() for m in _DIRECTIVE_LINE.finditer(grammar)] + [len(grammar)])
    out = {}
    for start, body_start, name in starts:
        end = next(e for e in ends if e > start)
        out[name] = grammar[body_start:end]
    return out


def check_finite(grammar: str, start: str = "start") -> None:
    """ValueError naming a rule that no finite text matches and that the text can reach from `start` (all rules
    when there is no `start` rule); see the module docstring."""
    bodies = _definitions(grammar)
    parsed: dict[str, _Group | None] = {}
    for name, body in bodies.items():
        try:
            parsed[name] = _parse(body)
        except Unreadable:
            parsed[name] = None  # taken as productive
    defined = set(parsed)
    productive = {name for name, group in parsed.items() if group is None}
    changed = True
    while changed:
        changed = False
        for name, group in parsed.items():
            if name not in productive and _productive(group, productive, defined):
                productive.add(name)
                changed = True
    if len(productive) == len(parsed):
        return
    reachable, todo = set(), [start] if start in parsed else list(parsed)
    while todo:
        name = todo.pop()
        if name in reachable or name not in parsed:
            continue
        reachable.add(name)
        if parsed[name] is not None:
            todo.extend(_references(parsed[name]))
    stuck = [name for name in parsed if name in reachable and name not in productive]
    if not stuck:
        return
    which = ", ".join(repr(name) for name in stuck[:5]) + (f" and {len(stuck) - 5} more" if len(stuck) > 5 else "")
    whole = ": the grammar has no finite sentence" if start in stuck else ""
    if len(stuck) == 1:
        raise ValueError(f"rule {which} never ends: each of its expansions needs {which} again, so no finite text "
                         f"matches it{whole}; give it an alternative that ends")
    raise ValueError(f"rules {which} never end: each of their expansions needs one of them again, so no finite "
                     f"text matches them{whole}; give one of them an alternative that ends")
