"""pagedjax as a Tunix rollout engine (`pagedjax.integrations.tunix`; skipped without `pagedjax[tunix]`): Tunix's
own rollout tests (`tunix/rl/rollout/test_mock_rollout.py`) on `PagedJaxRollout`, Tunix's trainer forward
(`tunix.rl.common.compute_per_token_logps`) on `TunixPolicy`, and every refusal."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix")

from tunix.rl import common  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from pagedjax import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from pagedjax.integrations.tunix import PagedJaxRollout, TunixPolicy, TunixTokenizer  # noqa: E402
from pagedjax.model.llama import init_model  # noqa: E402
from pagedjax.model.tokenizer import ByteTokenizer  # noqa: E402

CFG = ModelConfig(vocab_size=259, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128)
RC = base_rollout.RolloutConfig(max_prompt_length=10, max_tokens_to_generate=15, return_logprobs=True, seed=42,
                                temperature=1.0)
ENGINE = dict(cache_config=CacheConfig(block_size=8, num_blocks=64), batch_invariant=True,
              scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64))


def make_rollout(seed: int = 1) -> PagedJaxRollout:
    return PagedJaxRollout(rollout_actor=TunixPolicy(init_model(CFG, seed)), tokenizer=TunixTokenizer(ByteTokenizer()),
                           mesh=None, rollout_config=RC, **ENGINE)


@functools.cache
def shared_rollout() -> PagedJaxRollout:
    return make_rollout()


def test_generate_basic():  # Tunix's test_generate_basic, test_generate_single_prompt
    out = shared_rollout().generate(["prompt 1", "prompt 2"], rollout_config=RC)
    assert len(out.text) == len(out.tokens) == len(out.logprobs) == 2
    assert out.left_padded_prompt_tokens.shape == (2, 10)
    assert out.left_padded_prompt_tokens[0].tolist() == [258] + [256] + list(b"prompt 1")  # pad, BOS, bytes
    for text, tokens, lps in zip(out.text, out.tokens, out.logprobs, strict=True):
        assert text == ByteTokenizer().decode(tokens.tolist()) and len(lps) == len(tokens) <= 15
        assert 257 not in tokens.tolist()  # EOS ends a sample and is not part of it
    one = shared_rollout().generate("prompt 1", rollout_config=RC)
    assert len(one.text) == 1 and one.tokens[0].tolist() == out.tokens[0].tolist()
    ids = shared_rollout().generate([[256, *b"prompt 1"]], rollout_config=RC)  # token ids, as they are
    assert ids.tokens[0].tolist() == out.tokens[0].tolist()


def test_generate_no_logprobs_and_empty_prompts():
    rollout = shared_rollout()
    assert rollout.generate(["prompt 1"], dataclasses.replace(RC, return_logprobs=False)).logprobs is None
    out = rollout.generate([], rollout_config=RC)
    assert out.text == [] and out.tokens == [] and out.logprobs == []
    assert out.left_padded_prompt_tokens.shape == (0, RC.max_prompt_length)


def test_generate_prompt_truncation():
    out = shared_rollout().generate(["a long prompt"], dataclasses.replace(RC, max_prompt_length=3))
    assert out.left_padded_prompt_tokens.tolist() == [list(b"mpt")]  # the last 3 tokens: no padding


def test_generate_reproducibility_with_seed():
    a = make_rollout().generate(["prompt 1", "prompt 2"], RC)  # another engine, the same seed
    for seed in (42, jnp.array(42)):
        b = shared_rollout().generate(["prompt 1", "prompt 2"], dataclasses.replace(RC, seed=seed))
        assert a.text == b.text and all(x.tolist() == y.tolist() for x, y in zip(a.tokens, b.tokens, strict=True))
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a.logprobs, b.logprobs, strict=True))


def test_a_group_shares_its_prompt_and_its_logprobs_are_the_scores_bit_for_bit():
    rollout = shared_rollout()
    out = rollout.generate(["def f"] * 4 + ["x = "] * 4, RC)
    assert len({t.tobytes() for t in out.tokens[:4]}) > 1  # the group's samples differ (seeds 42 + j)
    completions = np.full((8, 15), rollout.pad_id(), np.int32)
    for row, t in enumerate(out.tokens):
        completions[row, :len(t)] = t
    scored = np.asarray(rollout.get_per_token_logps(jnp.asarray(out.left_padded_prompt_tokens),
                                                    jnp.asarray(completions)))
    for row, lps in enumerate(out.logprobs):
        assert scored[row, :len(lps)].tobytes() == lps.tobytes()
    # Tunix's trainer forward over the same arrays (TunixPolicy through compute_per_token_logps): the same
    # numbers to float32 rounding (another program: `pagedjax.integrations.policy` makes them exact)
    graphdef, state = nnx.split(rollout.model())
    trainer = np.asarray(common.compute_per_token_logps(
        graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(completions), pad_id=rollout.pad_id(), eos_id=rollout.eos_id()))
    mask = completions != rollout.pad_id()
    np.testing.assert_allclose(trainer[mask], scored[mask], rtol=0, atol=2e-5)


def test_pad_id_eos_id_and_model():
    rollout = shared_rollout()
    assert (rollout.pad_id(), rollout.eos_id()) == (258, 257)
    assert isinstance(rollout.model(), TunixPolicy)
    assert TunixTokenizer(ByteTokenizer(), pad_id=5).pad_id() == 5


def rollout_against_tunix(rollout, actor) -> list[np.ndarray]:
    """Rollouts of two prompts, their log-probabilities checked against Tunix's trainer forward of `actor`
    (`compute_per_token_logps`: float32 rounding apart); returns them."""
    out = rollout.generate(["def f", "x = 1"], RC)
    completions = np.full((2, 15), 258, np.int32)
    for row, t in enumerate(out.tokens):
        completions[row, :len(t)] = t
    graphdef, state = nnx.split(actor)
    tunix = np.asarray(common.compute_per_token_logps(
        graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(completions), pad_id=258, eos_id=257))
    for row, lps in enumerate(out.logprobs):
        assert len(lps) > 0
        np.testing.assert_allclose(tunix[row, :len(lps)], lps, rtol=0, atol=5e-5)
    return out.logprobs


def test_the_rollout_serves_what_an_optimizer_step_or_update_params_leaves_in_the_actor():
    rollout = make_rollout()
    before = rollout_against_tunix(rollout, rollout.model())
    nnx.update(rollout.model(), nnx.state(TunixPolicy(init_model(CFG, 3))))  # what a training step does
    after = rollout_against_tunix(rollout, rollout.model())
    assert after[0].tobytes() != before[0].tobytes()
    rollout.update_params(nnx.state(TunixPolicy(init_model(CFG, 2))))  # the policy's state, or its model's
    rollout_against_tunix(rollout, TunixPolicy(init_model(CFG, 2)))
    rollout.update_params(nnx.state(init_model(CFG, 4)))
    rollout_against_tunix(rollout, TunixPolicy(init_model(CFG, 4)))


def test_the_policy_forward_of_padded_rows_is_the_dense_forward_of_each_row():
    model = init_model(CFG, 1)
    policy = TunixPolicy(model)
    rows = [[256, 10, 11, 12], [256, 20, 21, 22, 23, 24]]
    prompt = jnp.asarray([[258, 258, 256, 10, 11], [258, 256, 20, 21, 22]], jnp.int32)
    completion = jnp.asarray([[12, 258, 258], [23, 24, 258]], jnp.int32)
    tokens, positions, mask, _ = common.process_ids(prompt, completion, 258, 257)
    logits, none = policy(tokens, positions=positions, cache=None, attention_mask=mask)
    assert none is None
    for b, (row, start) in enumerate(zip(rows, [2, 1], strict=True)):
        want = np.asarray(model.forward_dense(jnp.asarray([row], jnp.int32))[0])
        np.testing.assert_allclose(np.asarray(logits[b, start:start + len(row)]), want, rtol=1e-5, atol=1e-5)


def test_a_row_the_policy_cannot_read_gets_nan_logits():
    policy = TunixPolicy(init_model(CFG, 1))
    tokens = jnp.asarray([[1, 2, 3, 4], [1, 2, 3, 4]], jnp.int32)
    real = jnp.asarray([[True, False, True, True], [False, True, True, True]])  # row 0: a hole
    mask = real[:, None, :] & jnp.tril(jnp.ones((4, 4), bool))[None]
    logits, _ = policy(tokens, positions=jnp.asarray([[0, 0, 1, 2], [0, 0, 1, 2]]), attention_mask=mask)
    assert np.isnan(np.asarray(logits[0])).all() and np.isfinite(np.asarray(logits[1])).all()
    shifted, _ = policy(tokens, positions=jnp.asarray([[0, 0, 1, 2], [0, 1, 2, 3]]), attention_mask=mask)
    assert np.isnan(np.asarray(shifted[1])).all()  # positions that do not count from the first real token


def test_refusals():
    rollout = shared_rollout()
    with pytest.raises(ValueError, match="return_logprobs at temperature 0.9"):
        rollout.generate(["p"], dataclasses.replace(RC, temperature=0.9))
    with pytest.raises(ValueError, match=r"seed must be an integer or a one-element integer array, got uint32\[2\]"):
        rollout.generate(["p"], dataclasses.replace(RC, seed=jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="data_type bfloat16, but the engine serves the actor's float32 weights"):
        rollout.generate(["p"], dataclasses.replace(RC, data_type=jnp.bfloat16))
    with pytest.raises(ValueError, match="tensor_parallel_size 2; pagedjax's Tunix rollout runs on one device"):
        rollout.generate(["p"], dataclasses.replace(RC, tensor_parallel_size=2))
    with pytest.raises(TypeError, match=r"unexpected arguments \['echo'\]"):
        rollout.generate(["p"], RC, echo=True)
    with pytest.raises(ValueError, match=r"filtered by \(<class '\S+Cache'>,\); \(nnx.Param,\) and"):
        rollout.update_params(nnx.state(rollout.model()), filter_types=(nnx.Cache,))
    with pytest.raises(TypeError, match="rollout_actor must be a TunixPolicy"):
        PagedJaxRollout(rollout_actor=init_model(CFG, 1), tokenizer=TunixTokenizer(ByteTokenizer()))
    with pytest.raises(ValueError, match="takes cache=None"):
        rollout.model()(jnp.zeros((1, 2), jnp.int32), cache={})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1] * 2), ("x",)) if len(jax.devices()) == 1 else \
        jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    with pytest.raises(ValueError, match="a rollout mesh of 2 devices"):
        PagedJaxRollout(rollout_actor=rollout.model(), tokenizer=TunixTokenizer(ByteTokenizer()), mesh=mesh)


def test_a_tunix_grpo_loop_trains_the_actor_and_the_rollouts_follow_it():
    import optax
    from tunix.rl import rl_cluster
    from tunix.rl.grpo import grpo_learner

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    actor = TunixPolicy(init_model(CFG, 1))
    initial = jax.tree.leaves(nnx.state(actor))
    engine = functools.partial(PagedJaxRollout, sleep_when_idle=True, **ENGINE)  # the pool only during rollouts
    rc = dataclasses.replace(RC, max_tokens_to_generate=6, max_prompt_length=6)
    cluster = rl_cluster.RLCluster(
        actor=actor, tokenizer=TunixTokenizer(ByteTokenizer()),
        cluster_config=rl_cluster.ClusterConfig(
            role_to_mesh={role: mesh for role in (rl_cluster.Role.ACTOR, rl_cluster.Role.REFERENCE,
                                                  rl_cluster.Role.ROLLOUT)},
            rollout_engine=engine, rollout_config=rc,
            training_config=rl_cluster.RLTrainingConfig(actor_optimizer=optax.sgd(0.1), eval_every_n_steps=10**9,
                                                        max_steps=2, pbar_description=None)))
    texts = []

    def reward(prompts, completions, **_):
        texts.append(list(completions))
        return [sum(map(ord, c)) % 7 / 7 for c in completions]  # varies within a group: nonzero advantages

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=[reward],
                                       algo_config=grpo_learner.GRPOConfig(num_generations=4, beta=0.0))
    learner.train([{"prompts": np.array(["ab", "cd"])}] * 2)
    assert cluster.rollout.rollout.sleep() == 0  # released after the last rollout, during training
    assert len(texts) == 2 and len(texts[0]) == 8
    trained = cluster.rollout.model()
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(trained)), initial, strict=True))
    # the engine serves the trained weights: its score of a rollout is the trainer's forward to rounding
    out = cluster.rollout.generate(["ab"], rc)
    completions = np.full((1, 6), 258, np.int32)
    completions[0, :len(out.tokens[0])] = out.tokens[0]
    graphdef, state = nnx.split(trained)
    forward = np.asarray(common.compute_per_token_logps(
        graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(completions), pad_id=258, eos_id=257))[0, :len(out.tokens[0])]
    np.testing.assert_allclose(forward, out.logprobs[0], rtol=0, atol=2e-5)


def tunix_model(family: str, tied: bool):
    if family == "llama":
        from tunix.models.llama3 import model as m
        cfg = m.ModelConfig(num_layers=2, vocab_size=259, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                            num_kv_heads=2, rope_theta=10000, norm_eps=1e-5, weight_tying=tied)
        return m.Llama3(cfg, rngs=nnx.Rngs(0))
    from tunix.models.qwen3 import model as m
    cfg = m.ModelConfig(num_layers=2, vocab_size=259, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                        num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=tied)
    return m.Qwen3(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("family, tied", [("llama", True), ("qwen3", False)])  # untied: the LoRA test's llama
def test_a_tunix_model_is_served_as_the_same_network(family, tied, caplog):
    actor = tunix_model(family, tied)
    with caplog.at_level(logging.WARNING, logger="pagedjax.integrations.tunix_models"):
        rollout = PagedJaxRollout(rollout_actor=actor, tokenizer=TunixTokenizer(ByteTokenizer()), **ENGINE)
    # Tunix 0.1.7's attention ignores the config's rope_theta (10000 here): the probe finds what it computes
    assert "applies RoPE with theta 1e+06, not its config's 10000" in caplog.text
    before = rollout_against_tunix(rollout, actor)  # Tunix's own forward of its own model, to rounding
    # a training step replaces the actor's arrays: the next rollout serves them (reshaped on the device)
    new = tunix_model(family, tied)
    nnx.update(actor, jax.tree.map(lambda x: x * 1.5, nnx.state(new, nnx.Param)))
    assert rollout_against_tunix(rollout, actor)[0].tobytes() != before[0].tobytes()


def test_tunix_models_pagedjax_does_not_read_are_refused_by_name():
    from tunix.models.qwen3 import model as m

    from pagedjax.integrations.tunix_models import tunix_model_config
    moe = m.ModelConfig(num_layers=1, vocab_size=259, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                        num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="mixture of experts \\(4 experts\\) is not read"):
        tunix_model_config(m.Qwen3(moe, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="is not a Tunix model pagedjax reads"):
        tunix_model_config(init_model(CFG, 1))
    from tunix.models.llama3 import model as llama
    at_default = llama.ModelConfig(num_layers=1, vocab_size=259, embed_dim=64, hidden_dim=128, num_heads=4,
                                   head_dim=16, num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-5)
    assert tunix_model_config(llama.Llama3(at_default, rngs=nnx.Rngs(0))).rope_theta == 1e6  # no probe needed


def lora_actor(family: str):
    import qwix

    model = tunix_model(family, False)
    provider = qwix.LoraProvider(module_path=".*(q|k|v|o|gate|up|down)_proj", rank=4, alpha=8.0)
    t = jnp.zeros((1, 4), jnp.int32)
    actor = qwix.apply_lora_to_model(model, provider, t, jnp.arange(4)[None], None, jnp.ones((1, 4, 4), bool),
                                     rngs=nnx.Rngs(1))
    randomize_lora(actor, 0)
    return actor


def randomize_lora(actor, seed: int) -> None:
    """What a training step does to the LoRA parameters (qwix starts B at zero: a product of zero tests nothing)."""
    state = nnx.state(actor, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    nnx.update(actor, jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state))


@pytest.mark.parametrize("family", ["llama"])  # Qwen3's LoRA targets are the same linears
def test_a_lora_actor_is_served_through_an_adapter_slot_and_its_updates_too(family):
    actor = lora_actor(family)
    rollout = PagedJaxRollout(rollout_actor=actor, tokenizer=TunixTokenizer(ByteTokenizer()), lora_scale=8.0 / 4,
                              **ENGINE)
    rollout_against_tunix(rollout, actor)  # base + adapter, as Tunix's forward computes them
    base = [id(x) for x in jax.tree.leaves(rollout.engine.runner.params)]
    randomize_lora(actor, 1)  # a LoRA training step: only the adapter changes
    rollout_against_tunix(rollout, actor)
    assert [id(x) for x in jax.tree.leaves(rollout.engine.runner.params)] == base  # the base weights untouched
    rollout.update_params(nnx.state(lora_actor(family), nnx.LoRAParam), (nnx.LoRAParam,))  # Tunix's LoRA sync
    rollout_against_tunix(rollout, actor)


def test_lora_scale_goes_with_lora_parameters_only():
    with pytest.raises(ValueError, match="has LoRA parameters; give lora_scale"):
        PagedJaxRollout(rollout_actor=lora_actor("llama"), tokenizer=TunixTokenizer(ByteTokenizer()), **ENGINE)
    with pytest.raises(ValueError, match="lora_scale given for an actor without LoRA parameters"):
        PagedJaxRollout(rollout_actor=tunix_model("llama", False), tokenizer=TunixTokenizer(ByteTokenizer()),
                        lora_scale=2.0, **ENGINE)
