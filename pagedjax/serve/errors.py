"""Errors as OpenAI's API reports them: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

  400 invalid_request_error  malformed JSON; a field of the wrong type, out of range or unknown; a prompt over
                             the context length (code `context_length_exceeded`, before tokenizing when its size
                             shows it); a parameter not supported yet; an output constraint over a limit (code
                             `structured_output_limit`) or that the grammar library refused (`invalid_constraint`
                             when the engine's compile refused it), crashed on or took too long to compile;
                             anything else the engine refuses (`pagedjax.errors`: its `param` and `code`, mapped by
                             type, never by message); a LoRA adapter the loader refuses (`invalid_lora_adapter`), a
                             name taken (`lora_adapter_exists`) or not allowed (`invalid_lora_name`), a load past
                             `--max-registered-loras` (`too_many_lora_adapters`); an image part
                             to a model without images (`images_not_supported`), a URL that is not a base64 data
                             URL (`invalid_image_url`), another media type (`unsupported_image_type`), bytes that
                             are not a readable still image of it (`invalid_image`), too many images
                             (`too_many_images`), one outside a user message or placeholders that do not match the
                             images (`invalid_image_part`)
  401 authentication_error   `--api-key` is set and `Authorization: Bearer <key>` is missing or wrong
                             (code `invalid_api_key`)
  403 permission_error       a LoRA `lora_path` that may leave the server's LoRA root (`lora_path_not_allowed`);
                             a cross-site request (`origin_not_allowed`, `host_not_allowed`)
  404 invalid_request_error  an unknown model (code `model_not_found`) or path; runtime LoRA updates off
                             (`lora_updates_disabled`); no such adapter folder or served adapter
                             (`lora_adapter_not_found`)
  413 invalid_request_error  a body over `--max-request-bytes` (`request_too_large`); an adapter file over its limit
                             (`lora_adapter_too_large`); an image over `--max-image-bytes` or `--max-image-pixels`
                             (`image_too_large`), a request's images over `--max-image-bytes-per-request`
                             (`images_too_large`)
  500 server_error           the engine failed the request (code `engine_error`)
  503 server_error           the queue is full (`--max-queue`, code `queue_full`), too many grammar compiles wait
                             (`--max-queued-compiles`, code `grammar_compiles_full`) or none got a worker in
                             time (`grammar_compiles_busy`), or the server is shutting down
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedjax.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          408: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error response; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=_TYPES.get(status, "server_error"), param=param,
                                         code=code))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _response(status: int, body: ErrorResponse, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _short(value) -> str:
    """`repr(value)`, at most 80 characters (a 1 MB string is not sent back)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text):,} characters)"


_NOUNS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}


def _plural(tag: str) -> str:
    if tag.startswith("list[") and tag.endswith("]"):
        return f"lists of {_plural(tag[5:-1])}"
    return f"{_NOUNS.get(tag, tag)}s"


def _form(tag: str) -> str:
    """A pydantic union branch tag in words: 'list[constrained-str]' -> 'a list of strings'."""
    tag = tag.replace("constrained-", "")
    if tag.startswith("list[") and tag.endswith("]"):
        return f"a list of {_plural(tag[5:-1])}"
    noun = _NOUNS.get(tag, tag)
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _union_error(field: str, errs: list[dict]) -> tuple[str, dict | None]:
    """One message for a field of a union type (pydantic gives one error per alternative, `loc[1]` naming it):
    the error inside the one alternative the value had the shape of (a list too long, a string too long),
    else the forms the field takes."""
    def shape_error(e):
        return len(e["loc"]) == 2 and e.get("type", "").endswith("_type")

    inside = {}
    for e in errs:
        if not shape_error(e):
            inside.setdefault(e["loc"][1], e)
    if len(inside) == 1:
        e = next(iter(inside.values()))
        where = ".".join([field, *e["loc"][2:]])
        return f"{where}: {e.get('msg')}", e
    forms = list(dict.fromkeys(_form(e["loc"][1]) for e in errs if len(e["loc"]) > 1))
    text = f"{', '.join(forms[:-1])} or {forms[-1]}" if len(forms) > 1 else (forms or ["of another form"])[0]
    whole = next((e for e in errs if len(e["loc"]) == 2), None)  # its input is the field's whole value
    return f"{field}: must be {text}", whole


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A message naming the fields at fault, and the first of them (pydantic's errors, a leading "body"
    location dropped). A field of a union type (e.g. `prompt`) gets one error per alternative, made one."""
    by_field: dict[str, list[dict]] = {}
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        by_field.setdefault(loc[0] if loc else "", []).append({**e, "loc": loc})
    parts = []
    for field, errs in list(by_field.items())[:3]:
        e = errs[0]
        if e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {'.'.join(e['loc'])!r}")
            continue
        if len(errs) == 1:
            text, shown = f"{'.'.join(e['loc']) or 'body'}: {e.get('msg')}", e
        else:
            text, shown = _union_error(field, errs)
        got = None if shown is None else shown.get("input")
        if got is not None and not isinstance(got, dict | list | bytes):
            text += f" (got {_short(got)})"
        parts.append(text)
    more = f" (and {len(by_field) - 3} more fields)" if len(by_field) > 3 else ""
    param = next((f for f in by_field if f), None)
    return "; ".join(parts) + more, param


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns, its own and the framework's, in OpenAI's format."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _response(exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return _response(400, error_body(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        return _response(exc.status_code, error_body(exc.status_code, message), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _response(500, error_body(500, f"internal server error: {type(exc).__name__}: {exc}"))
