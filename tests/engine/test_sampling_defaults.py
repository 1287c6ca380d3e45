"""One sampling default everywhere (issue 42, point 4): `SamplingParams`' model-dependent fields default to None,
the model's default, which the engine fills in from its `SamplingDefaults` (the folder's generation_config.json,
else vLLM's: temperature 1.0) and never over a value given; `max_tokens` left out is the rest of the context
(issue 62, point 9), and one past the context is refused, naming it and the limit, instead of being cut short
silently."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedjax import CacheConfig, LLMEngine, SamplingDefaults, SamplingParams, SchedulerConfig
from pagedjax.config.sampling import DEFAULT_KEYS
from pagedjax.model.loading.checkpoint import bundled_model_path
from pagedjax.model.loading.generation_config import folder_sampling_defaults
from tests.engine.test_engine import CFG

VLLM = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
MAX_LEN = 64


def _engine(**kwargs) -> LLMEngine:
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=16, num_blocks=16),
                     scheduler_config=SchedulerConfig(max_model_len=MAX_LEN), compile_cache=False, **kwargs)


def _applied(engine, params: SamplingParams | None) -> SamplingParams:
    """The parameters the engine gives a request of `params` (nothing is queued)."""
    return engine.make_request("r", [1, 2, 3], params).request.sampling_params


def test_unset_fields_are_the_model_default_and_given_ones_are_never_replaced():
    params = SamplingParams()
    assert all(getattr(params, k) is None for k in DEFAULT_KEYS) and not params.has_defaults_applied
    with pytest.raises(ValueError, match="defaults"):
        params.has_penalties  # noqa: B018 - unknown before the engine's defaults are applied
    defaults = SamplingDefaults(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2)
    assert {k: getattr(params.with_defaults(defaults), k) for k in DEFAULT_KEYS} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2}
    # Values equal to vLLM's defaults, greedy included, are values given: none is replaced.
    given = SamplingParams(**VLLM | {"temperature": 0.0})
    assert given.with_defaults(defaults) is given
    partly = SamplingParams(temperature=0.0, top_k=1).with_defaults(defaults)
    assert (partly.temperature, partly.top_k, partly.top_p) == (0.0, 1, 0.9)


def test_an_engine_without_a_folder_gives_vllms_defaults():
    engine = _engine()
    assert engine.config.sampling_defaults == SamplingDefaults()
    for params in (None, SamplingParams(), SamplingParams(max_tokens=4)):
        assert {k: getattr(_applied(engine, params), k) for k in DEFAULT_KEYS} == VLLM
    greedy = _engine(sampling_defaults=SamplingDefaults(temperature=0.0, top_k=3))
    assert (_applied(greedy, None).temperature, _applied(greedy, None).top_k) == (0.0, 3)
    assert _applied(greedy, SamplingParams(temperature=1.0)).temperature == 1.0  # the request's value wins


def test_the_generation_config_of_a_folder_sets_the_defaults(tmp_path):
    assert folder_sampling_defaults(tmp_path) == SamplingDefaults()  # no file: vLLM's
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": -1, "repetition_penalty": 1.1, "top_p": None, "max_new_tokens": 9,
         "do_sample": True, "eos_token_id": 2}))
    defaults = folder_sampling_defaults(tmp_path)
    assert dataclasses.replace(defaults, source="") == SamplingDefaults(temperature=0.6, top_k=0,
                                                                       repetition_penalty=1.1, source="")
    assert defaults.source == str(tmp_path / "generation_config.json")
    assert defaults.describe() == f"temperature 0.6, repetition_penalty 1.1 ({tmp_path / 'generation_config.json'})"
    bundled = folder_sampling_defaults(None)  # the bundled model ships the settings of its demo
    assert (bundled.temperature, bundled.top_p, bundled.top_k) == (0.8, 0.95, 0)
    assert bundled.source == str(bundled_model_path() / "generation_config.json")


@pytest.mark.parametrize("content, says", [
    ('{"temperature": -1}', "temperature must be"), ('{"top_p": 0}', "top_p must be in"),
    ('{"top_k": 1.5}', "top_k"), ('{"temperature": "hot"}', "temperature must be a number"),
    ("[1]", "must hold a JSON object"), ("{", "not a readable JSON file"),
])
def test_a_bad_generation_config_is_refused_naming_the_file(tmp_path, content, says):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=says) as e:
        folder_sampling_defaults(tmp_path)
    assert str(tmp_path / "generation_config.json") in str(e.value)


def test_from_pretrained_reads_the_folders_defaults_unless_given():
    engine = LLMEngine.from_pretrained(None, cache_config=CacheConfig(num_blocks=16), compile_cache=False)
    assert engine.config.sampling_defaults == folder_sampling_defaults(None)
    assert _applied(engine, None).temperature == 0.8 and _applied(engine, None).top_p == 0.95
    mine = SamplingDefaults(temperature=0.0)
    given = LLMEngine.from_pretrained(None, cache_config=CacheConfig(num_blocks=16), compile_cache=False,
                                      sampling_defaults=mine)
    assert given.config.sampling_defaults == mine


def test_max_tokens_left_out_is_the_rest_of_the_context():
    """The one rule of every entry point (pagedjax-generate, the server's completions and chat: their tests): a
    request without max_tokens runs until it stops or the context is full (SamplingParams said 16)."""
    engine = _engine()
    assert SamplingParams().max_tokens is None
    for params in (None, SamplingParams(), SamplingParams(temperature=0.0)):  # what generate() and add_request do
        assert _applied(engine, params).max_tokens == MAX_LEN - 3
    assert _applied(engine, SamplingParams(max_tokens=4)).max_tokens == 4
    with pytest.raises(ValueError, match=r"min_tokens \(62\) is more than the 61 tokens the context leaves"):
        engine.make_request("r", [1, 2, 3], SamplingParams(min_tokens=62))


def test_max_tokens_past_the_context_is_an_error_naming_it_and_the_limit():
    """The engine used to stop such a request at the context's end, short of max_tokens, silently."""
    engine = _engine()
    prompt = list(range(1, 11))
    engine.make_request("fits", prompt, SamplingParams(max_tokens=MAX_LEN - len(prompt)))
    with pytest.raises(ValueError, match=rf"SamplingParams.max_tokens \({MAX_LEN - 9}\).* {MAX_LEN}-token context "
                                         rf"\(max_model_len\); max_tokens may be at most {MAX_LEN - 10}"):
        engine.add_request("past", prompt, SamplingParams(max_tokens=MAX_LEN - 9))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate(prompt, SamplingParams(max_tokens=10_000), use_tqdm=False)
    assert not engine.has_unfinished_requests()
