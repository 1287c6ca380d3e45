"""`POST /v1/embeddings` through the official `openai` client and raw HTTP: vectors equal the offline engine's
(`LLMEngine.embed`) as numbers and as base64 (the client's default), `dimensions`, batches of texts and token ids,
usage; bad inputs are 400s naming the field; embeddings and completions run side by side and leave no block held."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest

from pagedjax import PoolingParams
from pagedjax.model.tokenizer import ByteTokenizer
from tests.serve.server_utils import MAX_MODEL_LEN, MODEL_NAME, make_engine, running_server

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


def test_embeddings_and_completions_side_by_side_hold_nothing_after(server):
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
    mem = server.llm.stats().scheduler.memory
    assert mem.num_used_blocks == 0 and not server.llm.has_unfinished_requests()
