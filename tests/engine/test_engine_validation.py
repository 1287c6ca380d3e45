"""Bad input fails at the door, with the request and field named; nothing is coerced silently and nothing
half-queued. Also: a KV cache dtype other than the model's, on every backend."""

from __future__ import annotations

import gc
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import CacheConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.model.tokenizer import ByteTokenizer
from tests.dense import dense_forward
from tests.engine.test_engine import CFG, MAX_LEN, PROMPTS, SEED, _pad, make_engine


@pytest.mark.parametrize("seed,error", [(2**32, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                                        ("3", TypeError)])
def test_engine_seed_outside_32_bits_is_refused(seed, error):
    """Seeds of 2**32 or -1 used to pass and then overflow on the first step."""
    with pytest.raises(error, match="LLMEngine.seed"):
        LLMEngine(model_config=CFG, cache_config=CacheConfig(num_blocks=16), seed=seed)


@pytest.mark.parametrize("kwargs,error,field", [
    (dict(beam_width=0, max_tokens=4), ValueError, "beam_width"), (dict(beam_width=11, max_tokens=4), ValueError,
                                                                   "beam_width"),
    (dict(beam_width=2.0, max_tokens=4), TypeError, "beam_width"), (dict(beam_width=2, max_tokens=0), ValueError,
                                                                    "max_tokens"),
    (dict(beam_width=2, max_tokens="4"), TypeError, "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty="1"), ValueError, "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), ValueError, "ignore_eos"),
])
def test_beam_search_params_validate_every_field(kwargs, error, field):
    from pagedjax import BeamSearchParams

    with pytest.raises(error, match=f"BeamSearchParams.{field}"):
        BeamSearchParams(**kwargs)


@pytest.mark.parametrize("field,value,error", [
    ("seed", 2**63, ValueError), ("seed", -1, ValueError), ("seed", 1.0, TypeError),
    ("top_k", 2**31, ValueError), ("top_k", -5, ValueError), ("top_k", 3.0, TypeError),
    ("temperature", math.nan, ValueError), ("temperature", math.inf, ValueError), ("temperature", "1", TypeError),
    ("top_p", math.nan, ValueError), ("top_p", 0.0, ValueError), ("top_p", True, TypeError),
    ("max_tokens", 2.5, TypeError), ("max_tokens", "5", TypeError), ("max_tokens", True, TypeError),
    ("max_tokens", 0, ValueError), ("max_tokens", 2**31, ValueError),
    ("stop_token_ids", ["5"], TypeError), ("stop_token_ids", [1.0], TypeError), ("stop_token_ids", [True], TypeError),
    ("stop_token_ids", 5, TypeError), ("stop_token_ids", [-1], ValueError),
    ("ignore_eos", 1, TypeError),
])
def test_sampling_params_validate_every_field(field, value, error):
    with pytest.raises(error, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_accept_numpy_integers():
    p = SamplingParams(temperature=0.0,
                       max_tokens=np.int64(4), top_k=np.int32(3), seed=np.uint32(7), stop_token_ids=np.arange(3))
    assert p.stop_token_ids == (0, 1, 2) and all(type(t) is int for t in p.stop_token_ids)


@pytest.mark.parametrize("prompt,error", [
    ([1.0, 2.0], TypeError), ([1, "5"], TypeError), ([True, 2], TypeError), ("12", TypeError),
    (np.array([1.5]), TypeError), ([1, CFG.vocab_size], ValueError), ([], ValueError),
])
def test_prompt_token_ids_are_checked_not_coerced(prompt, error):
    engine = make_engine()
    with pytest.raises(error, match="'r'"):
        engine.add_request("r", prompt, SamplingParams(temperature=0.0))
    assert not engine.has_unfinished_requests()


def test_request_ids_and_params_are_checked():
    engine = make_engine()
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request(5, [1, 2])
    with pytest.raises(TypeError, match="sampling_params"):
        engine.add_request("a", [1, 2], {"max_tokens": 3})
    with pytest.raises(TypeError, match="cache_salt"):
        engine.add_request("a", [1, 2], cache_salt=3)
    engine.add_request("a", np.array([1, 2], np.int64))  # numpy integers are integers
    assert engine.scheduler.get_request("a").prompt_token_ids == [1, 2]


def test_unknown_device_overflow_request_is_refused_at_construction():
    """top_k > 2**31 - 1 used to pass validation and then make every step raise for everyone."""
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=0.0, top_k=2**31)


def test_generate_validates_the_whole_batch_before_queueing_any():
    engine = make_engine()
    with pytest.raises(TypeError):
        engine.generate([PROMPTS[0], PROMPTS[1], [1.5]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()  # prompts 1-2 used to stay queued and run unseen later
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([PROMPTS[0], [1] * (MAX_LEN + 1)], SamplingParams(temperature=0.0,
                                                                          max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    # still serving, nothing held
    assert len(engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0,
                                                            max_tokens=2), use_tqdm=False)[0].output_token_ids) == 2
    mem = engine.stats().scheduler.memory
    assert mem.num_used_blocks == 0 and mem.num_free_blocks + mem.num_cached_blocks == mem.num_blocks


def test_generate_ids_never_collide_with_the_callers():
    engine = make_engine()
    for rid in ("gen-0", "gen-1", "gen-1-0", "gen-1-1"):
        engine.add_request(rid, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2))
    outs = engine.generate([PROMPTS[1], PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert [len(o.output_token_ids) for o in outs] == [2, 2]
    assert len({o.request_id for o in outs} | {"gen-0", "gen-1", "gen-1-0", "gen-1-1"}) == 6
    while engine.has_unfinished_requests():  # the caller's own requests are still there, untouched
        engine.step()


def test_scheduler_config_defaults_to_the_models_length():
    """SchedulerConfig() used to default max_model_len to 2048, refused for a 512-position model."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16,
                      intermediate_size=32, max_position_embeddings=512)
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(num_blocks=64),
                       scheduler_config=SchedulerConfig(max_num_seqs=16))
    assert engine.scheduler_config.max_model_len == 512
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(model_config=cfg, cache_config=CacheConfig(num_blocks=64),
                  scheduler_config=SchedulerConfig(max_model_len=1024))
    with pytest.raises(TypeError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=2.0)


def test_an_unknown_option_is_refused_naming_the_options():
    """One configuration: an option is an `EngineConfig` field (the deprecated `num_steps` alias is gone), and a
    model's config is not an engine's config."""
    with pytest.raises(TypeError, match="unknown option.*num_steps.*decode_steps_per_call"):
        make_engine(num_steps=3)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got ModelConfig.*model_config="):
        LLMEngine(CFG)
    with pytest.raises(TypeError, match="model_config\\) is the folder's"):  # refused before anything loads
        LLMEngine.from_pretrained(None, model_config=CFG)


def test_engine_signature_shows_every_argument():
    """`help(LLMEngine)` sees the real arguments: the objects, and every option (`EngineConfig`'s fields, from the
    one definition), keyword-only with its default; `from_pretrained` the same but the folder's model_config."""
    import inspect

    from pagedjax.config.engine import OPTIONS

    params = inspect.signature(LLMEngine).parameters
    assert {"config", "model", "params", "tokenizer", "image_processor", "devices", "classifier", *OPTIONS} == \
        set(params)
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())
    assert params["decode_steps_per_call"].default == EngineConfig().decode_steps_per_call
    assert params["cache_config"].default == CacheConfig()
    loading = inspect.signature(LLMEngine.from_pretrained).parameters
    assert "model_config" not in loading
    assert {"path", "dtype", "quantization", "classifier_from_tokens", *OPTIONS} - {"model_config"} <= set(loading)


def test_data_parallel_layouts_are_built_by_the_factory_not_by_llm_engine():
    from pagedjax import DataParallelEngine, Engine, ParallelConfig
    from pagedjax import make_engine as build

    with pytest.raises(ValueError, match="make_engine"):
        LLMEngine(model_config=CFG, cache_config=CacheConfig(num_blocks=16),
                  parallel_config=ParallelConfig(data_parallel_size=2))
    one = build(model_config=CFG, cache_config=CacheConfig(num_blocks=16), parallel_config=None)
    assert type(one) is LLMEngine and one.parallel_config is None and isinstance(one, Engine)
    # Every engine-shaped class offers the whole protocol (DataParallelEngine used to lack beam_search).
    members = [m for m in dir(Engine) if not m.startswith("_")]
    assert all(hasattr(DataParallelEngine, m) or m in ("tokenizer", "model_config") for m in members)
    assert {"beam_search", "generate", "step", "abort", "stats", "add_request"} <= set(members)


def test_bytes_prompts_round_trip_exactly():
    """Non-UTF-8 prompt bytes reach the model as those bytes (not re-encoded surrogates)."""
    tok = ByteTokenizer()
    raw = b"caf\xe9 \xff\x00ok"
    assert tok.decode_bytes(tok.encode(raw)) == raw
    assert tok.decode_bytes(tok.encode(raw.decode("utf-8", errors="surrogateescape"))) == raw


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_kv_cache_dtype_may_differ_from_the_models(backend):
    """bfloat16 pages under a float32 model (what `auto` picks on a GPU) used to crash the Pallas backend."""
    engine = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=8, num_blocks=64, kv_dtype="bfloat16"),
                       scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                        max_model_len=MAX_LEN), seed=SEED, backend=backend)
    assert engine.runner.kv_cache.layers[0].k.dtype == jnp.bfloat16
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=1))
    plan = engine.scheduler.schedule()
    logits = engine.runner.execute(engine.step_inputs(plan), return_logits=True).logits
    dense = np.asarray(dense_forward(CFG, SEED)(jnp.asarray(_pad(prompts))))
    for i, kv_len in enumerate(plan.kv_lens):
        want = dense[i, kv_len - 1]
        # K/V rounded to bf16: ~1e-2 of the logits' scale
        np.testing.assert_allclose(logits[i], want, rtol=0, atol=2e-2 * np.abs(want).max())
    outs = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(outs[0].output_token_ids) == 3


def test_a_sample_is_not_aborted_alone():
    """Aborting every sample of a request by its internal id used to leave the request with no finished output
    (a caller waited forever); aborting one could rank a truncated sample best. Samples end with their request."""
    engine = make_engine()
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, n=2, best_of=3, temperature=1.0, seed=1))
    engine.step()  # the shared prefill; the samples exist now
    samples = [rid for rid in engine.scheduler.requests if rid != "r"]
    assert len(samples) == 3
    for rid in samples:
        with pytest.raises(ValueError, match="sample .* of request 'r': abort that request"):
            engine.abort(rid)
    assert engine.abort("r") and not engine.has_unfinished_requests()


def test_stop_token_id_counts_compile_two_programs():
    """Each distinct count of stop token ids (with penalties on) used to compile its own step program: a server
    driven with counts 1..1,024 compiled one per count and stalled every running stream meanwhile. Counts take
    8 or 512 columns now (`inputs.STOP_ID_WIDTHS`): counts 1..40 compile at most one program per width."""
    engine = make_engine()
    engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2, presence_penalty=0.5), use_tqdm=False)
    base = engine.stats().compilations
    for k in range(1, 41):
        params = SamplingParams(temperature=0.0,
                                max_tokens=1, presence_penalty=0.5, stop_token_ids=list(range(k)), ignore_eos=True)
        engine.generate([PROMPTS[0]], params, use_tqdm=False)
    assert engine.stats().compilations - base <= 2  # widths 8 and 512


def test_beam_search_refuses_what_could_deadlock_and_leaves_nothing_behind(monkeypatch):
    """On a pool too small for its held beams, beam search used to stop with "the scheduler made no progress";
    beside running requests it advanced them and dropped their outputs, or failed a fork on max_num_seqs and
    left the fork held in the scheduler forever."""
    from pagedjax import BeamSearchParams
    from tests.engine.test_engine import assert_all_free

    params = BeamSearchParams(beam_width=4, max_tokens=20)
    small = make_engine(block_size=4, num_blocks=10)
    with pytest.raises(ValueError, match="more than the pool's 10"):
        small.beam_search([PROMPTS[0]], params)
    assert not small.has_unfinished_requests()

    engine = make_engine()
    engine.add_request("other", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="runs alone: 1 requests are in flight"):
        engine.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()

    forks = []
    original = engine.scheduler.fork

    def fork(source_id, child):
        forks.append(child.request_id)
        if len(forks) == 2:
            raise ValueError("cannot fork: injected")
        return original(source_id, child)

    monkeypatch.setattr(engine.scheduler, "fork", fork)
    with pytest.raises(ValueError, match="injected"):
        engine.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=4))
    assert len(forks) == 2 and not engine.has_unfinished_requests()
    assert_all_free(engine)


def test_compiled_programs_are_bounded_and_outputs_stay_exact():
    """Compiled programs used to be kept for the engine's life (a server compiling ever new shapes grew by each
    one's memory, never freed). At most max_compiled_programs are held; one dropped and needed again is compiled
    again, and the tokens are those of an engine that keeps everything."""
    batches = [PROMPTS[:1], PROMPTS[:2], PROMPTS[:3], PROMPTS[:1], PROMPTS[:2]]  # batch buckets 1, 2, 4, 1, 2
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    uncapped = make_engine()
    want = [[o.output_token_ids for o in uncapped.generate(prompts, greedy, use_tqdm=False)] for prompts in batches]
    uncapped.runner.programs.wait()  # the compiles still running in the background
    assert uncapped.stats().compiled_programs == uncapped.stats().compilations
    uncapped_compilations = uncapped.stats().compilations
    # Engines of one structure share their programs (`runner._jitted`): the capped engine's must be its own.
    del uncapped
    jax.clear_caches()
    capped = make_engine(max_compiled_programs=2, compile_in_background=False)
    compiled = []  # a weak reference to every program the capped engine compiled (JAX's executable in it)
    install = capped.runner.programs._install

    def recording(shape, exe, pinned):
        if not any(ref() is exe._executable for ref in compiled):
            compiled.append(weakref.ref(exe._executable))
        return install(shape, exe, pinned)

    capped.runner.programs._install = recording
    for prompts, tokens in zip(batches, want, strict=True):
        got = capped.generate(prompts, greedy, use_tqdm=False)
        assert [o.output_token_ids for o in got] == tokens
        assert capped.stats().compiled_programs <= 2
    assert capped.stats().compilations > uncapped_compilations  # dropped programs were compiled again
    # A dropped program is freed: JAX's own trace and lowering caches held every program ever compiled (the
    # server's memory grew ~10 MiB per compilation with the cap reached, scripts/soak_serve.py).
    gc.collect()
    held = {id(exe._executable) for exe in capped.runner.programs.executables.values()}
    assert len(compiled) == capped.stats().compilations
    assert [ref() is not None for ref in compiled] == [id(ref()) in held for ref in compiled]
    with pytest.raises(ValueError, match="max_compiled_programs"):
        make_engine(max_compiled_programs=0)


_BYTE_CFG = ModelConfig(vocab_size=259, hidden_size=64, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=32,
                        intermediate_size=128, bos_token_id=256, eos_token_ids=(257,))


def _text_engine():
    return LLMEngine(model_config=_BYTE_CFG, cache_config=CacheConfig(num_blocks=16),
                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_model_len=MAX_LEN), seed=SEED,
                     tokenizer=ByteTokenizer(), compile_cache=False)


def test_one_prompt_is_one_request_as_in_vllm():
    """`generate("def f")` used to run five one-character requests; a dict prompt was read as its keys."""
    engine = _text_engine()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    tokens = list(ByteTokenizer().encode("def f"))
    for prompt in ("def f", b"def f", tokens, np.array(tokens), {"prompt": "def f"}, {"prompt_token_ids": tokens}):
        outs = engine.generate(prompt, params, use_tqdm=False)
        assert len(outs) == 1 and list(outs[0].prompt_token_ids) == tokens, prompt
    batch = engine.generate(["def f", tokens, {"prompt": "def f"}, {"prompt_token_ids": tokens}], params,
                            use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in batch] == [tokens] * 4


@pytest.mark.parametrize("prompts,match", [
    (5, "got int"), (None, "got NoneType"), ([1, [2, 3]], "mixes ints with list"), ([3.5], r"prompts\[0\].*float"),
    ({"text": "a"}, r"keys \['text'\]"), ([{"prompt": [1, 2]}], r"prompts\[0\].*'prompt'"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "keys"),
])
def test_prompts_of_a_bad_shape_name_what_was_given(prompts, match):
    engine = _text_engine()
    with pytest.raises(TypeError, match=match):
        engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_sampling_params_of_the_wrong_type_name_their_type():
    """A dict used to be read as a list of its keys: 'sampling_params must be SamplingParams, got str'."""
    engine = _text_engine()
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams or a list of them, got dict"):
        engine.generate(["a", "b"], {"max_tokens": 4}, use_tqdm=False)
    with pytest.raises(TypeError, match="got str"):
        engine.generate(["a"], "greedy", use_tqdm=False)
    assert not engine.has_unfinished_requests()
