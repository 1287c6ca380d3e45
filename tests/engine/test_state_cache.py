"""Recurrent state in the paged cache (`RecurrentState`): a toy hybrid model whose first layer keeps a per-sequence
recurrent state and a convolution window (as gated DeltaNet and Mamba-2 layers do) beside a full-attention layer.
The state lives in a pool of its own as snapshots valid at block boundaries; a prefix hit restores the snapshot at
the hit's end, never a live state. Greedy tokens equal the dense sequential model's cold, through prefix hits at and
inside blocks (caching really hitting), interleaved requests sharing a prefix (the tpu-inference bug: a hit on a
state another request is still updating), chunked prefill, preemption, fused decode and forks."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.config.kv_spec import FullAttention, RecurrentState, StatePages
from pagedjax.model.api import ModelSpec, PagedAttention, PagedKVCache, check_model
from tests.dense import greedy_by_recompute
from tests.pool import EnginePool
from tests.prefix_waves import later_wave_hits, run_waves, shared_prefix_waves

VOCAB, DIM, KERNEL, BS, MAX_LEN = 37, 16, 3, 4, 48
SPEC = ModelSpec(vocab_size=VOCAB, num_layers=2, num_q_heads=2, max_position_embeddings=MAX_LEN,
                 kv_layers=(RecurrentState((DIM,), (DIM, KERNEL - 1)), FullAttention(1, DIM)))


def paged_recurrence(u, decay, conv_w, pages: StatePages, meta, positions, block_size: int):
    """The state layer over paged snapshots, the kernels' contract (`pallas_kernels` recurrent ops): each sequence
    starts from the state after its first position's predecessor (zeros at position 0), runs its tokens in order
    (a depthwise causal conv over u, then h = decay * h + conv), and writes its state at every block boundary it
    crosses and after its last token. A sequence of kv_len 0 (an idle row of the fused decode loop, which keeps
    q_len 1) writes nothing. u `[T, D]` -> (h `[T, D]`, pages)."""
    t = jnp.arange(u.shape[0])
    num_seqs = meta.kv_lens.shape[0]
    cu = meta.cu_q_lens
    seq = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), num_seqs - 1)
    valid = (t < cu[-1]) & (meta.kv_lens[seq] > 0)
    first_tok = cu[seq]  # the sequence's first token in the step
    first_pos = meta.kv_lens - (cu[1:] - cu[:-1])  # [S]
    prev_block = meta.block_tables[jnp.arange(num_seqs), jnp.maximum(first_pos - 1, 0) // block_size]
    has_prev = (first_pos > 0)[:, None]
    h0 = jnp.where(has_prev, pages.recurrent[prev_block], 0.0)  # [S, D]
    c0 = jnp.where(has_prev[..., None], pages.conv[prev_block], 0.0)  # [S, D, K-1]: inputs before, oldest first

    def input_at(back):  # the conv input `back` tokens before each token: in the step, else the saved window
        inside = t - back >= first_tok
        saved = c0[seq, :, jnp.clip(KERNEL - 1 - (back - (t - first_tok)), 0, KERNEL - 2)]
        return jnp.where(inside[:, None], u[jnp.maximum(t - back, 0)], saved)

    window = jnp.stack([input_at(b) for b in range(KERNEL)], axis=-1)  # [T, D, K]: newest first
    conv = (window * conv_w[:, ::-1]).sum(-1)

    def step(h, xs):
        ti, c = xs
        h = jnp.where(ti == first_tok[ti], h0[seq[ti]], h)
        h = decay * h + c
        return h, h

    _, hs = jax.lax.scan(step, jnp.zeros(u.shape[1], jnp.float32), (t, conv))
    writes = valid & ((positions % block_size == block_size - 1) | (t == cu[seq + 1] - 1))
    block = jnp.where(writes, meta.block_tables[seq, positions // block_size], pages.recurrent.shape[0])
    new_conv = jnp.stack([input_at(b) for b in range(KERNEL - 2, -1, -1)], axis=-1)  # [T, D, K-1] oldest first
    return hs, StatePages(pages.recurrent.at[block].set(hs, mode="drop"), pages.conv.at[block].set(new_conv,
                                                                                                   mode="drop"))


class StateToy(nnx.Module):
    def __init__(self, seed: int = 0):
        keys = jax.random.split(jax.random.key(seed), 8)
        n = lambda k, *shape: jax.random.normal(k, shape) / math.sqrt(shape[0])
        self.embed = nnx.Param(jax.random.normal(keys[0], (VOCAB, DIM)))
        self.w_in = nnx.Param(n(keys[1], DIM, DIM))
        self.decay = nnx.Param(jax.nn.sigmoid(jax.random.normal(keys[2], (DIM,))))
        self.conv_w = nnx.Param(n(keys[3], DIM, KERNEL) * 0.7)
        self.wqkv = nnx.Param(n(keys[4], DIM, 4 * DIM))
        self.wo = nnx.Param(n(keys[5], 2 * DIM, DIM))
        self.head = nnx.Param(n(keys[6], DIM, VOCAB) * 3)
        self.attn = PagedAttention(1, num_q_heads=2, num_kv_heads=1, head_dim=DIM)
        self.spec = SPEC

    def __call__(self, token_ids, positions, cache: PagedKVCache):
        x = self.embed[token_ids]
        h, pages = paged_recurrence(x @ self.w_in, self.decay, self.conv_w, cache.layer(0), cache.meta_of(0),
                                    positions, cache.block_size_of(0))
        cache = cache.with_layer(0, pages)
        x = x + jnp.tanh(h)
        q, k, v = jnp.split(x @ self.wqkv, [2 * DIM, 3 * DIM], axis=-1)
        o, cache = self.attn(q.reshape(-1, 2, DIM), k.reshape(-1, 1, DIM), v.reshape(-1, 1, DIM), cache)
        return x + o.reshape(-1, 2 * DIM) @ self.wo, cache

    def compute_logits(self, hidden):
        return (hidden @ self.head).astype(jnp.float32)

    def forward_dense(self, tokens):  # [B, S] -> logits [B, S, vocab]
        x = self.embed[tokens]
        u = x @ self.w_in
        padded = jnp.pad(u, ((0, 0), (KERNEL - 1, 0), (0, 0)))
        conv = sum(padded[:, i:i + u.shape[1]] * self.conv_w[:, i] for i in range(KERNEL))

        def step(h, c):
            h = self.decay * h + c
            return h, h

        _, h = jax.lax.scan(step, jnp.zeros((u.shape[0], DIM)), jnp.swapaxes(conv, 0, 1))
        x = x + jnp.tanh(jnp.swapaxes(h, 0, 1))
        q, k, v = jnp.split(x @ self.wqkv, [2 * DIM, 3 * DIM], axis=-1)
        s = tokens.shape[1]
        q = q.reshape(-1, s, 2, DIM)
        scores = jnp.einsum("bqhd,bkd->bhqk", q, k) / math.sqrt(DIM)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
        o = jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(scores, -1), v).reshape(-1, s, 2 * DIM)
        return self.compute_logits(x + o @ self.wo)


def make_engine(*, num_blocks: int = 64, decode_steps: int = 4, budget: int = 8,
                state_block_size: int | None = None) -> LLMEngine:
    return LLMEngine(model=StateToy(), cache_config=CacheConfig(block_size=BS, num_blocks=num_blocks,
                                                                state_block_size=state_block_size),
                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                                      max_model_len=MAX_LEN), decode_steps_per_call=decode_steps)


POOL = EnginePool(make_engine)


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    POOL.clear()


rng = np.random.default_rng(4)
SHARED = rng.integers(0, VOCAB, 11).tolist()  # two full blocks and three tokens of a third
PROMPTS = [SHARED + [1], SHARED[:8] + [2, 3], rng.integers(0, VOCAB, 6).tolist(), SHARED + [4, 5, 6, 7, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def want():
    graphdef, state = nnx.split(StateToy())
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))
    out, margin = greedy_by_recompute(forward, PROMPTS, GREEDY.max_tokens, MAX_LEN)
    assert margin > 1e-3, margin
    return out


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_layout_pools_and_check():
    layout = SPEC.kv_layout
    assert layout.pools == ("kv", "state") and layout.group_pools == (1, 0) and layout.windows == (2, None)
    assert check_model(StateToy()) == SPEC
    # A snapshot's bytes per block of the state pool; the KV pool's blocks hold the attention layer's K/V only.
    config = CacheConfig(block_size=BS)
    assert config.block_bytes(SPEC, pool=1) == 4 * (DIM + DIM * (KERNEL - 1)) and config.block_bytes(SPEC) == \
        BS * 2 * DIM * 4
    # A snapshot per block of the state pool: the least multiple of BS at which a state layer's snapshot takes no
    # more bytes than an attention layer's KV of its tokens (a multiple of 64 tokens past one KV block), or as given
    # (a multiple of block_size).
    assert config.resolve_pool_block_sizes(SPEC) == (BS, BS)
    big = dataclasses.replace(SPEC, kv_layers=(RecurrentState((4, DIM, DIM), (DIM, KERNEL - 1)), SPEC.kv_layers[1]))
    assert config.block_bytes(big, pool=1) == 4 * (4 * DIM * DIM + DIM * (KERNEL - 1))  # 4224 bytes: 8.25 KV blocks
    assert config.resolve_pool_block_sizes(big) == (BS, 64)  # 9 blocks (36 tokens), to a multiple of 64
    assert CacheConfig(block_size=BS, state_block_size=3 * BS).resolve_pool_block_sizes(big) == (BS, 3 * BS)
    with pytest.raises(ValueError, match="state_block_size 6 must be a multiple of block_size 4"):
        CacheConfig(block_size=BS, state_block_size=6)


def test_prefix_hits_restore_snapshots_and_equal_a_cold_run(want):
    with POOL.engine() as engine:
        # State snapshots (`resolve_state_blocks`), one per block of BS tokens: this toy's snapshot (192 bytes) is
        # smaller than a KV block (512).
        assert engine.extra_pools == (2 * (2 * 4 + 8 // BS),) and engine.pool_block_sizes == (BS, BS)
        cold = [engine.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS[:1]]
        assert _tokens(cold) == want[:1]
        # The rest while PROMPTS[0]'s blocks are cached: hits at a block boundary (8 tokens of SHARED) and at the
        # last full block of SHARED + more (the state snapshot at position 7, never a live state).
        outs = engine.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
        assert _tokens(outs) == want[1:]
        assert [o.num_cached_tokens for o in outs] == [8, 0, 8]
        engine.scheduler.check_invariants()


@pytest.mark.parametrize("state_block_size", [None, 2 * BS])
def test_a_hit_ends_where_the_state_pool_has_a_snapshot(want, state_block_size):
    """Snapshots one per `state_block_size` tokens: a prefix hit is what both pools serve, so the KV pool's 12
    cached tokens of SHARED + [4] (three blocks of BS) count only up to the state's last snapshot (8 tokens with
    snapshots every 2 * BS); the tokens equal a cold run either way."""
    with POOL.engine(state_block_size=state_block_size) as engine:
        assert engine.pool_block_sizes == (BS, state_block_size or BS)
        assert _tokens(engine.generate([PROMPTS[3]], GREEDY, use_tqdm=False)) == want[3:]
        prompt = SHARED + [4, 5, 6, 7]
        cold, margin = _cold(prompt)
        assert margin > 1e-3, margin
        again = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=_MAX_NEW, ignore_eos=True),
                                use_tqdm=False)[0]
        assert again.num_cached_tokens == (12 if state_block_size is None else 8)
        assert again.outputs[0].token_ids == cold
        engine.scheduler.check_invariants()


def test_interleaved_requests_sharing_a_prefix_then_a_hit_equal_a_cold_run(want):
    """tpu-inference #3358: two requests sharing a prefix run interleaved (each step advancing both), then a third
    hits it: its state must be the snapshot at the hit's end, not what a running request has made of it since."""
    with POOL.engine() as engine:
        engine.add_request("a", PROMPTS[0], GREEDY)
        engine.add_request("b", PROMPTS[3], GREEDY)
        done = {}
        for _ in range(3):  # a few steps of both: their states move past the shared blocks
            for out in engine.step():
                done[out.request_id] = out
        engine.add_request("c", PROMPTS[0], GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            engine.scheduler.check_invariants()
        assert done["c"].num_cached_tokens == 8
        assert [done[r].outputs[0].token_ids for r in "abc"] == [want[0], want[3], want[0]]


@pytest.mark.slow  # (CI time: 5 s) tests/model/test_hf_qwen3_next.py runs these paths on a real state model
def test_preemption_chunks_and_forks_equal_the_dense_model(want):
    with POOL.engine(num_blocks=12) as engine:  # KV blocks for about two requests at once: the newest preempted
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert _tokens(outs) == want
        samples = engine.generate([PROMPTS[3]], SamplingParams(n=2, temperature=0.0, max_tokens=10,
                                                               ignore_eos=True), use_tqdm=False)[0]
        assert [c.token_ids for c in samples.outputs] == [want[3]] * 2
        stats = engine.stats()
        assert stats.scheduler.num_preemptions > 0 and stats.fused_decode_calls > 0
        assert stats.kv_groups == ("state", "full") and stats.scheduler.memory.num_used_blocks == 0


# ------------------------------------------------------------------------------------ random shared-prefix waves
_COLD: dict[tuple, tuple[list[int], float]] = {}  # prompt -> (the dense model's cold greedy tokens, margin)
_MAX_NEW = 6


def _cold(prompt: list[int]) -> tuple[list[int], float]:
    """The dense model's greedy `_MAX_NEW` tokens after `prompt` by full recompute (one prompt a call: one
    compilation; greedy tokens of fewer steps are a prefix of these), and the smallest top-2 margin seen."""
    if tuple(prompt) not in _COLD:
        if "forward" not in _COLD:
            graphdef, state = nnx.split(StateToy())
            _COLD["forward"] = jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))
        out, margin = greedy_by_recompute(_COLD["forward"], [prompt], _MAX_NEW, MAX_LEN)
        _COLD[tuple(prompt)] = (out[0], margin)
    return _COLD[tuple(prompt)]


# Two engines, compiled once for every example: 4-token chunks over 8 KV blocks (a long request and a short one at
# once: preemption) with a snapshot per 2 KV blocks (hits end at their multiples), or 8-token chunks over 64 with a
# snapshot per KV block. (CI time: the dev profile draws from these and two more, the small pool with a snapshot per
# block and the large one with a snapshot per 3: `DEV_ENGINES`.)
DEV_ENGINES = [dict(budget=4, num_blocks=8), dict(budget=8, num_blocks=64, state_block_size=3 * BS)]
WAVES = shared_prefix_waves(vocab=(0, VOCAB), prefix_lens=[0, 1, 3, BS, BS + 2, 2 * BS, 2 * BS + 3],
                            suffix_lens=[0, 0, 1, 3, BS, 9, 13, 13], max_new=_MAX_NEW,
                            engines=[dict(budget=4, num_blocks=8, state_block_size=2 * BS),
                                     dict(budget=8, num_blocks=64)]
                            + (DEV_ENGINES if settings.default.max_examples > 25 else []))


# (CI time: about 6 s in all, most of it the two engines' compiles) 4 drawn, and corners: a prefix of two whole
# blocks whose second wave hits it and preempts (4-token chunks, 8 blocks, a snapshot per 2 blocks); one of 1
# token, three interleaved.
@settings(max_examples=4)  # (CI time) + 2 explicit examples; the dev profile's 200 random ones passed
@example(w=dict(prompts=[SHARED[:8], SHARED[:8] + PROMPTS[2] * 2, SHARED[:8] + [6], SHARED[:8] + PROMPTS[2]],
                prefix_len=8, wave=[0, 1, 1, 1], delay=[0, 0, 1, 0], max_tokens=6,
                engine=dict(budget=4, num_blocks=8, state_block_size=2 * BS), preempts=True))
@example(w=dict(prompts=[[3], [3, 4], [3, 5, 6, 7, 8, 9]], prefix_len=1, wave=[0, 0, 0], delay=[0, 1, 2],
                max_tokens=5, engine=dict(budget=8, num_blocks=64)))
@given(w=WAVES)
def test_random_shared_prefix_waves_equal_cold_runs(w):
    """Every request's greedy tokens equal the dense model's cold run, whatever hit the prefix cache (snapshots at
    block boundaries, written by requests still running or finished), chunking and preemption did; and a later
    wave sharing at least one whole state block with a finished one does hit."""
    cold = [_cold(p) for p in w["prompts"]]
    if min(margin for _, margin in cold) < 1e-3:  # a near tie: the "right" token depends on rounding
        return
    with POOL.engine(**w["engine"]) as engine:
        preemptions = engine.stats().scheduler.num_preemptions
        done = run_waves(engine, w)
        assert engine.stats().scheduler.num_preemptions > preemptions or not w.get("preempts")
    assert [o.outputs[0].token_ids for o in done] == [tokens[:w["max_tokens"]] for tokens, _ in cold], w
    if later_wave_hits(w, w["engine"].get("state_block_size") or BS):
        assert sum(o.num_cached_tokens for o, v in zip(done, w["wave"], strict=True) if v > 0) > 0, w
