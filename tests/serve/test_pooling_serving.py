"""The pooling endpoints against a live server. `POST /v1/embeddings` through the official `openai` client and raw
HTTP: vectors equal the offline engine's (`LLMEngine.embed`) as numbers and as base64 (the client's default),
`dimensions`, batches of texts and token ids, usage. `/v1/score` and `/v1/rerank`: the offline engine's
`relevance`, of an embedding model (cosine) and of a cross-encoder (a one-label head over the pair's prompt), ranked
and cut to `top_n`. Bad inputs are 400s naming the field; pooling requests and completions run side by side and
leave no block held. An encoder (bidirectional attention) serves embeddings and refuses completions."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest

from pagedjax import CacheConfig, LLMEngine, PoolingParams, SchedulerConfig
from pagedjax.model.classifier import Classifier
from pagedjax.model.tokenizer import ByteTokenizer
from tests.serve.server_utils import CFG, MAX_MODEL_LEN, MODEL_NAME, SEED, make_engine, running_server

TEXTS = ["def parse(text):", "import os", "x"]


@pytest.fixture(scope="module")
def server():
    with running_server(make_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    engine = make_engine()
    return lambda ids, **kw: np.array(engine.embed([ids], PoolingParams(**kw))[0].outputs.embedding)


def test_the_openai_client_gets_the_offline_vectors(client, offline):
    tok = ByteTokenizer()
    out = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # base64 on the wire: the client's default
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == MODEL_NAME
    for text, d in zip(TEXTS, out.data, strict=True):
        np.testing.assert_allclose(d.embedding, offline(tok.encode(text)), rtol=1e-6, atol=1e-7)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    floats = client.embeddings.create(model=MODEL_NAME, input=[5, 6, 7], encoding_format="float", dimensions=8)
    np.testing.assert_allclose(floats.data[0].embedding, offline([5, 6, 7], dimensions=8), rtol=1e-6, atol=1e-7)
    assert len(floats.data[0].embedding) == 8


def test_bad_inputs_are_400s_naming_the_field(server):
    url = f"{server.url}/v1/embeddings"
    for body, field in (({"model": MODEL_NAME, "input": []}, "input"),
                        ({"model": MODEL_NAME, "input": ""}, "input"),
                        ({"model": MODEL_NAME, "input": [[1], []]}, "input"),
                        ({"model": MODEL_NAME, "input": [1] * MAX_MODEL_LEN}, "input"),
                        ({"model": MODEL_NAME, "input": [300]}, "prompt"),  # outside the vocabulary
                        ({"model": MODEL_NAME, "input": "x", "dimensions": 0}, "dimensions"),
                        ({"model": MODEL_NAME, "input": "x", "dimensions": 65}, "dimensions"),
                        ({"model": MODEL_NAME, "input": "x", "encoding_format": "int8"}, "encoding_format")):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field, (body, r.json())
    r = httpx.post(url, json={"model": "other", "input": "x"}, timeout=60)
    assert r.status_code == 404


def _stopped(server) -> float:
    """The server's count of requests finished with reason "stop" (`/metrics`)."""
    text = httpx.get(f"{server.url}/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('pagedjax_request_success_total{finish_reason="stop"}'))


def test_embeddings_and_completions_side_by_side_hold_nothing_after(server):
    before = _stopped(server)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            jobs = [c.post("/v1/embeddings", json={"model": MODEL_NAME, "input": [f"text {i}" * (i + 1)] * 3})
                    for i in range(6)]
            jobs += [c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "def", "max_tokens": 8})
                     for _ in range(4)]
            return await asyncio.gather(*jobs)

    replies = asyncio.run(run())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    assert all(len(r.json()["data"]) == 3 for r in replies[:6])
    assert _stopped(server) - before >= 18  # each input a request in the metrics (the completions may stop too)
    mem = server.llm.stats().scheduler.memory
    assert mem.num_used_blocks == 0 and not server.llm.has_unfinished_requests()


def test_score_and_rerank_of_an_embedding_model_are_the_offline_relevance(server):
    tok, llm = ByteTokenizer(), make_engine()
    query, docs = "def parse", ["def parse(x)", "import os", "class Parser:"]
    want = [o.outputs.score for o in llm.relevance(tok.encode(query), [tok.encode(d) for d in docs])]
    r = httpx.post(f"{server.url}/v1/score", json={"model": MODEL_NAME, "text_1": query, "text_2": docs}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want, rtol=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in [query, *docs])  # each text once
    r = httpx.post(f"{server.url}/v1/rerank", json={"model": MODEL_NAME, "query": query, "documents": docs,
                                                   "top_n": 2}, timeout=60)
    assert r.status_code == 200, r.text
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in r.json()["results"]] == best
    assert [x["document"]["text"] for x in r.json()["results"]] == [docs[i] for i in best]
    np.testing.assert_allclose([x["relevance_score"] for x in r.json()["results"]], [want[i] for i in best], rtol=1e-5)
    r = httpx.post(f"{server.url}/v1/rerank", json={"model": MODEL_NAME, "query": query, "documents": docs,
                                                   "return_documents": False}, timeout=60)
    assert len(r.json()["results"]) == 3 and all("document" not in x for x in r.json()["results"])
    for path, body, field in (("score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
                              ("score", {"text_1": "a", "text_2": []}, "text_2"),
                              ("score", {"text_1": "", "text_2": "a"}, "text_1"),
                              ("rerank", {"query": "a", "documents": []}, "documents"),
                              ("rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n")):
        r = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL_NAME, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


class PairTokenizer(ByteTokenizer):
    """The byte tokenizer with a pair template: the two texts' encodings one after the other."""

    def encode_pair(self, text, pair):
        return self.encode(text) + self.encode(pair, add_bos=False)


def test_a_cross_encoder_server_scores_each_pairs_prompt():
    head = Classifier(np.random.default_rng(0).normal(0, 0.1, (1, CFG.hidden_size)).astype(np.float32), None,
                      ("rel",))
    query, docs = "def parse", ["def parse(x)", "import os"]
    want = [o.outputs.score for o in make_engine(classifier=head, tokenizer=PairTokenizer()).relevance(query, docs)]
    with running_server(make_engine(classifier=head, tokenizer=PairTokenizer())) as s:
        r = httpx.post(f"{s.url}/v1/score", json={"model": MODEL_NAME, "text_1": query, "text_2": docs}, timeout=60)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want, rtol=1e-5)  # other batches
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "generation_not_supported"
    with running_server(make_engine(classifier=head)) as s:  # no pair template
        r = httpx.post(f"{s.url}/v1/rerank", json={"model": MODEL_NAME, "query": "a", "documents": ["b"]},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "tokenizer_required", r.text


def test_a_bidirectional_model_serves_embeddings_and_refuses_the_rest():
    """An encoder (`ModelConfig.bidirectional`, as EmbeddingGemma): `/v1/embeddings` gives the offline vectors; a
    completion is a 400 `generation_not_supported`, an input longer than one step a 400 naming it."""
    make = lambda: LLMEngine(model_config=CFG.replace(bidirectional=True), seed=SEED, tokenizer=ByteTokenizer(),
                             cache_config=CacheConfig(block_size=16, num_blocks=64),
                             scheduler_config=SchedulerConfig(max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN))
    want = [o.outputs.embedding for o in make().embed([ByteTokenizer().encode(t) for t in TEXTS])]
    with running_server(make()) as s:
        r = httpx.post(f"{s.url}/v1/embeddings", json={"model": MODEL_NAME, "input": TEXTS, "encoding_format": "float"},
                       timeout=60)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([d["embedding"] for d in r.json()["data"]], want, rtol=1e-5, atol=1e-6)
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "generation_not_supported", r.text
        r = httpx.post(f"{s.url}/v1/embeddings", json={"model": MODEL_NAME, "input": [1] * 65}, timeout=60)
        assert r.status_code == 400 and "runs in one step, which holds at most 64" in r.json()["error"]["message"]
