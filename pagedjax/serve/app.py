"""The HTTP routes (FastAPI): OpenAI's completions, chat completions, embeddings and models, vLLM's score and
rerank, plus health and metrics.

    app = build_app(AsyncLLMEngine(engine), model_name="pagedjax-tiny")   # then serve it with uvicorn

| route | |
|---|---|
| `POST /v1/completions` | a prompt (text or token ids) -> text; `stream: true` for server-sent events |
| `POST /v1/chat/completions` | messages (and images, as data URLs), through the chat template -> the reply |
| `POST /v1/embeddings` | texts or token ids -> one vector each (`pagedjax.serve.pooling`) |
| `POST /v1/score`, `POST /v1/rerank` | (query, document) relevance, vLLM's and Jina / Cohere's shapes |
| `GET /v1/models`, `GET /v1/models/{id}` | the served model, what runs it (`engine.summary`), its LoRA adapters |
| `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` | adapters at runtime, when enabled (`serve.lora`) |
| `GET /health` | 200 while the engine takes requests, 503 otherwise |
| `GET /metrics` | Prometheus text (see `pagedjax.serve.metrics`) |

With `api_key`, the `/v1` routes and `/metrics` need `Authorization: Bearer <key>` (401 otherwise; the scheme
in any case, the key compared in constant time); `/health` stays open for load balancers. The app starts the
engine thread on startup and stops it on shutdown (requests still in flight by then are aborted).

A web page must not be able to drive the server from a visitor's browser (a keyless server on 127.0.0.1 would
otherwise generate for any page, and DNS rebinding could read the answers): a request that carries an `Origin`
header (browsers send one with every cross-site or scripted POST; curl and API clients send none) is refused
(403) unless that origin is in `allowed_origins`, and with `allowed_hosts` a request whose `Host` is not one of
them is refused too (the CLI sets loopback names when it listens on loopback). The interactive docs
(`/docs`, `/redoc`, `/openapi.json`) are off unless `docs=True`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pagedjax.serve import pooling
from pagedjax.serve.admission import (
    DEFAULT_IMAGE_LIMITS,
    DEFAULT_MAX_CHAT_MESSAGES,
    DEFAULT_MAX_PARALLEL_TOOL_CALLS,
    DEFAULT_MAX_TOOL_STRING_LENGTH,
    ImageLimits,
)
from pagedjax.serve.async_engine import AsyncLLMEngine
from pagedjax.serve.chat_template import ChatTemplate
from pagedjax.serve.disconnect import ClientDisconnected, EventStreamResponse, until_disconnect
from pagedjax.serve.errors import APIError, bad_request, error_body, install_error_handlers, validation_message
from pagedjax.serve.lora import DEFAULT_MAX_REGISTERED_LORAS, RuntimeLoRAUpdates, ServedAdapters
from pagedjax.serve.metrics import CONTENT_TYPE, ServerMetrics
from pagedjax.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    UnloadLoRAAdapterRequest,
)
from pagedjax.serve.serving import OpenAIServing
from pagedjax.structured_output.isolation import CompileGuardConfig
from pagedjax.structured_output.limits import DEFAULT_LIMITS, StructuredLimits

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it


def _api_key_check(api_key: str | None):
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty: no client could ever match it")
    expected = api_key.encode() if api_key is not None else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        given = token.strip().encode("latin-1", errors="replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
            raise APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


def host_name(host_header: str) -> str:
    """The host of a `Host` header, without its port ("[::1]:8000" -> "::1"), lower case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _cross_site_guard(allowed_origins: Sequence[str], allowed_hosts: Sequence[str] | None):
    origins = {o.rstrip("/").lower() for o in allowed_origins}
    hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

    async def guard(request: Request, call_next):
        origin = request.headers.get("origin")
        if origin is not None and origin.rstrip("/").lower() not in origins:
            return JSONResponse(error_body(403, f"cross-origin requests are refused (Origin {origin[:100]!r}); "
                                                "allow an origin with --allowed-origin", code="origin_not_allowed"
                                           ).model_dump(), status_code=403)
        if hosts is not None and host_name(request.headers.get("host", "")) not in hosts:
            return JSONResponse(error_body(403, f"Host {request.headers.get('host', '')[:100]!r} is not served "
                                                "here; allow it with --allowed-host", code="host_not_allowed"
                                           ).model_dump(), status_code=403)
        return await call_next(request)

    return guard


DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# A larger body is validated in a worker thread: 40,000 chat messages (3 MB) take pydantic 180 ms, which on the
# event loop would stall every stream and /health as long; off it, the loop waits for the GIL a few ms at a time.
PARSE_ON_LOOP_BYTES = 64 * 2**10
DEFAULT_BODY_TIMEOUT_S = 30.0
LORA_REQUEST_BYTES = 64 * 2**10  # a load or unload request: a name and a path


def build_app(engine: AsyncLLMEngine, *, model_name: str, chat_template: ChatTemplate | None = None,
              api_key: str | None = None, shutdown_timeout: float = 0.0, allowed_origins: Sequence[str] = (),
              allowed_hosts: Sequence[str] | None = None, docs: bool = False,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              body_timeout: float = DEFAULT_BODY_TIMEOUT_S, structured_limits: StructuredLimits = DEFAULT_LIMITS,
              compile_config: CompileGuardConfig | None = None,
              max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES,
              max_parallel_tool_calls: int = DEFAULT_MAX_PARALLEL_TOOL_CALLS,
              max_tool_string_length: int = DEFAULT_MAX_TOOL_STRING_LENGTH,
              lora_modules: Mapping[str, str] | None = None,
              lora_updates: RuntimeLoRAUpdates | None = None,
              max_registered_loras: int = DEFAULT_MAX_REGISTERED_LORAS,
              image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> FastAPI:
    """The server's app over `engine` (started on startup, stopped on shutdown, after letting requests in
    flight finish for `shutdown_timeout` seconds). `api_key`, `allowed_origins`, `allowed_hosts`, `docs`: see
    the module docstring. A body over `max_request_bytes` is refused (413) as soon as it is known to be, before
    it is read whole, and one not received within `body_timeout` seconds is a 408 (a client trickling its body
    holds no connection for ever); prompts are tokenized (and chat templates rendered) in a worker thread, never
    on the event loop, after a prompt too large to fit and a chat of more than `max_chat_messages` messages are
    refused by their size. Output constraints are checked against `structured_limits`, then compiled in a
    grammar pool of their own, each new one test-compiled in a worker process first (`compile_config`; see
    `OpenAIServing`). A forced tool choice makes at most `max_parallel_tool_calls` calls, each string argument
    its schema leaves unbounded at most `max_tool_string_length` characters long (`pagedjax.serve.tools`).
    An engine with LoRA enabled serves the adapters `lora_modules` (name -> PEFT folder, registered now: ValueError
    naming a bad one) by name, and with `lora_updates` loads and unloads adapters at runtime (`pagedjax.serve.lora`;
    without it those routes answer 404), at most `max_registered_loras` at once. A model that takes images gets
    them in chat messages as data URLs, within `image_limits` (`pagedjax.serve.images`); for any other, an image
    part is a 400."""
    check_key = _api_key_check(api_key)
    adapters = ServedAdapters(engine, base_name=model_name, modules=lora_modules, runtime=lora_updates,
                              max_registered=max_registered_loras)
    if lora_updates is not None and api_key is None:
        logger.warning("runtime LoRA updates are on without an API key: any client that reaches the server may load "
                       "adapters from %s", lora_updates.root)
    metrics = ServerMetrics(engine.stats, lambda: engine.num_pending, engine.step_durations)
    serving = OpenAIServing(engine, model_name=model_name, chat_template=chat_template or ChatTemplate.from_model(None),
                            metrics=metrics, structured_limits=structured_limits, compile_config=compile_config,
                            max_chat_messages=max_chat_messages, max_parallel_tool_calls=max_parallel_tool_calls,
                            max_tool_string_length=max_tool_string_length, adapters=adapters, image_limits=image_limits)

    summary = engine.summary()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        logger.info("serving %s (max_model_len %d, chat template: %s, images: %s): %s", model_name,
                    serving.max_model_len, serving.chat_template.source, "no" if serving.images is None else "yes",
                    "; ".join(summary.lines()))
        yield
        await engine.shutdown(timeout=shutdown_timeout)
        serving.close()

    app = FastAPI(title="pagedjax-serve", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.middleware("http")(_cross_site_guard(allowed_origins, allowed_hosts))
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    created = int(time.time())
    # (closures: the body limit is this app's; as defaults, not `Annotated[...]`, because annotations are strings
    # here, resolved in the module's globals)
    completion_body = json_body(CompletionRequest, max_request_bytes, body_timeout)
    chat_body = json_body(ChatCompletionRequest, max_request_bytes, body_timeout)
    embedding_body = json_body(EmbeddingRequest, max_request_bytes, body_timeout)
    score_body = json_body(ScoreRequest, max_request_bytes, body_timeout)
    rerank_body = json_body(RerankRequest, max_request_bytes, body_timeout)
    load_body = json_body(LoadLoRAAdapterRequest, LORA_REQUEST_BYTES, body_timeout)
    unload_body = json_body(UnloadLoRAAdapterRequest, LORA_REQUEST_BYTES, body_timeout)
    protected = APIRouter(dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running and engine.accepting:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @protected.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def card(model_id: str = model_name) -> ModelCard:
        """The base model's card, or an adapter's (its `parent` the base model, its `root` its folder as
        `ServedAdapters` shows it)."""
        adapter = next((a for a in adapters.served() if a.request.lora_name == model_id), None)
        lineage = {"root": model_name} if adapter is None else {"root": adapter.root, "parent": model_name}
        return ModelCard(id=model_id, created=created, max_model_len=serving.max_model_len, **lineage,
                         **summary.as_dict())

    @protected.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[card(), *(card(a.request.lora_name) for a in adapters.served())])

    @protected.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return card(model_id)

    # The body is read after the check that the routes are on: a server without them says so, whatever it got.
    @protected.post("/v1/load_lora_adapter", openapi_extra=_body_schema(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> Response:
        adapters.check_runtime()
        body = await load_body(request)
        await adapters.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @protected.post("/v1/unload_lora_adapter", openapi_extra=_body_schema(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> Response:
        adapters.check_runtime()
        body = await unload_body(request)
        removed = await adapters.unload(body.lora_name)
        later = "" if removed else " Requests already running under it finish under it."
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.{later}")

    @protected.post("/v1/completions", response_model=CompletionResponse,
                    openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request, body: CompletionRequest = Depends(completion_body)):  # noqa: B008
        prepared = await asyncio.to_thread(serving.prepare_completion, body)
        await serving.compile(prepared)
        stream = await serving.start(prepared)
        if prepared.stream:
            return EventStreamResponse(serving.completion_events(prepared, stream))
        return await _until_disconnect(request, serving.completion(prepared, stream))

    @protected.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                    openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request, body: ChatCompletionRequest = Depends(chat_body)):  # noqa: B008
        prepared = await asyncio.to_thread(serving.prepare_chat, body)
        await serving.compile(prepared)
        stream = await serving.start(prepared)
        if prepared.stream:
            return EventStreamResponse(serving.chat_events(prepared, stream))
        return await _until_disconnect(request, serving.chat(prepared, stream))

    @protected.post("/v1/embeddings", response_model=EmbeddingResponse, openapi_extra=_body_schema(EmbeddingRequest))
    async def create_embeddings(request: Request, body: EmbeddingRequest = Depends(embedding_body)):  # noqa: B008
        prepared = await asyncio.to_thread(pooling.prepare_embeddings, serving, body)
        return await _until_disconnect(request, pooling.embeddings(serving, body, prepared))

    @protected.post("/v1/score", response_model=ScoreResponse, openapi_extra=_body_schema(ScoreRequest))
    async def create_score(request: Request, body: ScoreRequest = Depends(score_body)):  # noqa: B008
        scoring = await asyncio.to_thread(pooling.prepare_score, serving, body)
        return await _until_disconnect(request, pooling.score(serving, body, scoring))

    @protected.post("/v1/rerank", response_model=RerankResponse, openapi_extra=_body_schema(RerankRequest))
    async def create_rerank(request: Request, body: RerankRequest = Depends(rerank_body)):  # noqa: B008
        scoring = await asyncio.to_thread(pooling.prepare_rerank, serving, body)
        return await _until_disconnect(request, pooling.rerank(serving, body, scoring))

    app.include_router(protected)
    return app


def json_body(model: type[BaseModel], max_bytes: int, timeout: float = DEFAULT_BODY_TIMEOUT_S):
    """A dependency that reads the body (413 past `max_bytes`: by its Content-Length before reading, or as soon
    as that many bytes came; 408 when it takes longer than `timeout` seconds; a client gone meanwhile ends the
    request without a log line) and parses it as JSON whatever its Content-Type says (curl's `-d` sends
    form-encoded), validated by `model`; 400 naming the field otherwise."""

    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body is {size}, more than the {max_bytes:,} bytes this server takes "
                             "(--max-request-bytes)", code="request_too_large")

    async def parse(request: Request) -> BaseModel:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise too_large(f"{int(declared):,} bytes")
        raw = bytearray()
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > max_bytes:
                        raise too_large(f"over {max_bytes:,} bytes")
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                           code="request_timeout") from None
        except ClientDisconnect:
            raise APIError(CLIENT_CLOSED_REQUEST, "the client left while sending the body") from None
        try:
            if len(raw) <= PARSE_ON_LOOP_BYTES:
                return model.model_validate_json(bytes(raw))
            return await asyncio.to_thread(model.model_validate_json, bytes(raw))
        except ValidationError as e:
            message, param = validation_message(e.errors(include_url=False))
            raise bad_request(message, param) from None

    return parse


def _body_schema(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def _until_disconnect(request: Request, work):
    try:
        return await until_disconnect(request, work)
    except ClientDisconnected:  # the request was aborted with the work's cancellation
        return Response(status_code=CLIENT_CLOSED_REQUEST)
