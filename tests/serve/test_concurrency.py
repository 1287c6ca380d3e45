"""64 concurrent streaming clients, a quarter of them hanging up mid-stream: every other request gets exactly
the tokens it gets alone (greedy), the ones that left are aborted, and afterwards the engine holds nothing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedjax import SamplingParams
from pagedjax.model.tokenizer import ByteTokenizer
from tests.serve.server_utils import MAX_MODEL_LEN, MODEL_NAME, make_engine, metric, running_server

NUM_CLIENTS = 64
PROMPTS = [f"{i * 7}: def handler_{i}(request):\n" + "    x = 1\n" * (i % 4) for i in range(8)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server():
    with running_server(make_engine()) as s:
        yield s


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, *, leave_after: int | None) -> tuple[str, str]:
    """The streamed text and finish reason; with `leave_after`, hang up after that many text chunks."""
    max_tokens = MAX_MODEL_LEN - len(prompt) - 8 if leave_after is not None else MAX_TOKENS
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, reason, chunks = "", None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return text, "left"
    return text, reason


async def _run_clients(url: str) -> list[tuple[str, str]]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 4, max_keepalive_connections=NUM_CLIENTS + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks = [_stream(client, url, PROMPTS[i % len(PROMPTS)], leave_after=2 if i % 4 == 3 else None)
                 for i in range(NUM_CLIENTS)]
        return await asyncio.gather(*tasks)


def test_64_streaming_clients_a_quarter_leaving(server):
    results = asyncio.run(_run_clients(server.url))

    alone = make_engine()  # the same weights, each prompt run alone
    tok = ByteTokenizer()
    expected = [alone.generate([tok.encode(p)], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)[0].text for p in PROMPTS]
    for i, (text, reason) in enumerate(results):
        if i % 4 == 3:
            assert reason == "left"
        else:
            assert (text, reason) == (expected[i % len(PROMPTS)], "length"), i

    # The engine thread applies aborts asynchronously: wait until it has, then nothing may be left.
    text = ""
    with httpx.Client() as client:  # one for every scrape: `httpx.get` builds one (20 ms of CPU) each
        for _ in range(600):
            text = client.get(f"{server.url}/metrics").text
            if metric(text, "pagedjax_num_requests_pending") == 0 and \
                    metric(text, "pagedjax_num_requests_running") == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
    assert metric(text, "pagedjax_num_requests_running") == 0
    assert metric(text, "pagedjax_num_requests_waiting") == 0
    assert metric(text, "pagedjax_num_requests_pending") == 0
    assert metric(text, "pagedjax_kv_blocks_used") == 0
    # The clients that left were aborted, not run to their (long) max_tokens.
    assert metric(text, "pagedjax_request_success_total", 'finish_reason="abort"') == NUM_CLIENTS // 4
    assert metric(text, "pagedjax_request_success_total", 'finish_reason="length"') == NUM_CLIENTS * 3 // 4
    assert server.llm.stats().scheduler.memory.num_used_blocks == 0
    assert 0 < metric(text, "pagedjax_compiled_programs") == server.llm.stats().compiled_programs
    assert metric(text, "pagedjax_stand_in_steps_total") == server.llm.stats().stand_in_steps
    # Every step the engine thread ran is in the step-time histogram (the soak compares chunk gaps with it).
    assert metric(text, "pagedjax_engine_step_seconds_count") == server.llm.stats().steps > 0
    assert metric(text, "pagedjax_engine_step_seconds_bucket", 'le="+Inf"') == server.llm.stats().steps
