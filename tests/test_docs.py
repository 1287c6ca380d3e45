"""The README and docs/ hold together: every relative link points at a file and heading that exist, every
`pagedjax-generate` / `pagedjax-serve` command line in them parses, the README's install command installs what
its examples import, and the README stays a guide a user reads in minutes (measurements live in docs/)."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced blocks and inline code, where brackets are code, not links."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def blocks(text: str, *langs: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in langs]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (not '-' or '_'), spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text), flags=re.M):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file or anchor does not exist."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


def test_github_slugs():
    assert github_slug("Sliding windows, soft caps, q/k norms: Gemma, Qwen3, OLMo 2") == \
        "sliding-windows-soft-caps-qk-norms-gemma-qwen3-olmo-2"
    assert github_slug("Design notes (where the code refines the original design)") == \
        "design-notes-where-the-code-refines-the-original-design"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Part two\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#part-two) [ok](#here) `[code](nowhere.md)` [web](https://example.com)\n\n"
                    "## Here\n\n[gone](missing.md) [bad anchor](other.md#part-three)\n\n```\n[code](x.md)\n```\n")
    assert broken_links(page) == [f"missing.md: no file {tmp_path / 'missing.md'}",
                                  "other.md#part-three: no heading #part-three in other.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_readme_links_every_doc():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(prose(README.read_text()))}
    assert DOCS and [d.name for d in DOCS if d.resolve() not in linked] == []


def command_lines(text: str) -> list[list[str]]:
    """The bash blocks' commands (continuation lines joined, comments and leading VAR=value dropped)."""
    commands = []
    for body in blocks(text, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
                argv = argv[1:]
            if argv:
                commands.append(argv)
    return commands


def _parser_for(argv: list[str]):
    from pagedjax.cli.args import build_parser as generate_parser
    from pagedjax.serve.cli import build_parser as serve_parser

    if argv[0] == "pagedjax-generate" or argv[:3] == ["python", "-m", "pagedjax.cli"]:
        return generate_parser(), argv[1 if argv[0] == "pagedjax-generate" else 3:]
    if argv[0] == "pagedjax-serve" or argv[:3] == ["python", "-m", "pagedjax.serve"]:
        return serve_parser(), argv[1 if argv[0] == "pagedjax-serve" else 3:]
    return None, None


CLI_COMMANDS = [(page, argv) for page in PAGES for argv in command_lines(page.read_text())
                if _parser_for(argv)[0] is not None]


def test_the_pages_show_command_lines():
    assert sum(page == README for page, _ in CLI_COMMANDS) >= 3


@pytest.mark.parametrize("page,argv", CLI_COMMANDS, ids=[f"{p.name}: {shlex.join(a)[:60]}" for p, a in CLI_COMMANDS])
def test_command_line_parses(page, argv, monkeypatch):
    parser, args = _parser_for(argv)
    parser.error = lambda message: pytest.fail(f"{page.name}: `{shlex.join(argv)}`: {message}")
    parsed = parser.parse_args(args)
    if getattr(parsed, "model_class", None):  # resolves from the clone's root, where the README runs it
        module, _, factory = parsed.model_class.partition(":")
        monkeypatch.syspath_prepend(str(ROOT))
        assert callable(getattr(importlib.import_module(module), factory))


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def install_section() -> str:
    return README.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]


def installed_by_readme() -> set[str]:
    """The distributions the README's install command installs: the project's dependencies, those of the extras
    it names, and the packages it names (not their own dependencies: an example may not lean on those)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [line for body in blocks(install_section(), "bash") for line in body.splitlines()]
    (command,) = [line for line in lines if "pip install" in line]
    words = shlex.split(command.split("pip install", 1)[1].split("&&")[0])
    names = {_name(r) for r in project["dependencies"]}
    for word in words:
        if word.startswith("-"):
            continue
        if word.startswith("."):  # the project itself, with its extras
            extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", word).group(1) or ""
            for extra in filter(None, extras.split(",")):
                names |= {_name(r) for r in project["optional-dependencies"][extra]}
        else:
            names.add(_name(word))
    return names


def test_install_command_activates_the_venv_and_names_the_server_and_client():
    section = install_section()
    (command,) = [body for body in blocks(section, "bash") if "pip install" in body]
    assert "source .venv/bin/activate" in command
    assert {"fastapi", "uvicorn", "openai"} <= installed_by_readme()


def test_the_install_command_installs_what_the_examples_import():
    """Every module that a README or docs/ example imports is the project's, the standard library's, or from a
    distribution the README's install command installs: a dependency of the project or of an extra it names, or a
    package it names (the streaming example's `openai` used to be in no documented command)."""
    owners = importlib.metadata.packages_distributions()
    missing = []
    for body in [b for page in PAGES for b in blocks(page.read_text(), "python", "py")]:
        for module in re.findall(r"^\s*(?:from|import) ([A-Za-z_]\w*)", body, flags=re.M):
            if module in sys.stdlib_module_names or module in ("pagedjax", "pallas_kernels", "__future__"):
                continue
            if not {_name(d) for d in owners.get(module, [])} & installed_by_readme():
                missing.append(module)
    assert missing == []


def test_readme_gives_the_two_commands_first():
    """The project's two entry points, each alone in its block: set up and decode, and run the tests (CI's)."""
    section = README.read_text().split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    assert [b.strip() for b in blocks(section, "bash")] == ["scripts/run.sh", "scripts/test.sh"]
    assert README.read_text().index("\n## Two commands\n") < README.read_text().index("\n## Install\n")
    assert all((ROOT / "scripts" / name).stat().st_mode & 0o111 for name in ("run.sh", "test.sh"))


def test_readme_is_a_guide():
    """Issue 42: the README was 1,800 lines, mostly benchmark narratives (one section 18.7k characters); they
    live in docs/ now."""
    text = README.read_text()
    sections = re.split(r"\n(?=## )", text)
    assert len(text.splitlines()) <= 500, f"README.md is {len(text.splitlines())} lines"
    assert max(len(s) for s in sections) <= 3000, max(sections, key=len).splitlines()[0]


# The README's shell commands that run in another test (the pagedjax-generate ones run in the test below, as
# written), by `shlex.join` of their words: each names the test, and what differs from the README's command.
RUN_ELSEWHERE = {
    "scripts/run.sh": "tests/cli/test_cli_scripts.py::test_run_sh_installs_only_when_the_project_changed "
                      "(against stub tools: no pip, no model)",
    "scripts/test.sh": "tests/cli/test_cli_scripts.py::test_test_sh_reports_the_slowest_tests (against stub tools)",
    "source .venv/bin/activate '&&' pip install -e '.[serve]' openai":
        "tests/test_docs.py::test_the_install_command_installs_what_the_examples_import (what it installs; "
        "installing needs the network)",
    "pagedjax-serve --port 8000": "tests/serve/test_serve_cli.py::test_sigterm_finishes_the_request_in_flight_and_"
                                  "exits_0 (the bundled model on a free port, with a smaller engine)",
    "curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"pagedjax-tiny\", "
    "\"prompt\": \"def fib(n):\\n\", \"max_tokens\": 32, \"temperature\": 0}'":
        "tests/serve/test_readme_serving.py::test_curl_example (against a server on a free port)",
    "pagedjax-generate --tensor-parallel-size 2 --max-tokens 16": "tests/parallel/test_parallel.py::test_parallel "
        "(worker.py's cli_tensor_parallel, on 8 CPU devices, with --prompt, --num-blocks and --json)",
}


def _runs_here(argv: list[str]) -> bool:
    """A pagedjax-generate command that runs in this process (one of several devices needs XLA_FLAGS set before
    JAX starts)."""
    return _parser_for(argv)[0] is not None and argv[0] != "pagedjax-serve" and argv[:3] != \
        ["python", "-m", "pagedjax.serve"] and "--tensor-parallel-size" not in argv


README_COMMANDS = command_lines(README.read_text())


@pytest.mark.parametrize("argv", README_COMMANDS, ids=[shlex.join(a)[:60] for a in README_COMMANDS])
def test_every_readme_command_runs_in_a_test(argv, capsys, monkeypatch):
    """A README pagedjax-generate command runs here as written (from the clone's root, as the README says), and
    prints a completion and the statistics; every other command names the test that runs it. Was: the commands
    were parsed only, and `--model-class tests.model.gpt2_example:load --model DIR` failed ("gave no
    tokenizer")."""
    if not _runs_here(argv):
        where = RUN_ELSEWHERE.get(shlex.join(argv))
        assert where is not None, f"README command `{shlex.join(argv)}` runs in no test"
        file, _, name = where.split(" ")[0].partition("::")
        assert f"\ndef {name}(" in (ROOT / file).read_text(), where
        return
    from pagedjax.cli import main

    monkeypatch.chdir(ROOT)
    parser, args = _parser_for(argv)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "--- [1] " in out and "tokens/s" in out, out
