"""From an OpenAI request to the engine's `SamplingParams`: the one place where request fields become engine
parameters.

A field is passed to `SamplingParams` only when the request sets it, under the engine's name for it; a field
the engine's `SamplingParams` does not have is a 400 "... is not supported yet" rather than silently ignored.
"""

from __future__ import annotations

import dataclasses

from pagedjax.errors import InvalidRequest
from pagedjax.sampling_params import SamplingParams, StructuredOutput
from pagedjax.serve.errors import APIError, bad_request
from pagedjax.serve.protocol import ChatCompletionRequest, CompletionRequest

# Log-probability entries one request may ask for: samples x tokens x (1 + top alternatives). Each is a few dozen
# bytes of response and host memory; 500,000 (about 30 MB of JSON) allows 8 samples of 2,048 tokens with 20
# alternatives each; n=128 x 2,047 tokens x 21 would be 5.5 million.
MAX_LOGPROB_ENTRIES = 500_000



def engine_fields(request: CompletionRequest | ChatCompletionRequest, *, max_tokens: int,
                  forced_call: StructuredOutput | None = None) -> dict:
    """The `SamplingParams` keyword arguments a request asks for (`max_tokens` already resolved; `forced_call`:
    the grammar of the tool call that `tool_choice` forces, `pagedjax.serve.tools`)."""
    fields: dict = {"max_tokens": max_tokens}
    # A sampling field the request leaves out is the model's default (the engine's `sampling_defaults`: its
    # generation_config.json, else vLLM's, temperature 1.0), as in Python and pagedjax-generate.
    if request.temperature is not None:
        fields["temperature"] = request.temperature
    if request.stop is not None:
        fields["stop"] = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)
    if request.stop_token_ids:
        fields["stop_token_ids"] = tuple(request.stop_token_ids)
    for name in ("top_p", "seed", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty",
                 "min_tokens"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    if request.top_k is not None:
        fields["top_k"] = max(request.top_k, 0)  # vLLM's -1 and 0 both mean "off"
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if getattr(request, name):
            fields[name] = True
    # Several samples (one prefill, forked KV) and log-probabilities.
    if request.n != 1:
        fields["n"] = request.n
    if getattr(request, "best_of", None) is not None:
        fields["best_of"] = request.best_of
    if isinstance(request, CompletionRequest):
        if request.logprobs is not None:
            fields["logprobs"] = request.logprobs
    elif request.logprobs:
        fields["logprobs"] = request.top_logprobs or 0
    structured = structured_output(request, forced_call)
    if structured is not None:
        fields["structured"] = structured[0]
    return fields


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_output(request: CompletionRequest | ChatCompletionRequest,
                      forced_call: StructuredOutput | None = None) -> tuple[StructuredOutput, str] | None:
    """The request's output constraint and the field that gave it (chat's `response_format` json_object /
    json_schema, one of vLLM's guided_* fields, or `tool_choice` forcing a call), or None; 400 naming the fields
    when several are given."""
    given = [name for name in GUIDED if getattr(request, name) is not None]
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt.type != "text":
        given.append("response_format")
    if forced_call is not None:
        given.append("tool_choice")
    if len(given) > 1:
        raise bad_request(f"give one output constraint at most, got {', '.join(given)}", given[1])
    if not given:
        return None
    name = given[0]
    if name == "tool_choice":
        return forced_call, name
    try:
        if name != "response_format":
            value = getattr(request, name)
            return StructuredOutput(**{GUIDED[name]: tuple(value) if name == "guided_choice" else value}), name
        if fmt.type == "json_object":
            if fmt.json_schema is not None:
                raise bad_request("response_format.json_schema is for type json_schema", "response_format")
            return StructuredOutput(json_object=True), name
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
        return StructuredOutput(json=fmt.json_schema.schema_), name
    except InvalidRequest as e:  # StructuredOutput's refusal of the value
        raise bad_request(f"{name}: {str(e).replace('StructuredOutput.', '')}", name) from None
    except RecursionError:  # a schema given as JSON text, nested past what Python's json parses
        raise bad_request(f"{name}: the schema nests too deeply to parse", name) from None


def check_supported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for request fields this server does not serve (yet), or that contradict each other."""
    if isinstance(request, ChatCompletionRequest) and request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of < request.n:
        raise bad_request(f"best_of ({best_of}) must be >= n ({request.n})", "best_of")
    if request.stream and best_of is not None and best_of > request.n:
        raise bad_request("best_of > n cannot be streamed: the n best are known only at the end", "best_of")
    if request.logit_bias:
        raise bad_request("logit_bias is not supported yet by pagedjax-serve", "logit_bias")
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise bad_request("echo is not supported yet by pagedjax-serve", "echo")
        if request.suffix is not None:
            raise bad_request("suffix is not supported by pagedjax-serve", "suffix")


def sampling_params(request: CompletionRequest | ChatCompletionRequest, *, max_tokens: int,
                    forced_call: StructuredOutput | None = None) -> SamplingParams:
    """The engine's parameters for `request`; APIError 400 naming the field for anything the engine refuses."""
    check_supported(request)
    fields = engine_fields(request, max_tokens=max_tokens, forced_call=forced_call)
    if fields.get("logprobs") is not None:
        samples = fields.get("best_of", fields.get("n", 1))
        entries = samples * max_tokens * (fields["logprobs"] + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            name = "logprobs" if isinstance(request, CompletionRequest) else "top_logprobs"
            raise bad_request(f"{name}: {samples} samples x {max_tokens} tokens x {fields['logprobs'] + 1} "
                              f"log-probabilities = {entries:,}, more than the {MAX_LOGPROB_ENTRIES:,} one request "
                              "may ask for; lower n, max_tokens or the alternatives", name)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    for name in fields:
        if name not in known:
            raise bad_request(f"{name} is not supported yet by this engine", name)
    try:
        return SamplingParams(**fields)
    except InvalidRequest as e:  # its param: the SamplingParams field (`engine_fields` gives each its own)
        raise APIError(400, str(e).replace("SamplingParams.", ""), param=e.param, code=e.code) from None
