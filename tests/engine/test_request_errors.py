"""A refused request raises one error type per kind (`pagedjax.errors`), naming the field it is about (`param`) and
its kind (`code`), with the message it always had; the server's 400 is made from those, never from the text
(`pagedjax.serve.serving.engine_refusal`). Host only but for one small engine that never steps."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from pagedjax import (
    CacheConfig,
    ContextLengthExceeded,
    InvalidConstraint,
    InvalidRequest,
    InvalidType,
    LLMEngine,
    LoRARequest,
    SamplingParams,
    SchedulerConfig,
    StructuredOutput,
    UnsupportedFeature,
)
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.structured_output.compiler import ConstraintCompiler
from pagedjax.structured_output.limits import LimitError
from tests.engine.test_engine import CFG, MAX_LEN, SEED

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def engine():
    """A text-only engine without a tokenizer, LoRA or images (make_request never steps: nothing compiles)."""
    llm = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=16, num_blocks=4),
                    scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN),
                    seed=SEED, compile_cache=False)
    yield llm
    llm.close()


def refused(call, kind: type[InvalidRequest]) -> InvalidRequest:
    with pytest.raises(kind) as info:
        call()
    return info.value


@pytest.mark.parametrize("field,value,kind", [
    ("max_tokens", 0, InvalidRequest), ("max_tokens", "5", InvalidType), ("temperature", -1.0, InvalidRequest),
    ("temperature", "1", InvalidType), ("top_p", 0.0, InvalidRequest), ("top_k", 2**31, InvalidRequest),
    ("seed", -1, InvalidRequest), ("n", 0, InvalidRequest), ("logprobs", 21, InvalidRequest),
    ("presence_penalty", 3.0, InvalidRequest), ("repetition_penalty", 0.0, InvalidRequest),
    ("stop_token_ids", [-1], InvalidRequest), ("stop_token_ids", 5, InvalidType), ("stop", [""], InvalidRequest),
    ("stop", 5, InvalidType), ("ignore_eos", 1, InvalidType), ("structured", {"regex": "a"}, InvalidType),
])
def test_a_sampling_params_field_is_refused_naming_it(field, value, kind):
    error = refused(lambda: SamplingParams(**{field: value}), kind)
    assert (error.param, error.code) == (field, None)
    assert str(error).startswith(f"SamplingParams.{field}")  # the message it always had
    assert isinstance(error, TypeError if kind is InvalidType else ValueError)


def test_best_of_min_tokens_and_the_room_left_name_their_field():
    assert refused(lambda: SamplingParams(n=3, best_of=2), InvalidRequest).param == "best_of"
    assert refused(lambda: SamplingParams(max_tokens=4, min_tokens=5), InvalidRequest).param == "min_tokens"
    error = refused(lambda: SamplingParams(min_tokens=9).with_room(8), InvalidRequest)
    assert error.param == "min_tokens" and "the 8 tokens the context leaves" in str(error)


@pytest.mark.parametrize("kwargs,kind", [
    (dict(regex="a", choice=("a",)), InvalidRequest), (dict(json="{not json"), InvalidRequest),
    (dict(choice=()), InvalidRequest), (dict(regex=""), InvalidType), (dict(json_object=1), InvalidType),
])
def test_a_structured_output_is_refused_as_the_structured_field(kwargs, kind):
    assert refused(lambda: StructuredOutput(**kwargs), kind).param == "structured"


@pytest.mark.parametrize("prompt,max_tokens,param", [
    ([1] * (MAX_LEN + 1), 1, "prompt"),  # the scheduler's: longer than max_model_len
    ([1, 2, 3], MAX_LEN, "max_tokens"),  # make_request's: the prompt and max_tokens past max_model_len
    ([1, 2, 3], MAX_LEN - 3, "max_tokens"),  # the scheduler's: within max_model_len, more than the pool of 4 blocks
])
def test_past_the_context_or_the_pool_is_context_length_exceeded(engine, prompt, max_tokens, param):
    error = refused(lambda: engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)),
                    ContextLengthExceeded)
    assert (error.param, error.code) == (param, "context_length_exceeded")
    assert str(error).startswith("request 'r': ")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt,params,kind,param,says", [
    ([1, CFG.vocab_size], GREEDY, InvalidRequest, "prompt", "outside the vocabulary"),
    ([], GREEDY, InvalidRequest, "prompt", "empty prompt"),
    ([1.0, 2.0], GREEDY, InvalidType, "prompt", "prompt_token_ids must be ints"),
    ([1, 2], SamplingParams(temperature=0.0, stop_token_ids=(CFG.vocab_size,)), InvalidRequest, "stop_token_ids",
     "stop_token_ids [97] outside"),
    ([1, 2], {"max_tokens": 3}, InvalidType, "sampling_params", "sampling_params must be SamplingParams"),
])
def test_a_bad_prompt_or_field_names_it(engine, prompt, params, kind, param, says):
    error = refused(lambda: engine.add_request("r", prompt, params), kind)
    assert (error.param, error.code) == (param, None) and says in str(error)
    assert not engine.has_unfinished_requests()


def test_ids_and_salts_name_their_field(engine):
    assert refused(lambda: engine.add_request(5, [1, 2]), InvalidType).param == "request_id"
    assert refused(lambda: engine.add_request("s", [1, 2], cache_salt=3), InvalidType).param == "cache_salt"
    engine.add_request("dup", [1, 2], GREEDY)
    try:
        error = refused(lambda: engine.add_request("dup", [1, 2], GREEDY), InvalidRequest)
        assert (error.param, error.code) == ("request_id", "duplicate_request_id")
    finally:
        engine.abort("dup")


@pytest.mark.parametrize("call,param,code", [
    (lambda e: e.add_request("r", [1, 2], SamplingParams(temperature=0.0, stop=("x",))), "stop",
     "tokenizer_required"),
    (lambda e: e.make_request("r", "text"), "prompt", "tokenizer_required"),
    (lambda e: e.add_request("r", [1, 2], GREEDY, lora_request=LoRARequest("a", 1, "/nowhere")), "lora_request",
     "lora_not_enabled"),
    (lambda e: e.make_request("r", {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [np.zeros(3)]}}),
     "images", "images_not_supported"),
    (lambda e: e.add_request("r", [1, 2], SamplingParams(temperature=0.0, structured=StructuredOutput(regex="a"))),
     "structured", "tokenizer_required"),
])
def test_what_this_engine_does_not_do_is_an_unsupported_feature(engine, call, param, code):
    error = refused(lambda: call(engine), UnsupportedFeature)
    assert (error.param, error.code) == (param, code)
    assert not engine.has_unfinished_requests()


def test_a_constraint_the_library_refuses_is_an_invalid_constraint():
    compiler = ConstraintCompiler(ByteTokenizer(), 259, (257,))
    for structured in (StructuredOutput(regex="(["), StructuredOutput(grammar="start: undefined_rule")):
        error = refused(lambda s=structured: compiler.compile(s), InvalidConstraint)
        assert (error.param, error.code, error.kind) == ("structured", "invalid_constraint", structured.kind)
        assert str(error) == f"SamplingParams.structured.{structured.kind}: {error.reason}"
    named = error.for_request("r7")  # as make_request raises it: the same error, its message naming the request
    assert type(named) is InvalidConstraint and (named.kind, named.reason) == (error.kind, error.reason)
    assert str(named) == f"request 'r7': {error}"
    copy = pickle.loads(pickle.dumps(named))
    assert type(copy) is InvalidConstraint and str(copy) == str(named) and copy.reason == named.reason


def test_a_constraint_over_a_limit_is_a_request_error_of_its_own_code():
    error = LimitError("12 choices", "max_choices", 10)
    assert isinstance(error, InvalidRequest) and (error.param, error.code) == ("structured", "structured_output_limit")
    assert str(error) == "12 choices, over the limit max_choices = 10 (--max-choices)"
