"""Tokens that gather when their reader is behind: a request's stream hands what the
engine queued since its last read as one output, a decode worker past its message rate
(--max-stream-messages-per-s) pauses each stream so that the steps' tokens go as one
message, and the gateway's reader of a Decode stream takes what arrived as one event.
The tokens and their logprobs are those of one output a step, in order."""

from __future__ import annotations

import asyncio

import pytest
import torch

from baton.runtime.clients import DecodeWorkerClient
from baton.runtime.settings import DecodeWorkerSettings
from baton.wire.records import DecodeRequest, TokenEvent, WorkRequest
from decode_worker.server import SERVICE as DECODE_SERVICE
from decode_worker.server import DecodeWorkerService
from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.outputs import TokenLogprobs
from gateway.dispatch import EventReader
from tests.engine.test_engine import make_engine
from tests.serving.test_deadlines import _start, _stop
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", 4, 2, 16, True, dtype=torch.float32)[1]


def test_a_stream_read_behind_its_engine_takes_the_queued_outputs_as_one(model_dir):
    """Read step by step, 24 outputs; read only once the request has finished, one, with
    the same tokens and logprobs, its finish and counts the last step's."""

    async def scenario() -> tuple[list, list]:
        engine = AsyncEngine(make_engine(model_dir))
        engine.start()
        try:
            stepwise = [output async for output in await engine.add_request("a", PROMPT, PARAMS)]
            late = await engine.add_request("b", PROMPT, PARAMS)
            while await engine.call(lambda llm: llm.has_work()):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the last step's outputs reach the loop
            return stepwise, [output async for output in late]
        finally:
            await engine.stop()

    stepwise, late = asyncio.run(scenario())
    assert len(stepwise) > 2 and len(late) == 1
    merged = late[0]
    assert merged.new_token_ids == [t for o in stepwise for t in o.new_token_ids]
    assert [lp.token_id for lp in merged.new_logprobs] == merged.new_token_ids
    assert [lp.logprob for lp in merged.new_logprobs] == pytest.approx(
        [lp.logprob for o in stepwise for lp in o.new_logprobs])
    assert merged.finished and merged.finish_reason == "length"
    assert merged.num_output_tokens == stepwise[-1].num_output_tokens == PARAMS.max_tokens
    assert merged.timings is not None and merged.decode_timings is not None


def decode_events(model_dir, **settings_fields) -> list[TokenEvent]:
    """The events of one colocated Decode call on a decode worker started with these settings."""
    settings = DecodeWorkerSettings(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=64, threads=1,
                                    grace_s=0.5, **settings_fields)
    service = DecodeWorkerService(settings)

    async def scenario() -> list[TokenEvent]:
        task = await _start(settings, service, DECODE_SERVICE)
        client = DecodeWorkerClient(service.address)
        try:
            return [event async for event in client.decode(DecodeRequest(WorkRequest("r", PROMPT, PARAMS)),
                                                           timeout=60)]
        finally:
            await client.close()
            await _stop(service, task)

    return asyncio.run(scenario())


def test_a_decode_worker_past_its_message_rate_sends_a_streams_tokens_in_gathers(model_dir):
    """At 10 messages a second, one stream pauses 0.1 s between its messages: its 24
    tokens come in fewer messages than tokens, the same tokens as at an unbounded rate."""
    unbounded = decode_events(model_dir, max_stream_messages_per_s=1e9)
    gathered = decode_events(model_dir, max_stream_messages_per_s=10)
    tokens = [t for e in unbounded for t in e.token_ids]
    assert len(tokens) == PARAMS.max_tokens
    assert [t for e in gathered for t in e.token_ids] == tokens
    assert [lp.token_id for e in gathered for lp in e.logprobs] == tokens
    assert len(gathered) < len(tokens) / 2, [len(e.token_ids) for e in gathered]
    assert gathered[-1].finish_reason == "length" and all(e.finish_reason is None for e in gathered[:-1])


def test_the_gateways_reader_takes_what_arrived_as_one_event_then_the_streams_error():
    """Three events arrive while the consumer is busy: one take has them all, merged (the
    first's prompt logprobs, the last's finish and cache counts, every moment); the call's
    error comes after the events before it."""

    def logprob(token_id: int) -> TokenLogprobs:
        return TokenLogprobs(token_id, -0.5, ())

    events = [
        TokenEvent([1], [logprob(1)], prompt_logprobs=[logprob(9)], moments={"a": 1}),
        TokenEvent([2, 3], [logprob(2), logprob(3)], moments={"b": 2}),
        TokenEvent([4], [logprob(4)], "stop", stop_token_id=4, num_cached_tokens=8, moments={"c": 3}),
    ]

    async def source():
        for event in events:
            yield event
        raise RuntimeError("the call failed")

    async def scenario():
        reader = EventReader(source())
        await reader.wait()
        await asyncio.sleep(0.01)  # the rest arrives meanwhile
        merged = reader.take()
        with pytest.raises(RuntimeError, match="the call failed"):
            reader.take()
        await reader.aclose()
        return merged

    merged = asyncio.run(scenario())
    assert merged.token_ids == [1, 2, 3, 4]
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merged.prompt_logprobs == [logprob(9)]
    assert (merged.finish_reason, merged.stop_token_id, merged.num_cached_tokens) == ("stop", 4, 8)
    assert merged.moments == {"a": 1, "b": 2, "c": 3}
