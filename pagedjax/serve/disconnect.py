"""Noticing that an HTTP client went away, so that its request is aborted instead of generated for nobody.

Starlette notices a streaming client's disconnect only when a write fails (ASGI spec 2.4) or, with older
servers, by listening for `http.disconnect`; and a non-streaming handler is never told. Both helpers here listen
for `http.disconnect` while the work runs and cancel it when it comes; cancelling the task that iterates a
`RequestStream` aborts its request (see `pagedjax.serve.async_engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled (raising ClientDisconnected) if the client disconnects first. The request's
    body must have been read already (it has, once FastAPI parsed it)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (closing their body iterator, which aborts its request) as soon as the
    client disconnects, whatever ASGI spec version the server speaks."""

    media_type = "text/event-stream"

    def __init__(self, content, **kwargs):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await _wait_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
