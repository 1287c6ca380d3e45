"""The pooling endpoints' work: `POST /v1/embeddings` (OpenAI's shape), `/v1/score` and `/v1/rerank` (vLLM's, the
Jina / Cohere shape). Each text (or pair) of a request runs as one pooling request (`PoolingParams`), batched with
everything else; the scores are `pagedjax.engine.relevance`'s (a cross-encoder's sigmoid over each pair's joint
prompt, else the cosine of the two texts' embeddings).

The first input that fails fails the request, and a request that ends early (an error, a client gone) aborts every
one of its inputs still running. An input must leave one token of the context free (as a completion's prompt must: at
most max_model_len - 1 tokens).
"""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np

from pagedjax.engine.relevance import cosine, cross_encoder, pair_prompt, pairs
from pagedjax.errors import InvalidRequest
from pagedjax.model.classifier import HEAD_POOLING
from pagedjax.pooling_params import PoolingParams
from pagedjax.serve.admission import encode_text
from pagedjax.serve.async_engine import EngineStepError, EngineStoppedError, RequestStream, random_request_id
from pagedjax.serve.choices import RequestFailed
from pagedjax.serve.errors import bad_request
from pagedjax.serve.metrics import RequestTimer
from pagedjax.serve.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedjax.serve.serving import OpenAIServing, Prepared, engine_failures


def _tokens(serving: OpenAIServing, item, where: str, field: str) -> list[int]:
    """An input's token ids: a text tokenized (400 when empty or for a model without a tokenizer), or the ids."""
    if isinstance(item, str):
        if not item:  # (a tokenizer may give it a BOS token: still no text)
            raise bad_request(f"{where}: must not be empty", field)
        if serving.tokenizer is None:
            raise bad_request(f"{where}: this model has no tokenizer; send token ids", field)
        serving.check_prompt_size(item, "input")
        return encode_text(serving.tokenizer, item)
    return list(item)


def _prepared(serving: OpenAIServing, ids: list[int], params: PoolingParams, model: str, where: str,
              field: str) -> Prepared:
    """One pooling request, checked against the context (400 naming the input)."""
    if not ids:
        raise bad_request(f"{where}: must not be empty", field)
    if len(ids) >= serving.max_model_len:
        raise bad_request(f"This model's maximum context length is {serving.max_model_len} tokens. However, "
                          f"{where} has {len(ids)} tokens (at most {serving.max_model_len - 1} can be pooled). "
                          "Please shorten it.", field, "context_length_exceeded")
    return Prepared(request_id=random_request_id("pool"), model=model, prompt_token_ids=ids, params=params,
                    stream=False, include_usage=False, created=int(time.time()))


def _where(name: str, i: int, n: int) -> str:
    return name if n == 1 else f"{name}[{i}]"


async def _vector(stream: RequestStream, timer: RequestTimer) -> list[float]:
    """One pooling request's vector, counted in the server's metrics as any request (latency, finish reason)."""
    reason = None
    try:
        async with stream:
            async for out in stream:
                if out.finished:
                    reason = out.finish_reason
                    if out.embedding is None:  # aborted behind the request's back (the engine shut down)
                        raise bad_request(f"the request ended with {reason!r} before its vector was made")
                    return out.embedding
    except (RequestFailed, EngineStepError, EngineStoppedError):
        reason = "error"
        raise
    finally:
        timer.finish(reason)  # None: cancelled (the client left, or another input failed): counted as aborted
    raise RuntimeError("the request's stream ended without its final output")  # a bug: streams end with it


async def vectors(serving: OpenAIServing, prepared: list[Prepared]) -> list[list[float]]:
    """Start every pooling request (400 / 503 as `OpenAIServing.start`), collect their vectors in order (500 / 503
    as a completion's failures); whatever way it ends, none of them keeps running."""
    streams: list[RequestStream] = []
    tasks: list[asyncio.Task] = []
    try:
        for p in prepared:
            streams.append(await serving.start(p))
        tasks = [asyncio.ensure_future(_vector(s, serving.metrics.timer())) for s in streams]
        with engine_failures():
            return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()  # the others, when one failed (a no-op for those done)
        for s in streams:
            s.abort()  # a no-op for those that finished


def _usage_tokens(prepared: list[Prepared]) -> int:
    return sum(p.num_prompt_tokens for p in prepared)


# ------------------------------------------------------------------------------------------------- embeddings
def prepare_embeddings(serving: OpenAIServing, body: EmbeddingRequest) -> list[Prepared]:
    """One pooling request per input (tokenized here: a worker thread's work)."""
    serving.check_model(body.model)
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    try:
        params = PoolingParams(dimensions=body.dimensions)
    except InvalidRequest as e:
        raise bad_request(str(e), "dimensions") from None
    return [_prepared(serving, _tokens(serving, item, _where("input", i, len(inputs)), "input"), params, body.model,
                      _where("input", i, len(inputs)), "input") for i, item in enumerate(inputs)]


async def embeddings(serving: OpenAIServing, body: EmbeddingRequest, prepared: list[Prepared]) -> EmbeddingResponse:
    found = await vectors(serving, prepared)
    data = [EmbeddingData(index=i, embedding=_encoded(v, body.encoding_format)) for i, v in enumerate(found)]
    tokens = _usage_tokens(prepared)
    return EmbeddingResponse(id=random_request_id("embd"), created=prepared[0].created, model=body.model, data=data,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector


# ------------------------------------------------------------------------------------------- score and rerank
class Scoring:
    """The pooling requests that score a request's (query, document) pairs, and how their vectors become scores:
    one per pair for a cross-encoder, one per distinct text for an embedding model (`pagedjax.engine.relevance`)."""

    def __init__(self, serving: OpenAIServing, model: str, text_1, text_2, fields: tuple[str, str]):
        serving.check_model(model)
        try:
            scored = pairs(text_1, text_2)
            self.head = cross_encoder(serving.engine)
            if self.head is not None:
                for q, d in scored:
                    for text, field in ((q, fields[0]), (d, fields[1])):
                        if not text:
                            raise bad_request(f"{field}: must not be empty", field)
                    serving.check_prompt_size(q + d, "input")
                prompts = [pair_prompt(serving.tokenizer, q, d) for q, d in scored]
        except InvalidRequest as e:  # the relevance functions' refusals, as the request's fields name them
            field = {"text_1": fields[0], "text_2": fields[1]}.get(e.param, e.param)
            raise bad_request(str(e), field, e.code) from None
        if self.head is not None:
            self.prepared = [_prepared(serving, ids, HEAD_POOLING, model, _where("pair", i, len(prompts)), fields[1])
                             for i, ids in enumerate(prompts)]
            return
        index = {t: i for i, t in enumerate(dict.fromkeys(t for pair in scored for t in pair))}  # each text once
        texts = list(index)
        self.pairs = [(index[q], index[d]) for q, d in scored]
        field = {t: fields[0] for t, _ in scored} | {t: fields[1] for _, t in scored}
        self.prepared = [_prepared(serving, _tokens(serving, t, field[t], field[t]), PoolingParams(), model, field[t],
                                   field[t]) for t in texts]

    async def scores(self, serving: OpenAIServing) -> list[float]:
        found = await vectors(serving, self.prepared)
        if self.head is not None:
            return [float(self.head.probs(np.asarray(v))[0]) for v in found]
        return [cosine(found[a], found[b]) for a, b in self.pairs]

    @property
    def num_tokens(self) -> int:
        return _usage_tokens(self.prepared)


def prepare_score(serving: OpenAIServing, body: ScoreRequest) -> Scoring:
    return Scoring(serving, body.model, body.text_1, body.text_2, ("text_1", "text_2"))


async def score(serving: OpenAIServing, body: ScoreRequest, scoring: Scoring) -> ScoreResponse:
    found = await scoring.scores(serving)
    tokens = scoring.num_tokens
    return ScoreResponse(id=random_request_id("score"), created=int(time.time()), model=body.model,
                         data=[ScoreData(index=i, score=s) for i, s in enumerate(found)],
                         usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def prepare_rerank(serving: OpenAIServing, body: RerankRequest) -> Scoring:
    return Scoring(serving, body.model, body.query, body.documents, ("query", "documents"))


async def rerank(serving: OpenAIServing, body: RerankRequest, scoring: Scoring) -> RerankResponse:
    found = await scoring.scores(serving)
    order = sorted(range(len(found)), key=lambda i: -found[i])[:body.top_n]
    results = [RerankResult(index=i, relevance_score=found[i],
                            document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
               for i in order]
    return RerankResponse(id=random_request_id("rerank"), model=body.model, results=results,
                          usage=RerankUsage(total_tokens=scoring.num_tokens))
