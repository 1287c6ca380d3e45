"""AsyncLLMEngine without HTTP: its outputs equal the engine's own, leaving a stream early aborts the request
and frees its blocks, a failing step fails only what was in flight, and shutdown ends every stream."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from pagedjax import SamplingParams
from pagedjax.config import LoRAConfig
from pagedjax.errors import EngineUnavailable
from pagedjax.serve.async_engine import AsyncLLMEngine, EngineStepError, EngineStoppedError, QueueFullError
from tests.serve.server_utils import make_engine

PROMPTS = [[256, 1, 2, 3], [256, 40, 41, 42, 43, 44, 45], [256, *range(60, 90)]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(max_tokens=9, temperature=0.8, seed=3),
          SamplingParams(max_tokens=7, temperature=1.0, top_k=20, seed=4)]


@pytest.fixture(scope="module")
def expected():
    return [o.output_token_ids for o in make_engine().generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture
def engine():
    e = AsyncLLMEngine(make_engine())
    e.start()
    yield e
    e.stop()


async def _collect(engine, prompt, params) -> list:
    return [out async for out in engine.generate(prompt, params)]


def test_concurrent_outputs_equal_the_engines(engine, expected):
    async def main():
        return await asyncio.gather(*(_collect(engine, p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)))

    for outs, tokens in zip(asyncio.run(main()), expected, strict=True):
        assert outs[-1].finished and outs[-1].output_token_ids == tokens
        assert all(not o.finished for o in outs[:-1])
        # Snapshots are cumulative: each extends the one before.
        for a, b in zip(outs, outs[1:], strict=False):
            assert b.output_token_ids[:len(a.output_token_ids)] == a.output_token_ids
    assert engine.num_pending == 0


def test_leaving_a_stream_aborts_and_frees_blocks(engine, expected):
    async def main():
        seen = 0
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        async with contextlib.aclosing(engine.generate(PROMPTS[2], params)) as outputs:
            async for out in outputs:
                seen = len(out.output_token_ids)
                if seen >= 2:
                    break  # aclosing closes the generator: the request is aborted
        async with await engine.add_request(PROMPTS[1], params) as stream:  # the same with a stream
            async for _ in stream:
                break
        # Commands are applied in order: once a later request is done, the abort was applied before it.
        later = await _collect(engine, PROMPTS[0], PARAMS[0])
        return seen, later

    seen, later = asyncio.run(main())
    assert 2 <= seen < 200
    assert later[-1].output_token_ids == expected[0]
    stats = engine.stats()
    assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0
    assert stats.scheduler.memory.num_used_blocks == 0
    assert stats.generated_tokens < 400
    assert engine.num_pending == 0


def test_cancelling_the_consumer_task_aborts(engine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPTS[1], SamplingParams(temperature=0.0,
                                                                      max_tokens=200, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _collect(engine, PROMPTS[0], PARAMS[0])

    asyncio.run(main())
    assert engine.stats().scheduler.memory.num_used_blocks == 0
    assert engine.stats().generated_tokens < 200 + 12


def test_bad_request_raises_at_add_and_queues_nothing(engine):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request([256, 999], SamplingParams(temperature=0.0))
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request([], SamplingParams(temperature=0.0))

    asyncio.run(main())
    assert engine.num_pending == 0
    assert engine.stats().scheduler.num_waiting == 0


def test_a_prompt_with_images_refused_in_its_encoding_thread_queues_nothing_and_serving_goes_on(engine, expected):
    """Image prompts are encoded off the engine thread (`LLMEngine.encode_prompt` in a worker thread): its refusal
    (this text model takes no images) reaches the caller, nothing is pending or queued, and the next request runs."""
    from pagedjax.errors import UnsupportedFeature

    async def main():
        with pytest.raises(UnsupportedFeature, match="takes no images"):
            await engine.add_request(PROMPTS[0], PARAMS[0], images=[object()])
        assert engine.num_pending == 0
        return await _collect(engine, PROMPTS[0], PARAMS[0])

    outs = asyncio.run(main())
    assert outs[-1].output_token_ids == expected[0] and engine.num_pending == 0
    assert engine.stats().scheduler.memory.num_used_blocks == 0


def test_max_pending():
    engine = AsyncLLMEngine(make_engine(), max_pending=1)
    engine.start()

    async def main():
        async with await engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2)) as stream:
            with pytest.raises(QueueFullError, match="limit is 1"):
                await engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0))
            outs = [o async for o in stream]
        assert outs[-1].finished
        second = await _collect(engine, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2))  # room again
        assert second[-1].finished

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="max_pending"):
        AsyncLLMEngine(make_engine(), max_pending=0)


def test_a_failing_step_fails_what_is_in_flight_and_serves_on(engine, expected):
    llm = engine.engine
    step = llm.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return step()

    llm.step = failing_step

    async def main():
        with pytest.raises(EngineStepError, match="RuntimeError: boom"):
            await _collect(engine, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        return await _collect(engine, PROMPTS[0], PARAMS[0])

    try:
        later = asyncio.run(main())
    finally:
        llm.step = step
    assert later[-1].output_token_ids == expected[0]
    assert engine.stats().scheduler.memory.num_used_blocks == 0
    assert engine.is_running


@pytest.mark.parametrize("how", ["step", "fail"])
def test_an_unavailable_engine_fails_every_request_and_ends_the_thread(how):
    """A step that raises EngineUnavailable (a lost host), or `fail` called from another thread: the request in
    flight ends with the error, nothing more is taken, `unavailable` says why."""
    engine = AsyncLLMEngine(make_engine())
    engine.start()
    llm = engine.engine
    step, lost = llm.step, EngineUnavailable("a process was lost")
    seen = threading.Event()

    def step_then_lose():
        outputs = step()
        seen.set()
        if how == "step":
            raise lost
        return outputs

    llm.step = step_then_lose

    async def main():
        streams = [await engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=200,
                                                                      ignore_eos=True))]
        if how == "fail":
            await asyncio.to_thread(seen.wait, 60)
            engine.fail(lost)
        for stream in streams:
            with pytest.raises(EngineStoppedError, match="the engine stopped: a process was lost"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineStoppedError, match="a process was lost"):
            await engine.add_request(PROMPTS[0], PARAMS[0])

    asyncio.run(main())
    assert engine.unavailable is lost and not engine.is_running and not engine.accepting
    engine.stop()  # returns: the thread has ended


def test_shutdown_ends_streams_and_refuses_new_requests():
    engine = AsyncLLMEngine(make_engine())
    engine.start()
    gate = threading.Event()
    llm = engine.engine
    step = llm.step
    llm.step = lambda: (gate.wait(timeout=60), step())[1]

    async def main():
        stream = await engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        shutdown = asyncio.create_task(engine.shutdown(timeout=0))
        await asyncio.sleep(0)  # shutdown has stopped taking requests
        with pytest.raises(EngineStoppedError, match="shutting down"):
            await engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0))
        gate.set()
        with pytest.raises(EngineStoppedError, match="shut down before the request finished"):
            async for _ in stream:
                pass
        await shutdown

    asyncio.run(main())
    assert not engine.is_running
    assert llm.stats().scheduler.memory.num_used_blocks == 0


def test_shutdown_lets_requests_finish_within_the_timeout():
    engine = AsyncLLMEngine(make_engine())
    engine.start()

    async def main():
        stream = await engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))

        async def consume():
            return [o async for o in stream]

        consumer = asyncio.create_task(consume())
        await engine.shutdown(timeout=60)
        return await consumer

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length" and len(outs[-1].output_token_ids) == 5


def test_add_before_start_is_refused():
    engine = AsyncLLMEngine(make_engine())

    async def main():
        with pytest.raises(EngineStoppedError, match="not started"):
            await engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0))

    asyncio.run(main())


def test_a_consumer_that_stops_reading_holds_one_snapshot(engine):
    """A stalled client used to grow its stream's queue by a cumulative snapshot every step (memory quadratic in
    the output length); now a stream holds only the newest snapshot, and the finished one is never replaced."""
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
        async with await engine.add_request(PROMPTS[0], params) as stream:
            held = []
            while engine.stats().generated_tokens < 150:  # the engine runs on; nobody reads
                await asyncio.sleep(0.01)
                held.append(stream.num_undelivered)
            await asyncio.sleep(0.05)
            out = await stream.__anext__()  # the newest snapshot: the finished one
            assert out.finished and len(out.output_token_ids) == 150
            assert stream.num_undelivered == 0
            return held

    held = asyncio.run(main())
    assert max(held) == 1
    assert engine.num_pending == 0


def test_step_durations_count_each_duration_in_its_bucket():
    from pagedjax.serve.metrics import DurationHistogram

    h = DurationHistogram((0.01, 0.1))
    for seconds in (0.0, 0.01, 0.05, 0.1, 0.2, 30.0):  # an edge counts in its own bucket (Prometheus' `le`)
        h.observe(seconds)
    buckets, total = h.cumulative()
    assert buckets == [("0.01", 2), ("0.1", 4), ("+Inf", 6)] and total == pytest.approx(30.36)


def test_lora_adapters_are_added_and_removed_on_the_engine_thread(tmp_path):
    """(An adapter in use is retired and removed after its requests: tests/serve/test_lora_serving.py.)"""
    from pagedjax import LoRARequest
    from tests.lora.adapters import write_adapter
    from tests.serve.server_utils import CFG

    engine = AsyncLLMEngine(make_engine(lora_config=LoRAConfig(max_loras=1, max_lora_rank=8)))
    folder = write_adapter(tmp_path / "a", CFG, rank=4, seed=0)

    async def main():
        await engine.add_lora(LoRARequest("a", 1, str(folder)))
        assert [r.lora_name for r in engine.engine.list_loras()] == ["a"]
        with pytest.raises(ValueError, match="LoRA adapter 2 is not registered"):
            await engine.remove_lora(2)
        assert await engine.remove_lora(1) is True  # no request uses it: removed at once
        assert engine.engine.list_loras() == []
        with pytest.raises(ValueError, match="no such folder"):
            await engine.add_lora(LoRARequest("b", 3, str(tmp_path / "missing")))

    with pytest.raises(EngineStoppedError, match="not started"):
        asyncio.run(engine.add_lora(LoRARequest("a", 1, str(folder))))
    engine.start()
    try:
        asyncio.run(main())
    finally:
        engine.stop()
