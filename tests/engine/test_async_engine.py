"""The asyncio fronts: concurrent streams, cancellation, and errors reaching the caller."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams, start_async_engine
from tests.engine.conftest import run_to_completion

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["thread", "process"])
def async_engine(tiny_llama, request):
    """Both fronts the server may drive: the engine on a thread of this process, or in a process of its own."""
    engine = start_async_engine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu"), request.param)
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params=PARAMS, request_id=None):
    outputs = [o async for o in engine.generate(prompt, params, request_id=request_id)]
    return outputs


def test_concurrent_requests_match_the_offline_engine(async_engine, llama_engine):
    prompts = ["Hello", "The capital of France", "def add(a, b):", "SELECT"]

    async def main():
        return await asyncio.gather(*(_collect(async_engine, p) for p in prompts))

    streams = asyncio.run(main())
    for prompt, stream in zip(prompts, streams):
        llama_engine.add_request(prompt, PARAMS)
        (expected,) = run_to_completion(llama_engine).values()
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        assert stream[-1].outputs[0].token_ids == expected.outputs[0].token_ids
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(lengths)


def test_a_consumer_that_falls_behind_gets_the_latest_output_only(async_engine, llama_engine):
    """Outputs are cumulative, so a stream read after the engine has moved on skips to the newest: a slow
    client (a busy event loop) gets fewer, larger chunks, never missing tokens."""
    async def main():
        stream = async_engine.generate("Hello", PARAMS)
        first = await stream.__anext__()
        for _ in range(1000):
            stats = async_engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the loop runs the deliveries the engine thread queued before it answered
        return first, [output async for output in stream]

    first, rest = asyncio.run(main())
    llama_engine.add_request("Hello", PARAMS)
    (expected,) = run_to_completion(llama_engine).values()
    assert not first.finished
    assert len(rest) == 1 and rest[0].finished
    assert rest[0].outputs[0].token_ids == expected.outputs[0].token_ids


def test_cancelling_the_consumer_aborts_and_frees_blocks(async_engine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in async_engine.generate("Hello", SamplingParams(max_tokens=200, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            stats = async_engine.stats()
            if stats.num_running == 0 and stats.kv_blocks_used == 0:
                return stats
            await asyncio.sleep(0.02)
        return async_engine.stats()

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0


def test_abort_by_request_id_ends_the_stream(async_engine):
    async def main():
        outputs = []
        async for output in async_engine.generate("Hello", SamplingParams(max_tokens=200, ignore_eos=True),
                                                  request_id="to-abort"):
            outputs.append(output)
            if len(outputs) == 2:
                await async_engine.abort("to-abort")
                break
        return outputs

    asyncio.run(main())
    assert async_engine.stats().kv_blocks_used == 0


def test_invalid_request_raises_in_the_caller(async_engine):
    async def main():
        return await _collect(async_engine, "x", SamplingParams(max_tokens=10_000))

    with pytest.raises(ValueError, match="maximum context length"):
        asyncio.run(main())
    assert async_engine.stats().num_waiting == 0


def test_an_adapter_that_cannot_be_read_fails_its_stream_and_others_finish(tiny_llama, tmp_path):
    """The adapter was checked and cached, then evicted from host memory by another, and its weight
    file broke: its request's stream raises the read error; a base request running beside it finishes."""
    from adapters_registry import AdapterError
    from engine import LoRARequest
    from tests.tiny_models import make_peft_adapter

    evicted = LoRARequest("evicted", 1, str(make_peft_adapter(tiny_llama, tmp_path / "evicted", seed=3)))
    other = LoRARequest("other", 2, str(make_peft_adapter(tiny_llama, tmp_path / "other", seed=4)))
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", enable_lora=True,
                                      max_loras=1, max_cpu_loras=1))
    try:
        engine.add_lora(evicted)
        engine.add_lora(other)
        (tmp_path / "evicted" / "adapter_model.safetensors").write_bytes(b"gone")

        async def main():
            async def doomed():
                return [o async for o in engine.generate("Hello", PARAMS, lora_request=evicted)]

            return await asyncio.gather(doomed(), _collect(engine, "Hello"), return_exceptions=True)

        failed, base = asyncio.run(main())
        assert isinstance(failed, AdapterError) and "corrupt or truncated" in str(failed)
        assert base[-1].finished and len(base[-1].outputs[0].token_ids) == PARAMS.max_tokens
        stats = engine.stats()
        assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
    finally:
        engine.shutdown()


def _slow_steps(engine: AsyncEngine, seconds: float) -> None:
    """Each step sleeps first, so commands submitted meanwhile wait in the queue."""
    step = engine.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.engine.step = slow_step


def test_a_generate_cancelled_while_its_add_waits_leaves_the_engine_serving(tiny_llama):
    """A client that goes away before its request was even added: the engine thread must live on, and add nothing."""
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu"))
    try:
        async def main():
            _slow_steps(engine, 0.05)  # from the first step, so the busy request still runs when the victim comes
            busy = asyncio.create_task(_collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=30,
                                                                                 ignore_eos=True)))
            await asyncio.sleep(0.2)
            victim = asyncio.create_task(_collect(engine, "Hi", request_id="victim"))
            await asyncio.sleep(0)  # generate() now waits for its queued add
            victim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await victim
            finished = await asyncio.wait_for(busy, 60)
            after = await asyncio.wait_for(_collect(engine, "Hi"), 60)
            return finished, after

        finished, after = asyncio.run(main())
        assert finished[-1].finished and after[-1].finished
        assert "victim" not in engine.engine.requests
    finally:
        engine.shutdown()


def test_shutdown_fails_the_calls_still_queued(tiny_llama):
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu"))
    outcome = {}

    def stats_from_another_thread():
        try:
            outcome["stats"] = engine.stats()
        except RuntimeError as exc:
            outcome["error"] = str(exc)

    async def main():
        _slow_steps(engine, 0.3)  # from the first step: 200 fast steps could end the stream before the shutdown
        stream = asyncio.create_task(_collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=200,
                                                                               ignore_eos=True)))
        await asyncio.sleep(0.55)
        caller = threading.Thread(target=stats_from_another_thread)
        caller.start()
        await asyncio.sleep(0.05)  # its call waits behind a slow step
        engine.shutdown()
        caller.join(timeout=10)
        with pytest.raises(RuntimeError, match="shut down"):
            await asyncio.wait_for(stream, 10)
        return caller.is_alive()

    assert asyncio.run(main()) is False
    assert outcome == {"error": "the engine has been shut down"}
