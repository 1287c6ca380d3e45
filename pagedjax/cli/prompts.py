"""The prompts a run generates from: `--prompt` (with `--image` files), `--prompts-file`, `--demo` or the built-in
ones."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
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


# The built-in prompts' (--demo, or no prompt given) own length without --max-tokens: a canned run shows the engine
# in seconds, where a given prompt runs until the model stops or the context is full (`SamplingParams`' rule).
BUILT_IN_MAX_TOKENS = 64


@dataclass
class Prompts:
    texts: list[str]
    shared_prefix: str = ""  # --demo: the prefix every prompt starts with
    max_tokens: int | None = None  # without --max-tokens (None: the rest of the context)
    images: list = field(default_factory=list)  # --image: the one prompt's images (PIL, decoded), in order


def collect_prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Prompts:
    """The prompts the arguments ask for (usage errors through `parser`; an --image file that is no image: CLIError)."""
    if args.demo:
        if args.prompt or args.prompts_file or args.image:
            parser.error("--demo uses its own prompts; drop --prompt/--prompts-file/--image")
        return Prompts([DEMO_PREFIX + s for s in DEMO_SUFFIXES], DEMO_PREFIX, BUILT_IN_MAX_TOKENS)
    texts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            texts += read_prompts_file(args.prompts_file)
        except OSError as e:
            parser.error(f"--prompts-file: {e.strerror or e}: {args.prompts_file}")
    built_in = None  # the built-in prompts' own length
    if not texts:
        if args.prompt is not None or args.prompts_file is not None:
            parser.error("no prompts (empty --prompt or --prompts-file)")
        texts, built_in = list(DEFAULT_PROMPTS), BUILT_IN_MAX_TOKENS
    if any(t == "" for t in texts):
        parser.error("empty prompt")
    images = list(args.image or [])
    if images and (len(texts) != 1 or args.prompt is None):
        parser.error("--image needs exactly one prompt, given by --prompt (its image placeholders say where the "
                     "images go)")
    if images and args.beam_width is not None:
        parser.error("--image does not combine with --beam-width")
    # (the images opened before the model loads: a bad file fails at once)
    return Prompts(texts, max_tokens=built_in, images=open_images(images))


def open_images(paths: list[Path]) -> list:
    """The `--image` files as PIL images, decoded now (Pillow's decompression-bomb guard on: an image past its pixel
    limit is refused). CLIError naming the file that cannot be read or is no image."""
    from PIL import Image

    from pagedjax.cli.errors import CLIError

    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.load()
                images.append(image.copy())
        except (OSError, Image.DecompressionBombError, SyntaxError, ValueError) as e:
            raise CLIError(f"--image {path}: cannot read it as an image: {e}") from None
    return images
