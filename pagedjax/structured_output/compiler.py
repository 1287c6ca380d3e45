"""Structured output's compiler: a request's constraint (`SamplingParams.structured`) as a grammar matcher on the
host (`Constraint`: accept / rollback / fill a mask row). `manager` keeps the matchers by request id and `masks`
turns them into the arrays a step's sampler applies on device.

The grammar work is llguidance's (a Rust library with a numpy API and no torch at run time; it compiles JSON
schemas, regexes, choices and Lark grammars to one matcher and computes a next-token bitmask in tens of
microseconds: `scripts/bench_structured.py`). Per step, each constrained request that samples a token gets a row
of the bitmask (bit t of word t // 32 set = token t allowed; unconstrained rows are all ones), and the sampler
sets the logits of disallowed tokens to -inf before anything else (penalties, temperature, top-k / top-p /
min-p, log-probabilities), as vLLM does. The matcher then consumes the sampled token (`Constraint.advance`,
called by the output layer). A sample of a multi-sample request starts from a copy of its prefill's matcher.

What this costs the engine thread is kept small (`scripts/bench_structured.py`): a step's rows are filled in one
call of llguidance's executor (`token_masks`: its threads, without the GIL), and a constraint is compiled once
per compiler, its first mask computed then (which builds the lexer states its copies share), and then copied
(`ConstraintCompiler`: the server compiles it in its prepare stage, off the engine thread, so a new constrained
request never stalls the running ones on its compile, its limits or its first mask). A Lark grammar whose rules
cannot end is refused before it is compiled (`finite.check_finite`).

    compiler = ConstraintCompiler(tokenizer, vocab_size, eos_token_ids)
    constraint = compiler.compile(params.structured)   # ValueError naming the field if invalid
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedjax.errors import InvalidConstraint, UnsupportedFeature
from pagedjax.sampling_params import StructuredOutput
from pagedjax.structured_output.finite import check_finite
from pagedjax.structured_output.isolation import JSON_STYLE, grammar_of  # noqa: F401 - JSON_STYLE re-exported

logger = logging.getLogger(__name__)

# Distinct constraints a compiler keeps compiled (least recently used dropped first): a server's requests mostly
# repeat a few schemas, and a fresh matcher holds little beside its grammar.
COMPILED_CONSTRAINTS = 64


class Constraint:
    """A request's matcher at the state after the first `consumed` output tokens."""

    def __init__(self, matcher, consumed: int = 0):
        self.matcher = matcher
        self.consumed = consumed

    def copy(self) -> Constraint:
        return Constraint(self.matcher.deep_copy(), self.consumed)

    def advance(self, output_token_ids: list[int]) -> str | None:
        """Consume the outputs not consumed yet; None, or why the grammar refused one (the request must fail:
        its mask allowed the token, so this is the library refusing mid-generation)."""
        new = output_token_ids[self.consumed:]
        for token in new:
            if not self.matcher.consume_token(int(token)):
                return f"structured output: the constraint refused token {token}: {self.matcher.get_error()}"
            self.consumed += 1
        return None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed tokens (beam search continues a beam with another last token)."""
        if not 0 <= num_tokens <= self.consumed or not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"structured output: cannot roll back {num_tokens} of {self.consumed} tokens: "
                               f"{self.matcher.get_error()}")
        self.consumed -= num_tokens

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (int32 `[mask_words]`, C-contiguous)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, row.reshape(1, -1))


class ConstraintCompiler:
    """Compiles `StructuredOutput`s for one tokenizer (its vocabulary built once, on first use).

    Each distinct constraint is compiled once (`num_compiled` counts those compiles) into a fresh matcher that is
    kept, never advanced, for the last `COMPILED_CONSTRAINTS` of them; every `compile` returns a deep copy of it:
    a fresh matcher's equal (same grammar, same start state) in microseconds instead of milliseconds. Thread-safe:
    the server calls `compile` from its prepare stage (`LLMEngine.compile_constraint`), so the engine thread's
    own call for that request only copies. A constraint the library rejects raises each time and is not kept."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_compiled = 0
        self._ll_tokenizer = None
        self._tokenizer_lock = threading.Lock()  # the vocabulary is built once, however many threads ask
        self._lock = threading.Lock()  # guards _compiled, num_compiled, and the copying of a kept matcher
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()  # constraint -> fresh matcher

    def _llg_tokenizer(self):
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_llg_tokenizer()
            return self._ll_tokenizer

    def _build_llg_tokenizer(self):
        import llguidance

        eos = list(self.eos_token_ids) or None
        inner = getattr(self.tokenizer, "tokenizer", None)
        if inner is not None and hasattr(inner, "to_str"):  # a Hugging Face tokenizers.Tokenizer
            return llguidance.LLTokenizer(inner.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Vocabulary(self.tokenizer, self.vocab_size, self.eos_token_ids)),
            n_vocab=self.vocab_size, eos_token=eos)

    def compile(self, structured: StructuredOutput, check: Callable[[], None] | None = None) -> Constraint:
        """A fresh matcher for `structured`; `InvalidConstraint` when the library rejects it, `UnsupportedFeature`
        (param "structured") when there is no tokenizer (the constraint is on the text). `check` runs before a
        compile, never before a copy of a kept matcher (the manager's limits: what was compiled passed them)."""
        if self.tokenizer is None:
            raise UnsupportedFeature("SamplingParams.structured needs an engine with a tokenizer (the constraint is "
                                     "on the text)", param="structured", code="tokenizer_required")
        with self._lock:
            kept = self._compiled.get(structured)
            if kept is not None:
                self._compiled.move_to_end(structured)
                return Constraint(kept.deep_copy())
        if check is not None:
            check()
        # Outside the lock: a compile takes milliseconds (up to a second for a huge grammar), and another
        # thread's copy of a kept matcher must not wait for it. Two threads may compile one constraint at once;
        # both matchers are equal, and the later one is kept.
        kept = self._matcher(structured)
        with self._lock:
            self._compiled[structured] = kept
            self._compiled.move_to_end(structured)
            while len(self._compiled) > COMPILED_CONSTRAINTS:
                self._compiled.popitem(last=False)
            self.num_compiled += 1
            return Constraint(kept.deep_copy())

    def _matcher(self, structured: StructuredOutput):
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        kind = structured.kind
        try:
            if kind == "grammar":  # llguidance takes a grammar whose rules cannot end, then fails mid-request
                check_finite(structured.grammar)
            grammar = grammar_of(kind, getattr(structured, kind))
        except (ValueError, RuntimeError, TypeError) as e:
            raise _refused(kind, str(e)) from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        if matcher.is_error():
            raise _refused(kind, matcher.get_error())
        # The first mask builds the lexer's states for the start (lazily, tens of ms for a large grammar), which
        # every copy shares: built here, in the compiling thread, the engine thread's first mask is cheap.
        # A grammar whose start the parser cannot even mask is refused here rather than failing its requests.
        fill_next_token_bitmask(matcher, allocate_token_bitmask(1, self.vocab_size))
        if matcher.is_error():
            raise _refused(kind, matcher.get_error())
        return matcher


def _refused(kind: str, reason: str) -> InvalidConstraint:
    """The grammar library's refusal of a constraint of `kind`."""
    return InvalidConstraint(f"SamplingParams.structured.{kind}: {reason}", kind=kind, reason=reason)




class _Vocabulary:
    """A byte-level pagedjax tokenizer (`ByteTokenizer`: `decode_bytes`, `encode(text, add_bos=False)`) as
    llguidance's `TokenizerWrapper` wants it: each token's bytes (special tokens as 0xff + a name, which no text
    can produce), and an encoder without special tokens."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        if not hasattr(tokenizer, "decode_bytes"):
            raise UnsupportedFeature(f"structured output needs a Hugging Face or byte-level tokenizer, got "
                                     f"{type(tokenizer).__name__}", param="structured", code="tokenizer_required")
        special = set(getattr(tokenizer, "special_token_ids", ()) or ())
        self.tokens = []
        for i in range(vocab_size):
            piece = tokenizer.decode_bytes([i]) if i not in special else b""
            self.tokens.append(b"\xff" + f"<special_{i}>".encode() if i in special or not piece else piece)
        self.special_token_ids = sorted(special)
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        return list(self._tokenizer.encode(text, add_bos=False))
