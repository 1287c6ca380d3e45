"""One step path: a plain mixed step, a fused decode and a speculative verify step are each a `StepPlan` in and a
`StepResult` out of `ModelRunner.run`, applied by `Scheduler.update`; the engine's per-request state outside the
scheduler (text, grammar matchers, proposer state) is dropped when its request is no longer live."""

from __future__ import annotations

import inspect

import pytest

from pagedjax import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig, SpeculativeConfig
from pagedjax.core.step_result import StepResult
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.sampling_params import StructuredOutput
from tests.engine.test_engine import CFG, MAX_LEN, SEED, dense_greedy
from tests.engine.test_structured_output import CFG as BYTE_CFG


def _kind(plan) -> str:
    return "fused" if plan.fused is not None else "verify" if plan.num_drafts is not None else "plain"


def test_plain_fused_and_verify_steps_take_one_path_and_give_the_dense_tokens(monkeypatch):
    prompts = [[5, 6, 7, 8] * 4, [9, 9, 1, 9, 9, 1, 9], [3, 1, 4, 1, 5]]
    expected, margin = dense_greedy(prompts, 12)
    assert margin > 1e-3, margin
    engine = LLMEngine(config=EngineConfig(
        model_config=CFG, cache_config=CacheConfig(block_size=8, num_blocks=64),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN),
        seed=SEED, decode_steps_per_call=4,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)))
    applied = []
    update = engine.scheduler.update
    monkeypatch.setattr(engine.scheduler, "update",
                        lambda plan, result: applied.append((_kind(plan), type(result))) or update(plan, result))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    assert {kind for kind, _ in applied} == {"plain", "fused", "verify"}
    assert all(t is StepResult for _, t in applied)
    assert engine.stats().fused_decode_calls == sum(kind == "fused" for kind, _ in applied)


def test_no_per_request_state_outlives_its_request():
    engine = LLMEngine(model_config=BYTE_CFG, cache_config=CacheConfig(block_size=16, num_blocks=64),
                       scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                       seed=0, tokenizer=ByteTokenizer(),
                       speculative_config=SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    regex = StructuredOutput(regex="[a-z]{3,12}")
    engine.generate(["ab ab ab ab", "cd"], [SamplingParams(temperature=0.0,
                                                           max_tokens=8, n=2, seed=1, structured=regex),
                                            SamplingParams(temperature=0.0, max_tokens=8, stop=["zz"])], use_tqdm=False)
    engine.add_request("gone", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.abort("gone")
    engine.step()
    assert len(engine.output_processor) == 0 and len(engine.structured) == 0
    assert not engine.scheduler.requests and not engine.scheduler.groups


def test_the_engine_takes_one_config_and_options_over_it_and_shows_real_signatures():
    config = EngineConfig(model_config=CFG, cache_config=CacheConfig(num_blocks=16))
    engine = LLMEngine(config=config)
    assert engine.config is config and engine.num_blocks == 16
    engine = LLMEngine(config, decode_steps_per_call=3, cache_config=CacheConfig(num_blocks=8))
    assert engine.config == config.replace(decode_steps_per_call=3, cache_config=CacheConfig(num_blocks=8))
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        LLMEngine(config={"model_config": CFG})
    for fn in (LLMEngine, LLMEngine.from_pretrained):
        params = inspect.signature(fn).parameters
        assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()), fn
    assert {"quantization", "speculative_config", "decode_steps_per_call", "seed"} <= set(
        inspect.signature(LLMEngine.from_pretrained).parameters)
