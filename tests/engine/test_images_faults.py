"""A step whose image encoding fails: the engine keeps serving, exactly, and leaks nothing (a model of the contract,
random weights, no Hugging Face)."""

from __future__ import annotations

import functools

import numpy as np
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.config.vision import LlavaConfig, VisionConfig

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _engine() -> LLMEngine:
    from pagedjax.model.multimodal.llava import Llava

    vision = VisionConfig("clip", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          image_size=(16, 16), patch_size=8, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    model = Llava(LlavaConfig(text=ModelConfig(vocab_size=64, num_layers=1, hidden_size=32, num_q_heads=2,
                                               num_kv_heads=1, head_dim=16, intermediate_size=64),
                              vision=vision, image_token_id=63), rngs=nnx.Rngs(0))
    return LLMEngine(model=model, cache_config=CacheConfig(block_size=4, num_blocks=32),
                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32),
                     compile_cache=False)


def _prompts():
    spec_tokens = [63] * 4  # 4 placeholder tokens per 16 x 16 image (patches of 8)
    rng = np.random.default_rng(0)
    pixels = [rng.standard_normal((3, 16, 16)).astype(np.float32) for _ in range(2)]
    return [{"prompt_token_ids": [1, 2] + spec_tokens + [3], "multi_modal_data": {"image": [pixels[0]]}},
            {"prompt_token_ids": [4] + spec_tokens + [5, 6], "multi_modal_data": {"image": [pixels[1]]}},
            {"prompt_token_ids": [7, 8, 9]}]


def _run_encodes_through(engine, call) -> None:
    """Every encode of `engine` from now on runs as `call(program, *args)`, the compiled encode program first."""
    programs = engine.runner.image_features.programs
    lookup = programs.lookup

    def wrapped(shape, prepare):
        ran, program = lookup(shape, prepare)
        return ran, functools.partial(call, program)

    programs.lookup = wrapped


def test_a_failed_encode_that_lost_the_feature_array_costs_nothing_but_the_step():
    want = [o.output_token_ids for o in _engine().generate(_prompts(), GREEDY, use_tqdm=False)]
    engine = _engine()
    failures = []

    def broken(encode, params, array, pixels, slots):  # fails once, after the donated array was consumed
        if not failures:
            failures.append(1)
            array.delete()
            raise RuntimeError("injected encoder failure")
        return encode(params, array, pixels, slots)

    _run_encodes_through(engine, broken)
    got = [o.output_token_ids for o in engine.generate(_prompts(), GREEDY, use_tqdm=False)]
    assert failures and engine.stats().failed_steps == 1
    assert got == want  # the step's requests reran (recompute is exact), none failed
    assert engine.scheduler.kv_cache_manager.block_pool.num_used == 0
    again = [o.output_token_ids for o in engine.generate(_prompts(), GREEDY, use_tqdm=False)]
    assert again == want


def test_an_encode_interrupted_after_taking_the_array_is_recovered_and_reraised():
    """Ctrl-C inside the encode (a BaseException: re-raised, the step's requests preempted, nobody blamed): the
    engine then finishes every request with the tokens of an undisturbed run."""
    import pytest

    want = [o.output_token_ids for o in _engine().generate(_prompts(), GREEDY, use_tqdm=False)]
    engine = _engine()
    interrupted = []

    def interrupt(encode, params, array, pixels, slots):
        if not interrupted:
            interrupted.append(1)
            array.delete()
            raise KeyboardInterrupt
        return encode(params, array, pixels, slots)

    _run_encodes_through(engine, interrupt)
    ids = [f"r{i}" for i in range(3)]
    for rid, prompt in zip(ids, _prompts(), strict=True):
        engine.add_prepared_request(engine.make_request(rid, prompt, GREEDY))
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished_requests():
            engine.step()
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    assert [done[rid] for rid in ids] == want
    assert engine.scheduler.kv_cache_manager.block_pool.num_used == 0
