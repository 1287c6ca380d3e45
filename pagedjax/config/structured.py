"""`StructuredLimits`: the most one request's output constraint may ask of the grammar compiler (plain data, no
JAX). Why each limit and its default: `pagedjax.structured_output.limits`, which checks them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedjax.config.fields import option as _limit


@dataclass(frozen=True)
class StructuredLimits:
    """The most one request's output constraint (and its tools' schemas) may hold. Every field is a positive int;
    `pagedjax-serve` has a flag per field (`max_schema_depth` -> `--max-schema-depth`)."""

    max_schema_bytes: int = _limit(65_536, "bytes of one JSON schema as compact JSON (a tool's parameters, a "
                                           "response_format's schema); also of all tools' parameters together")
    max_schema_depth: int = _limit(128, "objects and arrays nested in a JSON schema, a $ref counting as what it "
                                        "points to (128: serde_json's own limit for a schema without $refs)")
    max_refs: int = _limit(512, "$ref keywords in one JSON schema")
    max_ref_depth: int = _limit(64, "$refs followed in a row in one JSON schema (a $def that refers to a $def ...)")
    max_enum_values: int = _limit(1_024, "enum values in one JSON schema, all its enums together")
    max_pattern_length: int = _limit(4_096, "characters of a regex (guided_regex, a schema's pattern or "
                                            "patternProperties key, a grammar's /regex/)")
    max_regex_repeat: int = _limit(1_000, "a counted repetition {m,n}'s bound, nested ones multiplied "
                                          "((a{10}){20}: 200), in regexes and grammars")
    max_choices: int = _limit(1_024, "strings of a guided_choice")
    max_choice_bytes: int = _limit(65_536, "bytes of a guided_choice's strings together")
    max_grammar_bytes: int = _limit(65_536, "bytes of a guided_grammar")
    max_grammar_rules: int = _limit(512, "rules of a guided_grammar")
    max_tools: int = _limit(128, "tools offered in one chat request")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StructuredLimits.{f.name} must be an int >= 1, got {value!r}")


DEFAULT_LIMITS = StructuredLimits()
