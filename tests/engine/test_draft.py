"""The draft-model proposer through the whole engine (`pagedjax.spec_decode.draft_model`): a draft identical to the
target accepts every proposal (its KV bookkeeping is right: `pagedjax.spec_decode.draft_kv`, whose state machine is
in tests/spec_decode/test_draft_kv.py), any draft gives the non-speculative tokens (greedy against the dense model,
seeded samples against the engine without speculation), a failing draft call costs only its proposals, and the
configuration's errors."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams
from pagedjax.config import SchedulerConfig, SpeculativeConfig
from pagedjax.model.llama import init_model
from pagedjax.model.loading.checkpoint import bundled_model_path
from pagedjax.parallel import ParallelConfig
from tests.engine.test_engine import (
    CFG,
    MAX_LEN,
    MAX_TOKENS,
    PROMPTS,
    SEED,
    assert_all_free,
    dense_greedy,
    make_engine,
    reference,
)
from tests.engine.test_engine_properties import workloads
from tests.engine.test_speculative import assert_same_outputs

# A draft of the target's vocabulary and nothing else in common (one layer, half the width, other weights).
SMALL = ModelConfig(vocab_size=CFG.vocab_size, hidden_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1,
                    head_dim=16, intermediate_size=64)


def same_draft(k: int = 3) -> SpeculativeConfig:
    """The target's own weights as the draft."""
    return SpeculativeConfig(method="draft", draft_model=init_model(CFG, SEED), num_speculative_tokens=k)


def test_a_draft_identical_to_the_target_accepts_every_proposal_and_gives_the_dense_tokens(monkeypatch, caplog):
    """Two prompts sharing a 40-token prefix (the second run's prefix-cache hits are blocks the draft recomputes).
    Then a draft call that raises: that step verifies nothing, the tokens stay the dense ones, and the draft's KV is
    recomputed afterwards (every proposal accepted again). (Log-probabilities of verified rows: test_speculative.)"""
    prompts, expected = PROMPTS[3:5], reference()[3:5]  # the dense model's (shared with test_engine)
    engine = make_engine(block_size=8, max_num_seqs=2, speculative_config=same_draft())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert engine.generate(prompts[:1], params, use_tqdm=False)[0].output_token_ids == expected[0]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    s = engine.stats()
    assert s.scheduler.prefix_cache_hits > 0
    assert s.spec_proposed_tokens > 0 and s.spec_accepted_tokens == s.spec_proposed_tokens  # acceptance 1
    assert s.steps < 3 + sum(map(len, expected)) // 2  # several tokens per step
    # The draft's programs compile inside the steps too: counted with the target's, their time out of tokens/s.
    target, draft = engine.runner.programs, engine.speculator.draft.runner.programs
    assert draft.num_compilations > 0 and draft.compile_seconds > 0
    assert s.compilations == target.num_compilations + draft.num_compilations
    assert s.compile_s == pytest.approx(target.compile_seconds + draft.compile_seconds)
    assert s.compiled_programs == len(target) + len(draft)
    assert s.tokens_per_s == pytest.approx(s.generated_tokens / (s.elapsed_s - s.compile_s))
    assert_all_free(engine)

    proposer = engine.speculator.proposer
    execute, calls = proposer.runner.execute, []

    def fails_once(inputs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("draft device lost")
        return execute(inputs)

    monkeypatch.setattr(proposer.runner, "execute", fails_once)
    with caplog.at_level(logging.ERROR, logger="pagedjax.spec_decode.draft_model"):
        outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    assert proposer.num_failed_calls == 1 and proposer.epoch == 1 and "draft device lost" in caplog.text
    after = engine.stats()
    assert after.spec_accepted_tokens - s.spec_accepted_tokens == after.spec_proposed_tokens - s.spec_proposed_tokens
    assert after.spec_proposed_tokens > s.spec_proposed_tokens
    assert_all_free(engine)

    # sleep() releases the draft's KV arrays with the target's; after wake() every proposal is accepted again.
    target_bytes, draft_bytes = engine.runner.kv_cache.nbytes_per_device, proposer.runner.kv_cache.nbytes_per_device
    assert engine.sleep() == target_bytes + draft_bytes and proposer.runner.asleep
    engine.wake()
    assert [o.output_token_ids for o in engine.generate(prompts[:1], params, use_tqdm=False)] == expected[:1]
    last = engine.stats()
    assert last.spec_accepted_tokens - after.spec_accepted_tokens == last.spec_proposed_tokens - \
        after.spec_proposed_tokens > 0


@pytest.mark.slow
def test_an_unrelated_draft_gives_the_non_speculative_tokens_and_samples():
    """Greedy, seeded sampling (with log-probabilities), n / best_of forks, a stop id and a request with penalties
    (not speculated) beside them: the engine without speculation's outputs, whatever the draft proposes."""
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.95, seed=3, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0.0, logprobs=1),
              SamplingParams(max_tokens=7, temperature=1.0, seed=11, n=2, best_of=3),
              SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(13,)),
              SamplingParams(max_tokens=12, presence_penalty=0.5, temperature=0.9, seed=2)]
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[2], PROMPTS[0], PROMPTS[5]]
    runs = []
    for config in (None, SpeculativeConfig(method="draft", draft_model=SMALL, num_speculative_tokens=3), same_draft()):
        engine = make_engine(block_size=4, speculative_config=config)
        runs.append(engine.generate(prompts, params, use_tqdm=False))
        assert_all_free(engine)
        assert config is None or engine.stats().spec_proposed_tokens > 0
    for plain, *specs in zip(*runs, strict=True):
        for spec in specs:
            assert_same_outputs(plain, spec)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(w=workloads(), k=st.integers(1, 4), same=st.booleans())
def test_draft_speculation_matches_dense_on_random_workloads(w, k, same):
    """`test_engine_properties`' random workloads (pools down to preemption, chunked prefill, prefix caching, the
    fused decode): the dense model's greedy tokens, with the target's own weights as the draft (every proposal
    accepted) or an unrelated one."""
    expected, margin = dense_greedy(w["prompts"], w["max_tokens"])
    if margin < 1e-3:
        return
    longest = max(map(len, w["prompts"])) + w["max_tokens"]
    config = same_draft(k) if same else SpeculativeConfig(method="draft", draft_model=SMALL, num_speculative_tokens=k)
    engine = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=w["block_size"],
                                                                  num_blocks=max(w["num_blocks"],
                                                                                 -(-longest // w["block_size"])),
                                                                  enable_prefix_caching=w["prefix"]),
                       scheduler_config=SchedulerConfig(max_num_seqs=w["max_num_seqs"],
                                                        max_num_batched_tokens=w["budget"], max_model_len=MAX_LEN),
                       seed=SEED, decode_steps_per_call=w["num_steps"], speculative_config=config)
    outs = engine.generate(w["prompts"], SamplingParams(temperature=0.0, max_tokens=w["max_tokens"]), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    s = engine.stats()
    assert not same or s.spec_accepted_tokens == s.spec_proposed_tokens
    assert_all_free(engine)


@pytest.mark.slow
def test_after_warmup_draft_calls_run_on_a_stand_in_while_their_own_programs_compile():
    """`warmup()` compiles the draft's widest step too; with compile_in_background a draft call whose program is not
    compiled runs on it (the server's way): the proposals, and so the acceptance, are the same."""
    prompts, expected = PROMPTS[3:5], reference()[3:5]
    engine = make_engine(block_size=8, max_num_seqs=2, speculative_config=same_draft(), compile_in_background=True)
    engine.warmup()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    s = engine.stats()
    assert s.spec_proposed_tokens > 0 and s.spec_accepted_tokens == s.spec_proposed_tokens
    assert engine.speculator.draft.runner.programs.stand_in_steps > 0
    engine.close()


@pytest.mark.slow
def test_a_draft_read_from_a_folder_the_bundled_model_as_its_own_draft():
    """`draft_model` a folder (the bundled trained model's), the target the same model: its greedy text, every
    proposal accepted."""
    cache, sched = CacheConfig(block_size=16, num_blocks=32), SchedulerConfig(max_num_seqs=2, max_model_len=256)
    prompts, params = ["def fibonacci(n):", "import os\n"], SamplingParams(temperature=0.0, max_tokens=24)
    plain = LLMEngine.from_pretrained(None, cache_config=cache, scheduler_config=sched).generate(prompts, params,
                                                                                                 use_tqdm=False)
    config = SpeculativeConfig(method="draft", draft_model=str(bundled_model_path()), num_speculative_tokens=3)
    engine = LLMEngine.from_pretrained(None, cache_config=cache, scheduler_config=sched, speculative_config=config)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    s = engine.stats()
    assert s.spec_proposed_tokens > 0 and s.spec_accepted_tokens == s.spec_proposed_tokens
    assert_all_free(engine)


def test_kv_memory_holds_the_draft_models_blocks_too():
    cache = CacheConfig(block_size=8, kv_memory_bytes=10 * CacheConfig(block_size=8).block_bytes(CFG))
    plain = LLMEngine(model_config=CFG, cache_config=cache, scheduler_config=SchedulerConfig(max_model_len=MAX_LEN),
                      seed=SEED)
    config = SpeculativeConfig(method="draft", draft_model=CFG, num_speculative_tokens=2)  # as big as the target
    assert LLMEngine(model_config=CFG, cache_config=cache, scheduler_config=SchedulerConfig(max_model_len=MAX_LEN),
                     seed=SEED, speculative_config=config).num_blocks == plain.num_blocks // 2 == 5
    one_block = CacheConfig(block_size=8, kv_memory_bytes=cache.block_bytes(CFG))
    with pytest.raises(ValueError, match=r"holds no block of \d+ bytes \(the draft model's \d+ included\)"):
        LLMEngine(model_config=CFG, cache_config=one_block, scheduler_config=SchedulerConfig(max_model_len=MAX_LEN),
                  seed=SEED, speculative_config=config)


@pytest.mark.parametrize("model, kwargs, error, match", [
    (CFG, dict(draft_model=SMALL.replace(vocab_size=50)), ValueError,
     "SpeculativeConfig.draft_model has vocab_size 50, the target model 97"),
    (CFG, dict(draft_model=object()), TypeError, "SpeculativeConfig.draft_model: "),
    (CFG.replace(sliding_windows=(8, 8)), dict(draft_model=SMALL), ValueError, "sliding window"),
    # a folder, read as from_pretrained reads one: the bundled model (vocabulary 2048)
    (CFG, dict(draft_model=str(bundled_model_path())), ValueError, "vocab_size 2048, the target model 97"),
])
def test_bad_draft_models_are_refused_at_construction(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLMEngine(model_config=model, cache_config=CacheConfig(block_size=8, num_blocks=16),
                  scheduler_config=SchedulerConfig(max_model_len=MAX_LEN), seed=SEED,
                  speculative_config=SpeculativeConfig(method="draft", **kwargs))


def test_a_draft_whose_heads_do_not_split_over_the_targets_devices_is_refused():
    """A draft runs on the target's devices, split as the target is (tests/parallel/worker.py,
    speculative_draft_tp2): its heads must split over the same tensor_parallel_size, checked before any device is
    touched (this process has one)."""
    with pytest.raises(ValueError, match=r"SpeculativeConfig.draft_model \(on the target's devices\): "
                                         r"tensor_parallel_size 4 must divide the model's 2 query heads"):
        LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=8, num_blocks=16),
                  scheduler_config=SchedulerConfig(max_model_len=MAX_LEN), seed=SEED,
                  parallel_config=ParallelConfig(tensor_parallel_size=4),
                  speculative_config=SpeculativeConfig(method="draft", draft_model=SMALL))


def test_the_config_repr_shows_a_module_draft_by_its_type():
    """A draft given as a model module is its type in the config's repr (its parameter arrays printed whole made
    every log line of a config pages long); a folder or a ModelConfig shows as itself."""
    module = SpeculativeConfig(method="draft", draft_model=init_model(SMALL, SEED), num_speculative_tokens=2)
    assert repr(module) == ("SpeculativeConfig(method='draft', num_speculative_tokens=2, prompt_lookup_min=2, "
                            "prompt_lookup_max=4, draft_model=<Llama module>)")
    folder = SpeculativeConfig(method="draft", draft_model="/models/draft", num_speculative_tokens=2)
    assert repr(folder).endswith(", draft_model='/models/draft')")
    assert repr(SpeculativeConfig(method="draft", draft_model=SMALL)).endswith(f", draft_model={SMALL!r})")
    assert repr(SpeculativeConfig()) == ("SpeculativeConfig(method='ngram', num_speculative_tokens=4, "
                                         "prompt_lookup_min=2, prompt_lookup_max=4)")
