"""The OpenAI API's request and response bodies (the subset pagedjax serves), as pydantic models.

Field names and defaults are OpenAI's, but for sampling fields left out (`temperature`, `top_p`, ...: the model's
defaults, as in `SamplingParams`) and `max_tokens`: without it a completion, like a chat, runs until it stops or
the context is full (`SamplingParams`' rule, every entry point's; OpenAI's completions stop at 16). Plus
vLLM's common extensions (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `return_token_ids`). Requests are strict: unknown fields and values of the wrong
JSON type (a string for a number, a float for an integer) are rejected with a message naming the field, never
coerced. A `null` is the field's default, as OpenAI's API takes it (its SDKs send `"n": null`, `"stream": null`,
...); a required field cannot be null. Response fields only some requests ask for (`return_token_ids`' ids) are
left out of the others' responses.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

SEED_LIMIT = 2**63  # seeds travel to the device as two uint32 halves (see SamplingParams)
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 256


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """Drop `null` for fields that have a default other than None (they take it); required fields keep
        theirs, and fail as missing values."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required() and fields[k].default is not None)}


class StreamOptions(_Request):
    include_usage: bool = False


Probability = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
NonEmpty = Annotated[str, Field(min_length=1)]


class _SamplingFields(_Request):
    """Fields completions and chat share."""

    model: str
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None  # None: the model's (SamplingDefaults)
    top_p: Probability | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    # the prompt's and each choice's token ids in the response, as vLLM returns them (`prompt_token_ids`,
    # `token_ids`; streamed: the prompt's in the first chunk, each chunk's new tokens in its choices)
    return_token_ids: bool = False
    # vLLM's structured output extensions (one at most; chat's response_format is OpenAI's way)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmpty | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    guided_grammar: NonEmpty | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: up to the context length, as chat's
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None


class TextContent(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str  # a data URL (`pagedjax.serve.images`: the server fetches nothing)
    detail: Literal["auto", "low", "high"] = "auto"  # OpenAI's; accepted, no effect (the model's processor sizes)


class ImageURLContent(_Request):
    """OpenAI's image part: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`."""

    type: Literal["image_url"]
    image_url: ImageURL

    @property
    def url(self) -> str:
        return self.image_url.url

    url_field: ClassVar[str] = "image_url.url"  # where the URL is, in error messages


class ImageURLShorthand(_Request):
    """vLLM's shorthand image part: `{"image_url": "data:image/png;base64,..."}` (no `type`)."""

    image_url: str

    @property
    def url(self) -> str:
        return self.image_url

    url_field: ClassVar[str] = "image_url"


ContentPart = TextContent | ImageURLContent | ImageURLShorthand
ImagePart = ImageURLContent | ImageURLShorthand
_PART_TYPES: dict[str, type[_Request]] = {"text": TextContent, "image_url": ImageURLContent}


def _json_kind(value: Any) -> str:
    """A JSON value's type in words ("an object", "an array", ...)."""
    for kind, name in ((bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "an array"),
                       (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _part_error(index: int, detail: str) -> PydanticCustomError:
    return PydanticCustomError("content_part", "{detail}", {"detail": f"part {index}: {detail}"})


def _content_part(index: int, part: Any) -> ContentPart:
    """One content part, validated by the model its `type` names (no union: one clear error, naming the part)."""
    if not isinstance(part, dict):
        raise _part_error(index, f'must be an object ({{"type": "text", ...}} or {{"type": "image_url", ...}}), got '
                                 f"{_json_kind(part)}")
    if "type" not in part:
        if "image_url" not in part:
            raise _part_error(index, 'has no "type" ("text" or "image_url")')
        model = ImageURLShorthand
    else:
        kind = part["type"]
        model = _PART_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            shown = repr(kind) if isinstance(kind, str) and len(kind) <= 40 else _json_kind(kind)
            raise _part_error(index, f'type must be "text" or "image_url" (got {shown}): this server takes text and '
                                     "images (as data URLs) only")
    if model is ImageURLContent and isinstance(part.get("image_url"), str):
        raise _part_error(index, 'image_url must be an object {"url": ...} (or, without "type", vLLM\'s shorthand '
                                 '{"image_url": "<url>"})')
    try:
        return model.model_validate(part)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in error["loc"])
        if error["type"] == "extra_forbidden":
            raise _part_error(index, f"unknown field {where!r}") from None
        raise _part_error(index, f"{where or 'the part'}: {error['msg']}") from None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or content parts (OpenAI's): text, and images in user messages (`pagedjax.serve.images`)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's answer to a call: accepted as OpenAI clients replay
    # them; their text (content) goes through the chat template like any message's.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _parts(cls, value: Any, handler) -> Any:
        """A list of parts is validated part by part (see `_content_part`); a string or null as declared."""
        if not isinstance(value, list):
            try:
                return handler(value)
            except ValidationError:
                got = ", got an object" if isinstance(value, dict) else ""  # a scalar is shown as it is
                raise PydanticCustomError("content_type", "{detail}", {
                    "detail": f"must be a string, a list of content parts or null{got}"}) from None
        return [_content_part(i, part) for i, part in enumerate(value)]

    def text(self) -> str:
        """The message's text: its string, or its text parts joined (its images left out)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContent))

    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """(index in `content`, part) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(j, part) for j, part in enumerate(self.content) if not isinstance(part, TextContent)]


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object (None: no arguments)
    strict: bool | None = None  # accepted; a forced call is always constrained to `parameters`


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: NonEmpty


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: up to the context length
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True  # vLLM's: end the prompt with the assistant's turn header
    # Tool calling (pagedjax.serve.tools): tool_choice defaults to "auto" when tools are given
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


# ------------------------------------------------------------------------------------------------ responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int  # the prompt's tokens read from the prefix cache, not computed (OpenAI's, vLLM's)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def _without_unasked(data: dict, keys: tuple[str, ...]) -> dict:
    """A response object's fields without the `keys` that are None (fields only some requests ask for)."""
    return {k: v for k, v in data.items() if k not in keys or v is not None}


_TOKEN_IDS = ("prompt_token_ids", "token_ids")  # vLLM's return_token_ids


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids (streamed: in the choice's first chunk)
    token_ids: list[int] | None = None  # with return_token_ids (streamed: the chunk's new tokens)

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        return _without_unasked(handler(self), _TOKEN_IDS)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(_Request):
    """OpenAI's `/v1/embeddings` body: `input` one text, a list of texts, one token-id list or a list of them (at
    most `MAX_EMBEDDING_INPUTS`); `encoding_format` "float" (lists of numbers) or "base64" (little-endian float32
    bytes, what OpenAI's Python client asks for by default); `dimensions` the first d entries (normalised after
    the cut where the model normalises); `user` accepted, unused."""

    model: str
    input: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | Annotated[list[int], Field(min_length=1)]
            | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1,
                                                                              max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a str: base64 of float32 little-endian


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


Texts = str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]


class ScoreRequest(_Request):
    """vLLM's `/v1/score` body: `text_1` one query (scored with each of `text_2`) or one per `text_2` item."""

    model: str
    text_1: Texts
    text_2: Texts


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(_Request):
    """The Jina / Cohere `/v1/rerank` body vLLM serves: `documents` ordered by relevance to `query`, the best
    `top_n` (all by default), each with its text unless `return_documents` is false."""

    model: str
    query: str
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        return _without_unasked(handler(self), ("document",))


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    """The assistant's reply: `content` is null when it only called tools; `tool_calls` appears when it called
    any (as in OpenAI's)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        return {k: v for k, v in handler(self).items() if k != "tool_calls" or v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Any = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        return _without_unasked(handler(self), _TOKEN_IDS)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # with return_token_ids

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        return _without_unasked(handler(self), _TOKEN_IDS)


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first delta only
    arguments: str = ""  # the next piece of the arguments' JSON text

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of the `index`-th tool call of a choice: its first delta has `id`, `type` and the function's name;
    the pieces of `function.arguments` concatenate to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    """A streamed piece of the assistant's message: only the keys that are set appear (as in OpenAI's)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Any = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the chunk's new tokens

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        return _without_unasked(handler(self), _TOKEN_IDS)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in the first chunk

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        return _without_unasked(handler(self), _TOKEN_IDS)


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedjax"
    # vLLM's: a LoRA adapter's `parent` is the base model's id and its `root` its folder, relative to the server's
    # LoRA root (else the folder's name: never an absolute server path); the base model's `root` is its id.
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    # What the engine runs (`pagedjax.engine.summary.EngineSummary.as_dict`): compute dtype, weight storage,
    # parameters by storage type, KV cache dtype, speculative method, tp/dp, sampling defaults.
    dtype: str
    weights: str
    num_params: int
    param_bytes: int
    params_by_type: dict[str, dict[str, int]]
    kv_cache_dtype: str
    speculative: str
    tensor_parallel_size: int
    data_parallel_size: int
    sampling_defaults: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(_Request):
    """`POST /v1/load_lora_adapter` (vLLM's): serve the PEFT folder `lora_path` (under the server's LoRA root) as
    the model `lora_name`."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(_Request):
    """`POST /v1/unload_lora_adapter` (vLLM's): stop serving adapter `lora_name`."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
