"""The README's and docs/' Python examples run as written: every ```python block of README.md and docs/*.md.
(```py blocks need a live server, a model folder or several devices: tests/serve/test_readme_serving.py runs the
README's Serving section against a server.) A block that appears on several pages runs once."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def _distinct_blocks() -> dict[str, list[str]]:
    """Each distinct block -> where it appears ("README.md #0", "docs/engine.md #1", ...)."""
    where: dict[str, list[str]] = {}
    for page in PAGES:
        for index, block in enumerate(python_blocks(page)):
            where.setdefault(block, []).append(f"{page.relative_to(ROOT)} #{index}")
    return where


BLOCKS = _distinct_blocks()


def test_readme_has_python_examples():
    assert len(python_blocks(README)) >= 2


def _stated_out_shape(block: str) -> tuple[int, ...] | None:
    """The shape a block's comments state for its `out` (`out = ...  # [2, 8, 64] ...` or `out: [6, 4, 64]`)."""
    m = re.search(r"^out = .*# \[([\d, ]+)\]|\bout: \[([\d, ]+)\]", block, flags=re.M)
    return None if m is None else tuple(int(d) for d in (m[1] or m[2]).split(","))


def test_the_attention_example_states_its_output_shape():
    assert (2, 8, 64) in [_stated_out_shape(b) for b in BLOCKS]  # README's and docs/kernels.md's kernel call


@pytest.mark.parametrize("block", list(BLOCKS), ids=[places[0] for places in BLOCKS.values()])
def test_readme_example_runs(block, capsys):
    namespace: dict = {}
    exec(compile(block, f"{' = '.join(BLOCKS[block])} (python block)", "exec"), namespace)
    stated = _stated_out_shape(block)
    if stated is not None:  # the shape the block's comment gives its `out`
        assert namespace["out"].shape == stated
    printed = capsys.readouterr().out
    assert printed.strip(), "an example prints what it computes"
    if "outs" in namespace:  # the engine examples: the bundled model's greedy continuation of Python prompts
        text = namespace["outs"][0].text
        assert text in printed and sum(not c.isspace() for c in text) >= 0.5 * len(text) > 0, repr(text)
