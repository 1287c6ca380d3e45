"""The several-hosts flags of both command lines (`pagedjax.cli.multihost.start`): what does not fit together is a
one-line error before JAX starts. Two processes: tests/parallel/test_multihost.py,
tests/serve/test_serve_multihost.py."""

from __future__ import annotations

import pytest

from pagedjax.cli import multihost
from pagedjax.cli.args import build_parser as generate_parser
from pagedjax.cli.errors import CLIError
from pagedjax.serve.cli import build_parser as serve_parser


@pytest.mark.parametrize("parser", [generate_parser, serve_parser])
@pytest.mark.parametrize("argv, error", [
    (["--nnodes", "2"], "--nnodes / --node-rank need --dist-init-addr"),
    (["--node-rank", "1"], "--nnodes / --node-rank need --dist-init-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank 2 must be below --nnodes 2"),
    (["--nnodes", "2", "--dist-init-addr", "host0"], "must be HOST:PORT"),
    (["--nnodes", "2", "--dist-init-addr", "auto"], "leave out --nnodes and --node-rank"),
    (["--nnodes", "2", "--dist-init-addr", "h:1", "--data-parallel-size", "2"], "replicas across hosts"),
])
def test_flags_that_do_not_fit_are_named(parser, argv, error):
    with pytest.raises(CLIError, match=error):
        multihost.start(parser().parse_args(argv))


def test_one_process_is_the_default_and_the_description_leaves_out_per_process_flags(tmp_path):
    args = serve_parser().parse_args(["--api-key", "secret", "--port", "9001", "--max-num-seqs", "4"])
    assert multihost.start(args) is None and args.processes == 1
    described = multihost.description(args)
    assert "api_key" not in described["flags"] and "port" not in described["flags"]
    assert "node_rank" not in described["flags"] and described["flags"]["max_num_seqs"] == "4"
    (tmp_path / "config.json").write_text("{}")
    folder = generate_parser().parse_args(["--model", str(tmp_path)])
    assert multihost.description(folder)["model_files"] == {"config.json": 2}
    with pytest.raises(SystemExit):
        generate_parser().parse_args(["--dist-timeout", "0"])
