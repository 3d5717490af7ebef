"""The prefill worker's KV sender: who may open which channel."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from baton.wire.records import OpenKvChannel
from engine.kv_cache import KVCache, KVLayout
from kvtransfer import KvLayoutSpec, Rendezvous
from prefill_worker.kv_sender import ChannelInUse, KvSender, _Channel


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
    sender = KvSender("p-0", engine=None, kv_cache=cache, layout=layout, lease_s=30.0, metrics=None)
    live = _Transport(is_broken=False)
    sender._channels["decode-0-abc-0"] = _Channel(live, ThreadPoolExecutor(1), "decode-0")
    request = OpenKvChannel(Rendezvous("decode-0-abc-0", "127.0.0.1", 1, 1.0, bytes(32)), layout, "intruder")

    with pytest.raises(ChannelInUse):
        asyncio.run(sender.open_channel(request))
    assert sender._channels["decode-0-abc-0"].transport is live and not live.closed
