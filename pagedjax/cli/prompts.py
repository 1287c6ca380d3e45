"""The prompts a run generates from: `--prompt`, `--prompts-file`, `--demo` or the built-in ones."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
]

# --demo: one long shared prefix (a module header) and several different continuations.
DEMO_PREFIX = '''"""Read settings from configuration files."""

import os
import sys

__all__ = ["read_config", "Config"]

ENCODING = "utf-8"

'''
DEMO_SUFFIXES = [
    "def read_config(path):\n",
    "def parse_args(argv=None):\n",
    "class Config(OrderedDict):\n",
    "def _strip_comment(line):\n",
    "def write_config(path, config):\n",
]


def read_prompts_file(path: Path) -> list[str]:
    text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8", errors="surrogateescape")
    prompts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                value = json.loads(line)
            except ValueError:
                value = None
            if isinstance(value, str):
                line = value
        prompts.append(line)
    return prompts


@dataclass
class Prompts:
    texts: list[str]
    shared_prefix: str = ""  # --demo: the prefix every prompt starts with


def collect_prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Prompts:
    """The prompts the arguments ask for (usage errors through `parser`)."""
    if args.demo:
        if args.prompt or args.prompts_file:
            parser.error("--demo uses its own prompts; drop --prompt/--prompts-file")
        return Prompts([DEMO_PREFIX + s for s in DEMO_SUFFIXES], DEMO_PREFIX)
    texts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            texts += read_prompts_file(args.prompts_file)
        except OSError as e:
            parser.error(f"--prompts-file: {e.strerror or e}: {args.prompts_file}")
    if not texts:
        if args.prompt is not None or args.prompts_file is not None:
            parser.error("no prompts (empty --prompt or --prompts-file)")
        texts = list(DEFAULT_PROMPTS)
    if any(t == "" for t in texts):
        parser.error("empty prompt")
    return Prompts(texts)
