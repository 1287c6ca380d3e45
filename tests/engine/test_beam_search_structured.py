"""Beam search under a structured-output constraint: every beam keeps its own matcher (rolled back when the
beam continues with another token than it sampled, copied when it forks), so every returned beam satisfies the
constraint, and the search equals a brute-force beam search of the dense model whose logits are masked by a
fresh matcher per beam (written independently of the engine's). Unconstrained beam search is unchanged
(`tests/engine/test_sampling_surface.py` checks it against the dense model, as before)."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.engine import beam_search as beam_module
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.sampling_params import BeamSearchParams, StructuredOutput
from pagedjax.structured_output.compiler import ConstraintCompiler
from tests.dense import dense_beam_search, dense_forward
from tests.engine.test_structured_output import CFG, engine

SEED = 0  # test_structured_output's engine's
MAX_LEN = 256
REGEX = "(ab|cd|x)[0-9]{1,3}!"


@pytest.fixture(scope="module")
def llm():
    return engine()


def _dense_constrained_beam_search(prompt, width, max_tokens, structured):
    """[(tokens, cumulative logprob)] best first (length penalty 1): each beam's candidates are the top 2 * width
    tokens of the log-softmax of the dense logits with the tokens its own matcher (a fresh one, fed the beam's
    tokens) forbids set to -inf."""
    forward = dense_forward(CFG, SEED)
    compiler = ConstraintCompiler(ByteTokenizer(), CFG.vocab_size, CFG.eos_token_ids)
    eos = set(CFG.eos_token_ids)

    def logprobs(tokens):
        ids = prompt + tokens
        batch = np.zeros((1, MAX_LEN), np.int32)
        batch[0, :len(ids)] = ids
        logits = np.asarray(forward(jnp.asarray(batch)))[0, len(ids) - 1].astype(np.float32)
        constraint = compiler.compile(structured)
        assert constraint.advance(tokens) is None
        words = np.zeros(-(-CFG.vocab_size // 32), np.int32)
        constraint.fill(words)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:CFG.vocab_size].astype(bool)
        return np.asarray(jax.nn.log_softmax(jnp.asarray(np.where(allowed, logits, -np.inf))))

    return dense_beam_search(logprobs, width, max_tokens, eos)


@functools.cache
def _reference(prompt: tuple[int, ...]):
    return _dense_constrained_beam_search(list(prompt), 3, 8, StructuredOutput(regex=REGEX))


@pytest.mark.parametrize("sampled", [False, True])
def test_constrained_beam_search_equals_a_masked_dense_beam_search(llm, monkeypatch, sampled):
    """Greedy beams (as shipped) continue with the token they sampled; beams that sample (temperature 1: the
    candidates' log-probabilities are of the masked logits, so the search is the same) are continued with
    other tokens, which rolls their matcher back."""
    if sampled:
        monkeypatch.setattr(beam_module, "SamplingParams", functools.partial(SamplingParams, seed=0))
        monkeypatch.setattr(beam_module, "RAW_SAMPLING", {**beam_module.RAW_SAMPLING, "temperature": 1.0})
    forks, replaced = [], []
    sched = llm.scheduler
    fork, replace = sched.fork, sched.replace_last_token
    monkeypatch.setattr(sched, "fork", lambda *a: forks.append(a) or fork(*a))
    monkeypatch.setattr(sched, "replace_last_token", lambda *a: replaced.append(a) or replace(*a))
    prompt = ByteTokenizer().encode("Code: ")
    [out] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8,
                                                       structured=StructuredOutput(regex=REGEX)))
    ref = _reference(tuple(prompt))
    assert [s.token_ids for s in out.sequences] == [t for t, _ in ref]
    np.testing.assert_allclose([s.cumulative_logprob for s in out.sequences], [c for _, c in ref],
                               rtol=1e-4, atol=1e-4)
    assert forks and bool(replaced) == sampled  # beams forked (and, sampled, continued with other tokens)
    for s in out.sequences:
        assert s.token_ids[-1] in CFG.eos_token_ids and re.fullmatch(REGEX, s.text), s.text
    assert not llm.has_unfinished_requests() and sched.kv_cache_manager.block_pool.num_used == 0


CHOICES = ("red", "green", "blue", "violet")
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("structured", [StructuredOutput(choice=CHOICES), StructuredOutput(json=SCHEMA)])
def test_every_beam_satisfies_its_constraint(llm, structured):
    outs = llm.beam_search(["A: ", "B: "], BeamSearchParams(beam_width=4, max_tokens=40, structured=structured))
    for out in outs:
        assert len(out.sequences) == 4
        for s in out.sequences:
            assert s.token_ids[-1] in CFG.eos_token_ids, s.text
            if structured.choice:
                assert s.text in CHOICES
            else:
                jsonschema.validate(json.loads(s.text), SCHEMA)
    assert not llm.has_unfinished_requests() and llm.scheduler.kv_cache_manager.block_pool.num_used == 0


def test_bad_constrained_beam_search_params_are_refused(llm):
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured"):
        BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True, structured=StructuredOutput(regex="a"))
    with pytest.raises(TypeError, match="BeamSearchParams.structured must be a StructuredOutput"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured={"regex": "a"})
    with pytest.raises(ValueError, match="structured.regex"):
        llm.beam_search(["A: "], BeamSearchParams(beam_width=2, max_tokens=4, structured=StructuredOutput(regex="(")))
    assert not llm.has_unfinished_requests()
