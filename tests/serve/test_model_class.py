"""`--model-class MODULE:FACTORY`: a model of one's own (here the GPT-2-style example of
`tests/model/gpt2_example.py`) behind `pagedjax-serve`, answering the official OpenAI client with the text an
offline engine gives; and the CLI's one-line errors for a factory that cannot be used."""

from __future__ import annotations

import jax
import openai
import pytest
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.cli.command import main as generate_main
from pagedjax.cli.engine_setup import build_engine, load_model_for_cli
from pagedjax.serve.cli import build_parser
from tests.model.gpt2_example import load
from tests.serve.server_utils import MODEL_NAME, running_server

FACTORY = "tests.model.gpt2_example:load"
ENGINE_ARGS = ["--block-size", "16", "--num-blocks", "32", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
               "--max-model-len", "128"]
SERVE_ARGS = [*ENGINE_ARGS, "--no-warmup"]  # the warm-up's programs are another test's (CI time)


def model_only(path):
    """A factory that returns no tokenizer."""
    return load(path)[0]


def test_serve_answers_an_openai_client_with_the_offline_engines_text():
    args = build_parser().parse_args(["--model-class", FACTORY, *SERVE_ARGS])
    loaded = load_model_for_cli(args)
    assert loaded.model_config is None and loaded.spec.num_layers == 2
    count = sum(x.size for x in jax.tree.leaves(nnx.state(loaded.model, nnx.Param)))
    assert loaded.num_params == count and loaded.without_weights().num_params == count
    assert loaded.without_weights().model is None  # what the CLI keeps once the engine has the weights
    with running_server(build_engine(args, loaded)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=8, temperature=0)
    model, tokenizer = load()
    offline = LLMEngine(model=model, tokenizer=tokenizer, cache_config=CacheConfig(block_size=16, num_blocks=32),
                        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                         max_model_len=128))
    want = offline.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


@pytest.mark.parametrize("argv, message", [
    (["--model-class", "tests.model.gpt2_example"], "must be MODULE:FACTORY"),
    (["--model-class", "no_such_module:load"], "no module 'no_such_module'"),
    (["--model-class", "tests.model.gpt2_example:nothing"], "has no 'nothing'"),
    (["--model-class", "tests.model.gpt2_example:GPT2Config"], "must be a flax.nnx.Module, got GPT2Config"),
    (["--model-class", "tests.model.gpt2_example:load_hf_gpt2"], "load_hf_gpt2(None) raised TypeError"),
    (["--model-class", "tests.serve.test_model_class:model_only"], "gave no tokenizer"),
    (["--model-class", FACTORY, "--dtype", "bfloat16"], "--dtype applies to the built-in models"),
], ids=["format", "module", "attribute", "not-a-model", "factory-raises", "no-tokenizer", "dtype"])
def test_an_unusable_model_class_is_one_line_exit_2(argv, message, capsys):
    assert generate_main([*argv, "--prompt", "x", *ENGINE_ARGS]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
