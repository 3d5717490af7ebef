"""The gateway's routing policy (when a prompt is prefilled on its decode worker), its
worker pool, the dispatcher's release of held KV when a stream ends early, and its
moving of a request off a lost decode worker (with fake workers; tests/serving/test_chaos.py
kills real ones)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from baton.runtime.settings import GatewaySettings
from baton.wire.records import KvHandle, PrefillResult, TokenEvent, WorkerStats
from engine.sampling_params import SamplingParams
from gateway.dispatch import Dispatcher
from gateway.errors import RequestError
from gateway.prepare import PreparedRequest
from gateway.workers import RoutingPolicy, Worker
from kvtransfer.layout import KvLayoutSpec

DEFAULTS = RoutingPolicy.from_settings(GatewaySettings(decode_workers=("127.0.0.1:2",)))


def test_defaults_hand_off_unless_the_prefill_queue_is_long():
    policy = DEFAULTS
    assert policy.max_local_prefill_tokens == 0 and policy.max_prefill_queue_tokens == 2048
    assert not policy.prefill_locally(1, prefill_queue=0, decode_queue=0)
    assert not policy.prefill_locally(500, prefill_queue=2048, decode_queue=0)  # at the threshold: remote
    assert policy.prefill_locally(500, prefill_queue=2049, decode_queue=0)
    assert policy.prefill_locally(500, prefill_queue=5000, decode_queue=4999)
    # The decode worker is no better off: stay remote.
    assert not policy.prefill_locally(500, prefill_queue=5000, decode_queue=5000)


def test_short_prompts_stay_local():
    policy = RoutingPolicy(max_local_prefill_tokens=32, max_prefill_queue_tokens=0)
    assert policy.prefill_locally(32, prefill_queue=0, decode_queue=10_000)
    assert not policy.prefill_locally(33, prefill_queue=0, decode_queue=0)
    assert not policy.prefill_locally(33, prefill_queue=10**9, decode_queue=0)  # queue rule off


def test_negative_thresholds_are_refused():
    with pytest.raises(ValueError):
        RoutingPolicy(max_local_prefill_tokens=-1, max_prefill_queue_tokens=0)
    with pytest.raises(ValueError):
        RoutingPolicy(max_local_prefill_tokens=0, max_prefill_queue_tokens=-1)


def test_pool_counts_each_prompt_on_the_worker_that_prefills_it():
    import asyncio

    from gateway.workers import WorkerPool

    async def scenario() -> None:
        pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2"], RoutingPolicy(0, max_prefill_queue_tokens=100))
        prefill, decode = pool.prefill[0], pool.decode[0]
        for worker in pool.workers:
            worker.is_up = True
        decode.stats = WorkerStats(worker_id="d", role="decode", serving=True, num_kv_blocks_free=1000)
        assert pool.pick_prefill(80, decode) is prefill  # queue 0: remote
        assert pool.pick_prefill(80, decode) is prefill  # queue 80 <= 100: remote
        assert prefill.queued_prefill_tokens == 160
        assert pool.pick_prefill(50, decode) is None  # queue 160 > 100, decode has 0: local
        assert (prefill.queued_prefill_tokens, decode.queued_prefill_tokens) == (160, 50)
        # The prefill worker turned out unreachable: its prompt moves to the decode worker.
        pool.prefill_moved(prefill, decode, 80)
        assert (prefill.queued_prefill_tokens, decode.queued_prefill_tokens) == (80, 130)
        prefill.is_up = False
        assert pool.pick_prefill(10, decode) is None  # no prefill worker up: colocated
        assert decode.queued_prefill_tokens == 140
        await pool.close()

    asyncio.run(scenario())


class _StubWorker:
    """A decode worker's GetStats on a real loopback gRPC server: answers `serving` as
    the test sets it, and counts the calls."""

    def __init__(self) -> None:
        self.serving = False
        self.calls = 0

    async def GetStats(self, request, context):
        from baton.wire.internal.v1 import worker_pb2

        self.calls += 1
        return worker_pb2.WorkerStats(worker_id="decode-x", role="decode", serving=self.serving,
                                      num_kv_blocks_free=100, block_size=16)


async def _serve_stub(worker: _StubWorker):
    import grpc

    from baton.wire.internal.v1 import worker_pb2_grpc

    server = grpc.aio.server()
    handler = worker_pb2_grpc.DecodeWorkerServicer()
    handler.GetStats = worker.GetStats
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(handler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_pool_start_waits_for_a_decode_worker():
    """The gateway turns SERVING only once a decode worker is up; a worker that never
    comes up fails the start with a clear timeout."""
    import asyncio

    from gateway.workers import WorkerPool

    async def scenario() -> None:
        worker = _StubWorker()
        server, address = await _serve_stub(worker)
        pool = WorkerPool([], [address], DEFAULTS)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.start(), 0.3)
        assert not pool.decode[0].is_up
        await pool.close()

        pool = WorkerPool([], [address], DEFAULTS)
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, setattr, worker, "serving", True)
        started = loop.time()
        await asyncio.wait_for(pool.start(), 10)
        assert pool.decode[0].is_up and loop.time() - started >= 0.3
        await pool.close()
        await server.stop(None)

    asyncio.run(scenario())


def test_a_request_finding_no_decode_worker_polls_again_once():
    """A decode worker marked down (a failed call, or a poll while it restarted) is asked
    again when a request finds none up; concurrent requests share that one poll."""
    import asyncio

    from gateway.workers import WorkerPool

    async def scenario() -> None:
        worker = _StubWorker()
        worker.serving = True
        server, address = await _serve_stub(worker)
        pool = WorkerPool([], [address], DEFAULTS)
        pool.mark_down(pool.decode[0])
        assert pool.pick_decode(10) is None
        calls = worker.calls
        await asyncio.gather(*(pool.refresh_decode() for _ in range(8)))
        assert worker.calls == calls + 1
        assert pool.pick_decode(10) is pool.decode[0]
        # Down for real: the refresh answers quickly and the worker stays out.
        await server.stop(None)
        pool.mark_down(pool.decode[0])
        await pool.refresh_decode()
        assert pool.pick_decode(10) is None
        await pool.close()

    asyncio.run(scenario())


def test_a_decode_worker_is_charged_blocks_of_its_own_size():
    """Between polls the gateway adds what it sent to a decode worker's load, counted in
    that worker's blocks: the block size each worker reports, not one the gateway assumes."""
    import asyncio

    from gateway.workers import WorkerPool

    async def scenario() -> None:
        pool = WorkerPool([], ["127.0.0.1:1", "127.0.0.1:2"], DEFAULTS)
        small, large = pool.decode
        for worker, block_size in ((small, 4), (large, 32)):
            worker.is_up = True
            worker.stats = WorkerStats(worker_id=worker.address, role="decode", serving=True,
                                       num_kv_blocks_free=1000, block_size=block_size)
        assert pool.pick_decode(100) is small  # equal free blocks: the first
        assert small.pending_blocks == 25
        assert pool.pick_decode(100) is large  # 975 left on the small one
        assert large.pending_blocks == 4
        await pool.close()

    asyncio.run(scenario())


# --------------------------------------------------------------- KV released on early exits
class _FakePrefillClient:
    """Answers Prefill with a held KV handle (or never, when `block`), and records ReleaseKv."""

    def __init__(self, block: bool = False) -> None:
        self.block = block
        self.started = asyncio.Event()
        self.released: list[str] = []
        self.kv_tokens: list[str] = []

    async def prefill(self, work, timeout, metadata):
        self.started.set()
        self.kv_tokens.append(work.kv_token)
        if self.block:
            await asyncio.Event().wait()
        layout = KvLayoutSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=16, dtype="float64")
        handle = KvHandle("p-0", "127.0.0.1:1", work.request_id, len(work.prompt_token_ids), 2, layout, 30.0,
                          work.kv_token)
        return PrefillResult(first_token_id=7, kv_handle=handle)

    async def release_kv(self, request, timeout, metadata):
        assert request.kv_token == self.kv_tokens[-1] and len(request.kv_token) == 32  # the prefill's own token
        self.released.append(request.request_id)
        return True


class _FakePool:
    """One decode and one prefill worker, always chosen."""

    def __init__(self, prefill_client) -> None:
        self.decode = [Worker("127.0.0.1:2", "decode", client=None, is_up=True)]  # as WorkerPool's
        self.prefill = Worker("127.0.0.1:1", "prefill", client=prefill_client, is_up=True)

    def pick_decode(self, num_tokens, avoid=frozenset(), prompt=None):
        return self.decode[0]

    def pick_prefill(self, num_tokens, decode, prompt=None):
        return self.prefill


async def _until(predicate, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _prepared(request_id: str) -> PreparedRequest:
    return PreparedRequest(request_id, [5, 6, 7, 8], SamplingParams(max_tokens=4), priority=0,
                           max_model_len=2048)


def test_a_stream_closed_at_its_first_token_releases_the_held_kv():
    """The client went away (or a stop string matched) at the first token, before the
    decode call: the gateway drops the prefill worker's lease at once, not at expiry."""

    async def scenario() -> list[str]:
        client = _FakePrefillClient()
        events = Dispatcher(_FakePool(client)).run(_prepared("closed-at-first"), lambda: 30.0)
        first = await events.__anext__()
        assert first.token_ids == [7]
        await events.aclose()
        await _until(lambda: client.released)
        return client.released

    assert asyncio.run(scenario()) == ["closed-at-first"]


def test_a_stream_cancelled_during_its_prefill_call_releases_what_the_worker_may_hold():
    async def scenario() -> list[str]:
        client = _FakePrefillClient(block=True)
        events = Dispatcher(_FakePool(client)).run(_prepared("cancelled-in-prefill"), lambda: 30.0)
        task = asyncio.create_task(events.__anext__())
        await client.started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: client.released)
        return client.released

    assert asyncio.run(scenario()) == ["cancelled-in-prefill"]


# --------------------------------------------------------------- requests moved off lost workers
class _FakeDecodeClient:
    """Streams `tokens` one event each, then fails (`fail`: a gRPC code), hangs (`fail`:
    "hang"), or ends with finish "length". Records each request it gets."""

    def __init__(self, tokens: list[int], fail: grpc.StatusCode | str | None = None) -> None:
        self.tokens = tokens
        self.fail = fail
        self.requests = []

    async def decode(self, request, timeout, metadata):
        self.requests.append(request)
        for i, token in enumerate(self.tokens):
            last = self.fail is None and i == len(self.tokens) - 1
            yield TokenEvent([token], [], "length" if last else None)
        if self.fail == "hang":
            await asyncio.Event().wait()
        elif self.fail is not None:
            raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection lost")


class _DecodePool:
    """Decode workers only (colocated), picked in order; a probe finds a worker alive
    as its `alive` says."""

    def __init__(self, *clients, stall_timeout_s: float = 0.05) -> None:
        self.decode = [Worker(f"127.0.0.1:{i + 2}", "decode", client=client, is_up=True,
                              min_stall_timeout_s=stall_timeout_s) for i, client in enumerate(clients)]
        self.alive = {worker.address: True for worker in self.decode}

    def pick_decode(self, num_tokens, avoid=frozenset(), prompt=None):
        return next((w for w in self.decode if w.is_up and w.address not in avoid), None)

    def pick_prefill(self, num_tokens, decode, prompt=None):
        return None

    async def refresh_decode(self):
        pass

    def mark_down(self, worker):
        worker.set_up(False, lost=True)

    async def probe(self, worker):
        if not self.alive[worker.address]:
            worker.set_up(False, lost=True)
        return self.alive[worker.address]


async def _collect(dispatcher, prepared) -> list[int]:
    return [t async for event in dispatcher.run(prepared, lambda: 30.0) for t in event.token_ids]


@pytest.mark.parametrize("failure", ["broken stream", "stalled worker", "drained worker"])
def test_a_request_moves_off_a_lost_decode_worker_with_what_it_streamed(failure):
    """The stream breaks (killed worker), the worker goes silent and fails a probe (frozen),
    or it lets the request go (CANCELLED, draining): the request continues on the other
    decode worker with the streamed tokens appended to its prompt, its limits counted
    down, under a new attempt id; the client gets every token once."""
    fail = {"broken stream": grpc.StatusCode.UNAVAILABLE, "stalled worker": "hang",
            "drained worker": grpc.StatusCode.CANCELLED}[failure]

    async def scenario():
        lost, other = _FakeDecodeClient([100, 101], fail), _FakeDecodeClient([102, 103])
        pool = _DecodePool(lost, other)
        pool.alive[pool.decode[0].address] = failure != "stalled worker"
        prepared = PreparedRequest("r", [5, 6, 7], SamplingParams(max_tokens=4, min_tokens=3, seed=9,
                                                                  temperature=1.0), priority=0, max_model_len=2048)
        tokens = await _collect(Dispatcher(pool), prepared)
        return tokens, other.requests, pool

    tokens, requests, pool = asyncio.run(scenario())
    assert tokens == [100, 101, 102, 103]
    (moved,) = requests
    work = moved.request
    assert work.request_id == "r~1" and moved.kv_handle is None
    assert work.prompt_token_ids == [5, 6, 7, 100, 101] and work.num_generated_tokens == 2
    assert work.attempt == 1  # moved work: no worker refuses it
    assert (work.params.max_tokens, work.params.min_tokens, work.params.seed) == (2, 1, 9)
    assert not pool.decode[0].is_up and pool.decode[0].lost.is_set()


@pytest.mark.parametrize(("max_tokens", "max_model_len"), [(2, 2048), (10, 5)])
def test_a_request_lost_as_its_last_token_came_ends_by_length_and_does_not_move(max_tokens, max_model_len):
    """Its max_tokens out, or its context full (3 prompt tokens + 2 = max_model_len): the
    length rule ends it, as the worker would have; a move would be a prompt no worker takes."""

    async def scenario():
        lost, other = _FakeDecodeClient([100, 101], grpc.StatusCode.UNAVAILABLE), _FakeDecodeClient([102])
        prepared = PreparedRequest("r", [5, 6, 7], SamplingParams(max_tokens=max_tokens), priority=0,
                                   max_model_len=max_model_len)
        events = [event async for event in Dispatcher(_DecodePool(lost, other)).run(prepared, lambda: 30.0)]
        return events, other.requests

    events, moved = asyncio.run(scenario())
    assert [t for event in events for t in event.token_ids] == [100, 101]
    assert events[-1].finish_reason == "length" and moved == []


@pytest.mark.parametrize(("code", "attempt"), [
    (grpc.StatusCode.UNAVAILABLE, 1),  # lost: the prompt is moved work
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 0),  # refused: still new work, which may be refused again
])
def test_a_prompt_that_runs_colocated_after_a_lost_prefill_worker_is_moved_work(code, attempt):
    class Failing(_FakePrefillClient):
        async def prefill(self, work, timeout, metadata):
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")

    class Pool(_FakePool):
        def mark_down(self, worker):
            worker.set_up(False, lost=True)

        def prefill_moved(self, worker, decode, num_tokens):
            pass

    async def scenario():
        pool = Pool(Failing())
        pool.decode[0].client = decode = _FakeDecodeClient([100, 101, 102, 103])
        tokens = await _collect(Dispatcher(pool), _prepared("r"))
        return tokens, decode.requests

    tokens, (request,) = asyncio.run(scenario())
    assert tokens == [100, 101, 102, 103]
    assert request.kv_handle is None and request.request.request_id == "r"
    assert request.request.attempt == attempt


def test_a_slow_worker_that_answers_its_probe_keeps_its_request():
    """No token within the stall timeout, but the worker answers the probe (the request
    is queued there): the request stays."""

    class Slow(_FakeDecodeClient):
        async def decode(self, request, timeout, metadata):
            self.requests.append(request)
            await asyncio.sleep(0.3)  # six stall timeouts
            yield TokenEvent([100], [], "length")

    async def scenario():
        slow = Slow([])
        pool = _DecodePool(slow, _FakeDecodeClient([1]))
        tokens = await _collect(Dispatcher(pool), _prepared("slow"))
        return tokens, slow.requests

    tokens, requests = asyncio.run(scenario())
    assert tokens == [100] and len(requests) == 1


def test_no_other_decode_worker_is_a_clear_unavailable_and_moves_are_bounded():
    async def alone():
        pool = _DecodePool(_FakeDecodeClient([100], grpc.StatusCode.UNAVAILABLE))
        return await _collect(Dispatcher(pool), _prepared("alone"))

    with pytest.raises(RequestError) as error:
        asyncio.run(alone())
    assert error.value.code == grpc.StatusCode.UNAVAILABLE and "no other decode worker" in error.value.details

    async def query_of_death():  # every worker it lands on fails: at most max_migrations moves
        clients = [_FakeDecodeClient([], grpc.StatusCode.UNAVAILABLE) for _ in range(4)]
        pool = _DecodePool(*clients)
        try:
            await _collect(Dispatcher(pool, max_migrations=2), _prepared("deadly"))
        finally:
            assert [len(c.requests) for c in clients] == [1, 1, 1, 0]

    with pytest.raises(RequestError) as error:
        asyncio.run(query_of_death())
    assert error.value.code == grpc.StatusCode.UNAVAILABLE and "giving up" in error.value.details


def test_a_workers_refusal_names_the_clients_fields():
    """A worker names fields of its own request (WorkRequest paths); the client gets them
    as its GenerateRequest names them, and none of the workers' own messages."""
    from baton.wire.records import ErrorDetails
    from gateway.errors import RequestError

    def refused(*fields: str) -> RequestError:
        error = RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no")
        error.error_details = ErrorDetails(tuple((field, "why") for field in fields), 0.5)
        return error

    assert refused("request.sampling.max_tokens").for_client("text").error_details == ErrorDetails(
        (("sampling.max_tokens", "why"),), 0.5)
    for prompt_field, expected in (("token_ids.ids", "token_ids.ids[7]"), ("text", "text"),
                                   ("messages.messages", "messages.messages")):
        fields = refused("request.prompt_token_ids[7]").for_client(prompt_field).error_details.field_violations
        assert fields == ((expected, "why"),)
    renamed = RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request.sampling.max_tokens: too many")
    renamed.error_details = ErrorDetails((("request.sampling.max_tokens", "too many"),))
    assert renamed.for_client("text").details == "sampling.max_tokens: too many"
    # Only the workers' own fields: the deployment's fault, not the client's.
    internal = refused("kv_handle.prefill_address", "request.request_id").for_client("text")
    assert internal.code == grpc.StatusCode.INTERNAL and internal.error_details.field_violations == ()
    assert "kv_handle" not in internal.details
    assert refused("sampling.top_p").for_client("text").error_details.field_violations == (("sampling.top_p", "why"),)
    unnamed = RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_s=2.0).for_client("text")
    assert unnamed.code == grpc.StatusCode.RESOURCE_EXHAUSTED and unnamed.error_details.retry_after_s == 2.0

