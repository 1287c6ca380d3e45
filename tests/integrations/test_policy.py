"""The trainer's exact log-probabilities (`pagedjax.integrations.policy`): in batch-invariant mode a rollout's
log-probabilities, the engine's score of the same tokens and the trainer's `exact_logprobs` are the same bits,
for any batch the rollouts shared and any token budget; the gradient is the dense forward's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SchedulerConfig
from pagedjax.integrations.policy import completion_batch, dense_logprobs, exact_logprobs, scatter_logprobs
from pagedjax.integrations.rollout import RolloutEngine
from pagedjax.model.llama import init_model

CFG = ModelConfig(vocab_size=259, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128)
STOP = 3


@functools.cache
def rollout_engine(budget: int) -> RolloutEngine:
    engine = LLMEngine(model_config=CFG, params=nnx.state(init_model(CFG, 1)), batch_invariant=True,
                       cache_config=CacheConfig(block_size=8, num_blocks=48),
                       scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                                        max_model_len=64))
    return RolloutEngine(engine, pad_id=0, stop_ids=[STOP])


@functools.cache
def trainer():
    graphdef, params = nnx.split(init_model(CFG, 1))
    weights = lambda b: jnp.linspace(-1.0, 1.0, b)[:, None]  # one number per row: a loss that is not symmetric

    def loss(params, tokens, engine_lps, mask, exact: bool):
        dense = dense_logprobs(nnx.merge(graphdef, params), tokens)
        lp = exact_logprobs(dense, engine_lps) if exact else dense
        return jnp.sum(weights(tokens.shape[0]) * lp * mask), lp

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnames="exact")
    return params, grad


prompt_lengths = st.lists(st.integers(1, 20), min_size=1, max_size=4)


@settings(max_examples=6, deadline=None)
@given(lengths=prompt_lengths, group=st.integers(1, 3), budget=st.sampled_from([16, 32]), seed=st.integers(0, 999),
       mix=st.booleans())
def test_trainer_log_probabilities_are_the_rollouts_bit_for_bit(lengths, group, budget, seed, mix):
    rollout = rollout_engine(budget)
    rng = np.random.default_rng(seed)
    prompts = [p for n in lengths for p in [rng.integers(4, CFG.vocab_size, n).tolist()] * group]
    max_tokens = int(rng.integers(1, 12))
    out = rollout.generate(prompts, max_tokens=max_tokens, max_prompt_length=20, temperature=1.0, seed=seed,
                           return_logprobs=True)
    if mix:  # the same samples drawn again before other requests (sample j keeps seed + j): the same bits
        others = [rng.integers(4, CFG.vocab_size, int(rng.integers(1, 20))).tolist() for _ in range(3)]
        again = rollout.generate(prompts + others, max_tokens=max_tokens, max_prompt_length=20, temperature=1.0,
                                 seed=seed, return_logprobs=True)
        for a, b, la, lb in zip(again.tokens, out.tokens, again.logprobs, out.logprobs, strict=False):
            assert a.tolist() == b.tolist() and la.tobytes() == lb.tobytes()
    completions = [t.tolist() for t in out.tokens]
    # the engine's score of the same tokens: the rollout's bits, alone and in one padded batch
    scored = rollout.score(out.left_padded_prompt_tokens,
                           np.asarray([c + [0] * (12 - len(c)) for c in completions], np.int32))
    for row, (c, lps) in enumerate(zip(completions, out.logprobs, strict=True)):
        assert scored[row, :len(c)].tobytes() == lps.tobytes()
    batch = completion_batch(prompts, completions, width=32, pad_id=0)
    engine_lps = scatter_logprobs(batch, out.logprobs)
    params, grad = trainer()
    args = (jnp.asarray(batch.tokens), jnp.asarray(engine_lps), jnp.asarray(batch.mask))
    (_, exact), g_exact = grad(params, *args, exact=True)
    (_, dense), g_dense = grad(params, *args, exact=False)
    assert np.asarray(exact).tobytes() == engine_lps.tobytes()  # the trainer's values: the rollout's bits
    np.testing.assert_allclose(np.asarray(dense) * batch.mask, engine_lps, rtol=0, atol=2e-5)
    for a, b in zip(jax.tree.leaves(g_exact), jax.tree.leaves(g_dense), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
