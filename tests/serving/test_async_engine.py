"""AsyncEngine under cancellation: a caller that goes away leaves nothing behind.

A gRPC handler is cancelled at any await (client cancel, deadline, lost peer).
These drive the engine the way the workers do and cancel the callers at every
point of `add_request`, then check, on the engine thread, that no request is
left and every KV block is free.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.request import InvalidRequestError, PromptTooLongError
from tests.engine.test_engine import make_engine
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", 4, 2, 16, True, dtype=torch.float64)


def engine_state(engine) -> tuple[int, int]:
    """(requests the engine still holds, KV blocks in use), read between steps."""
    return len(engine.scheduler.requests), engine.kv_manager.num_used_blocks


async def settle(engine: AsyncEngine) -> tuple[int, int]:
    """The engine's state once it has nothing left to step (at most ~5 s)."""
    for _ in range(500):
        if not await engine.call(lambda llm: llm.has_work()):
            break
        await asyncio.sleep(0.01)
    return await engine.call(engine_state)


def test_a_caller_cancelled_while_adding_leaves_no_request_and_no_blocks(tiny):
    """Cancelled before its command ran, while it ran, or after it ran but before the
    caller resumed: in every case the request ends and its blocks are freed, also a
    prefill_only request that would otherwise be HELD for a handoff nobody will take."""
    _, model_dir = tiny

    async def scenario() -> tuple[int, tuple[int, int]]:
        engine = AsyncEngine(make_engine(model_dir))
        engine.start()
        num_cancelled = 0
        try:
            for round_index in range(24):
                request_id = f"r{round_index}"
                task = asyncio.create_task(engine.add_request(
                    request_id, list(range(4, 30)), SamplingParams(max_tokens=8, ignore_eos=True),
                    prefill_only=round_index % 2 == 0,
                ))
                for _ in range(round_index % 4):  # cancel at a different point each round
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    num_cancelled += 1
                else:  # the caller had its stream first: its own cancel path aborts (the workers')
                    await engine.abort(request_id)
            return num_cancelled, await settle(engine)
        finally:
            await engine.stop()

    num_cancelled, state = asyncio.run(scenario())
    assert num_cancelled >= 12, "most rounds must cancel the add itself"
    assert state == (0, 0)


def test_a_held_request_ends_its_stream_and_its_id_can_be_used_again(tiny):
    """A prefill_only request's HELD output is its stream's last (release_kv ends it with
    no further output): the stream entry goes, and the id is free for a new request."""
    _, model_dir = tiny

    async def scenario() -> None:
        engine = AsyncEngine(make_engine(model_dir))
        engine.start()
        try:
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            for _ in range(3):  # the same id, prefilled and handed off three times
                stream = await engine.add_request("same-id", list(range(4, 20)), params, prefill_only=True)
                held = await stream.get()
                assert held.kv_block_ids and not held.finished
                assert await engine.call(lambda llm: llm.release_kv("same-id"))
            assert await settle(engine) == (0, 0)
            assert not engine._streams, "no stream entry outlives its request"
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_a_refused_request_raises_the_engines_error_and_leaves_nothing(tiny):
    """The engine thread's refusal reaches the caller as raised, naming the attribute at
    fault (which the workers answer with), and no stream, request or block stays."""
    _, model_dir = tiny

    async def scenario() -> list[tuple[type, str]]:
        engine = AsyncEngine(make_engine(model_dir))  # a 512-token context; 64 blocks of 4 tokens
        engine.start()
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        refused = []
        try:
            # Long enough to be still running when its id comes again below.
            stream = await engine.add_request("running", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True))
            for add in (lambda: engine.add_request("long", [5] * 512, params),
                        lambda: engine.add_prefilled_request("big", [5] * 300, 7, params),
                        lambda: engine.add_request("running", [5, 6], params)):
                with pytest.raises(InvalidRequestError) as error:
                    await add()
                refused.append((type(error.value), error.value.name))
            async for _ in stream:
                pass
            assert await settle(engine) == (0, 0)
            assert not engine._streams
        finally:
            await engine.stop()
        return refused

    assert asyncio.run(scenario()) == [(PromptTooLongError, "prompt_token_ids"),
                                       (InvalidRequestError, "prompt_token_ids"),
                                       (InvalidRequestError, "request_id")]
