"""The server's 400 for a request the engine refused is made from the error's type, `param` and `code`
(`pagedjax.errors`), never from its text: a constraint's refusal names the request field it came from, a field the
request names otherwise is translated, and a reworded message changes nothing but the message. Host only."""

from __future__ import annotations

import pytest

from pagedjax import (
    ContextLengthExceeded,
    InvalidConstraint,
    InvalidRequest,
    SamplingParams,
    UnsupportedFeature,
)
from pagedjax.serve.protocol import CompletionRequest
from pagedjax.serve.sampling import sampling_params
from pagedjax.serve.serving import Prepared, engine_refusal
from pagedjax.structured_output.limits import LimitError


def prepared(structured_field: str | None = None) -> Prepared:
    return Prepared(request_id="cmpl-1", model="m", prompt_token_ids=[1, 2], params=SamplingParams(), stream=False,
                    include_usage=False, created=0, structured_field=structured_field)


@pytest.mark.parametrize("error,param,code,message", [
    (InvalidRequest("request 'cmpl-1': stop_token_ids [97] outside [0, 97)", param="stop_token_ids"),
     "stop_token_ids", None, "stop_token_ids [97] outside [0, 97)"),
    (InvalidRequest("request 'cmpl-1': token ids [99] outside the vocabulary [0, 97)", param="prompt"),
     "prompt", None, "token ids [99] outside the vocabulary [0, 97)"),
    (ContextLengthExceeded("request 'cmpl-1': its prompt and max_tokens may need 9 blocks", param="max_tokens"),
     "max_tokens", "context_length_exceeded", "its prompt and max_tokens may need 9 blocks"),
    (UnsupportedFeature("request 'cmpl-1': this model takes no images", param="images", code="images_not_supported"),
     "messages", "images_not_supported", "this model takes no images"),
    (InvalidRequest("request 'cmpl-1': lora_int_id 1 is another adapter", param="lora_request"),
     "model", None, "lora_int_id 1 is another adapter"),
    # wording that the old text lookups read as other fields ("prompt", "max_tokens") changes nothing
    (InvalidRequest("request 'cmpl-1': the prompt's max_tokens", param="stop_token_ids"),
     "stop_token_ids", None, "the prompt's max_tokens"),
])
def test_an_engine_refusal_maps_its_param_and_code(error, param, code, message):
    api = engine_refusal(error, prepared())
    assert (api.status, api.param, api.code, api.message) == (400, param, code, message)


def test_a_constraint_refusal_names_the_field_the_constraint_came_from():
    error = InvalidConstraint("SamplingParams.structured.regex: unclosed group\nat 1", kind="regex",
                              reason="unclosed group\nat 1").for_request("cmpl-1")
    api = engine_refusal(error, prepared("guided_regex"))
    assert (api.param, api.code, api.message) == ("guided_regex", "invalid_constraint", "guided_regex: unclosed group")
    limit = LimitError("12 choices", "max_choices", 10).for_request("cmpl-1")
    api = engine_refusal(limit, prepared("response_format"))
    assert (api.param, api.code) == ("response_format", "structured_output_limit")
    assert api.message == "response_format: 12 choices, over the limit max_choices = 10 (--max-choices)"


def test_a_sampling_field_the_engine_refuses_is_a_400_naming_it():
    request = CompletionRequest(model="m", prompt="x", max_tokens=4, min_tokens=5)
    with pytest.raises(Exception) as info:
        sampling_params(request, max_tokens=4)
    api = info.value
    assert (api.status, api.param, api.code) == (400, "min_tokens", None)
    assert api.message == "min_tokens must be in [0, 4], got 5"
