"""AsyncLLMEngine: the engine thread and its callers on the event loop."""
from __future__ import annotations

import asyncio
import threading

import pytest

from specserve import EngineConfig, LLMEngine, SamplingParams
from specserve.async_engine import AsyncLLMEngine


def test_a_caller_cancelled_while_its_request_is_added_gets_it_aborted(tiny_model_dir):
    """The cancel arrives after the engine thread began adding the request: nobody will
    read its stream, so it must not run (and hold KV blocks) to max_tokens."""
    llm = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", block_size=4,
                                 num_kv_blocks=64, max_model_len=256))
    adding, release = threading.Event(), threading.Event()
    add = llm.add_request

    def slow_add(*args, **kwargs):
        adding.set()
        release.wait(10)
        return add(*args, **kwargs)

    llm.add_request = slow_add
    engine = AsyncLLMEngine(llm)
    engine.start()

    async def main():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        task = asyncio.ensure_future(engine.add_request([1, 2, 3], params, "r"))
        await asyncio.to_thread(adding.wait, 10)
        task.cancel()  # the engine thread is inside add_request now
        with pytest.raises(asyncio.CancelledError):
            await asyncio.gather(task, asyncio.to_thread(release.set))
        return await engine.call(lambda e: list(e.scheduler.requests))

    try:
        assert asyncio.run(main()) == []
    finally:
        engine.stop()
