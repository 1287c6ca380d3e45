"""The HTTP routes (FastAPI): OpenAI's completions, chat completions and models, plus health and metrics.

    app = build_app(AsyncLLMEngine(engine), model_name="pagedjax-tiny")   # then serve it with uvicorn

| route | |
|---|---|
| `POST /v1/completions` | a prompt (text or token ids) -> text; `stream: true` for server-sent events |
| `POST /v1/chat/completions` | messages, through the chat template -> the assistant's reply |
| `GET /v1/models`, `GET /v1/models/{id}` | the served model |
| `GET /health` | 200 while the engine takes requests, 503 otherwise |
| `GET /metrics` | Prometheus text (see `pagedjax.serve.metrics`) |

With `api_key`, the `/v1` routes and `/metrics` need `Authorization: Bearer <key>` (401 otherwise; compared in
constant time); `/health` stays open for load balancers. The app starts the engine thread on startup and stops
it on shutdown (requests still in flight by then are aborted).
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from pagedjax.serve.async_engine import AsyncLLMEngine
from pagedjax.serve.chat_template import ChatTemplate
from pagedjax.serve.disconnect import ClientDisconnected, EventStreamResponse, until_disconnect
from pagedjax.serve.errors import APIError, bad_request, install_error_handlers, validation_message
from pagedjax.serve.metrics import CONTENT_TYPE, ServerMetrics
from pagedjax.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from pagedjax.serve.serving import OpenAIServing

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it


def _api_key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1", errors="replace")
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


def build_app(engine: AsyncLLMEngine, *, model_name: str, chat_template: ChatTemplate | None = None,
              api_key: str | None = None, shutdown_timeout: float = 0.0) -> FastAPI:
    """The server's app over `engine` (started on startup, stopped on shutdown, after letting requests in
    flight finish for `shutdown_timeout` seconds). `api_key`: see the module docstring."""
    metrics = ServerMetrics(engine.stats, lambda: engine.num_pending)
    serving = OpenAIServing(engine, model_name=model_name, chat_template=chat_template or ChatTemplate.from_model(None),
                            metrics=metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        logger.info("serving %s (max_model_len %d, chat template: %s)", model_name, serving.max_model_len,
                    serving.chat_template.source)
        yield
        await engine.shutdown(timeout=shutdown_timeout)

    app = FastAPI(title="pagedjax-serve", lifespan=lifespan)
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    created = int(time.time())
    protected = APIRouter(dependencies=[Depends(_api_key_check(api_key))])

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running and engine.accepting:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @protected.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def card() -> ModelCard:
        return ModelCard(id=model_name, created=created, max_model_len=serving.max_model_len)

    @protected.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @protected.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return card()

    @protected.post("/v1/completions", response_model=CompletionResponse,
                    openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request, body: Annotated[CompletionRequest, Depends(_completion_body)]):
        prepared = serving.prepare_completion(body)
        stream = await serving.start(prepared)
        if prepared.stream:
            return EventStreamResponse(serving.completion_events(prepared, stream))
        return await _until_disconnect(request, serving.completion(prepared, stream))

    @protected.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                    openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request,
                               body: Annotated[ChatCompletionRequest, Depends(_chat_body)]):
        prepared = serving.prepare_chat(body)
        stream = await serving.start(prepared)
        if prepared.stream:
            return EventStreamResponse(serving.chat_events(prepared, stream))
        return await _until_disconnect(request, serving.chat(prepared, stream))

    app.include_router(protected)
    return app


def json_body(model: type[BaseModel]):
    """A dependency that parses the body as JSON whatever its Content-Type says (curl's `-d` sends
    form-encoded), validated by `model`; 400 naming the field otherwise."""

    async def parse(request: Request) -> BaseModel:
        raw = await request.body()
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            message, param = validation_message(e.errors(include_url=False))
            raise bad_request(message, param) from None

    return parse


_completion_body = json_body(CompletionRequest)
_chat_body = json_body(ChatCompletionRequest)


def _body_schema(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def _until_disconnect(request: Request, work):
    try:
        return await until_disconnect(request, work)
    except ClientDisconnected:  # the request was aborted with the work's cancellation
        return Response(status_code=CLIENT_CLOSED_REQUEST)
