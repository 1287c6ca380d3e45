import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedjax.device.sampling import SamplingMetadata, filter_logits, sample


def _meta(n, temperature=0.0, top_k=0, top_p=1.0, seeds=None, steps=None):
    seeds = list(range(n)) if seeds is None else seeds
    steps = [0] * n if steps is None else steps
    return SamplingMetadata.from_lists([temperature] * n, [top_k] * n, [top_p] * n, seeds, steps)


def test_greedy_is_argmax():
    logits = jax.random.normal(jax.random.key(0), (5, 33))
    np.testing.assert_array_equal(np.asarray(sample(logits, _meta(5))), np.argmax(np.asarray(logits), -1))


def test_top_k_one_is_argmax_at_any_temperature():
    logits = jax.random.normal(jax.random.key(1), (6, 40))
    out = sample(logits, _meta(6, temperature=5.0, top_k=1))
    np.testing.assert_array_equal(np.asarray(out), np.argmax(np.asarray(logits), -1))


def test_same_seed_same_token_regardless_of_batch():
    row = jax.random.normal(jax.random.key(2), (1, 50))
    others = jax.random.normal(jax.random.key(3), (3, 50))
    alone = sample(row, _meta(1, temperature=1.0, seeds=[1234], steps=[7]))
    batch = jnp.concatenate([others[:2], row, others[2:]])
    together = sample(batch, _meta(4, temperature=1.0, seeds=[5, 6, 1234, 8], steps=[0, 3, 7, 1]))
    assert int(alone[0]) == int(together[2])


def test_seed_and_step_change_the_draw():
    logits = jnp.zeros((64, 1000))  # uniform: draws collide rarely
    by_step = sample(logits, _meta(64, temperature=1.0, seeds=[9] * 64, steps=list(range(64))))
    assert len(set(np.asarray(by_step).tolist())) > 50
    by_seed = sample(logits, _meta(64, temperature=1.0, seeds=list(range(64)), steps=[0] * 64))
    assert len(set(np.asarray(by_seed).tolist())) > 50


def test_sampling_follows_the_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (n, 4))
    draws = np.asarray(sample(logits, _meta(n, temperature=1.0, seeds=[42] * n, steps=list(range(n)))))
    freq = np.bincount(draws, minlength=4) / n
    # 4 sigma of a binomial at n=4000 is below 0.032.
    np.testing.assert_allclose(freq, probs, atol=0.032)


_filter_jit = jax.jit(filter_logits)


@given(st.data())
def test_filter_logits_keeps_top_k_and_top_p_sets(data):
    vocab = data.draw(st.sampled_from([2, 5, 17, 30]), label="vocab")  # few shapes: few compilations
    # Distinct logits on a 0.01 grid: exact ties (and subnormals, flushed to zero on CPU) have no defined order.
    values = data.draw(st.lists(st.integers(-500, 500), min_size=vocab, max_size=vocab, unique=True), label="logits")
    top_k = data.draw(st.integers(0, vocab + 2), label="top_k")
    top_p = data.draw(st.floats(0.05, 1.0), label="top_p")
    temperature = data.draw(st.sampled_from([0.5, 1.0, 2.0]), label="temperature")
    logits = np.array(values, np.float32) / 100
    out = np.asarray(_filter_jit(jnp.asarray(logits[None]), jnp.array([temperature]), jnp.array([top_k]),
                                   jnp.array([top_p], jnp.float32)))[0]
    kept = set(np.flatnonzero(np.isfinite(out)).tolist())

    order = np.argsort(-logits)
    k = vocab if top_k <= 0 else min(top_k, vocab)
    candidates = order[:k]
    p = np.exp((logits[candidates] - logits[candidates].max()) / temperature)
    p /= p.sum()
    before = np.cumsum(p) - p
    expected = {int(c) for c, b in zip(candidates, before, strict=True) if b < top_p}
    expected.add(int(order[0]))
    # Tokens within float rounding of the top-p boundary may go either way.
    boundary = {int(c) for c, b in zip(candidates, before, strict=True) if abs(b - top_p) < 1e-5}
    assert kept - boundary == expected - boundary
    np.testing.assert_allclose(out[sorted(kept)], logits[sorted(kept)] / temperature, rtol=1e-6)


def test_rows_without_filters_keep_every_token_whatever_the_batch():
    """top_k 0, top_p 1, min_p 0 leave a row's scaled logits as they are, bit for bit, alone or beside rows that
    filter; a tail whose mass rounds to zero in float32 (one logit 30 above 31,999 others) is kept too (the
    cumulative sum reached 1.0 before it)."""
    logits = np.zeros((3, 32000), np.float32)
    logits[:, 7] = 30.0
    logits[2] = np.random.default_rng(0).normal(size=32000)
    temperature = jnp.array([1.0, 0.7, 1.0])
    alone = np.asarray(_filter_jit(jnp.asarray(logits[:1]), temperature[:1], jnp.array([0]),
                                   jnp.array([1.0], jnp.float32), jnp.array([0.0], jnp.float32)))
    np.testing.assert_array_equal(alone[0], logits[0])
    mixed = np.asarray(_filter_jit(jnp.asarray(logits), temperature, jnp.array([0, 0, 5]),
                                   jnp.array([1.0, 1.0, 1.0], jnp.float32), jnp.array([0.0, 0.0, 0.0], jnp.float32)))
    np.testing.assert_array_equal(mixed[0], alone[0])
    np.testing.assert_array_equal(mixed[1], logits[1] / np.float32(0.7))
    assert np.isfinite(mixed[2]).sum() == 5  # the filtering row is cut


@given(st.data())
def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely(data):
    vocab = data.draw(st.sampled_from([5, 17]), label="vocab")
    values = data.draw(st.lists(st.integers(-500, 500), min_size=vocab, max_size=vocab, unique=True), label="logits")
    min_p = data.draw(st.floats(0.0, 1.0), label="min_p")
    temperature = data.draw(st.sampled_from([0.5, 1.0, 2.0]), label="temperature")
    logits = np.array(values, np.float32) / 100
    out = np.asarray(_filter_jit(jnp.asarray(logits[None]), jnp.array([temperature]), jnp.array([0]),
                                 jnp.array([1.0], jnp.float32), jnp.array([min_p], jnp.float32)))[0]
    kept = set(np.flatnonzero(np.isfinite(out)).tolist())
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    ratio = p / p.max()
    expected = {int(i) for i in np.flatnonzero(ratio >= min_p)}
    boundary = {int(i) for i in np.flatnonzero(np.abs(ratio - min_p) < 1e-5)}
    assert kept - boundary == expected - boundary and int(np.argmax(logits)) in kept


def test_penalties_match_the_formulas():
    from pagedjax.device.sampling import PenaltyMetadata, apply_penalties

    logits = np.array([[2.0, -1.0, 0.5, 3.0, -2.0]], np.float32)
    pen = PenaltyMetadata(presence=np.array([0.5], np.float32), frequency=np.array([0.25], np.float32),
                          repetition=np.array([2.0], np.float32), min_tokens=np.array([3], np.int32),
                          output_counts=np.array([[0, 2, 1, 0, 0]], np.int32),
                          prompt_mask=np.array([[True, False, False, False, True]]),
                          stop_ids=np.array([[3, -1]], np.int32))
    out = np.asarray(jax.jit(apply_penalties)(logits, pen, np.array([2], np.int32)))[0]
    # token 0: prompt, positive -> /2; 1: output x2, negative -> *2, -0.25*2, -0.5; 2: output x1, positive -> /2,
    # -0.25, -0.5; 3: a stop id before min_tokens -> -inf; 4: prompt, negative -> *2
    np.testing.assert_allclose(out, [1.0, -2.0 - 0.5 - 0.5, 0.25 - 0.25 - 0.5, -np.inf, -4.0], rtol=1e-6)
    out = np.asarray(jax.jit(apply_penalties)(logits, pen, np.array([3], np.int32)))[0]
    assert out[3] == 3.0  # min_tokens reached: the stop id may be sampled


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 259])
def test_token_mask_keeps_exactly_the_allowed_tokens(vocab):
    """Bit t % 32 of word t // 32 allows token t (the sign bit included); everything else becomes -inf, and
    greedy and sampled tokens come only from the allowed set."""
    from pagedjax.device.sampling import apply_token_mask

    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    allowed = rng.random((3, vocab)) < 0.3
    allowed[:, vocab - 1] = True  # the last token (a sign bit when vocab % 32 == 0) at least
    allowed[2] = True  # an all-allowed row
    bits = np.zeros((3, words * 32), np.uint32)
    bits[:, :vocab] = allowed
    mask = (bits.reshape(3, words, 32) << np.arange(32, dtype=np.uint32)).sum(-1).astype(np.uint32).view(np.int32)
    logits = jnp.asarray(rng.normal(size=(3, vocab)), jnp.float32)
    out = np.asarray(apply_token_mask(logits, jnp.asarray(mask)))
    np.testing.assert_array_equal(np.isfinite(out), allowed)
    np.testing.assert_array_equal(out[allowed], np.asarray(logits)[allowed])
    meta = SamplingMetadata.from_lists([0.0, 1.0, 1.0], [0] * 3, [1.0] * 3, [1, 2, 3], [0] * 3)
    tokens = np.asarray(sample(jnp.asarray(out), meta))
    assert all(allowed[i, t] for i, t in enumerate(tokens))
