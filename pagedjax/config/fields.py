"""The checks every config and parameter class validates its fields with: each returns the value normalized (an
int as `int`, a number as `float`) or raises a TypeError / ValueError naming `owner.name`.

Plain Python, no JAX, and nothing of pagedjax: the bottom of the import layers (`pagedjax.config` and
`pagedjax.config.moe` build on it).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

# The model / compute dtypes a config may name, and their bytes per element.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as a string ("float32", "bfloat16", "float16")."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


def describe(value) -> str:
    """A value as an error message shows it: its type and repr."""
    return "None" if value is None else f"{type(value).__name__} {value!r}"


def is_int(value) -> bool:
    """A true integer (Python or numpy), not a bool, float or string."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(owner: str, name: str, value, *, lo: int | None = None, hi: int | None = None,
              optional: bool = False) -> int | None:
    """`value` as an int (numpy integers too; bools are not ints here) within [lo, hi], else TypeError or
    ValueError naming `owner.name`: the one integer check of every config and parameter class."""
    if value is None and optional:
        return None
    if not is_int(value):
        raise TypeError(f"{owner}.{name} must be an int{' or None' if optional else ''}, got {describe(value)}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{'-inf' if lo is None else lo}, {hi}]"
        raise ValueError(f"{owner}.{name} must be {bound}, got {value}")
    return value


def check_float(owner: str, name: str, value, *, positive: bool = False) -> float:
    """`value` (an int or a float, not a bool) as a finite float >= 0 (> 0 when `positive`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}.{name} must be a number, got {describe(value)}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range
        value = math.inf
    if not math.isfinite(value) or (positive and value <= 0) or value < 0:
        raise ValueError(f"{owner}.{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value}")
    return value


def check_bool(owner: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be true or false, got {describe(value)}")
    return value


def check_choice(owner: str, name: str, value, choices: tuple[str, ...], *, optional: bool = True) -> str | None:
    """One of `choices` (or None when optional)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be {'None or ' if optional else ''}a string, got {describe(value)}")
    if value not in choices:
        raise ValueError(f"{owner}.{name} {value!r} is not supported (supported: {', '.join(choices)})")
    return value


def option(default, help: str):  # noqa: A002 - argparse's word
    """A config field that is also a command-line flag: its default and its help text, the one definition of both
    that Python (the field), `pagedjax-generate` and `pagedjax-serve` (`pagedjax.cli.args.add_field_option`) read,
    so that they cannot drift."""
    return dataclasses.field(default=default, metadata={"help": help})


def from_fields(cls, value, what: str):
    """A dataclass `cls` from `value`, a mapping of its fields (a parsed `to_dict`): TypeError for anything that
    is not a mapping, ValueError naming unknown fields; `what` names the value in both (e.g. "ModelConfig.moe")."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be None, a {cls.__name__} or a mapping of its fields, got {describe(value)}")
    unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown {what} fields: {sorted(unknown)}")
    return cls(**value)
