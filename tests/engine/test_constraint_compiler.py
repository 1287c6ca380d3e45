"""What keeps structured output cheap on the engine thread is exact: a constraint compiled once and copied is a
fresh matcher's equal (same masks along any walk, copies independent of each other), the compiled ones kept are
bounded and a rejected one is never kept, compiles from several threads at once agree; and a step's masks filled
in one parallel call equal the row-by-row fill. Host only: the byte tokenizer, no model."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.sampling_params import StructuredOutput
from pagedjax.structured_output import compiler as structured_module
from pagedjax.structured_output.compiler import ConstraintCompiler
from pagedjax.structured_output.masks import mask_words, token_masks

VOCAB, EOS = 259, (257,)
CONSTRAINTS = (StructuredOutput(json={"type": "object", "required": ["a", "b"], "additionalProperties": False,
                                      "properties": {"a": {"type": "string", "maxLength": 5},
                                                     "b": {"type": "array", "items": {"type": "integer"}}}}),
               StructuredOutput(regex=r"[a-c]{2,5}-\d{3}"),
               StructuredOutput(choice=("yes", "no", "maybe not")),
               StructuredOutput(grammar='start: "(" item ("," item)* ")"\nitem: /[xy]+/'))


def compiler() -> ConstraintCompiler:
    return ConstraintCompiler(ByteTokenizer(), VOCAB, EOS)


def allowed(constraint) -> np.ndarray:
    """The tokens `constraint` allows next, as bools `[VOCAB]` (the row-by-row fill)."""
    words = np.zeros(mask_words(VOCAB), np.int32)
    constraint.fill(words)
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


def walk(constraint, picks: list[int]) -> list[np.ndarray]:
    """The allowed sets along a walk from the constraint's start that takes, at each step, allowed token number
    `pick` (mod how many), until EOS or the picks run out."""
    seen, tokens = [], []
    for pick in picks:
        ok = allowed(constraint)
        seen.append(ok)
        choices = np.flatnonzero(ok)
        if not len(choices) or choices[pick % len(choices)] in EOS:
            break
        tokens.append(int(choices[pick % len(choices)]))
        assert constraint.advance(tokens) is None
    return seen


@settings(max_examples=8, deadline=None)
@given(which=st.integers(0, len(CONSTRAINTS) - 1), picks=st.lists(st.integers(0, 1000), min_size=1, max_size=12))
def test_a_kept_constraints_copies_equal_a_fresh_compile_and_are_independent(which, picks):
    structured = CONSTRAINTS[which]
    shared = compiler()
    first, second = shared.compile(structured), shared.compile(structured)
    assert shared.num_compiled == 1 and first.matcher is not second.matcher
    want = walk(compiler().compile(structured), picks)  # an uncached compile of its own
    assert [a.tolist() for a in walk(first, picks)] == [a.tolist() for a in want]
    # The first copy walked on; the second is still at the start, and so is every later copy.
    assert allowed(second).tolist() == want[0].tolist()
    assert allowed(shared.compile(structured)).tolist() == want[0].tolist() and shared.num_compiled == 1


def test_kept_constraints_are_bounded_and_rejected_ones_are_not_kept(monkeypatch):
    monkeypatch.setattr(structured_module, "COMPILED_CONSTRAINTS", 2)
    shared = compiler()
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    for structured in (a, b, a, c):  # c drops b, the least recently used
        shared.compile(structured)
    assert shared.num_compiled == 3
    shared.compile(a)
    shared.compile(c)
    assert shared.num_compiled == 3
    shared.compile(b)
    assert shared.num_compiled == 4
    for _ in range(2):
        with pytest.raises(ValueError, match=r"structured\.grammar"):
            shared.compile(StructuredOutput(grammar="start: undefined_rule"))
    assert shared.num_compiled == 4 and len(shared._compiled) == 2


def test_compiles_from_several_threads_agree():
    shared = compiler()
    results: dict[int, list] = {}
    start = threading.Barrier(4)

    def work(k):
        start.wait()
        results[k] = [allowed(shared.compile(CONSTRAINTS[(k + i) % len(CONSTRAINTS)])).tolist()
                      for i in range(len(CONSTRAINTS))]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = {s: allowed(compiler().compile(s)).tolist() for s in CONSTRAINTS}
    for k, rows in results.items():
        assert rows == [want[CONSTRAINTS[(k + i) % len(CONSTRAINTS)]] for i in range(len(CONSTRAINTS))]
    assert len(CONSTRAINTS) <= shared.num_compiled <= 4 * len(CONSTRAINTS)


class _Row:
    def __init__(self, constraint):
        self.constraint = constraint


def _matchers(rows, emits):
    """The matcher of each row that samples a token (what `StructuredOutputManager.masks` hands `token_masks`)."""
    return [row.constraint.matcher if row.constraint is not None and e else None
            for row, e in zip(rows, emits, strict=True)]


def test_the_parallel_fill_equals_the_row_by_row_fill():
    shared = compiler()
    rows = [_Row(shared.compile(CONSTRAINTS[i % len(CONSTRAINTS)])) for i in range(7)] + [_Row(None)]
    for i, row in enumerate(rows[:-1]):  # each matcher at its own state
        walk(row.constraint, [i * 7 + j for j in range(i % 4)])
    broken = rows[1].constraint.matcher  # a matcher the library put in its error state fills as a lone one would
    assert not broken.consume_token(ord("z")) and broken.is_error()
    emits = [True] * len(rows)
    emits[2] = False  # a row that samples nothing (a prefill chunk) gets all ones, as an unconstrained one
    masks = token_masks(_matchers(rows, emits), VOCAB)
    assert masks.shape == (len(rows), mask_words(VOCAB)) and masks.dtype == np.int32
    for i, row in enumerate(rows):
        if row.constraint is None or not emits[i]:
            assert (masks[i] == -1).all()
        else:
            words = np.zeros(mask_words(VOCAB), np.int32)
            row.constraint.fill(words)
            assert (masks[i] == words).all(), i
    assert token_masks(_matchers(rows, [False] * len(rows)), VOCAB) is None
    assert token_masks(_matchers([_Row(None)], [True]), VOCAB) is None
