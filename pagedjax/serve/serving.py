"""The completions and chat endpoints' work: request -> prompt token ids and `SamplingParams` -> the engine ->
an OpenAI response, whole or as server-sent events.

Both endpoints share it: they differ only in how the prompt is made (text or token ids; messages through the
chat template) and in the shape of their response objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pagedjax.errors import InvalidConstraint, InvalidRequest
from pagedjax.sampling_params import LoRARequest, SamplingParams
from pagedjax.serve.admission import (
    DEFAULT_IMAGE_LIMITS,
    DEFAULT_MAX_CHAT_MESSAGES,
    DEFAULT_MAX_PARALLEL_TOOL_CALLS,
    DEFAULT_MAX_TOOL_STRING_LENGTH,
    ImageLimits,
    encode_text,
    longest_token_bytes,
    utf8_length,
)
from pagedjax.serve.async_engine import (
    AsyncLLMEngine,
    EngineStepError,
    EngineStoppedError,
    QueueFullError,
    RequestStream,
    random_request_id,
)
from pagedjax.serve.chat_template import ChatTemplate, ChatTemplateError
from pagedjax.serve.choices import ChoiceTracker, RequestFailed
from pagedjax.serve.errors import APIError, bad_request, error_body
from pagedjax.serve.images import ImageSupport, check_images, image_refs
from pagedjax.serve.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from pagedjax.serve.lora import ServedAdapters
from pagedjax.serve.memory import HeapTrimmer
from pagedjax.serve.metrics import RequestTimer, ServerMetrics
from pagedjax.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    UsageInfo,
)
from pagedjax.serve.sampling import sampling_params, structured_output
from pagedjax.serve.tools import (
    ToolCallParser,
    ToolPlan,
    finish_reason,
    parse_message,
    template_messages,
    tool_plan,
)
from pagedjax.structured_output.isolation import (
    CompileGuard,
    CompileGuardConfig,
    CompilerBusy,
    CompileRefused,
    short_error,
    worker_tokenizer,
)
from pagedjax.structured_output.limits import DEFAULT_LIMITS, LimitError, StructuredLimits, check_structured

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(payload) -> str:
    """One server-sent event carrying a pydantic model or a JSON-ready object."""
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    model: str  # as the request named it: the base model or a LoRA adapter (`ServedAdapters`)
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    created: int
    structured_field: str | None = None  # the request field its output constraint came from
    return_token_ids: bool = False  # vLLM's: the prompt's and the choices' token ids in the response
    tools: ToolPlan | None = None  # the tools it offers the model: its choices' text is parsed for calls
    # Its images, opened and checked, not decoded (`serve.images.OpenedImage`; the placeholders in
    # `prompt_token_ids` expanded): `start` decodes them into the model's pixels and drops them from here
    images: tuple = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(getattr(self.params, "stop", ()))

    @property
    def num_choices(self) -> int:
        return getattr(self.params, "n", 1)


# The engine's request fields (`InvalidRequest.param`) that a request names otherwise: its images come in its
# messages, its adapter is the model it names; "structured" is the field its constraint came from.
ENGINE_FIELDS = {"images": "messages", "lora_request": "model"}


def engine_refusal(error: InvalidRequest, prepared: Prepared) -> APIError:
    """The 400 for a request the engine refused (`pagedjax.errors`): by its type, param and code, never its text.
    An output constraint's refusal names the field the constraint came from, with the grammar library's reason
    (its first line: `short_error`)."""
    field = prepared.structured_field
    if isinstance(error, InvalidConstraint):
        return bad_request(f"{field}: {short_error(error.reason)}", field, error.code)
    message = str(error).replace(f"request {prepared.request_id!r}: ", "")
    if error.param == "structured":  # its output constraint (over the engine's limits): the field it came from
        return bad_request(f"{field}: {message}", field, error.code)
    return bad_request(message, ENGINE_FIELDS.get(error.param, error.param), error.code)


@contextlib.contextmanager
def engine_failures():
    """A request's failure in the engine as its HTTP error: 500 when the engine failed it (its step raised), 503
    when the engine stopped."""
    try:
        yield
    except RequestFailed as e:
        raise APIError(500, f"The engine failed the request: {e}", code="engine_error") from None
    except EngineStepError as e:
        raise APIError(500, str(e), code="engine_error") from None
    except EngineStoppedError as e:
        raise APIError(503, str(e), code="unavailable") from None


class OpenAIServing:
    """The endpoints' logic over one async engine; see the module docstring.

    A request goes through three stages: `prepare_*` (a worker thread: validation, the chat template, the
    prompt's size and its tokens, the constraint's limits, a chat's images checked and their headers read:
    `serve.images`), `compile` (the grammar pool: the grammar library's work, test-compiled in a worker process
    first: `CompileGuard`), then the engine (`start`, after a chat's images are decoded in the image pool, within
    the server's pixel budget: `ImageSupport.pixels`). The grammar pool is its own (`compile_config.workers` threads, at
    most `compile_config.max_queued` compiles waiting or running: more get 503), so a slow grammar never delays
    tokenizing or admitting other requests."""

    def __init__(self, engine: AsyncLLMEngine, *, model_name: str, chat_template: ChatTemplate,
                 metrics: ServerMetrics, structured_limits: StructuredLimits = DEFAULT_LIMITS,
                 compile_config: CompileGuardConfig | None = None,
                 max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES,
                 max_parallel_tool_calls: int = DEFAULT_MAX_PARALLEL_TOOL_CALLS,
                 max_tool_string_length: int = DEFAULT_MAX_TOOL_STRING_LENGTH,
                 adapters: ServedAdapters | None = None, image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS):
        if engine.tokenizer is None:
            raise ValueError("pagedjax-serve needs an engine with a tokenizer (text in, text out)")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        # The LoRA adapters a request's `model` may name besides the base model (none by default).
        self.adapters = adapters if adapters is not None else ServedAdapters(engine, base_name=model_name)
        self.chat_template = chat_template
        self.metrics = metrics
        # What one request can hold: max_model_len, or less when the KV pool is smaller (a default max_tokens is
        # clipped to it, and /v1/models advertises it).
        self.max_model_len = int(engine.max_request_tokens)
        self.structured_limits = structured_limits
        self.max_chat_messages = max_chat_messages
        self.max_parallel_tool_calls = max_parallel_tool_calls  # a forced choice's calls (`serve.tools`)
        self.max_tool_string_length = max_tool_string_length  # of a forced call's unbounded string argument
        # None for a model that takes no images (every image part is a 400); `pagedjax.serve.images`
        self.images: ImageSupport | None = ImageSupport.for_engine(engine, chat_template, image_limits)
        # A prompt of more UTF-8 bytes has more tokens than fit (`pagedjax.serve.admission`); None: not bounded.
        per_token = longest_token_bytes(self.tokenizer)
        self.prompt_byte_limit = None if per_token is None else (self.max_model_len - 1) * per_token
        if per_token is None:
            logger.warning("%s is not a tokenizer whose tokens bound a prompt's length from its size: prompts are "
                           "tokenized before they are found too long", type(self.tokenizer).__name__)
        spec = engine.model_spec
        self.compile_config = compile_config or CompileGuardConfig()
        self.guard = CompileGuard(worker_tokenizer(self.tokenizer, spec.vocab_size, tuple(spec.eos_token_ids)),
                                  self.compile_config)
        self._grammar_pool = ThreadPoolExecutor(self.compile_config.workers, thread_name_prefix="pagedjax-grammar")
        self._compiles = 0  # waiting or running in the grammar pool (event loop side)
        self.trimmer = HeapTrimmer()  # freed memory back to the system (`pagedjax.serve.memory`)

    def close(self) -> None:
        """End the grammar workers and pool, the image pool and the heap trimmer (the app's shutdown)."""
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.guard.close()
        if self.images is not None:
            self.images.close()
        self.trimmer.stop()

    # ---------------------------------------------------------------------------------------------- prepare
    def check_model(self, model: str) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 naming the field for a model not served."""
        return self.adapters.lookup(model)

    def _max_tokens(self, requested: int | None, num_prompt: int, what: str) -> int:
        """The request's max_tokens: as asked (400 past the context), or None: what the context leaves after the
        prompt (`SamplingParams`' rule, every entry point's); 400 for a prompt that leaves no room."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your {what} has "
                              f"{num_prompt} tokens, which leaves no room for a completion. Please shorten it.",
                              "messages" if what == "messages" else "prompt", "context_length_exceeded")
        room = limit - num_prompt
        if requested is None:
            return room
        if requested > room:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{num_prompt + requested} tokens ({num_prompt} in the {what}, {requested} in the "
                              "completion). Please reduce the length of the prompt or the completion.",
                              "max_tokens", "context_length_exceeded")
        return requested

    def check_prompt_size(self, text: str, what: str) -> None:
        """400 for a prompt text whose size alone shows it cannot fit, before it is tokenized."""
        limit = self.prompt_byte_limit
        if limit is None:
            return
        size = len(text) if len(text) > limit else utf8_length(text)  # characters: no more than its bytes
        if size > limit:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                              f"{what} has at least {size:,} bytes of UTF-8, more than the {limit:,} that "
                              f"{self.max_model_len - 1} tokens of this tokenizer can hold, which leaves no room "
                              "for a completion. Please shorten it.", "messages" if what == "messages" else "prompt",
                              "context_length_exceeded")

    def _prepare(self, request, prompt_token_ids: list[int], max_tokens: int, prefix: str,
                 tools: ToolPlan | None = None, images: tuple = (),
                 ) -> Prepared:
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        forced_call = None if tools is None else tools.constraint
        params = sampling_params(request, max_tokens=max_tokens, forced_call=forced_call)
        structured = structured_output(request, forced_call)
        if structured is not None and structured[1] != "tool_choice":  # a forced call's tools are checked
            try:
                check_structured(structured[0], self.structured_limits)
            except LimitError as e:
                raise bad_request(f"{structured[1]}: {e}", structured[1], "structured_output_limit") from None
        return Prepared(request_id=random_request_id(prefix), model=request.model, prompt_token_ids=prompt_token_ids,
                        params=params, stream=request.stream,
                        include_usage=bool(request.stream_options and request.stream_options.include_usage),
                        created=int(time.time()), structured_field=None if structured is None else structured[1],
                        return_token_ids=request.return_token_ids, tools=tools, images=images)

    def prepare_completion(self, request: CompletionRequest) -> Prepared:
        self.check_model(request.model)
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request(f"prompt: a batch of {len(prompt)} prompts is not supported; send one prompt "
                                  "per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.check_prompt_size(prompt, "prompt")
        ids = encode_text(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad_request("prompt: must not be empty", "prompt")
        max_tokens = self._max_tokens(request.max_tokens, len(ids), "prompt")
        return self._prepare(request, ids, max_tokens, "cmpl")

    def prepare_chat(self, request: ChatCompletionRequest) -> Prepared:
        self.check_model(request.model)
        if len(request.messages) > self.max_chat_messages:
            raise bad_request(f"messages: {len(request.messages):,} messages, more than the "
                              f"{self.max_chat_messages:,} this server takes (--max-chat-messages)", "messages")
        refs = image_refs(request.messages)
        if refs and self.images is None:
            raise bad_request(f"{refs[0].part}: this model ({self.model_name}) does not take images", refs[0].part,
                              "images_not_supported")
        sources = check_images(refs, self.images.limits) if refs else []  # every limit, before decoding any
        tools = tool_plan(request, self.structured_limits, max_parallel_calls=self.max_parallel_tool_calls,
                          max_string_length=self.max_tool_string_length)
        native = self.chat_template.supports_tools
        messages = template_messages(request.messages, tools, supports_tools=native,
                                     content_parts=self.images is not None and self.images.content_parts)
        try:
            text = self.chat_template.render(messages, add_generation_prompt=request.add_generation_prompt,
                                             tools=tools.tools if tools is not None and native else None)
        except ChatTemplateError as e:
            raise bad_request(f"messages: {e}", "messages") from None
        self.check_prompt_size(text, "messages")
        if self.images is not None:  # placeholders expanded in the text, as transformers' processor does
            text = self.images.expand(text, len(sources))
        ids = self.chat_template.encode(self.tokenizer, text)
        max_tokens = self._max_tokens(request.max_completion_tokens or request.max_tokens, len(ids), "messages")
        images = self.images.open(sources) if sources else ()  # headers checked: decoded by `start`
        return self._prepare(request, ids, max_tokens, "chatcmpl", tools, images)

    # ----------------------------------------------------------------------------------------------- compile
    async def compile(self, prepared: Prepared) -> None:
        """Have the grammar library validate the request's tool schemas and compile its constraint, in the
        grammar pool (400 for what it refuses, 503 when too many compiles wait); nothing to do without either
        (a constraint compiled before only copies its matcher)."""
        if prepared.params.structured is None and (prepared.tools is None or not prepared.tools.schemas):
            return
        if self._compiles >= self.compile_config.max_queued:
            raise APIError(503, f"The server is overloaded: {self._compiles} grammar compiles are waiting or "
                                "running; retry later", code="grammar_compiles_full", headers={"Retry-After": "1"})
        self._compiles += 1
        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self._compile, prepared)
        finally:
            self._compiles -= 1

    def _compile(self, prepared: Prepared) -> None:  # in the grammar pool
        try:
            for where, schema in prepared.tools.schemas if prepared.tools is not None else ():
                try:
                    self.guard.check("json", schema)
                except CompileRefused as e:
                    raise bad_request(f"{where} is not a valid JSON schema: {e}", "tools") from None
            structured, field = prepared.params.structured, prepared.structured_field
            if structured is None:
                return
            try:
                self.guard.check(structured.kind, getattr(structured, structured.kind))
            except CompileRefused as e:
                raise bad_request(f"{field}: {e}", field) from None
            try:  # the engine thread then only copies the matcher
                self.engine.compile_constraint(structured)
            except InvalidRequest as e:  # InvalidConstraint: the library's refusal; LimitError: the engine's limits
                raise engine_refusal(e, prepared) from None
            except ValueError as e:  # a refusal of no kind, of the constraint: a 400 naming its field
                raise bad_request(f"{field}: {short_error(str(e))}", field) from None
        except CompilerBusy as e:
            raise APIError(503, f"The server is overloaded: {e}", code="grammar_compiles_busy",
                           headers={"Retry-After": "1"}) from None

    # ------------------------------------------------------------------------------------------------ engine
    async def start(self, prepared: Prepared) -> RequestStream:
        """Hand the request to the engine (400 for what the engine refuses, 503 when it cannot take more; 404
        for an adapter unloaded since the request was prepared). The adapter is looked up and the request sent to
        the engine thread in one step of the event loop: an unload never comes between them; a chat's images are
        decoded before that (`ImageSupport.pixels`)."""
        opened, prepared.images = prepared.images, ()  # the engine's from now on: not held for the response
        images = await self.images.pixels(opened) if opened else ()
        lora = self.check_model(prepared.model)
        try:
            return await self.engine.add_request(prepared.prompt_token_ids, prepared.params,
                                                 request_id=prepared.request_id, lora_request=lora, images=images)
        except InvalidRequest as e:
            raise engine_refusal(e, prepared) from None
        except (TypeError, ValueError) as e:  # a refusal of no kind: a 400 naming no field
            raise bad_request(str(e).replace(f"request {prepared.request_id!r}: ", "")) from None
        except QueueFullError as e:
            raise APIError(503, f"The server is overloaded: {e}", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineStoppedError as e:
            raise APIError(503, f"The server is not taking requests: {e}", code="unavailable") from None

    async def _run(self, stream: RequestStream, tracker: ChoiceTracker, timer: RequestTimer):
        """Yield each snapshot's choice deltas until the request finishes (the stream is closed either way)."""
        reason = None
        try:
            async with stream:
                async for out in stream:
                    timer.tokens(len(out.output_token_ids))
                    deltas = tracker.update(out)
                    if out.finished:
                        reason = out.finish_reason
                    yield deltas
        except (RequestFailed, EngineStepError, EngineStoppedError):
            reason = "error"
            raise
        finally:
            timer.finish(reason)

    def _usage(self, prepared: Prepared, tracker: ChoiceTracker) -> UsageInfo:
        """The request's usage, with its prefix-cache hit as OpenAI's `prompt_tokens_details.cached_tokens`."""
        n_prompt = prepared.num_prompt_tokens
        return UsageInfo(prompt_tokens=n_prompt, completion_tokens=tracker.completion_tokens,
                         total_tokens=n_prompt + tracker.completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=tracker.num_cached_tokens))

    async def _collect(self, prepared: Prepared, stream: RequestStream) -> ChoiceTracker:
        tracker = ChoiceTracker(token_ids=prepared.return_token_ids)
        with engine_failures():
            async for _ in self._run(stream, tracker, self.metrics.timer()):
                pass
        return tracker

    # ---------------------------------------------------------------------------------------------- respond
    def _token_ids(self, prepared: Prepared, tracker: ChoiceTracker) -> list[list[int] | None]:
        """Each final choice's token ids with return_token_ids, else Nones."""
        if not prepared.return_token_ids:
            return [None] * len(tracker.final_choices())
        return tracker.final_token_ids()

    async def completion(self, prepared: Prepared, stream: RequestStream) -> CompletionResponse:
        tracker = await self._collect(prepared, stream)
        tok = self.tokenizer
        prompt_ids = prepared.prompt_token_ids if prepared.return_token_ids else None
        choices = [CompletionChoice(index=i, text=text, finish_reason=reason,
                                    logprobs=None if lps is None else completion_logprobs(tok, lps),
                                    prompt_token_ids=prompt_ids, token_ids=ids)
                   for (i, text, reason, lps), ids in zip(tracker.final_choices(), self._token_ids(prepared, tracker),
                                                          strict=True)]
        return CompletionResponse(id=prepared.request_id, created=prepared.created, model=prepared.model,
                                  choices=choices, usage=self._usage(prepared, tracker))

    async def chat(self, prepared: Prepared, stream: RequestStream) -> ChatCompletionResponse:
        tracker = await self._collect(prepared, stream)
        tok = self.tokenizer
        choices = []
        for (i, text, reason, lps), ids in zip(tracker.final_choices(), self._token_ids(prepared, tracker),
                                               strict=True):
            message = ChatMessageOut(content=text)
            if prepared.tools is not None:
                content, calls = parse_message(text, forced=prepared.tools.constraint is not None)
                message = ChatMessageOut(content=content, tool_calls=calls or None)
                reason = finish_reason(reason, bool(calls))
            choices.append(ChatChoice(index=i, message=message, finish_reason=reason,
                                      logprobs=None if lps is None else chat_logprobs(tok, lps), token_ids=ids))
        return ChatCompletionResponse(id=prepared.request_id, created=prepared.created, model=prepared.model,
                                      choices=choices, usage=self._usage(prepared, tracker),
                                      prompt_token_ids=prepared.prompt_token_ids if prepared.return_token_ids
                                      else None)

    async def completion_events(self, prepared: Prepared, stream: RequestStream) -> AsyncIterator[str]:
        def chunk(choices, usage=None):
            return CompletionChunk(id=prepared.request_id, created=prepared.created, model=prepared.model,
                                   choices=choices, usage=usage)

        offsets: dict[int, TextOffsets] = {}  # per choice: where its next token starts in its text
        prompt_sent: set[int] = set()  # choices whose first chunk carried the prompt's token ids

        def choice(d):
            logprobs = None
            if d.logprobs is not None:
                offset = offsets.setdefault(d.index, TextOffsets())
                logprobs = completion_logprobs(self.tokenizer, d.logprobs, offset)
            prompt_ids = None
            if prepared.return_token_ids and d.index not in prompt_sent:
                prompt_sent.add(d.index)
                prompt_ids = prepared.prompt_token_ids
            return CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason, logprobs=logprobs,
                                    prompt_token_ids=prompt_ids, token_ids=d.token_ids)

        async for event in self._events(prepared, stream, chunk, choice, first=None):
            yield event

    async def chat_events(self, prepared: Prepared, stream: RequestStream) -> AsyncIterator[str]:
        def chunk(choices, usage=None, prompt_ids=None):
            return ChatCompletionChunk(id=prepared.request_id, created=prepared.created, model=prepared.model,
                                       choices=choices, usage=usage, prompt_token_ids=prompt_ids)

        parsers: dict[int, ToolCallParser] = {}  # per choice, when the request offers tools

        def choice(d):
            delta, reason = DeltaMessage(content=d.text or None), d.finish_reason
            if prepared.tools is not None:
                parser = parsers.get(d.index)
                if parser is None:
                    parser = parsers[d.index] = ToolCallParser(forced=prepared.tools.constraint is not None)
                parsed = parser.feed(d.text, final=d.finish_reason is not None)
                delta = DeltaMessage(content=parsed.content or None, tool_calls=parsed.tool_calls or None)
                reason = finish_reason(reason, bool(parser.calls))
                if delta.content is None and delta.tool_calls is None and reason is None and d.logprobs is None \
                        and not d.token_ids:
                    return None  # all of it held back (a tag being read): no empty chunk
            return ChatChunkChoice(index=d.index, delta=delta, finish_reason=reason,
                                   logprobs=None if d.logprobs is None else chat_logprobs(self.tokenizer, d.logprobs),
                                   token_ids=d.token_ids)

        first = chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                       for i in range(prepared.num_choices)],
                      prompt_ids=prepared.prompt_token_ids if prepared.return_token_ids else None)
        async for event in self._events(prepared, stream, chunk, choice, first=first):
            yield event

    async def _events(self, prepared: Prepared, stream: RequestStream, chunk, choice, first) -> AsyncIterator[str]:
        """The response's events: `first` (a chunk, or None), chunks of new text per choice, usage if asked,
        then [DONE]; a failure mid-way is an error event (OpenAI's error object) before [DONE]."""
        tracker = ChoiceTracker(token_ids=prepared.return_token_ids)
        try:
            if first is not None:  # the chat's role chunk
                yield sse(first)
            async for deltas in self._run(stream, tracker, self.metrics.timer()):
                choices = [c for c in map(choice, deltas) if c is not None]  # None: nothing to send for it
                if choices:
                    yield sse(chunk(choices))
            if prepared.include_usage:
                yield sse(chunk([], usage=self._usage(prepared, tracker)))
        except RequestFailed as e:
            yield sse(error_body(500, f"The engine failed the request: {e}", code="engine_error").model_dump())
        except EngineStepError as e:
            yield sse(error_body(500, str(e), code="engine_error").model_dump())
        except EngineStoppedError as e:
            yield sse(error_body(503, str(e), code="unavailable").model_dump())
        yield DONE
