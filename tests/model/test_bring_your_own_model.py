"""Bring your own model: the GPT-2-style model of `tests/model/gpt2_example.py`, which pagedjax has never seen,
served through the public model contract (`pagedjax.model.api`) with what the engine offers: greedy tokens
equal to the model's own dense forward through prefix hits, preemption and fused decode; seeded samples; beam
search; 8-bit KV; the CLI's `--model-class` and the server; and models that break the contract refused at
construction with a message naming what is wrong. (Tensor parallelism: `tests/parallel/worker.py`.)"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.model.api import ModelSpec, PagedAttention, check_model
from pagedjax.sampling_params import BeamSearchParams
from tests.dense import greedy_by_recompute
from tests.model.gpt2_example import GPT2, GPT2Config
from tests.pool import EnginePool

CFG = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)
MAX_LEN = 48
rng = np.random.default_rng(0)
SHARED = rng.integers(0, 64, 9).tolist()
# Lengths 1, a block's (4) and more; two prompts sharing two full blocks (prefix cache hits).
PROMPTS = [[5], rng.integers(0, 64, 4).tolist(), SHARED + [1, 2], SHARED + [3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def gpt2(seed: int = 0) -> GPT2:
    return GPT2(CFG, rngs=nnx.Rngs(seed))


def engine(model=None, *, num_blocks: int = 64, kv_dtype: str = "auto", token_budget: int = 32,
           **kwargs) -> LLMEngine:
    return LLMEngine(model=model or gpt2(), cache_config=CacheConfig(block_size=4, num_blocks=num_blocks,
                                                                      kv_dtype=kv_dtype),
                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=token_budget,
                                                      max_model_len=MAX_LEN), **kwargs)


# (CI time) The default engine (a fresh gpt2(), float pages, 64 blocks) serves the module's tests that need it, left
# idle (tests/pool.py).
POOL = EnginePool(engine)


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    POOL.clear()


@pytest.fixture(scope="module")
def dense_greedy():
    graphdef, state = nnx.split(gpt2())
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))
    want, margin = greedy_by_recompute(forward, PROMPTS, GREEDY.max_tokens, MAX_LEN)
    assert margin > 1e-4, "a near tie would make the comparison depend on rounding: pick another seed"
    return want


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_equals_its_dense_forward_with_prefix_hits_chunks_preemption_and_fused_decode(dense_greedy):
    with POOL.engine() as e:
        hit_rate = e.stats().scheduler.prefix_cache_hit_rate
        assert _tokens(e.generate(PROMPTS, GREEDY, use_tqdm=False)) == dense_greedy
        assert e.stats().scheduler.prefix_cache_hit_rate > hit_rate
    # Four requests of up to 19 tokens in 8 blocks of 4: some are preempted; prompts of 10 and 11 tokens run
    # in chunks of at most 8; decode runs 4 fused steps a call.
    small = engine(num_blocks=8, token_budget=8, decode_steps_per_call=4)
    assert _tokens(small.generate(PROMPTS, GREEDY, use_tqdm=False)) == dense_greedy
    assert small.stats().scheduler.num_preemptions > 0 and small.stats().fused_decode_calls > 0


def test_n_seeded_samples_equal_singles_with_seeds_s_plus_i():
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=4, ignore_eos=True)
    with POOL.engine() as e:
        together = [c.token_ids for c in e.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs]
        alone = [e.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i,
                                                         ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
                 for i in range(4)]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1  # the samples differ: the seeds are used


def test_beam_search_scores_are_the_models_log_probabilities():
    model = gpt2()
    beams = engine(model).beam_search([PROMPTS[1]], BeamSearchParams(beam_width=3, max_tokens=4,
                                                                     ignore_eos=True))[0].sequences
    assert len(beams) == 3
    scores = [b.score for b in beams]
    assert scores == sorted(scores, reverse=True)
    prompt = PROMPTS[1]
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))  # one program, not op by op
    for beam in beams:
        seq = prompt + list(beam.token_ids)
        logp = jax.nn.log_softmax(forward(jnp.asarray([seq]))[0], axis=-1)
        want = sum(float(logp[i - 1, seq[i]]) for i in range(len(prompt), len(seq)))
        np.testing.assert_allclose(beam.cumulative_logprob, want, rtol=1e-4, atol=1e-4)


def test_int8_kv_pages_stay_close_to_float_ones():
    """The first sampled token's top-5 log-probabilities over int8 pages within 0.05 of those over float pages."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    with POOL.engine() as e:
        f32 = e.generate(PROMPTS, params, use_tqdm=False)
    int8_engine = engine(kv_dtype="int8")
    int8 = int8_engine.generate(PROMPTS, params, use_tqdm=False)
    assert int8_engine.stats().kv_dtype == "int8"
    for a, b in zip(f32, int8, strict=True):
        want, got = dict(a.outputs[0].logprobs[0].top), dict(b.outputs[0].logprobs[0].top)
        best = max(want, key=want.get)
        assert best in got and abs(want[best] - got[best]) < 0.05, (want, got)


# --------------------------------------------------------------------------------- models that break the contract
class _Base(GPT2):
    def __init__(self):
        super().__init__(CFG, rngs=nnx.Rngs(0))


class _NoSpec(_Base):
    def __init__(self):
        super().__init__()
        self.spec = None


class _SpecSaysThreeLayers(_Base):
    def __init__(self):
        super().__init__()
        self.spec = self.spec.replace(num_layers=3)


class _SpecSaysTwoKVHeads(_Base):
    def __init__(self):
        super().__init__()
        self.spec = self.spec.replace(num_kv_heads=2)


class _WritesFewerHeads(_Base):
    def __init__(self):
        super().__init__()
        self.h[1].attn.paged = PagedAttention(1, num_q_heads=4, num_kv_heads=4, head_dim=4)


class _AttendsLayerZeroTwice(_Base):
    def __init__(self):
        super().__init__()
        self.h[1].attn.paged = PagedAttention(0, num_q_heads=4, num_kv_heads=4, head_dim=8)


class _UndeclaredWindow(_Base):
    def __init__(self):
        super().__init__()
        self.h[0].attn.paged = PagedAttention(0, num_q_heads=4, num_kv_heads=4, head_dim=8, sliding_window=16)


class _UndeclaredBidirectional(_Base):
    def __init__(self):
        super().__init__()
        self.h[0].attn.paged = PagedAttention(0, num_q_heads=4, num_kv_heads=4, head_dim=8, bidirectional=True)


class _ReturnsHiddenOnly(_Base):
    def __call__(self, token_ids, positions, cache):
        return super().__call__(token_ids, positions, cache)[0]


class _LogitsOfTheWrongSize(_Base):
    def compute_logits(self, hidden):
        return super().compute_logits(hidden)[..., :10]


class _UnevenPartition(_Base):
    def param_partition(self, names, tp):
        return P("tp") if names[-1] == "bias" and names[-2] == "c_attn" else None


@pytest.mark.parametrize("model, error", [
    (_NoSpec, r"spec must be a pagedjax.ModelSpec"),
    (_SpecSaysThreeLayers, r"declares 3 layers, but no PagedAttention ran for layers \[2\]"),
    (_SpecSaysTwoKVHeads, r"4 KV heads of 8, but the model's ModelSpec declares 2 of 8 for this layer"),
    (_WritesFewerHeads, r"layer_index=1\): q has shape \(\d+, 4, 8\), expected .* \(\d+, 4, 4\)"),
    (_AttendsLayerZeroTwice, r"layer_index=0\) ran twice in one step"),
    (_UndeclaredWindow, r"sliding_window=16, but ModelSpec.sliding_windows declares None"),
    (_UndeclaredBidirectional, r"bidirectional=True, but the model's spec says bidirectional=False"),
    (_ReturnsHiddenOnly, r"must return \(hidden, cache\)"),
    (_LogitsOfTheWrongSize, r"compute_logits must return float32 logits \[tokens, vocab_size\] = \[2, 64\]"),
], ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_a_model_breaking_the_contract_is_refused_at_construction(model, error):
    with pytest.raises((TypeError, ValueError), match=error):
        engine(model())


def test_not_a_model_and_both_ways_at_once_are_refused():
    with pytest.raises(TypeError, match="must be a flax.nnx.Module"):
        check_model(object())
    with pytest.raises(ValueError, match="not both"):
        LLMEngine(model_config=ModelSpec(vocab_size=8, num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=4),
                  model=gpt2())
    with pytest.raises(TypeError, match="model_config must be a pagedjax.ModelConfig"):
        LLMEngine(model_config=ModelSpec(vocab_size=8, num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=4))


def test_an_uneven_partition_is_refused_naming_the_parameter():
    from pagedjax.model.api import param_partition_fn

    part = param_partition_fn(_UnevenPartition(), 5)
    with pytest.raises(ValueError, match=r"splits parameter h.0.attn.c_attn.bias of shape \(96,\) over 5 devices"):
        part(("h", 0, "attn", "c_attn", "bias"), (96,))
    assert part(("h", 0, "mlp", "c_fc", "kernel"), (32, 128)) == P()  # no rule of its own, no default: replicated


def test_docs_show_this_example():
    """docs/models.md's "Bring your own model" code (which the README links to, and tests/test_readme.py runs) is
    `tests/model/gpt2_example.py`, verbatim."""
    root = Path(__file__).parents[2]
    section = (root / "docs" / "models.md").read_text().split("\n## Bring your own model\n", 1)[1].split("\n## ")[0]
    example = (Path(__file__).parent / "gpt2_example.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    body = example[example.index("from __future__"):]
    assert any(body.strip() in b for b in blocks), "docs/models.md's GPT-2 differs from gpt2_example.py"
    assert "(docs/models.md#bring-your-own-model)" in (root / "README.md").read_text()
