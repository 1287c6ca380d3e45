"""Structured output (`SamplingParams.structured`): every completion keeps its constraint (JSON schema, regex,
choice, grammar), greedy and sampled, with n > 1, under preemption and a fused-decode engine; unconstrained
requests batched with constrained ones are unaffected bit for bit; log-probabilities offer only allowed tokens;
bad constraints are refused before anything is queued, and a constraint that fails mid-generation fails its
request alone. A byte-level random model: its raw preferences are noise, so only the constraint shapes the text.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.sampling_params import StructuredOutput

CFG = ModelConfig(vocab_size=259, hidden_size=64, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=32,
                  intermediate_size=128, bos_token_id=256, eos_token_ids=(257,))
PROMPT = "Answer: "


def engine(num_blocks: int = 64, **kwargs) -> LLMEngine:
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=16, num_blocks=num_blocks),
                     scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                     seed=0, tokenizer=ByteTokenizer(), **kwargs)


@pytest.fixture(scope="module")
def llm() -> LLMEngine:
    return engine()


def _texts(llm, structured, n=1, temperature=0.0, seed=None, prompts=(PROMPT,), max_tokens=120):
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, n=n, structured=structured)
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    return [c.text for o in outs for c in o.outputs], outs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice_regex_and_json_object(llm, temperature):
    texts, outs = _texts(llm, StructuredOutput(choice=("yes", "no", "maybe not")), n=3, temperature=temperature,
                         seed=5)
    assert all(t in ("yes", "no", "maybe not") for t in texts), texts
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    texts, _ = _texts(llm, StructuredOutput(regex=r"[a-c]{2,5}-\d{3}"), n=2, temperature=temperature, seed=1)
    assert all(re.fullmatch(r"[a-c]{2,5}-\d{3}", t) for t in texts), texts
    texts, _ = _texts(llm, StructuredOutput(grammar='start: "(" item ("," item)* ")"\nitem: /[xy]/'),
                      temperature=temperature, seed=2)
    assert re.fullmatch(r"\([xy](,[xy])*\)", texts[0]), texts


# Bounded schemas: every value has a longest spelling, so a completion always ends within max_tokens.
_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    # Letters only: an escape (\u00e9) spells one character in six tokens, and would unbound the length.
    st.builds(lambda n: {"type": "string", "maxLength": n, "pattern": f"^[a-z]{{0,{n}}}$"}, st.integers(0, 6)),
    st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda vs: {"enum": vs}),
)


def _node(children):
    keys = st.lists(st.text("pqrs", min_size=1, max_size=3), min_size=1, max_size=3, unique=True)
    return st.one_of(
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 2)),
        keys.flatmap(lambda ks: st.fixed_dictionaries({k: children for k in ks}).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False})))


SCHEMAS = st.recursive(_LEAVES, _node, max_leaves=5)


@settings(max_examples=6, deadline=None)
@given(schema=SCHEMAS, temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 100))
def test_every_completion_validates_against_its_json_schema(llm, schema, temperature, seed):
    texts, outs = _texts(llm, StructuredOutput(json=schema), n=2, temperature=temperature, seed=seed,
                         max_tokens=200)
    for text, c in zip(texts, (c for o in outs for c in o.outputs), strict=True):
        assert c.finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_samples_equal_singles_and_unconstrained_requests_are_untouched(llm):
    structured = StructuredOutput(regex=r"[a-z]{3,8}( [a-z]{3,8}){0,2}")
    together, _ = _texts(llm, structured, n=3, temperature=1.0, seed=7)
    alone = [_texts(llm, structured, temperature=1.0, seed=7 + i)[0][0] for i in range(3)]
    assert together == alone
    # Beside a constrained neighbour, a free request's tokens and log-probabilities are those it has beside an
    # unconstrained one of the same length (its mask row allows everything; same batch shapes throughout).
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=2)
    neighbour = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = llm.generate([PROMPT, PROMPT], [free, neighbour], use_tqdm=False)[0].outputs[0]
    constrained = dataclasses.replace(neighbour, structured=StructuredOutput(regex="[a-z]{12,20}"))
    mixed = llm.generate([PROMPT, PROMPT], [free, constrained], use_tqdm=False)
    assert re.fullmatch("[a-z]{12}", mixed[1].outputs[0].text)
    assert mixed[0].outputs[0].token_ids == want.token_ids and mixed[0].outputs[0].logprobs == want.logprobs


def test_preemption_and_fused_decode_keep_the_constraint(llm):
    structured = StructuredOutput(json={"type": "object", "required": ["a"], "additionalProperties": False,
                                        "properties": {"a": {"type": "string", "pattern": "^[a-z ]{0,20}$"}}})
    prompts = [PROMPT + str(i) for i in range(5)]
    want, _ = _texts(llm, structured, prompts=prompts, temperature=1.0, seed=0, max_tokens=30)
    small = engine(num_blocks=8)  # five requests of up to 39 tokens in 8 blocks of 16: preempted and recomputed
    got, _ = _texts(small, structured, prompts=prompts, temperature=1.0, seed=0, max_tokens=30)
    assert got == want and small.stats().scheduler.num_preemptions > 0
    fused = engine(decode_steps_per_call=4)
    got, _ = _texts(fused, structured, prompts=prompts, temperature=1.0, seed=0, max_tokens=30)
    assert got == want
    for text in got:
        assert set(json.loads(text)) == {"a"}


def test_log_probabilities_offer_only_allowed_tokens(llm):
    _, outs = _texts(llm, StructuredOutput(choice=("ab", "ac", "b")), temperature=0.0, max_tokens=4)
    lps = outs[0].outputs[0].logprobs if outs[0].outputs[0].logprobs else None
    assert lps is None  # not asked for
    params = SamplingParams(temperature=0.0,
                            max_tokens=4, logprobs=5, structured=StructuredOutput(choice=("ab", "ac", "b")))
    first = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].logprobs[0]
    assert {t for t, _ in first.top} == {ord("a"), ord("b")}
    assert np.isclose(sum(np.exp(lp) for _, lp in first.top), 1.0, atol=1e-5)  # the mask renormalizes


def test_bad_constraints_are_refused_before_anything_is_queued(llm):
    for structured, field in ((StructuredOutput(regex="(["), "structured.regex"),
                              (StructuredOutput(json={"type": "objectx"}), "structured.json"),
                              (StructuredOutput(grammar="start: undefined_rule"), "structured.grammar")):
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.add_request("bad", [1, 2], SamplingParams(temperature=0.0, structured=structured))
        assert not llm.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="needs an engine with a tokenizer"):
        LLMEngine(model_config=CFG,
                  cache_config=CacheConfig(num_blocks=8)).add_request("x", [1], SamplingParams(temperature=0.0,
            structured=StructuredOutput(regex="a")))


def test_a_constraint_failing_mid_generation_fails_its_request_alone(llm, monkeypatch):
    from pagedjax.structured_output import compiler as structured_module

    real = structured_module.Constraint.advance

    def advance(self, output_token_ids):
        if len(output_token_ids) >= 2:
            return "structured output: the constraint refused token 1: injected"
        return real(self, output_token_ids)

    monkeypatch.setattr(structured_module.Constraint, "advance", advance)
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0.0, max_tokens=6, structured=StructuredOutput(
        regex="[a-z]{6}")), free], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "injected" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].output_token_ids) == 6
    assert llm.stats().scheduler.memory.num_used_blocks == 0


def test_the_python_api_checks_constraints_against_the_engines_limits(llm):
    """`LLMEngine.add_request` used to compile any constraint in-process (only the server checked limits): a
    constraint past a limit is refused before the grammar library sees it, and an engine with a raised limit
    takes it."""
    from pagedjax.config import StructuredLimits

    many = StructuredOutput(choice=[f"c{i}" for i in range(1_100)])
    with pytest.raises(ValueError, match=r"over the limit max_choices = 1,024"):
        llm.add_request("many", list(PROMPT.encode()), SamplingParams(temperature=0.0, max_tokens=4, structured=many))
    assert not llm.has_unfinished_requests()
    roomy = engine(structured_limits=StructuredLimits(max_choices=2_000))
    (out,) = roomy.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, structured=many), use_tqdm=False)
    assert out.outputs[0].text in many.choice
