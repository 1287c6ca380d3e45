"""The --speculative-* flags (both CLIs share them: `pagedjax.cli.args.add_engine_options`) -> SpeculativeConfig."""

from __future__ import annotations

import json

import pytest

from pagedjax.cli.args import build_parser
from pagedjax.cli.engine_setup import speculative_config_of
from pagedjax.cli.errors import CLIError
from pagedjax.cli.report import stats_rows
from pagedjax.cli.warm_start import CompileCache
from pagedjax.config import SpeculativeConfig
from pagedjax.serve.cli import build_parser as serve_parser


def _config(*argv: str):
    return speculative_config_of(build_parser().parse_args(list(argv)))


def test_speculation_is_off_without_a_method():
    assert _config() is None


def test_the_server_takes_the_same_flags():
    args = serve_parser().parse_args(["--speculative-method", "ngram", "--speculative-num-tokens", "3"])
    assert speculative_config_of(args) == SpeculativeConfig(num_speculative_tokens=3)


def test_flags_make_the_config():
    assert _config("--speculative-method", "ngram") == SpeculativeConfig()
    assert _config("--speculative-method", "ngram", "--speculative-num-tokens", "7", "--speculative-prompt-lookup-min",
                   "1", "--speculative-prompt-lookup-max", "5") == SpeculativeConfig("ngram", 7, 1, 5)


def test_a_speculative_flag_without_a_method_is_an_error():
    with pytest.raises(CLIError, match="--speculative-prompt-lookup-max needs --speculative-method"):
        _config("--speculative-prompt-lookup-max", "3")


def test_a_bad_combination_names_the_field():
    with pytest.raises(ValueError, match="SpeculativeConfig.prompt_lookup_max must be >= 4"):
        _config("--speculative-method", "ngram", "--speculative-prompt-lookup-min", "4",
                "--speculative-prompt-lookup-max", "2")


def test_the_draft_model_flag_makes_a_draft_config():
    assert _config("--speculative-method", "draft", "--speculative-draft-model", "some/folder",
                   "--speculative-num-tokens", "3") == SpeculativeConfig("draft", 3, draft_model="some/folder")
    with pytest.raises(CLIError, match="--speculative-draft-model needs --speculative-method"):
        _config("--speculative-draft-model", "some/folder")
    # The CLI names the flag, not the Python field (was: ValueError "SpeculativeConfig.draft_model is needed ...").
    with pytest.raises(CLIError, match="--speculative-method draft needs --speculative-draft-model PATH"):
        _config("--speculative-method", "draft")
    with pytest.raises(CLIError, match="--speculative-draft-model applies to --speculative-method draft and mtp, "
                                       "not ngram"):
        _config("--speculative-method", "ngram", "--speculative-draft-model", "some/folder")


def test_a_draft_model_the_engine_refuses_is_named_by_its_flag(capsys):
    """A missing draft folder used to end in a FileNotFoundError traceback; the engine's refusals of a draft
    (e.g. another vocabulary) named SpeculativeConfig's fields."""
    from pagedjax import cli
    from pagedjax.cli.engine_setup import in_flags

    code = cli.main(["--prompt", "x", "--max-tokens", "2", "--num-blocks", "16", "--no-compile-cache",
                     "--speculative-method", "draft", "--speculative-draft-model", "/no/such/draft"])
    err = capsys.readouterr().err
    assert code == 2 and "error: --speculative-draft-model: no model at /no/such/draft" in err, err
    assert "SpeculativeConfig" not in err and "Traceback" not in err
    assert in_flags("SpeculativeConfig.draft_model has vocab_size 5, the target model 7") == \
        "--speculative-draft-model has vocab_size 5, the target model 7"
    assert in_flags("SpeculativeConfig(method='draft') does not run") == "--speculative-method draft does not run"


def test_mtp_runs_the_bundled_models_head(capsys):
    """`--speculative-method mtp` alone: the --model folder's own head (the bundled model ships one), proposals
    verified and counted in the statistics table; `--speculative-draft-model` names another head's folder."""
    from pagedjax import cli

    assert _config("--speculative-method", "mtp") == SpeculativeConfig("mtp")
    assert _config("--speculative-method", "mtp", "--speculative-draft-model", "h") == SpeculativeConfig(
        "mtp", draft_model="h")
    code = cli.main(["--prompt", "def read_config(path):\n    with open(path) as f:\n", "--max-tokens", "24",
                     "--temperature", "0", "--num-blocks", "32", "--speculative-method", "mtp",
                     "--speculative-num-tokens", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    stats = json.loads(out)["stats"]
    # more than a quarter accepted (33% when written; a random head's almost never: 1 in 2048)
    assert stats["spec_accepted_tokens"] > stats["spec_proposed_tokens"] / 4 > 0, stats
    code = cli.main(["--prompt", "x", "--max-tokens", "2", "--num-blocks", "16", "--no-compile-cache",
                     "--speculative-method", "mtp", "--speculative-draft-model", "/no/such/head"])
    err = capsys.readouterr().err
    assert code == 2 and "error: no MTP head in /no/such/head" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--speculative-method", "eagle"], "--speculative-method"),
    (["--speculative-num-tokens", "0"], "--speculative-num-tokens"),
])
def test_bad_values_give_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_statistics_table_shows_the_proposals_when_there_were_some():
    summary = dict.fromkeys(("requests", "prompt_tokens", "generated_tokens", "tokens_per_s", "step_time_s",
                             "kv_blocks_used_peak", "kv_blocks", "kv_blocks_used_peak_pct", "kv_waste_pct",
                             "kv_bytes_per_token", "prefix_cache_hit_pct", "preemptions", "compilations",
                             "programs_compiled", "programs_loaded", "compile_s", "warmup_s", "engine_steps",
                             "wall_s", "spec_proposed_tokens", "spec_accepted_tokens"), 0)
    off = CompileCache(None)
    assert "speculative proposals" not in dict(stats_rows(summary, off))
    rows = dict(stats_rows(summary | dict(spec_proposed_tokens=1200, spec_accepted_tokens=900), off))
    assert rows["speculative proposals"] == "900 of 1,200 accepted"
