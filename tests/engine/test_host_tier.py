"""The host tier through the whole engine (`CacheConfig.kv_host_memory_bytes`), and the disk tier under it
(`kv_disk_dir`): prefixes the device pool evicted are served from host memory or from files, after a restart too
(`num_cached_tokens` shows them), and the tokens are the dense model's whatever the tiers do: random workloads over
tiny pools (preemption, forks, fused decode), failed steps with moves in flight, bad files."""

from __future__ import annotations

import tempfile

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.engine.summary import summarize
from tests.dense import greedy_by_recompute
from tests.engine.test_engine import CFG, MAX_LEN, SEED, dense_greedy
from tests.engine.test_engine_faults import Faults

HOST = 1 << 20  # slots for every block these workloads evict


def _engine(*, block_size: int = 4, num_blocks: int = 10, budget: int = 8, max_num_seqs: int = 1, steps: int = 1,
            host: int | None = HOST, disk_dir=None, disk: int = HOST, seed: int = SEED) -> LLMEngine:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_host_memory_bytes=host,
                        kv_disk_dir=None if disk_dir is None else str(disk_dir),
                        kv_disk_bytes=None if disk_dir is None else disk)
    return LLMEngine(model_config=CFG, cache_config=cache,
                     scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                      max_model_len=MAX_LEN), seed=seed, decode_steps_per_call=steps)


def _check_idle(engine: LLMEngine) -> None:
    kv = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests() and kv.block_pool.num_used == 0
    kv.block_pool.check_invariants()
    for tier in kv.tiers:
        if tier is not None:
            tier.check_invariants()
            assert (tier.disk is not None) == bool(engine.cache_config.kv_disk_dir)


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_prefixes_evicted_from_the_device_are_served_from_host_memory():
    """Three 20-token prefixes, one request at a time, in a pool of 10 blocks of 4: each evicts the one before.
    Without the tier the second round hits nothing; with it, each request hits its 20 tokens, loaded from host."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, 20).tolist() + rng.integers(0, CFG.vocab_size, 3).tolist()
               for _ in range(3)] * 2
    want, margin = dense_greedy(prompts, GREEDY.max_tokens)
    assert margin > 1e-3
    for host, cached in ((None, [0] * 6), (HOST, [0, 0, 0, 20, 20, 20])):
        engine = _engine(host=host)
        outs = [engine.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == want
        assert [o.num_cached_tokens for o in outs] == cached
        stats = engine.stats().scheduler
        if host is not None:
            assert stats.host_hit_tokens == 60 and stats.host_blocks_loaded == 15
            assert stats.host_blocks_stored >= 15 and stats.host_slots > stats.host_blocks > 0
            assert summarize(engine).lines()[0].endswith(", host tier 1.0 MiB")
            block_bytes = CacheConfig(block_size=4).block_bytes(CFG)
            every = engine.stats()
            assert every.host_bytes_loaded == 15 * block_bytes and every.host_move_s > 0
            assert every.host_bytes_stored == stats.host_blocks_stored * block_bytes
        _check_idle(engine)


def test_a_preempted_request_takes_its_blocks_back_from_the_host():
    """Preemption recomputes only what no tier holds: three requests in a pool for two, one preempted; its full
    blocks were published, evicted into the tier while it waited, and come back from there (fewer prefill tokens
    computed than without the tier), with the dense tokens."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, 20).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want, _ = dense_greedy(prompts, 12)
    computed = {}
    for host in (None, HOST):
        engine = _engine(host=host, budget=64, max_num_seqs=3)
        assert [o.output_token_ids for o in engine.generate(prompts, params, use_tqdm=False)] == want
        stats = engine.stats()
        assert stats.scheduler.num_preemptions > 0
        computed[host] = stats.prefill_tokens_computed
        assert (stats.scheduler.host_hit_tokens > 0) == (host is not None)
        _check_idle(engine)
    assert computed[HOST] < computed[None], computed


@st.composite
def workloads(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16), label="token_seed"))
    block_size = draw(st.sampled_from([4, 8]), label="block_size")
    prefixes = [rng.integers(0, CFG.vocab_size, draw(st.integers(0, 3 * block_size))).tolist()
                for _ in range(draw(st.integers(1, 3), label="num_prefixes"))]
    prompts = [prefixes[draw(st.integers(0, len(prefixes) - 1))]
               + rng.integers(0, CFG.vocab_size, draw(st.integers(1, 12))).tolist()
               for _ in range(draw(st.integers(2, 6), label="num_prompts"))]
    longest = max(map(len, prompts)) + 6
    return dict(prompts=prompts, block_size=block_size,
                num_blocks=draw(st.sampled_from([1, 2]), label="pools_of_longest") * -(-longest // block_size),
                host=draw(st.sampled_from([1, 8, 64]), label="host_blocks"),
                disk=draw(st.sampled_from([None, 2, 64]), label="disk_blocks"),
                budget=draw(st.sampled_from([8, 32]), label="budget"), max_num_seqs=draw(st.integers(1, 3)),
                steps=draw(st.sampled_from([1, 4]), label="steps"), n=draw(st.sampled_from([1, 2]), label="n"),
                waves=draw(st.integers(1, 3), label="waves"),
                abort=draw(st.none() | st.tuples(st.integers(0, len(prompts) - 1), st.integers(0, 6)), label="abort"))


# (CI time: ~2 s an example) 1 drawn (10 in the dev profile) and 2 explicit examples: three prefixes of 3 blocks
# through a pool that fits one request (each evicts the one before; the next wave loads them all from the host, or
# with a host of 2 blocks over a disk tier, from files), forks and fused decode; a roomier pool with batches, a tier
# of one block (stores and loads compete for it).
@settings(max_examples=max(1, settings.default.max_examples // 20), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(w=dict(prompts=[list(range(s, s + 12)) + [1, 2] for s in (10, 30, 50)], block_size=4, num_blocks=5, host=2,
                disk=64, budget=8, max_num_seqs=1, steps=4, n=2, waves=2, abort=(1, 3)))
@example(w=dict(prompts=[list(range(10, 27)), list(range(10, 27)) + [4], list(range(30, 49))], block_size=8,
                num_blocks=6, host=1, disk=None, budget=32, max_num_seqs=3, steps=1, n=1, waves=3, abort=None))
@given(w=workloads())
def test_random_workloads_with_a_host_tier_give_the_dense_tokens(w):
    """Waves of the same prompts (later waves find their prefixes on the device, the host or the disk), greedy n-way
    forks, one request of the first wave aborted after some steps: every sample of every other request is the dense
    model's greedy continuation, nothing is held afterwards, the tiers are consistent."""
    params = SamplingParams(max_tokens=6, temperature=0.0, n=w["n"], ignore_eos=True)
    want, margin = dense_greedy(w["prompts"], params.max_tokens)
    if margin < 1e-3:  # a near tie: the right token depends on rounding
        return
    block_bytes = CacheConfig(block_size=w["block_size"]).block_bytes(CFG)
    with tempfile.TemporaryDirectory() as folder:
        engine = _engine(block_size=w["block_size"], num_blocks=w["num_blocks"], budget=w["budget"],
                         max_num_seqs=w["max_num_seqs"], steps=w["steps"], host=w["host"] * block_bytes,
                         disk_dir=None if w["disk"] is None else folder, disk=(w["disk"] or 1) * block_bytes)
        for wave in range(w["waves"]):
            ids = [f"{wave}-{i}" for i in range(len(w["prompts"]))]
            for rid, prompt in zip(ids, w["prompts"], strict=True):
                engine.add_request(rid, prompt, params)
            done, steps, aborted = {}, 0, None
            while engine.has_unfinished_requests():
                if wave == 0 and w["abort"] is not None and steps == w["abort"][1]:
                    aborted = ids[w["abort"][0]] if engine.abort(ids[w["abort"][0]]) else None
                done.update((o.request_id, o) for o in engine.step() if o.finished)
                steps += 1
            assert set(done) == set(ids) - {aborted}  # an aborted request reports nothing more
            for rid, tokens in zip(ids, want, strict=True):
                if rid != aborted:
                    assert [c.token_ids for c in done[rid].outputs] == [tokens] * w["n"]
        _check_idle(engine)


@pytest.mark.parametrize("mode", ["before", "after", "lose_cache"])
def test_failed_steps_with_moves_in_flight_lose_nothing(mode):
    """Every third device call fails while prefixes move between the tiers: after the faults the engine serves the
    same prompts with the dense tokens, from the tiers again, and its pools and tier stay consistent."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab_size, 16).tolist() + [i] for i in range(3)] * 2
    want, _ = dense_greedy(prompts, GREEDY.max_tokens)
    engine = _engine()
    faults = Faults(engine, fail_at=range(2, 200, 3), mode=mode)
    for p, w in zip(prompts, want, strict=True):
        out = engine.generate([p], GREEDY, use_tqdm=False)[0]  # a one-request step that fails fails the request
        assert out.outputs[0].token_ids == w if out.finish_reason != "error" else "InjectedFault" in out.error
    assert faults.raised
    faults.remove()
    _check_idle(engine)
    outs = [engine.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert engine.stats().scheduler.host_hit_tokens > 0
    _check_idle(engine)


def test_tier_configurations_that_cannot_work_are_refused(tmp_path):
    from pagedjax.config import SpeculativeConfig
    from pagedjax.model.llama import init_model

    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        CacheConfig(kv_host_memory_bytes=HOST, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no block of pool 0"):
        _engine(host=1)
    with pytest.raises(ValueError, match="needs both kv_disk_dir and kv_disk_bytes"):
        CacheConfig(kv_host_memory_bytes=HOST, kv_disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs both kv_disk_dir and kv_disk_bytes"):
        CacheConfig(kv_host_memory_bytes=HOST, kv_disk_bytes=HOST)
    with pytest.raises(ValueError, match="through the host tier"):
        CacheConfig(kv_disk_dir=str(tmp_path), kv_disk_bytes=HOST)
    with pytest.raises(TypeError, match="kv_disk_dir must be a folder's path"):
        CacheConfig(kv_host_memory_bytes=HOST, kv_disk_dir=7, kv_disk_bytes=HOST)
    with pytest.raises(TypeError, match="kv_disk_dir must be a folder's path"):
        CacheConfig(kv_host_memory_bytes=HOST, kv_disk_dir="", kv_disk_bytes=HOST)
    assert CacheConfig(kv_host_memory_bytes=HOST, kv_disk_dir=tmp_path, kv_disk_bytes=HOST).kv_disk_dir == str(tmp_path)
    with pytest.raises(ValueError, match="kv_disk_bytes 1 holds no block of pool 0"):
        _engine(disk_dir=tmp_path, disk=1)
    with pytest.MonkeyPatch.context() as patch:  # several processes (jax.distributed) could find other files
        patch.setattr(jax, "process_count", lambda: 2)
        with pytest.raises(ValueError, match="a disk tier serves one process; this engine runs over 2"):
            _engine(disk_dir=tmp_path)
    draft = SpeculativeConfig(method="draft", draft_model=init_model(CFG, SEED), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="does not move a draft model's or an MTP head's KV"):
        LLMEngine(model_config=CFG, cache_config=CacheConfig(num_blocks=8, kv_host_memory_bytes=HOST),
                  speculative_config=draft, seed=SEED)


def test_latent_sparse_and_gqa_pages_move_through_the_tier():
    """A model of MLA latent pages, DSA latent + indexer-key pages and GQA pages (`tests/engine/latent_toy.py`): its
    three kinds of page arrays go out to the host and back, each prefix served from there the second time, with
    the dense model's tokens."""
    from tests.engine.latent_toy import VOCAB, LatentToy
    from tests.engine.test_latent_cache import MAX_LEN as TOY_LEN
    from tests.engine.test_latent_cache import _dense_greedy

    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, 13).tolist() for _ in range(3)] * 2
    model = LatentToy()
    want = _dense_greedy(model, prompts, 6)
    engine = LLMEngine(model=model, cache_config=CacheConfig(block_size=4, num_blocks=6, kv_host_memory_bytes=HOST),
                       scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8,
                                                        max_model_len=TOY_LEN))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.output_token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 12, 12, 12]
    _check_idle(engine)


def test_a_hybrid_models_kv_and_state_snapshots_move_through_the_tiers():
    """A recurrent state + attention model (`tests/engine/test_state_cache.py`'s toy): each pool has a tier, its KV
    blocks' and its state snapshots'; evicted from the device, a prefix comes back from both (the snapshot at the
    hit's end from the state pool's): the dense model's tokens."""
    from tests.engine.test_state_cache import BS, SPEC, StateToy
    from tests.engine.test_state_cache import MAX_LEN as TOY_LEN
    from tests.engine.test_state_cache import VOCAB as TOY_VOCAB

    cache = CacheConfig(block_size=BS, num_blocks=6, num_state_blocks=6, kv_host_memory_bytes=HOST)
    slots = cache.resolve_host_blocks(SPEC, 6, extra_pools=(6,))
    assert slots[0] > 0 and slots[1] > 0, slots
    graphdef, state = nnx.split(StateToy())
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, TOY_VOCAB, 13).tolist() for _ in range(3)] * 2
    want, margin = greedy_by_recompute(forward, prompts, 6, TOY_LEN)
    assert margin > 1e-3, margin
    engine = LLMEngine(model=StateToy(), cache_config=cache,
                       scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8,
                                                        max_model_len=TOY_LEN))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.output_token_ids for o in outs] == want
    kv_tier, state_tier = engine.scheduler.kv_cache_manager.tiers
    assert engine.stats().scheduler.host_hit_tokens > 0 and kv_tier.num_loaded > 0 and state_tier.num_loaded > 0
    _check_idle(engine)


@pytest.mark.slow  # (CI time) a window group's hit from the tier: the core test and the hybrid's state pool above
def test_a_window_models_groups_both_load_from_the_tier():
    """gpt-oss's pattern at toy size (`tests/engine/test_kv_groups.py`: window and global layers over one pool):
    three prefixes through a pool for one; each comes back with its global group's blocks and its window group's
    in-window ones loaded from the host, with the dense model's tokens."""
    from tests.engine.test_kv_groups import BS as GROUP_BS
    from tests.engine.test_kv_groups import CFG as WINDOW_CFG
    from tests.engine.test_kv_groups import MAX_LEN as GROUP_LEN
    from tests.engine.test_kv_groups import SEED as GROUP_SEED
    from tests.engine.test_kv_groups import dense_greedy as window_greedy

    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, WINDOW_CFG.vocab_size, 17).tolist() for _ in range(3)] * 2
    want = window_greedy(prompts, 6)
    engine = LLMEngine(model_config=WINDOW_CFG, seed=GROUP_SEED,
                       cache_config=CacheConfig(block_size=GROUP_BS, num_blocks=14, kv_host_memory_bytes=HOST),
                       scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8,
                                                        max_model_len=GROUP_LEN))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.output_token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 16, 16, 16]
    stats = engine.stats().scheduler
    assert stats.host_hit_tokens == 48 and stats.host_blocks_loaded > 12  # 4 global blocks + the window's, each
    _check_idle(engine)


def test_a_move_that_raises_fails_its_step_and_the_engine_serves_on():
    """A host-to-device load that raises (as a device call may): that step's request fails with the error, its plan's
    moves are discarded, nothing is held, and the same prompts then give the dense tokens, from the tier again."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, CFG.vocab_size, 20).tolist() + [i] for i in range(3)] * 2
    want, _ = dense_greedy(prompts, GREEDY.max_tokens)
    engine = _engine()
    host = engine.runner.host_blocks
    write, calls = host._write, []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected load failure")
        return write(*args, **kwargs)

    host._write = broken
    outs = [engine.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    failed = [o for o in outs if o.finish_reason == "error"]
    assert len(failed) == 1 and "injected load failure" in failed[0].error
    assert all(o.outputs[0].token_ids == w for o, w in zip(outs, want, strict=True) if o.finish_reason != "error")
    _check_idle(engine)
    again = [engine.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in again] == want and engine.stats().scheduler.host_hit_tokens > 0
    _check_idle(engine)


def test_a_restarted_engine_serves_prefixes_from_disk_and_a_bad_file_is_a_miss(tmp_path):
    """Three 20-token prefixes through a pool for one (and the first two again, which evicts the third): every block
    the device evicts is stored on the host and written through to files. A second engine on the same folder (a
    restart) hits all of them from disk, except from a corrupted file on: that prefix hits its two blocks before it
    and computes the rest. Tokens are the dense model's throughout; an engine with other weights has a folder of its
    own and finds nothing."""
    from pagedjax.core.request import Request

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.vocab_size, 20).tolist() + [i, 1, 2] for i in range(3)]
    want, margin = dense_greedy(prompts, GREEDY.max_tokens)
    assert margin > 1e-3
    first = _engine(disk_dir=tmp_path)
    outs = [first.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts + prompts[:2]]
    assert [o.outputs[0].token_ids for o in outs] == want + want[:2]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 20, 20]  # the last two from the host
    stats = first.stats()
    assert stats.scheduler.disk_blocks_written == stats.scheduler.host_blocks_stored >= 10
    assert stats.disk_bytes_written == stats.host_bytes_stored and stats.scheduler.disk_blocks_read == 0
    assert summarize(first).lines()[0].endswith(", host tier 1.0 MiB, disk tier 0.0 GiB")
    _check_idle(first)

    restarted = _engine(disk_dir=tmp_path)
    kv = restarted.scheduler.kv_cache_manager
    bad = restarted.disk_tiers[0].path(kv.groups[0].block_key(kv.block_hashes(Request("x", prompts[1], GREEDY)), 2))
    bad.write_bytes(bad.read_bytes()[:-1])  # truncated
    outs = [restarted.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [20, 8, 20]
    stats = restarted.stats()
    assert stats.scheduler.disk_files_bad == 1 and stats.scheduler.disk_blocks_read == 12
    assert stats.disk_bytes_read == 12 * CacheConfig(block_size=4).block_bytes(CFG) and stats.disk_s > 0
    _check_idle(restarted)

    other = _engine(disk_dir=tmp_path, seed=SEED + 1)  # other weights: its own folder
    assert other.disk_tiers[0].directory != restarted.disk_tiers[0].directory and len(other.disk_tiers[0]) == 0
    assert other.generate([prompts[0]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_new_weights_serve_from_a_folder_of_their_own(tmp_path):
    """`update_weights` points the disk tier at the new weights' folder: blocks the old weights computed are never
    read for them, and going back to the old weights finds the old folder's blocks again."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG.vocab_size, 20).tolist() + [i, 1, 2] for i in range(3)]
    engine = _engine(disk_dir=tmp_path)
    old = nnx.state(nnx.merge(engine.runner.graphdef, engine.runner.params))
    for p in prompts:
        engine.generate([p], GREEDY, use_tqdm=False)
    folder = engine.disk_tiers[0].directory
    new = jax.tree.map(lambda x: x * 1.01, old)
    engine.update_weights(new)
    assert engine.disk_tiers[0].directory != folder and len(engine.disk_tiers[0]) == 0
    assert engine.generate([prompts[0]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    engine.update_weights(old)
    assert engine.disk_tiers[0].directory == folder
    assert engine.generate([prompts[0]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 20
    _check_idle(engine)


def test_saved_blocks_are_found_after_a_restart_and_a_server_saves_at_shutdown(tmp_path):
    """Prompts that fit the pool leave their blocks on the device, where a restart would lose them:
    `save_kv_tiers` writes every cached one to the disk tier (straight from the device: a host tier of two blocks
    is no bound), and a restarted engine hits them. An async engine (a server) saves at shutdown."""
    import asyncio

    from pagedjax.serve.async_engine import AsyncLLMEngine

    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, CFG.vocab_size, 20).tolist() + [i, 1, 2] for i in range(2)]
    want, _ = dense_greedy(prompts, GREEDY.max_tokens)
    host = 2 * CacheConfig(block_size=4).block_bytes(CFG)
    first = _engine(disk_dir=tmp_path / "a", num_blocks=32, host=host)
    assert [o.outputs[0].token_ids for o in first.generate(prompts, GREEDY, use_tqdm=False)] == want
    cached = first.scheduler.kv_cache_manager.block_pool.num_cached
    assert first.stats().scheduler.disk_blocks_written == 0 and cached == 12  # 26 computed tokens: 6 blocks each
    assert first.save_kv_tiers() == cached and first.save_kv_tiers() == 0
    _check_idle(first)
    restarted = _engine(disk_dir=tmp_path / "a", num_blocks=32)  # (a hit read from disk passes through host slots)
    outs = [restarted.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want and [o.num_cached_tokens for o in outs] == [20, 20]

    served = AsyncLLMEngine(_engine(disk_dir=tmp_path / "b", num_blocks=32))
    served.start()

    async def ask():
        return [out async for out in served.generate(prompts[0], GREEDY)][-1]

    assert asyncio.run(ask()).output_token_ids == want[0]
    assert len(served.engine.disk_tiers[0]) == 0
    served.stop()
    assert len(served.engine.disk_tiers[0]) == 6
    assert _engine(disk_dir=tmp_path / "b").save_kv_tiers() == 0  # nothing cached, nothing written


def test_warmup_compiles_every_move_count_and_changes_no_block():
    """`HostBlocks.warmup` (run by `LLMEngine.warmup`): the moves of every padded count up to the pool's size are
    compiled, the cache's contents stay as they were, and the tier serves on with the dense tokens."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, CFG.vocab_size, 20).tolist() + [i, 1, 2] for i in range(3)] * 2
    want, _ = dense_greedy(prompts, GREEDY.max_tokens)
    engine = _engine()
    engine.generate(prompts[:1], GREEDY, use_tqdm=False)
    host, runner = engine.runner.host_blocks, engine.runner
    before = [np.asarray(x).copy() for x in jax.tree.leaves(runner.kv_cache)]
    runner.kv_cache = host.warmup(runner.kv_cache, (engine.num_blocks,))
    assert host._read._cache_size() >= 5 and host._write._cache_size() >= 5  # counts 1, 2, 4, 8, 16 for 10 blocks
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(runner.kv_cache), strict=True))
    outs = [engine.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts[1:]]
    assert [o.outputs[0].token_ids for o in outs] == want[1:] and engine.stats().scheduler.host_hit_tokens > 0
    _check_idle(engine)


def test_an_aborted_request_keeps_the_blocks_it_loaded_for_the_next_one():
    """A request whose prefix came back from the host is aborted after its first step: nothing is held, the tier
    stays consistent, and the blocks it loaded (published once its step ran) serve the next request from the
    device, with the dense tokens."""
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, CFG.vocab_size, 20).tolist() + [i, 1, 2] for i in range(3)]
    want, _ = dense_greedy(prompts, GREEDY.max_tokens)
    engine = _engine()
    for p in prompts:  # each evicts the one before into the tier
        engine.generate([p], GREEDY, use_tqdm=False)
    engine.add_request("aborted", prompts[0], GREEDY)
    engine.step()  # its 20 tokens loaded from the host, 3 computed
    assert engine.stats().scheduler.host_hit_tokens == 20
    assert engine.abort("aborted")
    _check_idle(engine)
    out = engine.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want[0] and out.num_cached_tokens == 20
    assert engine.stats().scheduler.host_hit_tokens == 20  # from the device this time
    _check_idle(engine)


def test_image_prompts_move_through_the_tier():
    """A LLaVA toy (`tests/engine/test_images_faults.py`'s): prompts with images, keyed by the images' contents,
    through a pool for one request; the second round hits its prefixes from the host, a prompt of the same tokens
    with another image hits only the blocks before the image, and every request has the tokens of an engine
    without a tier."""
    from pagedjax.config.vision import LlavaConfig, VisionConfig
    from pagedjax.model.multimodal.llava import Llava

    vision = VisionConfig("clip", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          image_size=(16, 16), patch_size=8, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    config = LlavaConfig(text=CFG.replace(vocab_size=64, max_position_embeddings=64), vision=vision,
                         image_token_id=63)

    def engine(host):
        return LLMEngine(model=Llava(config, rngs=nnx.Rngs(0)),
                         cache_config=CacheConfig(block_size=4, num_blocks=8, kv_host_memory_bytes=host),
                         scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=32))

    rng = np.random.default_rng(0)
    pixels = [rng.standard_normal((3, 16, 16)).astype(np.float32) for _ in range(3)]
    text = [rng.integers(0, 60, 13).tolist() for _ in range(2)]
    prompt = lambda i, image: {"prompt_token_ids": text[i][:5] + [63] * 4 + text[i][5:],
                               "multi_modal_data": {"image": [pixels[image]]}}
    prompts = [prompt(0, 0), prompt(1, 1)] * 2 + [prompt(0, 2)]
    want = [o.output_token_ids for o in engine(None).generate(prompts, GREEDY, use_tqdm=False)]
    tiered = engine(HOST)
    outs = [tiered.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.output_token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 0, 16, 16, 4]  # 17 tokens: 4 blocks; another image: 1
    assert tiered.stats().scheduler.host_hit_tokens > 0
    _check_idle(tiered)


def test_a_save_whose_moves_raise_leaves_the_tiers_consistent_and_the_engine_serving(tmp_path):
    """`save_kv_tiers` whose device read raises: the error reaches the caller, the moves are discarded, nothing is
    held, and the engine serves on and saves again."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, CFG.vocab_size, 20).tolist() + [i, 1, 2] for i in range(2)]
    want, _ = dense_greedy(prompts, GREEDY.max_tokens)
    engine = _engine(disk_dir=tmp_path, num_blocks=32)
    engine.generate(prompts[:1], GREEDY, use_tqdm=False)
    host = engine.runner.host_blocks
    read = host._read

    def broken(*args, **kwargs):
        raise RuntimeError("injected read failure")

    host._read = broken
    with pytest.raises(RuntimeError, match="injected read failure"):
        engine.save_kv_tiers()
    host._read = read
    _check_idle(engine)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert engine.save_kv_tiers() == engine.scheduler.kv_cache_manager.block_pool.num_cached == 12
