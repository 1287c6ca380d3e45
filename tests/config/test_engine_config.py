"""`EngineConfig`: every LLMEngine option checked in one place, each error naming the keyword."""

from __future__ import annotations

import pytest

from pagedjax.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig


def test_defaults_are_the_engine_defaults_and_replace_checks_again():
    config = EngineConfig()
    assert (config.backend, config.decode_steps_per_call, config.seed, config.max_compiled_programs) == (
        "auto", 1, 0, 64)
    assert isinstance(config.cache_config, CacheConfig) and isinstance(config.scheduler_config, SchedulerConfig)
    assert config.replace(seed=5).seed == 5
    with pytest.raises(ValueError, match="LLMEngine.seed"):
        config.replace(seed=-1)


@pytest.mark.parametrize("changes, error, match", [
    (dict(backend="cuda"), ValueError, "LLMEngine.backend 'cuda' is not supported"),
    (dict(decode_steps_per_call=0), ValueError, "LLMEngine.decode_steps_per_call"),
    (dict(seed=2**32), ValueError, "LLMEngine.seed"),
    (dict(max_compiled_programs=0), ValueError, "LLMEngine.max_compiled_programs"),
    (dict(compile_cache=3), TypeError, "LLMEngine.compile_cache must be a bool or a folder"),
    (dict(compile_in_background="yes"), TypeError, "LLMEngine.compile_in_background"),
    (dict(cache_config={"num_blocks": 4}), TypeError, "cache_config must be a CacheConfig, got dict"),
    (dict(speculative_config={"num_speculative_tokens": 2}), TypeError,
     "speculative_config must be a SpeculativeConfig, got dict"),
    (dict(batch_invariant=True, decode_steps_per_call=2), ValueError, "batch_invariant=True needs"),
    (dict(batch_invariant=True, speculative_config=SpeculativeConfig()), ValueError, "cannot be combined"),
])
def test_each_bad_option_is_refused_naming_it(changes, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**changes)
