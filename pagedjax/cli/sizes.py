"""Byte sizes: parsed from the command line (`--kv-memory 64MiB`) and shown to people ('64.0 MiB')."""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64MiB', '1.5GB', '512k', '1048576' -> bytes. KiB/MiB/GiB and bare K/M/G are binary; kB/MB/GB decimal.

    Exact integer arithmetic: any number of digits parses (whether the size fits is checked later)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 64MiB, 1GB, 512k, 1048576)")
    number, unit, binary, b = m.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    base = 1024 if binary or (unit and not b) else 1000
    value = int(Fraction(number) * base ** power)
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return value


def format_size(num_bytes: int) -> str:
    """Bytes for people: '64.0 MiB', '1.2 TiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{num_bytes} B" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
