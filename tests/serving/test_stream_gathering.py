"""Tokens that gather when their reader is behind: a request's stream hands what the
engine queued since its last read as one output, a decode worker past its message rate
(--max-stream-messages-per-s, or the gateway's share of its own that the Decode call
carries) pauses each stream so that the steps' tokens go as one message, and the
gateway's reader of a Decode stream takes what arrived as one event. The tokens and their
logprobs are those of one output a step, in order."""

from __future__ import annotations

import asyncio

import pytest
import torch

from baton.runtime.clients import DecodeWorkerClient
from baton.runtime.settings import DecodeWorkerSettings
from baton.wire import convert
from baton.wire.internal.v1 import worker_pb2
from baton.wire.records import DecodeRequest, FieldError, TokenEvent, WorkRequest
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


def decode_events(model_dir, share: float | None = None, **settings_fields) -> list[TokenEvent]:
    """The events of one colocated Decode call, carrying the gateway's `share` (messages a
    second), on a decode worker started with these settings."""
    settings = DecodeWorkerSettings(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=64, threads=1,
                                    grace_s=0.5, **settings_fields)
    service = DecodeWorkerService(settings)

    async def scenario() -> list[TokenEvent]:
        task = await _start(settings, service, DECODE_SERVICE)
        client = DecodeWorkerClient(service.address)
        try:
            request = DecodeRequest(WorkRequest("r", PROMPT, PARAMS), max_messages_per_s=share)
            return [event async for event in client.decode(request, timeout=60)]
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


def test_the_gateways_share_bounds_a_worker_whose_own_bound_is_higher(model_dir):
    """A worker unbounded itself, a call carrying a share of 10 messages a second: the
    share is the bound (the lower applies), with the same tokens."""
    gathered = decode_events(model_dir, share=10.0, max_stream_messages_per_s=1e9)
    assert [t for e in gathered for t in e.token_ids] == [t for e in decode_events(model_dir, share=1e9) for t in e.token_ids]
    assert len(gathered) < PARAMS.max_tokens / 2, [len(e.token_ids) for e in gathered]


@pytest.mark.parametrize("share", [0.0, -1.0, float("inf"), float("nan")])
def test_a_share_that_bounds_nothing_is_refused_by_name(share):
    work = convert.work_request_to_pb(WorkRequest("r", PROMPT, PARAMS))
    with pytest.raises(FieldError, match="max_messages_per_s"):
        convert.decode_request_from_pb(worker_pb2.DecodeRequest(request=work, max_messages_per_s=share))
    assert convert.decode_request_from_pb(convert.decode_request_to_pb(
        DecodeRequest(WorkRequest("r", PROMPT, PARAMS), max_messages_per_s=12.5))).max_messages_per_s == 12.5


def test_a_gateway_shares_its_message_rate_among_its_routable_decode_workers(model_dir):
    """A dispatcher relaying 60 messages a second over three decode workers, one of them
    marked down: each Decode call carries a share of 30."""
    from baton.runtime.settings import GatewaySettings
    from gateway.dispatch import Dispatcher
    from gateway.prepare import PreparedRequest
    from gateway.workers import RoutingPolicy, WorkerPool

    settings = [DecodeWorkerSettings(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=64, threads=1,
                                     grace_s=0.5, worker_id=f"decode-{i}") for i in range(2)]

    async def scenario() -> list[float | None]:
        services = [DecodeWorkerService(s) for s in settings]
        tasks = [await _start(s, service, DECODE_SERVICE) for s, service in zip(settings, services)]
        down = "127.0.0.1:9"  # nothing listens there: marked down once polled
        pool = WorkerPool([], [*(s.address for s in services), down],
                          RoutingPolicy.from_settings(GatewaySettings(decode_workers=(services[0].address,))))
        await pool.start()
        sent: list[float | None] = []
        try:
            for worker in pool.decode:
                decode = worker.client.decode

                def recording(request, *args, decode=decode, **kwargs):
                    sent.append(request.max_messages_per_s)
                    return decode(request, *args, **kwargs)

                worker.client.decode = recording
            pool.mark_down(next(w for w in pool.decode if w.address == down))
            dispatcher = Dispatcher(pool, max_messages_per_s=60.0)
            prepared = PreparedRequest("r", PROMPT, PARAMS, priority=0, max_model_len=2048)
            tokens = [t async for event in dispatcher.run(prepared, lambda: 60.0) for t in event.token_ids]
            assert len(tokens) == PARAMS.max_tokens
        finally:
            await pool.close()
            for service, task in zip(services, tasks):
                await _stop(service, task)
        return sent

    assert asyncio.run(scenario()) == [30.0]


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
