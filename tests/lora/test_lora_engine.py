"""Multi-LoRA serving end to end: each adapter's greedy tokens equal the merged-weights model's (W + scale A B,
by full recompute), in batches mixing base and adapter requests, through chunked prefill, fused decode and slot
swaps (more adapters than slots), without recompiling; the adapter is part of every block's identity; a token
reads its own slot only (other slots full of NaN change nothing of it), and an adapter leaves no weights behind."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from pagedjax import (
    BeamSearchParams,
    CacheConfig,
    LLMEngine,
    LoRARequest,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
)
from pagedjax.config import LoRAConfig, MoEConfig, QuantConfig, SpeculativeConfig
from pagedjax.model.layers.lora import ATTENTION_MODULES, TARGET_MODULES, LoRAWeights, lora_weights_nbytes
from pagedjax.model.llama import init_model, model_from_state, quantize_params
from tests import dense
from tests.engine.latent_toy import LatentToy
from tests.kernels.cases import examples
from tests.lora.adapters import merged_params, write_adapter

CFG = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128)
SEED = 7
MAX_TOKENS = 10
MAX_LEN = 96
BLOCK = 8
_rng = np.random.default_rng(3)
PROMPTS = [_rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 17, 45, 9)]  # 45 > the 32-token budget
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Different ranks and target sets (all-linear, attention-only rsLoRA, MLP-only), more adapters than slots.
# Seeds chosen for no near tie (a top-1 / top-2 logit margin > 1e-3) in the references.
ADAPTERS = {1: dict(rank=8, targets="all-linear", alpha=16, seed=1),
            2: dict(rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"), alpha=6, rslora=True, seed=22),
            3: dict(rank=16, targets=("gate_proj", "up_proj", "down_proj"), alpha=8, seed=3)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {i: write_adapter(root / f"a{i}", CFG, **kw) for i, kw in ADAPTERS.items()}


def lora(folders, i):
    return None if i is None else LoRARequest(f"a{i}", i, str(folders[i]))


@pytest.fixture(scope="module")
def engine():
    # 2 slots for 3 adapters; a 32-token budget chunks the long prompt; fused decodes of 4 steps.
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=160),
                     scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=MAX_LEN),
                     seed=SEED, decode_steps_per_call=4, lora_config=LoRAConfig(max_loras=2, max_lora_rank=16))


@functools.cache
def _dense_forward(folder):
    state = nnx.state(init_model(CFG, SEED), nnx.Param) if folder is None else merged_params(CFG, SEED, folder)
    graphdef = nnx.graphdef(init_model(CFG, SEED))
    return jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))


@functools.cache
def _reference(folder, prompts) -> list[list[int]]:
    outputs, margin = dense.greedy_by_recompute(_dense_forward(folder), prompts, MAX_TOKENS, MAX_LEN)
    assert margin > 1e-3, margin  # no near tie: identical tokens do not hang on rounding
    return outputs


def reference(folders, i, prompts=PROMPTS) -> list[list[int]]:
    """Greedy tokens of each prompt by the merged-weights model of adapter i (None: the base model)."""
    return _reference(None if i is None else folders[i], tuple(map(tuple, prompts)))


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("adapter", [None, 1, 2, 3])
def test_each_adapter_equals_its_merged_weights_model(engine, folders, adapter):
    outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora(folders, adapter))
    assert tokens(outputs) == reference(folders, adapter)


# (CI time) Each example is one batch through the shared engine (~1 s): the two explicit ones and one drawn.
@settings(max_examples=examples(1), deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, 1, 2, 3]), st.integers(0, len(PROMPTS) - 1)), min_size=1,
                max_size=8))
@example([(1, 2), (None, 0), (3, 2), (2, 1), (None, 2), (1, 3), (3, 0), (2, 2)])  # 3 adapters, 2 slots
@example([(2, 2)])
def test_a_random_mixed_batch_equals_each_request_alone(engine, folders, batch):
    """Any batch of base and adapter requests (more adapters than slots, repeats, one prompt under several
    adapters) gives each request the tokens of its merged-weights model alone."""
    picks, which = zip(*batch, strict=True)
    outputs = engine.generate([PROMPTS[w] for w in which], GREEDY, use_tqdm=False,
                              lora_request=[lora(folders, i) for i in picks])
    assert tokens(outputs) == [reference(folders, i)[w] for i, w in zip(picks, which, strict=True)]


def test_fused_decode_serves_adapters(engine, folders):
    before = engine.stats().fused_decode_calls
    outputs = engine.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[lora(folders, 1), lora(folders, 2)])
    assert tokens(outputs) == [reference(folders, 1)[0], reference(folders, 2)[1]]
    assert engine.stats().fused_decode_calls > before


def test_swapping_adapters_through_the_slots_never_recompiles(engine, folders):
    rng = np.random.default_rng(11)
    fresh = lambda: [rng.integers(0, CFG.vocab_size, len(p)).tolist() for p in PROMPTS]  # no prefix hits
    for i in (3, 1):  # the slots hold 3 then 1, whatever tests before left there
        engine.generate(fresh(), GREEDY, use_tqdm=False, lora_request=lora(folders, i))
    compiled, loads = engine.stats().compilations, engine.lora.num_slot_loads
    for i in (2, 3, 1, 2):  # 2 evicts 3, 3 evicts 1, 1 evicts 2, 2 evicts 3: every run loads a slot
        engine.generate(fresh(), GREEDY, use_tqdm=False, lora_request=lora(folders, i))
    assert engine.lora.num_slot_loads - loads == 4
    assert engine.stats().compilations == compiled


def test_blocks_are_shared_under_one_adapter_only(engine, folders):
    prompt = np.random.default_rng(12).integers(0, CFG.vocab_size, 4 * BLOCK + 3).tolist()
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def hits(i):
        before = engine.stats().scheduler.prefix_cache_hits
        engine.generate([prompt], one, use_tqdm=False, lora_request=lora(folders, i))
        return engine.stats().scheduler.prefix_cache_hits - before

    assert hits(1) == 0
    assert hits(2) == 0  # the same tokens under another adapter: no block matches
    assert hits(None) == 0  # nor under the base model
    assert hits(1) == 4 * BLOCK  # the same adapter: every full block
    assert hits(None) == 4 * BLOCK


def test_lora_requests_are_checked(engine, folders, tmp_path):
    with pytest.raises(TypeError, match="LoRARequest"):
        engine.add_request("x", [1, 2], lora_request="a1")
    engine.add_request("ok", [1, 2], lora_request=lora(folders, 1))  # binds id 1 to a1 (if no test did)
    assert engine.abort("ok")
    with pytest.raises(ValueError, match="lora_int_id 1 is 'a1'"):
        engine.add_request("x", [1, 2], lora_request=LoRARequest("other", 1, str(folders[1])))
    big = write_adapter(tmp_path / "big", CFG, rank=32, seed=0)
    with pytest.raises(ValueError, match="request 'x'.*field 'r' is 32, above the engine's max_lora_rank 16"):
        engine.add_request("x", [1, 2], lora_request=LoRARequest("big", 9, str(big)))
    with pytest.raises(ValueError, match="2 lora requests for 1 prompts"):
        engine.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=[None, None])
    with pytest.raises(TypeError, match="LoRARequests or None, got str"):
        engine.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=["a"])
    assert not engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="lora_int_id must be an int"):
        LoRARequest("a", "1", "/x")
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("a", 0, "/x")


def test_engines_that_cannot_serve_adapters_refuse(folders):
    plain = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=16), seed=SEED,
                      compile_cache=False)
    with pytest.raises(ValueError, match="needs an engine that serves LoRA adapters"):
        plain.add_request("x", [1, 2], lora_request=lora(folders, 1))
    moe = CFG.replace(moe=MoEConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=32))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLMEngine(model_config=moe, cache_config=CacheConfig(block_size=BLOCK, num_blocks=16), compile_cache=False,
                  lora_config=LoRAConfig())
    with pytest.raises(ValueError, match="built-in model"):
        LLMEngine(model=LatentToy(), cache_config=CacheConfig(block_size=BLOCK, num_blocks=16), compile_cache=False,
                  lora_config=LoRAConfig())
    with pytest.raises(ValueError, match="LoRAConfig.max_cpu_loras must be >= 4"):
        LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=16),
                  lora_config=LoRAConfig(max_cpu_loras=2))


def test_samples_of_a_request_keep_its_adapter(engine, folders):
    # Greedy: both samples are the reference.
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=2)
    outputs = engine.generate(PROMPTS[:2], params, use_tqdm=False, lora_request=[lora(folders, 3), lora(folders, 2)])
    for out, i, k in zip(outputs, (3, 2), (0, 1), strict=True):
        assert [c.token_ids for c in out.outputs] == [reference(folders, i)[k]] * 2


@pytest.mark.slow  # (CI time: 6 s) a combination: n-gram speculation and adapters each run by default
def test_ngram_speculation_serves_adapters(folders):
    # Repetitive prompts, so that prompt lookup proposes; verification runs each token (every verified position)
    # under its own adapter: two adapters and the base model in one batch give the tokens decoding without
    # speculation gives (the merged-weights models': `test_each_adapter_equals_its_merged_weights_model`).
    repeats = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5 + [9, 10], [12, 13] * 6]
    prompts, picks = [repeats[0], repeats[1], repeats[2], repeats[1]], [2, 2, None, 1]
    engine = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=64),
                       scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                        max_model_len=MAX_LEN), seed=SEED,
                       speculative_config=SpeculativeConfig(num_speculative_tokens=3),
                       lora_config=LoRAConfig(max_loras=2))
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=[lora(folders, i) for i in picks])
    assert tokens(outputs) == [reference(folders, i, prompts)[k] for k, i in enumerate(picks)]
    stats = engine.stats()
    # Proposals accepted and rejected (rolled back) under adapters and the base model alike.
    assert stats.spec_proposed_tokens > stats.spec_accepted_tokens > 0, stats


def test_draft_model_speculation_is_refused_with_lora():
    # The draft would propose without the requests' adapters.
    draft = SpeculativeConfig(method="draft", draft_model=CFG.replace(num_layers=1), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="SpeculativeConfig\\(method='draft'\\) is not supported with LoRA"):
        LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=16), speculative_config=draft,
                  compile_cache=False, lora_config=LoRAConfig())


def test_adapters_are_added_and_removed_at_runtime(engine, folders):
    engine.add_lora(lora(folders, 2))
    assert lora(folders, 2) in engine.list_loras()
    prompt = np.random.default_rng(13).integers(0, CFG.vocab_size, 2 * BLOCK + 1).tolist()
    engine.add_request("busy", prompt, SamplingParams(max_tokens=2, temperature=0.0), lora_request=lora(folders, 2))
    with pytest.raises(ValueError, match="in use by unfinished requests"):
        engine.remove_lora(2)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(2) and not engine.remove_lora(2)
    assert lora(folders, 2) not in engine.list_loras()
    # Id 2 again, now bound to adapter 3's folder: its requests get adapter 3's tokens, and never the blocks
    # cached under id 2's former weights.
    rebound = LoRARequest("again", 2, str(folders[3]))
    before = engine.stats().scheduler.prefix_cache_hits
    outputs = engine.generate([prompt, PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=rebound)
    assert engine.stats().scheduler.prefix_cache_hits == before
    assert tokens(outputs)[1] == reference(folders, 3)[1]
    assert engine.remove_lora(2)
    engine.add_lora(lora(folders, 2))  # and back (later tests' adapter 2)
    plain = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=16), seed=SEED,
                      compile_cache=False)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.list_loras()


def test_beam_search_and_score_under_an_adapter_equal_the_merged_model(engine, folders):
    merged = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=160),
                       scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                                        max_model_len=MAX_LEN), seed=SEED, params=merged_params(CFG,
                                                                                                                SEED,
                                                                                                                folders[1]))
    beams = BeamSearchParams(beam_width=2, max_tokens=4)
    prompts = PROMPTS[:2]
    got = engine.beam_search(prompts, beams, lora_request=lora(folders, 1))
    want = merged.beam_search(prompts, beams)
    assert [[s.token_ids for s in o.sequences] for o in got] == [[s.token_ids for s in o.sequences] for o in want]
    completions = [reference(folders, 1)[0][:4], reference(folders, 1)[1][:4]]
    scored = engine.score(prompts, completions, lora_request=lora(folders, 1))
    for a, b in zip(scored, merged.score(prompts, completions), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    base = engine.score(prompts, completions)
    assert not np.allclose(base[1], scored[1], atol=1e-2)  # the adapter matters


def test_slot_bytes_and_slot_bounds(engine):
    weights = engine.runner.lora_weights
    per_slot = sum(x.nbytes for x in jax.tree.leaves(weights)) // weights.scales.shape[0]
    assert per_slot == lora_weights_nbytes(CFG, 16)
    a, b = [{}] * CFG.num_layers, [{}] * CFG.num_layers
    for slot in (0, 3):  # slot 0 is the base model's zeros; max_loras is 2
        with pytest.raises(ValueError, match=f"LoRA slot {slot} outside \\[1, 2\\]"):
            engine.runner.set_lora_slot(slot, a, b, 1.0)


def test_one_slot_one_host_copy_and_preemption(folders):
    # One device slot and one host copy for two adapters, and a pool too small for the batch (preemption).
    small = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=9),
                      scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                                       max_model_len=MAX_LEN),
                      seed=SEED, lora_config=LoRAConfig(max_loras=1, max_cpu_loras=1))
    picks = [1, 2, None, 1]
    outputs = small.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[lora(folders, i) for i in picks])
    assert tokens(outputs) == [reference(folders, i)[k] for k, i in enumerate(picks)]
    assert small.stats().scheduler.num_preemptions > 0
    # 1 and 2 were read when added (2 pushing 1 out of host memory); then each is read again for its slot, 1
    # pushing 2 out and 2, after 1's requests finished, pushing 1 out.
    assert small.lora.num_disk_loads == 4 and small.lora.num_slot_loads == 2


def test_data_parallel_engines_refuse_lora():
    from pagedjax.config import EngineConfig, LoRAConfig, ParallelConfig
    from pagedjax.engine.data_parallel import DataParallelEngine

    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        DataParallelEngine(model_config=CFG, parallel_config=ParallelConfig(data_parallel_size=2),
                           lora_config=LoRAConfig())
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        DataParallelEngine(parallel_config=ParallelConfig(data_parallel_size=2),
                           config=EngineConfig(model_config=CFG, lora_config=LoRAConfig()))


def test_float_adapters_on_an_int8_base(folders):
    """An int8 base model with a float adapter computes what a float model of its dequantized kernels with the
    adapter merged does."""
    qcfg, qstate = quantize_params(CFG, nnx.state(init_model(CFG, SEED), nnx.Param), QuantConfig.parse("int8"))
    qmodel = model_from_state(qcfg, qstate)
    kernels = {(i, m): np.asarray(getattr(getattr(layer, "self_attn" if m in ATTENTION_MODULES else "mlp"), m).kernel())
               for i, layer in enumerate(qmodel.layers) for m in TARGET_MODULES}
    state = merged_params(CFG, SEED, folders[1], kernels)
    graphdef = nnx.graphdef(init_model(CFG, SEED))
    want, margin = dense.greedy_by_recompute(jax.jit(lambda t: nnx.merge(graphdef, state).forward_dense(t)), PROMPTS,
                                             MAX_TOKENS, MAX_LEN)
    assert margin > 1e-3, margin
    engine = LLMEngine(model_config=qcfg, cache_config=CacheConfig(block_size=BLOCK, num_blocks=64),
                       scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                        max_model_len=MAX_LEN), params=qstate, seed=SEED,
                       lora_config=LoRAConfig(max_loras=1))
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora(folders, 1))) == want


def test_a_poisoned_adapter_is_refused_by_tensor_and_the_engine_serves_on(engine, folders, tmp_path):
    bad = write_adapter(tmp_path / "bad", CFG, rank=4, seed=5)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    tensors[key][2, 7] = np.nan  # one weight of one tensor
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    loads, weights = engine.lora.num_slot_loads, engine.runner.lora_weights
    for add in (lambda r: engine.add_lora(r), lambda r: engine.add_request("bad", [1, 2], lora_request=r)):
        with pytest.raises(ValueError, match=f"tensor '{key}' holds NaN"):
            add(LoRARequest("bad", 9, str(bad)))
    assert 9 not in {r.lora_int_id for r in engine.list_loras()} and not engine.has_unfinished_requests()
    assert engine.lora.num_slot_loads == loads and engine.runner.lora_weights is weights  # no slot touched
    outputs = engine.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[None, lora(folders, 1)])
    assert tokens(outputs) == [reference(folders, None)[0], reference(folders, 1)[1]]


def test_a_removed_adapters_slot_is_zeroed(engine, folders):
    """Removing an adapter zeroes its device slot at once (it used to stay until another adapter took it)."""
    request = LoRARequest("leaving", 8, str(folders[3]))
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=request)
    slot = engine.lora.slots.slot_of(engine.lora.key_of(8))
    assert engine.runner.lora_weights.scales[slot] != 0
    assert engine.remove_lora(8)
    weights = engine.runner.lora_weights
    assert not any(np.asarray(w[:, slot]).any() for layer in weights.a for w in layer.values())
    assert not any(np.asarray(w[slot]).any() for layer in weights.b for w in layer.values())
    assert weights.scales[slot] == 0 and slot not in {engine.lora.slots.slot_of(k) for k in engine.lora.slots.resident}


def test_a_failed_slot_load_leaves_no_adapter_on_another_ones_weights(engine, folders, monkeypatch):
    """A slot load that raises (here the write; also a folder that no longer reads, an interrupt) frees the slot it
    was given: the table used to keep the adapter there, so the next step served its requests with the weights of
    the adapter it had evicted."""
    rng = np.random.default_rng(15)
    engine.generate(rng.integers(0, CFG.vocab_size, (2, 3)).tolist(), SamplingParams(max_tokens=1), use_tqdm=False,
                    lora_request=[lora(folders, 1), lora(folders, 2)])  # both slots taken
    key = engine.lora.register(lora(folders, 3))

    def broken(*args):
        raise RuntimeError("injected slot write failure")

    monkeypatch.setattr(engine.runner, "set_lora_slot", broken)
    with pytest.raises(RuntimeError, match="injected"):
        engine.lora.slots_for([key])
    assert engine.lora.slots.slot_of(key) is None
    monkeypatch.undo()
    outputs = engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=lora(folders, 3))
    assert tokens(outputs) == [reference(folders, 3)[0]]


# ------------------------------------------------------------------------------------------------- isolation
POISONS = {"nan": np.nan, "inf": np.inf, "huge": 3e38}


def _poisoned(weights: LoRAWeights, slots: list[int], value: float) -> LoRAWeights:
    """`weights` with every A, B and scale of `slots` set to `value`, in the device arrays (no validation)."""
    at = np.asarray(slots)
    return LoRAWeights(tuple({m: w.at[:, at].set(value) for m, w in layer.items()} for layer in weights.a),
                       tuple({m: w.at[at].set(value) for m, w in layer.items()} for layer in weights.b),
                       weights.scales.at[at].set(value))


def test_a_token_reads_its_own_slot_only(engine, folders):
    """Every slot but one filled with NaN, infinities or 3e38 (A, B and scale, the base model's slot 0 too) in the
    device arrays: the requests of the clean slot, in the same steps as the poisoned ones (one prefill step, fused
    decodes), get bitwise the tokens and log-probabilities of an unpoisoned run. Before, every linear multiplied
    every token by every slot's A and B and masked with zeros: NaN x 0 reached every token."""
    prompts = np.random.default_rng(14).integers(0, CFG.vocab_size, (6, 4)).tolist()  # 24 tokens: one step
    picks = [None, 1, 2] * 2
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)

    def run():
        engine.scheduler.reset_prefix_cache()  # every token computed again
        outputs = engine.generate(prompts, params, use_tqdm=False, lora_request=[lora(folders, i) for i in picks])
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    clean = run()  # adapters 1 and 2 now in the two slots
    slot_of = {None: 0, **{i: engine.lora.slots.slot_of(engine.lora.key_of(i)) for i in (1, 2)}}
    loads, weights = engine.lora.num_slot_loads, engine.runner.lora_weights
    try:
        for kept in slot_of:
            for name, value in POISONS.items():
                engine.runner.lora_weights = _poisoned(weights, [s for i, s in slot_of.items() if i != kept], value)
                got = run()
                assert got != clean, name  # the poison took
                mine = [k for k, i in enumerate(picks) if i == kept]
                assert [got[k] for k in mine] == [clean[k] for k in mine], (kept, name)
        assert engine.lora.num_slot_loads == loads  # no slot was written meanwhile: the poison stayed in place
    finally:
        engine.runner.lora_weights = weights


def test_adapters_prefixes_move_through_the_kv_tiers(folders, tmp_path):
    """One prompt under the base model and two adapters (each its own blocks: the adapter is in the block hashes)
    through a pool for one request, over a host tier of a few blocks and a disk tier: each comes back from the
    tiers the second time, with its merged-weights model's tokens; no block is lent to another adapter's prefix."""
    block_bytes = CacheConfig(block_size=BLOCK).block_bytes(CFG)
    tiers = LLMEngine(model_config=CFG, seed=SEED, lora_config=LoRAConfig(max_loras=2, max_lora_rank=16),
                      cache_config=CacheConfig(block_size=BLOCK, num_blocks=8, kv_host_memory_bytes=8 * block_bytes,
                                               kv_disk_dir=str(tmp_path), kv_disk_bytes=64 * block_bytes),
                      scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32,
                                                       max_model_len=MAX_LEN))
    picks = [None, 1, 2] * 2
    outs = [tiers.generate([PROMPTS[2]], GREEDY, use_tqdm=False, lora_request=lora(folders, i))[0] for i in picks]
    assert tokens(outs) == [reference(folders, i)[2] for i in picks]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 40, 40, 40]
    stats = tiers.stats().scheduler
    assert stats.host_hit_tokens == 120 and stats.disk_blocks_read > 0
    assert tiers.scheduler.kv_cache_manager.block_pool.num_used == 0


def test_adapters_given_with_their_weights_are_served_and_replaced_in_place(engine, folders):
    """`add_lora_adapter`: a trainer's adapter, its weights on the device (never copied to the host), served as
    the same adapter read from a folder; giving the id new weights replaces them, and its requests never hit
    the blocks cached under the former ones."""
    from pagedjax.lora.adapter import LoRAAdapter
    from pagedjax.lora.peft import load_peft_adapter

    def given(i: int) -> LoRAAdapter:
        read = load_peft_adapter(str(folders[i]), f"a{i}", 9, CFG, 16)
        weights = {k: (jax.numpy.asarray(a), jax.numpy.asarray(b)) for k, (a, b) in read.weights.items()}
        return LoRAAdapter("trainer", 9, "in memory", read.rank, read.scale, weights)

    request = LoRARequest("trainer", 9, "in memory")
    assert engine.add_lora_adapter(request, given(1))
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request)) == reference(folders, 1)
    before = engine.stats().scheduler.prefix_cache_hits
    new = given(3)  # the trainer's next weights
    with jax.transfer_guard_device_to_host("disallow"):  # into the slot on the device: no implicit host copy
        assert engine.add_lora_adapter(request, new)
        outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request)
    assert tokens(outputs) == reference(folders, 3)
    assert engine.stats().scheduler.prefix_cache_hits == before
    engine.add_request("busy", PROMPTS[1], SamplingParams(max_tokens=2, temperature=0.0), lora_request=request)
    with pytest.raises(ValueError, match="in use by unfinished requests"):
        engine.add_lora_adapter(request, given(1))
    while engine.has_unfinished_requests():
        engine.step()
    good = given(1)
    (layer, module), (a, b) = next(iter(good.weights.items()))
    wrong = {(layer, module): (a[:-1], b)}
    for adapter, error in [(LoRAAdapter("x", 8, "m", good.rank, 1.0, good.weights), "adapter 8 given for lora_int_id"),
                           (LoRAAdapter("x", 9, "m", 32, 1.0, {}), "adapter rank 32 > max_lora_rank 16"),
                           (LoRAAdapter("x", 9, "m", good.rank, 1.0, wrong), f"layer {layer} {module}: A"),
                           (LoRAAdapter("x", 9, "m", good.rank, 1.0, {(5, module): (a, b)}), "layer 5"),
                           (LoRAAdapter("x", 9, "m", good.rank, 1.0, {(0, "lm_head"): (a, b)}), "layer 0 lm_head")]:
        with pytest.raises(ValueError, match=error):
            engine.add_lora_adapter(request, adapter)
    with pytest.raises(TypeError, match="takes a LoRARequest and a LoRAAdapter"):
        engine.add_lora_adapter(request, good.weights)
    # every refusal left the registered weights (adapter 3's) serving, and no block behind
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request)) == reference(folders, 3)
    assert engine.remove_lora(9)
    assert engine.stats().scheduler.memory.num_used_blocks == 0
