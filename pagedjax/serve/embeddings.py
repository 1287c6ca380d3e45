"""The embeddings endpoint's work (`POST /v1/embeddings`, OpenAI's shape): each input -> token ids -> one pooling
request (`PoolingParams`: the model's pooling, the request's `dimensions`) -> the vectors, as numbers or base64.

The inputs of one request run as that many engine requests, batched with everything else; the first that fails
fails the request, and a request that ends early (an error, a client gone) aborts every one of its inputs still
running. An input must leave one token of the context free (as a completion's prompt must: at most max_model_len - 1
tokens).
"""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np

from pagedjax.errors import InvalidRequest
from pagedjax.pooling_params import PoolingParams
from pagedjax.serve.admission import encode_text
from pagedjax.serve.async_engine import RequestStream, random_request_id
from pagedjax.serve.errors import bad_request
from pagedjax.serve.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from pagedjax.serve.serving import OpenAIServing, Prepared, engine_failures


def prepare_embeddings(serving: OpenAIServing, body: EmbeddingRequest) -> list[Prepared]:
    """One prepared pooling request per input (tokenized here: a worker thread's work); 400 naming the input for
    an empty one, one too long for the context, or text for a model without a tokenizer."""
    serving.check_model(body.model)
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    try:
        params = PoolingParams(dimensions=body.dimensions)
    except InvalidRequest as e:
        raise bad_request(str(e), "dimensions") from None
    created, prepared = int(time.time()), []
    for i, item in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            if not item:  # (a tokenizer may give it a BOS token: still no text to embed)
                raise bad_request(f"{where}: must not be empty", "input")
            if serving.tokenizer is None:
                raise bad_request(f"{where}: this model has no tokenizer; send token ids", "input")
            serving.check_prompt_size(item, "input")
            ids = encode_text(serving.tokenizer, item)
        else:
            ids = list(item)
        if not ids:
            raise bad_request(f"{where}: must not be empty", "input")
        if len(ids) >= serving.max_model_len:
            raise bad_request(f"This model's maximum context length is {serving.max_model_len} tokens. However, "
                              f"{where} has {len(ids)} tokens (at most {serving.max_model_len - 1} can be embedded). "
                              "Please shorten it.", "input", "context_length_exceeded")
        prepared.append(Prepared(request_id=random_request_id("embd"), model=body.model, prompt_token_ids=ids,
                                 params=params, stream=False, include_usage=False, created=created))
    return prepared


async def _vector(stream: RequestStream) -> list[float]:
    async with stream:
        async for out in stream:
            if out.finished:
                if out.embedding is None:  # aborted behind the request's back (the engine shut down)
                    raise bad_request(f"the request ended with {out.finish_reason!r} before its vector was made")
                return out.embedding
    raise RuntimeError("the request's stream ended without its final output")  # a bug: streams end with it


async def embeddings(serving: OpenAIServing, body: EmbeddingRequest,
                     prepared: list[Prepared]) -> EmbeddingResponse:
    """Start every input's request (400 / 503 as `OpenAIServing.start`), collect the vectors in input order (500
    / 503 as a completion's failures); whatever way it ends, no input of it keeps running."""
    streams: list[RequestStream] = []
    tasks: list[asyncio.Task] = []
    try:
        for p in prepared:
            streams.append(await serving.start(p))
        tasks = [asyncio.ensure_future(_vector(s)) for s in streams]
        with engine_failures():
            vectors = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()  # the others, when one failed (a no-op for those done)
        for s in streams:
            s.abort()  # a no-op for those that finished
    data = [EmbeddingData(index=i, embedding=_encoded(v, body.encoding_format)) for i, v in enumerate(vectors)]
    tokens = sum(p.num_prompt_tokens for p in prepared)
    return EmbeddingResponse(id=prepared[0].request_id, created=prepared[0].created, model=body.model, data=data,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector
