"""The MTP head's proposer through the whole engine (`pagedjax.spec_decode.mtp`): every proposal is the head's dense
chain over the request's tokens (its KV bookkeeping is right: which positions it computed, with which features, in
which slots, across prefill chunks, verifying steps, prefix-cache hits and preemptions), the output is the
non-speculative one (greedy against the dense model, seeded samples against the engine without speculation), a
failing head call costs only its proposals, sleep / wake, the bundled model's trained head, and the errors."""

from __future__ import annotations

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams
from pagedjax.config import SchedulerConfig, SpeculativeConfig
from pagedjax.model.loading.checkpoint import bundled_model_path, read_checkpoint_metadata
from pagedjax.model.loading.loader import folder_mtp_head
from pagedjax.parallel import ParallelConfig
from pagedjax.spec_decode.mtp import MTPProposer, load_mtp_head
from pagedjax.spec_decode.mtp_head import MTPHead, head_config, init_head, load_head, save_head
from tests.engine.test_engine import (
    CFG,
    MAX_LEN,
    MAX_TOKENS,
    PROMPTS,
    SEED,
    assert_all_free,
    dense_greedy,
    reference,
)
from tests.engine.test_speculative import assert_same_outputs

HEAD = init_head(CFG, seed=3)


def mtp(k: int = 3, head=HEAD) -> SpeculativeConfig:
    return SpeculativeConfig(method="mtp", draft_model=head, num_speculative_tokens=k)


def make_engine(block_size=16, num_blocks=64, max_num_seqs=4, max_batched=32, **kw) -> LLMEngine:
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                     scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                                      max_model_len=MAX_LEN), seed=SEED, **kw)


def dense_chain(target, head: MTPHead, k: int):
    """f(tokens, n) -> the head's first n <= k greedy guesses after `tokens` (t_0 .. t_N; the target computed t_0 ..
    t_{N-1}) by its dense forward, and the smallest top-1 / top-2 logit margin among them: rows p = 0 .. N-1 read
    (t_{p+1}, the target's f_p); each guess d_j is then a row of its own, with the head's previous output as its
    feature. One jitted program: k guesses over sequences padded to MAX_LEN + k (rows past the last real one are
    causal padding; a guess depends on the earlier ones only)."""
    target_graphdef, target_state = nnx.split(target)
    head_graphdef, head_state = nnx.split(head)

    @jax.jit
    def chain(tokens, n):
        target, head = nnx.merge(target_graphdef, target_state), nnx.merge(head_graphdef, head_state)
        feats = target.hidden_dense(tokens[None])[0]
        inputs = jnp.concatenate([tokens[1:], tokens[:1]])
        guesses, margins = [], []
        for j in range(k):
            h = head.dense(target.embed(inputs)[None], feats[None])[0]
            logits = head.logits(target, h[n - 1 + j])
            top = jax.lax.top_k(logits, 2)[0]
            guess = jnp.argmax(logits).astype(jnp.int32)
            guesses.append(guess)
            margins.append(top[0] - top[1])
            inputs = inputs.at[n + j].set(guess)
            feats = feats.at[n + j].set(h[n - 1 + j])
        return jnp.stack(guesses), jnp.stack(margins)

    def run(tokens: list[int], n: int) -> tuple[list[int], float]:
        padded = np.zeros(MAX_LEN + k, np.int32)
        padded[:len(tokens)] = tokens
        guesses, margins = chain(padded, len(tokens) - 1)
        return np.asarray(guesses)[:n].tolist(), float(np.min(np.asarray(margins)[:n]))

    return run


def recorded_proposals(engine: LLMEngine, monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the proposal) of every proposal the engine's MTP proposer makes from now on."""
    proposer = engine.speculator.proposer
    assert isinstance(proposer, MTPProposer)
    seen, propose = [], proposer.propose

    def recording(asks, step):
        out = propose(asks, step)
        seen.extend((list(a.request.all_token_ids), list(p)) for a, p in zip(asks, out, strict=True) if p)
        return out

    monkeypatch.setattr(proposer, "propose", recording)
    return seen


def check_against_dense(engine: LLMEngine, seen, minimum: int) -> None:
    target = nnx.merge(engine.runner.graphdef, engine.runner.params)
    head = nnx.merge(engine.speculator.proposer.head_graphdef, engine.speculator.proposer.head_params)
    k = engine.config.speculative_config.num_speculative_tokens
    reference_chain, compared = dense_chain(target, head, k), 0
    for tokens, proposal in seen:
        expected, margin = reference_chain(tokens, len(proposal))
        if margin > 1e-4:  # a near tie may flip under float32 rounding
            assert proposal == expected, (len(tokens), proposal, expected)
            compared += 1
    assert compared >= minimum, (compared, len(seen))


@pytest.mark.parametrize("block_size, first", [(8, slice(2, 4)), pytest.param(16, slice(0, 4), marks=pytest.mark.slow)])
def test_proposals_are_the_dense_chain_and_outputs_the_dense_tokens(monkeypatch, block_size, first):
    """Prompts of 53 and 45 tokens (chunked: 32 tokens per step; the slow variant adds prompts of 1 and 16), then
    the second again with one sharing its 40-token prefix and one its first 36: their prefix-cache hits end a block
    before the shared text's last full block (`KVCacheManager.drop_last_hit_block`; with blocks of 8 the 40 shared
    tokens end on a block boundary and the 36 inside a block, with 16 both inside one), so the head's KV at a hit's
    last position was made with the same next token.
    k = 3, `decode_steps_per_call` 4: no fused decode runs. Every proposal equals the head's dense chain; the tokens
    are the dense model's."""
    engine = make_engine(block_size=block_size, speculative_config=mtp(), decode_steps_per_call=4)
    seen = recorded_proposals(engine, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = engine.generate(PROMPTS[first], params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference()[first]
    inside = PROMPTS[3][:36] + [1, 2, 3, 4, 5]  # leaves the cached text inside a block, at 36
    outs = engine.generate(PROMPTS[3:5] + [inside], params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference()[3:5] + dense_greedy([inside], MAX_TOKENS)[0]
    # 40 (36) shared tokens, their full blocks cached, one left out
    assert [o.num_cached_tokens for o in outs] == [(n // block_size - 1) * block_size for n in (40, 40, 36)]
    assert engine.stats().spec_proposed_tokens > 0
    assert engine.stats().fused_decode_calls == 0  # its steps would keep no hidden states for the head
    check_against_dense(engine, seen, minimum=30)
    assert_all_free(engine)


@pytest.mark.slow
def test_preempted_requests_recompute_the_heads_kv(monkeypatch):
    """A pool too small for four requests at once: preemptions recompute the victims' target KV and, with it, the
    head's; the proposals after each recompute are still the dense chain's. (With k = 5: four chained steps.)"""
    engine = make_engine(block_size=8, num_blocks=16, speculative_config=mtp(k=5))
    seen = recorded_proposals(engine, monkeypatch)
    outs = engine.generate(PROMPTS[1:5], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference()[1:5]
    assert engine.stats().scheduler.num_preemptions > 0
    check_against_dense(engine, seen, minimum=20)
    assert_all_free(engine)


@pytest.mark.slow
def test_seeded_samples_equal_the_engine_without_speculation():
    """Seeded sampling with log-probabilities, greedy, a forked multi-sample request, and one with penalties (not
    speculated, in the same steps): every output is the engine's without speculation."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, top_p=0.95, seed=3, logprobs=2),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1),
              SamplingParams(max_tokens=7, temperature=1.0, seed=11, n=2),
              SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.5, temperature=0.9, seed=2)]
    plain = make_engine().generate(PROMPTS[:4], params, use_tqdm=False)
    engine = make_engine(speculative_config=mtp())
    speculative = engine.generate(PROMPTS[:4], params, use_tqdm=False)
    for a, b in zip(plain, speculative, strict=True):
        assert_same_outputs(a, b)
    assert engine.stats().spec_proposed_tokens > 0
    assert_all_free(engine)


def test_a_failing_head_call_costs_its_proposals_only(monkeypatch, caplog):
    """The head's second call raises: that step proposes nothing, the engine goes on serving (later calls
    propose), the tokens are the dense model's and no block is left held. (The default case's shapes.)"""
    engine = make_engine(block_size=8, speculative_config=mtp())
    proposer = engine.speculator.proposer
    lookup, calls = proposer.programs.lookup_optional, []

    def fails_once(shape, prepare):
        program = lookup(shape, prepare)
        calls.append(1)
        if len(calls) == 2:
            def lost(*args):
                raise RuntimeError("head device lost")
            return lost
        return program

    monkeypatch.setattr(proposer.programs, "lookup_optional", fails_once)
    with caplog.at_level(logging.ERROR, logger="pagedjax.spec_decode.mtp"):
        outs = engine.generate(PROMPTS[2:4], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference()[2:4]
    assert proposer.num_failed_calls == 1 and "head device lost" in caplog.text
    assert len(calls) > 2 and engine.stats().spec_proposed_tokens > 0
    assert_all_free(engine)


def test_with_background_compiles_a_head_program_never_stalls_a_step():
    """`compile_in_background` (a server's engine): a head call whose program is not compiled yet proposes nothing
    while it compiles in the background; the engine's thread never waits for the head's compiles, the tokens are the
    dense model's, and once compiled the programs propose. `close()` cancels the head's compiles still waiting."""
    engine = make_engine(block_size=8, speculative_config=mtp(), compile_in_background=True)
    proposer = engine.speculator.proposer
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = engine.generate(PROMPTS[2:4], params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference()[2:4]
    programs = proposer.programs
    assert programs.num_compilations >= 1 and programs.compile_seconds == 0.0
    programs.wait()  # (a test's: a server never waits)
    before = engine.stats().spec_proposed_tokens
    outs = engine.generate(PROMPTS[2:4], params, use_tqdm=False)  # the same shapes: compiled now
    assert [o.output_token_ids for o in outs] == reference()[2:4]
    assert engine.stats().spec_proposed_tokens > before and programs.compile_seconds == 0.0
    engine.close()
    assert programs.num_pending == 0
    assert_all_free(engine)


# (CI time: 10 s) the engine's own stand-in programs after warm-up run in tests/engine/test_programs.py
@pytest.mark.slow
def test_after_warmup_a_head_call_without_its_program_runs_on_the_warmups():
    """`warmup()` compiles the head's widest program too: with background compiles, a call whose own program is
    not compiled yet runs on it, padded, so the first steps propose (without it they proposed nothing until their
    own compiled), nothing compiles on the engine's thread, and the tokens are the dense model's."""
    engine = make_engine(block_size=8, speculative_config=mtp(), compile_in_background=True)
    proposer = engine.speculator.proposer
    engine.warmup()
    assert proposer.widest is not None and proposer.programs.executables.get(proposer.widest) is not None
    calls = []
    program = proposer.programs.executables[proposer.widest]
    proposer.programs.executables[proposer.widest] = lambda *a: calls.append(a[3].shape) or program(*a)
    outs = engine.generate(PROMPTS[2:3], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [reference()[2][:3]]
    assert calls and all(rows == proposer.widest.rows for rows, _ in calls)  # the hidden states padded to it
    assert engine.stats().spec_proposed_tokens > 0 and proposer.programs.compile_seconds == 0.0
    engine.close()
    assert_all_free(engine)


@pytest.mark.slow
def test_sleep_releases_the_heads_kv_and_wake_serves_again():
    """(With k = 1: no chained step.)"""
    engine = make_engine(speculative_config=mtp(k=1))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    engine.generate(PROMPTS[:1], params, use_tqdm=False)
    head_bytes = engine.speculator.proposer.kv.nbytes
    freed = engine.sleep()
    assert engine.speculator.proposer.kv is None and freed >= head_bytes > 0
    engine.wake()
    outs = engine.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference()[:2] and engine.stats().spec_proposed_tokens > 0


def test_the_kv_pool_is_sized_with_the_heads_bytes():
    cache = CacheConfig(block_size=16, kv_memory_bytes=1 << 20)
    plain = LLMEngine(model_config=CFG, cache_config=cache, seed=SEED)
    with_head = LLMEngine(model_config=CFG, cache_config=cache, seed=SEED, speculative_config=mtp())
    per_block = cache.block_bytes(CFG.spec)
    assert plain.num_blocks == (1 << 20) // per_block
    assert with_head.num_blocks == (1 << 20) // (per_block + cache.block_bytes(head_config(CFG).spec))


def test_a_saved_head_loads_for_its_target_and_is_refused_for_another(tmp_path):
    save_head(tmp_path / "mtp", HEAD, extra={"note": "test"})
    loaded = load_head(tmp_path / "mtp", CFG)
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), nnx.state(loaded), nnx.state(HEAD))
    assert all(jax.tree.leaves(same))
    half = load_head(tmp_path / "mtp", CFG.replace(dtype="bfloat16"))  # served in its target's dtype
    assert half.config == head_config(CFG.replace(dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(half))} == {jnp.dtype("bfloat16")}
    other = CFG.replace(hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="the MTP head in .* was built for another target"):
        load_head(tmp_path / "mtp", other)
    with pytest.raises(FileNotFoundError, match="no MTP head in .*mtp_config.json is missing"):
        load_head(tmp_path, CFG)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "mtp_config.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="is not an MTP head's config"):
        load_head(tmp_path / "bad", CFG)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(speculative_config=SpeculativeConfig(method="mtp")), ValueError,
     r"SpeculativeConfig\(method='mtp'\) needs its head"),
    (dict(speculative_config=SpeculativeConfig(method="mtp", draft_model=init_head(CFG.replace(hidden_size=32,
                                                                                           head_dim=8)))),
     ValueError, "the MTPHead was built for another target"),
    (dict(speculative_config=SpeculativeConfig(method="mtp", draft_model=42)), TypeError,
     "a head's folder or an MTPHead, got int"),
    (dict(speculative_config=mtp(), parallel_config=ParallelConfig(tensor_parallel_size=1)), ValueError,
     "does not run under a parallel_config"),
    (dict(speculative_config=mtp(), cache_config=CacheConfig(num_blocks=32, kv_host_memory_bytes=1 << 20)),
     ValueError, "the host tier does not move a draft model's or an MTP head's KV"),
])
def test_engine_refuses(kwargs, error, match):
    with pytest.raises(error, match=match):
        LLMEngine(model_config=CFG, seed=SEED, **kwargs)


def test_the_head_and_its_proposer_refuse_what_they_cannot_serve(tmp_path):
    with pytest.raises(ValueError, match="needs a built-in model"):
        load_mtp_head(mtp(), None, None)  # a model of the public contract: no ModelConfig to share
    assert load_mtp_head(SpeculativeConfig(), CFG, None) is None and load_mtp_head(None, CFG, None) is None
    with pytest.raises(ValueError, match="an MTP head has one layer, its config says 2"):
        MTPHead(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="must keep its hidden states"):
        MTPProposer(HEAD, types.SimpleNamespace(keep_hidden=False), 8, CacheConfig(block_size=16, num_blocks=8), 2)
    with pytest.raises(TypeError, match="not JSON serializable"):
        save_head(tmp_path / "h", HEAD, extra={"bad": object()})
    assert not (tmp_path / "h").exists()  # refused before anything was written


def test_a_head_is_refused_for_targets_whose_layers_it_does_not_build():
    with pytest.raises(ValueError, match="this target has sliding windows, architecture 'gemma2'"):
        head_config(CFG.replace(architecture="gemma2", sliding_windows=(8, None)))
    with pytest.raises(TypeError, match="built-in model's ModelConfig"):
        head_config(CFG.spec)


def test_the_bundled_model_ships_its_head():
    """`from_pretrained` and `--model` find a folder's `mtp/` (the bundled model's: scripts/train_mtp.py); its
    acceptance through the whole engine is tests/cli/test_cli_speculative.py's."""
    config = folder_mtp_head(None, SpeculativeConfig(method="mtp"))
    assert config == SpeculativeConfig(method="mtp", draft_model=str(bundled_model_path() / "mtp"))
    assert folder_mtp_head(None, SpeculativeConfig(method="mtp", draft_model="mine")).draft_model == "mine"
    assert folder_mtp_head(None, SpeculativeConfig()) == SpeculativeConfig()
    cfg = ModelConfig.from_dict(read_checkpoint_metadata(bundled_model_path())["model_config"])
    head = load_head(bundled_model_path() / "mtp", cfg)
    assert head.config == head_config(cfg)


def test_a_model_folder_without_a_head_is_named(tmp_path):
    from pagedjax.model.loading.checkpoint import load_checkpoint, save_checkpoint

    cfg, state = load_checkpoint(bundled_model_path())
    save_checkpoint(tmp_path / "model", cfg, state)
    with pytest.raises(ValueError, match=r"needs its head.*mtp/"):
        LLMEngine.from_pretrained(tmp_path / "model", speculative_config=SpeculativeConfig(method="mtp"))
