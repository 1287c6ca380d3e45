"""Serving pagedjax over HTTP with OpenAI's API: `pagedjax-serve` (also `python -m pagedjax.serve`).

Modules, one concept each: `async_engine` (AsyncLLMEngine: the engine in a background thread, asyncio streams of
outputs), `protocol` (the API's request and response bodies), `sampling` (request fields -> SamplingParams),
`chat_template` (messages -> prompt), `images` (image parts: data URLs decoded under limits), `admission` (a prompt
refused by its size before it is tokenized), `detokenizer` (UTF-8-safe text deltas) and `choices` (deltas per
choice), `serving` (the endpoints' work), `disconnect` (aborting requests whose client left), `errors` (OpenAI's
error JSON), `metrics` (Prometheus), `app` (the FastAPI routes) and `cli` (the command).
Needs the `serve` extra: `pip install 'pagedjax[serve]'`.
"""

from pagedjax.serve.async_engine import AsyncLLMEngine, EngineStepError, EngineStoppedError, QueueFullError

__all__ = ["AsyncLLMEngine", "EngineStepError", "EngineStoppedError", "QueueFullError"]
