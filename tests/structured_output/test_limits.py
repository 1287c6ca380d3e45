"""`StructuredLimits` checks (Python, before any native compile) and `CompileGuard` (the worker process that may
crash in the server's place)."""

from __future__ import annotations

import json
import time

import pydantic
import pytest

from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.sampling_params import StructuredOutput
from pagedjax.structured_output.isolation import (
    CompileGuard,
    CompileGuardConfig,
    CompileRefused,
    short_error,
    worker_tokenizer,
)
from pagedjax.structured_output.limits import (
    DEFAULT_LIMITS,
    LimitError,
    StructuredLimits,
    check_schema,
    check_structured,
    check_tools,
    repeat_product,
)
from tests.serve.test_hostile import ref_chain, right_recursive_grammar


def nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"items": schema}
    return schema


def refused(structured_or_schema, limits=DEFAULT_LIMITS) -> str | None:
    try:
        if isinstance(structured_or_schema, StructuredOutput):
            check_structured(structured_or_schema, limits)
        else:
            check_schema(structured_or_schema, limits)
    except LimitError as e:
        return e.limit
    return None


def test_real_schemas_pass():
    class Leaf(pydantic.BaseModel):
        name: str
        tags: list[str]

    class Node(pydantic.BaseModel):
        leaf: Leaf | None
        children: list[Node]  # recursive: a cycle of $refs is not a chain

    tree = {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"enum": [1, 2, 3]}}}
    for schema in (Node.model_json_schema(), tree, ref_chain(30), True, {}):
        assert refused(schema) is None, schema


@pytest.mark.parametrize("schema, limit", [
    (ref_chain(600), "max_refs"),
    (ref_chain(60), "max_schema_depth"),
    (nested(5000), "max_schema_depth"),  # deeper than Python's recursion limit
    ({"enum": list(range(600)), "anyOf": [{"enum": list(range(600))}]}, "max_enum_values"),
    ({"type": "string", "pattern": "a" * 5000}, "max_pattern_length"),
    ({"patternProperties": {"[a-z]{2000}": {}}}, "max_regex_repeat"),
])
def test_schemas_over_a_limit(schema, limit):
    assert refused(schema) == limit


def test_ref_depth_is_its_own_limit_and_every_limit_is_configurable():
    assert refused(ref_chain(10), StructuredLimits(max_ref_depth=5)) == "max_ref_depth"
    assert refused(ref_chain(600), StructuredLimits(max_refs=1000, max_schema_depth=10**4, max_ref_depth=1000,
                                                    max_schema_bytes=10**6)) is None
    with pytest.raises(ValueError, match="max_refs must be an int >= 1"):
        StructuredLimits(max_refs=0)
    try:
        check_schema(ref_chain(600), DEFAULT_LIMITS)
    except LimitError as e:
        assert str(e) == "the schema has 601 $refs, over the limit max_refs = 512 (--max-refs)"


@pytest.mark.parametrize("pattern, product", [
    ("[a-z]{1000}", 1000), ("(a{10}){20}", 200), ("((a{2}){3}b{7}){5}", 35), (r"\{5000}", 1), ("[{]{3}", 3),
    ("a{2,9}", 9), ("a{4,}", 4), ("a{,5}", 5), ("a{}", 1), ("(a|b{30})*", 30), ("", 1),
])
def test_repeat_product(pattern, product):
    assert repeat_product(pattern) == product


@pytest.mark.parametrize("grammar, limit", [
    (right_recursive_grammar(600), "max_grammar_rules"),
    (right_recursive_grammar(5000), "max_grammar_bytes"),
    ('start: ("a"{10}){200}', "max_regex_repeat"),
    ('start: ["a"{2000}]', "max_regex_repeat"),
    ("start: /[a-z]{2000}/", "max_regex_repeat"),
    (f"start: /{'a' * 5000}/", "max_pattern_length"),
    (f'start: "x" %json {json.dumps(ref_chain(600))}', "max_refs"),
    ('start: "a{5000}" // b{5000}\n', None),  # in a string and a comment: no repetition
    ('start: "x" %json {"type": "object", "properties": {"a": {"type": "string"}}}', None),
    (right_recursive_grammar(300), None),
])
def test_grammars(grammar, limit):
    assert refused(StructuredOutput(grammar=grammar)) == limit


def test_choices_and_tools():
    assert refused(StructuredOutput(choice=[f"c{i}" for i in range(2000)])) == "max_choices"
    assert refused(StructuredOutput(choice=["x" * 40_000, "y" * 40_000])) == "max_choice_bytes"
    with pytest.raises(LimitError, match="129 tools"):
        check_tools([None] * 129, DEFAULT_LIMITS)
    with pytest.raises(LimitError, match=r"^tools\[1\].function.parameters: the schema has 601 \$refs"):
        check_tools([None, ref_chain(600)], DEFAULT_LIMITS)
    big = {"type": "object", "description": "x" * 40_000}
    with pytest.raises(LimitError, match="the tools' parameters have .* bytes together"):
        check_tools([big, big], DEFAULT_LIMITS)


def test_short_error():
    assert short_error("thread panicked at src/x.rs:1\nstack backtrace:\n  0: ...").startswith("the grammar library")
    assert short_error("bad regex\nline 2") == "bad regex"
    assert len(short_error("x" * 10_000)) == 300


# ---------------------------------------------------------------------------------------------- the guard
@pytest.fixture(scope="module")
def guard():
    guard = CompileGuard(worker_tokenizer(ByteTokenizer(), 259, (257,)), CompileGuardConfig(workers=1, timeout_s=1.0))
    yield guard
    guard.close()


def test_a_crash_is_a_refusal_and_the_next_compile_gets_a_fresh_worker(guard):
    guard.check("json", '{"type": "string"}')
    deaths = guard.num_worker_deaths
    with pytest.raises(CompileRefused, match="died of SIGSEGV"):
        guard.check("json", json.dumps(ref_chain(1000)))
    assert guard.num_worker_deaths == deaths + 1
    compiles = guard.num_test_compiles
    with pytest.raises(CompileRefused, match="died of SIGSEGV"):  # the verdict is kept: no second crash
        guard.check("json", json.dumps(ref_chain(1000)))
    assert (guard.num_test_compiles, guard.num_worker_deaths) == (compiles, deaths + 1)
    guard.check("regex", "[a-z]{3}")
    with pytest.raises(CompileRefused, match="invalid regex"):
        guard.check("regex", "([")


def test_a_compile_past_the_time_limit_is_killed(guard):
    start = time.monotonic()
    with pytest.raises(CompileRefused, match="more than the 1 s limit"):
        guard.check("choice", [f"choice number {i}" for i in range(100_000)])  # 15 s to compile
    assert time.monotonic() - start < 3
    guard.check("choice", ["a", "b"])


def test_a_compile_past_the_memory_limit_is_a_refusal():
    guard = CompileGuard(None, CompileGuardConfig(workers=1, memory_bytes=150 * 2**20))
    try:
        guard.check("json", '{"type": "string"}')
        alternatives = {"type": "string", "pattern": "^(" + "|".join(f"w{i}" for i in range(100_000)) + ")$"}
        with pytest.raises(CompileRefused, match="150 MiB of memory"):
            guard.check("json", json.dumps(alternatives))
    finally:
        guard.close()
