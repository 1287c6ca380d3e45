"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    namespace: dict = {}
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), namespace)
    if "out" in namespace and hasattr(namespace["out"], "shape"):
        assert namespace["out"].shape == (2, 8, 64)
    printed = capsys.readouterr().out
    assert printed.strip(), "an example prints what it computes"
    if "outs" in namespace:  # the engine example: the bundled model's greedy continuation of Python prompts
        text = namespace["outs"][0].text
        assert text in printed and sum(not c.isspace() for c in text) >= 0.5 * len(text) > 0, repr(text)
