"""The README's Serving section runs as written, against a live server: its launch command parses, its `curl`
example and its `openai` client example (a ```py block: tests/test_readme.py runs the ```python blocks
on their own, and this one needs a server) work, with the server's address put in place of port 8000."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import openai
import pytest

from pagedjax.serve.cli import build_parser
from tests.serve.server_utils import MODEL_NAME, make_engine, running_server

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = README.read_text().split("\n## Serving\n", 1)[1].split("\n## ", 1)[0]
README_URL = "http://127.0.0.1:8000"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", SECTION, flags=re.S)


@pytest.fixture(scope="module")
def server():
    with running_server(make_engine()) as s:  # served under the bundled model's name, as in the README
        yield s


def test_launch_command_parses():
    launch = next(b for b in _blocks("bash") if b.startswith("pagedjax-serve"))
    argv = shlex.split(launch)
    args = build_parser().parse_args(argv[1:])
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_curl_example(server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    command = next(b for b in _blocks("bash") if b.startswith("curl"))
    assert README_URL in command and MODEL_NAME in command
    done = subprocess.run(["bash", "-c", command.replace(README_URL, server.url)], capture_output=True, text=True,
                          timeout=120, check=True)
    body = json.loads(done.stdout)
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert 1 <= body["usage"]["completion_tokens"] <= 32


def test_openai_client_example(server, capsys):
    (code,) = _blocks("py")
    assert README_URL in code
    exec(compile(code.replace(README_URL, server.url), "README.md Serving example", "exec"), {})
    printed = capsys.readouterr().out
    # What the example streamed is the whole answer to the same request.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(model=MODEL_NAME, max_tokens=32, seed=0,
                                           messages=[{"role": "user", "content": "Write a parser."}])
    assert printed == whole.choices[0].message.content
