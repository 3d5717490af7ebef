"""The prefill worker's KV sender: who may open which channel, and who may release or pull
which request's KV."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from baton.wire.records import OpenKvChannel, ReleaseKv, SendKv
from engine.kv.cache import KVCache, KVLayout
from kvtransfer import KvEndpoint, KvLayoutSpec, ReleasedBeforeHeld, Rendezvous
from prefill_worker.kv_sender import (LEASE_SWEEP_S, MIN_LEASE_S, AlreadyClaimed, BlockCountMismatch, ChannelInUse,
                                      KvSender, NotHeld, _Channel)


# Two CPU workers on different hosts: their channels are gloo.
PREFILL_SIDE = KvEndpoint("prefill-host", "boot-a/net:1", "cpu")
DECODE_SIDE = KvEndpoint("decode-host", "boot-b/net:1", "cpu")


class _Transport:
    """A stand-in for an open transport: only what the sender asks of it when opening."""

    backend = "fake"

    def __init__(self, is_broken: bool) -> None:
        self.is_broken = is_broken
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_an_open_working_channel_cannot_be_reopened_by_its_id():
    """Anyone who learns or guesses a channel id used to close the live channel by opening
    it again (handoffs then failed until the decode side noticed). A working channel's id
    is now refused; the channel stays open."""
    cache = KVCache(KVLayout(2, 4, 2, 16, torch.float32), 8, 0)
    layout = KvLayoutSpec.from_kv_layout(cache.layout)
    sender = KvSender("p-0", engine=None, kv_cache=cache, layout=layout, endpoint=PREFILL_SIDE, lease_s=30.0,
                      tally=None)
    live = _Transport(is_broken=False)
    sender._channels["decode-0-abc-0"] = _Channel(live, ThreadPoolExecutor(1), "decode-0")
    request = OpenKvChannel(Rendezvous("decode-0-abc-0", "127.0.0.1", 1, 1.0, bytes(32)), layout, "intruder",
                            DECODE_SIDE)

    with pytest.raises(ChannelInUse):
        asyncio.run(sender.open_channel(request))
    assert sender._channels["decode-0-abc-0"].transport is live and not live.closed


# --------------------------------------------------------------- the KV token owns the KV
class _Engine:
    """Records what the sender asks of the engine thread."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.released: list[str] = []

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    async def call(self, command):
        class _Llm:
            def release_kv(_, request_id: str) -> bool:
                self.released.append(request_id)
                return True
        return command(_Llm())


def _owned_sender() -> tuple[KvSender, _Engine]:
    cache = KVCache(KVLayout(2, 4, 2, 16, torch.float32), 8, 0)
    layout = KvLayoutSpec.from_kv_layout(cache.layout)
    engine = _Engine()
    sender = KvSender("p-0", engine=engine, kv_cache=cache, layout=layout, endpoint=PREFILL_SIDE, lease_s=30.0,
                      tally=None)
    sender._channels["c-0"] = _Channel(_Transport(is_broken=False), ThreadPoolExecutor(1), "decode-0")
    return sender, engine


async def _first_event(sender: KvSender, request: SendKv):
    events = sender.send(request)
    try:
        return await events.__anext__()
    finally:
        await events.aclose()


def test_a_stranger_cannot_release_abort_or_pull_a_requests_kv():
    """Knowing a request id was enough to drop its lease, abort its prefill, or consume its
    lease with a malformed SendKv. Without the request's token each is answered as for an
    unknown id, and nothing is touched."""

    async def scenario() -> None:
        sender, engine = _owned_sender()
        sender.claim("prefilling", "a" * 32)
        assert not await sender.release(ReleaseKv("prefilling", "b" * 32))
        assert not await sender.release(ReleaseKv("prefilling", ""))
        assert engine.aborted == []  # a stranger cannot abort a prefill
        with pytest.raises(AlreadyClaimed):
            sender.claim("prefilling", "b" * 32)

        sender.claim("held", "t" * 32)
        sender.hold("held", [3, 4], num_tokens=8)
        for token in ("", "x" * 32, "t" * 31):
            assert not await sender.release(ReleaseKv("held", token))
            with pytest.raises(NotHeld):
                await _first_event(sender, SendKv("c-0", "held", 1, 2, [0, 1], kv_token=token))
        # The owner's malformed send is refused before the lease is pinned: it stays held.
        with pytest.raises(BlockCountMismatch):
            await _first_event(sender, SendKv("c-0", "held", 1, 3, [0, 1, 2], kv_token="t" * 32))
        assert "held" in sender.leases and engine.released == []

        assert await sender.release(ReleaseKv("held", "t" * 32))  # the owner may
        assert "held" not in sender.leases and engine.released == ["held"]
        assert await sender.release(ReleaseKv("prefilling", "a" * 32))
        assert engine.aborted == ["prefilling"]
        # Its first token was out already (the abort came too late to stop it): its Prefill
        # is told not to hold the blocks, so they do not wait out a lease nobody will pull.
        with pytest.raises(ReleasedBeforeHeld):
            sender.hold("prefilling", [5, 6], num_tokens=8)
        assert "prefilling" not in sender.leases

    asyncio.run(scenario())


def test_held_kv_is_freed_at_its_requests_deadline_if_that_comes_before_the_lease():
    """Its decode call shares the deadline: KV nobody pulled by then never will be. Such
    an end is not counted as an expired lease (no decode worker was too slow)."""

    async def scenario() -> None:
        sender, engine = _owned_sender()
        sender.lease_s = 1.0
        now = time.monotonic()
        for request_id in ("soon", "past", "later", "none"):
            sender.claim(request_id, "t" * 32)
        assert sender.hold("soon", [1], num_tokens=4, deadline=now + 0.2) <= 0.2
        assert sender.hold("past", [2], num_tokens=4, deadline=now - 1.0) == MIN_LEASE_S
        assert sender.hold("later", [3], num_tokens=4, deadline=now + 3600.0) == 1.0  # the lease comes first
        assert sender.hold("none", [4], num_tokens=4) == 1.0
        sender.start()
        try:
            while "soon" not in engine.released and time.monotonic() < now + 0.9:  # before "later" ends
                await asyncio.sleep(0.01)
            assert sorted(engine.released) == ["past", "soon"] and sender.num_leases_expired == 0
            assert "later" in sender.leases and "none" in sender.leases
            await asyncio.sleep(1.0 + LEASE_SWEEP_S)
        finally:
            await sender.close()
        assert sorted(engine.released) == ["later", "none", "past", "soon"] and sender.num_leases_expired == 2

    asyncio.run(scenario())
