"""A Lark grammar whose rules cannot end is refused before it is compiled (llguidance took `start: "a" start`, let
the model begin it, then failed the request with its parser's internal state), and a compiled constraint's first
mask is built when it is compiled, off the engine thread: its copies' first masks are cheap. Host only: the byte
tokenizer, no model."""

from __future__ import annotations

import pytest

from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.sampling_params import StructuredOutput
from pagedjax.structured_output.compiler import ConstraintCompiler
from pagedjax.structured_output.finite import MAX_NESTING, check_finite

VOCAB, EOS = 259, (257,)


@pytest.mark.parametrize("grammar, stuck", [
    ('start: "a" start', "'start'"),
    ('start: x\nx: "a" x', "'start', 'x'"),
    ('start: "b" | "a" x\nx: "c" x', "'x'"),  # the grammar has sentences, but a model that wrote "a" is stuck
    ('start: item{1,3}\nitem: "(" item ")"', "'start', 'item'"),
    ('start: a\na: "x"\n  | b\nb: "y" b', "'b'"),  # a continuation line
    ('%import common.WORD\nstart: WORD start', "'start'"),
    ('start: <|end|> start', "'start'"),
    ('start: %json {"type": "object"} start', "'start'"),
    ('start: "a" ~ 2..3 start', "'start'"),
])
def test_rules_that_cannot_end_are_refused_by_name(grammar, stuck):
    with pytest.raises(ValueError, match=f"rules? {stuck} never end") as e:
        check_finite(grammar)
    assert ("no finite sentence" in str(e.value)) == ("'start'" in stuck)


@pytest.mark.parametrize("grammar", [
    'start: "a" start | "b"',
    'start: ("a" start)?',
    'start: "a" start*',
    'start: item{0,3}\nitem: "(" [item] ")"',
    '?start: "x" | [start "y"]',
    'start: "a" -> one\n  | start "b" -> two',
    'start: "a" start ~ 0..3',
    'x: x\nstart: "a"',  # a rule that cannot end but that nothing reaches
    'start: @sub',  # a subgrammar reference: not read, taken as one that ends
    'start: %lark { whatever } start',  # text the scan does not read: the rule is taken as one that ends
    "start: " + "(" * (MAX_NESTING + 5) + '"a" start' + ")" * (MAX_NESTING + 5),  # nested past the scan's depth
    'start: r0\n' + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(300)) + '\nr300: "b"',
])
def test_grammars_that_can_end_pass(grammar):
    check_finite(grammar)


def test_the_compiler_refuses_them_before_compiling():
    compiler = ConstraintCompiler(ByteTokenizer(), VOCAB, EOS)
    with pytest.raises(ValueError, match=r"^SamplingParams\.structured\.grammar: rule 'start' never ends"):
        compiler.compile(StructuredOutput(grammar='start: "a" start'))
    assert compiler.num_compiled == 0
    # the shape of the forced tool-call grammar (`pagedjax.serve.tools.call_grammar`) compiles
    compiler.compile(StructuredOutput(grammar='start: call{1,3}\ncall: "<c>" (fn_0) "</c>"\nfn_0: %json {"type": '
                                              '"object", "properties": {"a": {"type": "string", "maxLength": 9}}}'))


def test_a_compiled_constraints_copies_start_with_its_lexer_built(monkeypatch):
    """The first mask of a constraint builds its lexer's states (about 10 ms for 1,024 choices, more for larger
    grammars and vocabularies); copies share them. It used to be built by the first copy's first mask: on the
    engine thread, in the step of the request's first token. Checked by what compile does, not by timing it (a
    timed comparison failed on a loaded machine): its one first mask is computed on the matcher it compiled."""
    import llguidance.numpy

    masked = []
    fill = llguidance.numpy.fill_next_token_bitmask
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask",
                        lambda matcher, *a, **k: (masked.append(matcher), fill(matcher, *a, **k))[1])
    structured = StructuredOutput(choice=tuple(f"option number {i} of many" for i in range(1024)))
    compiler = ConstraintCompiler(ByteTokenizer(), VOCAB, EOS)
    constraint = compiler.compile(structured)
    assert len(masked) == 1 and masked[0] is not constraint.matcher  # the compiled one, not the copy handed out
    compiler.compile(structured)
    assert len(masked) == 1  # a second copy of it masks nothing at compile
