"""A KV channel accepts only the peer introduced over the control plane: a TCPStore (gloo,
nccl) or an abstract Unix socket (ipc) is open to whoever reaches it, so each side
proves it holds the channel's one-time secret (kvtransfer/proof.py) before it trusts
the other, and the ipc receiver shows its cache to nobody else."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from engine.kv.cache import KVCache, KVLayout
from kvtransfer import KvTransferError
from kvtransfer.connect import join, listen

LAYOUT = KVLayout(2, 4, 2, 8, torch.float32)


def _cache(transport: str) -> KVCache:
    return KVCache(LAYOUT, 8, 0, shareable=transport == "ipc")


def _accept_in_thread(offer) -> tuple[threading.Thread, dict]:
    outcome: dict[str, object] = {}

    def accept() -> None:
        try:
            outcome["receiver"] = offer.accept()
        except BaseException as error:
            outcome["receiver"] = error

    thread = threading.Thread(target=accept)
    thread.start()
    return thread, outcome


def test_a_stranger_at_the_store_cannot_join_as_the_peer():
    """The store is open to anyone who reaches its port, and its keys can be listed; a
    stranger who joins an offered channel under its id, without the secret that went
    to the real sender over the control plane, is refused, and so is its own side."""
    offer = listen("offered", "gloo", "127.0.0.1", _cache("gloo"), timeout_s=10)
    thread, outcome = _accept_in_thread(offer)
    stranger = dataclasses.replace(offer.rendezvous, secret=bytes(32))
    with pytest.raises(KvTransferError, match="secret"):
        join(stranger, _cache("gloo"))
    thread.join(timeout=15)
    assert isinstance(outcome.get("receiver"), KvTransferError), outcome
    assert "does not hold the channel's secret" in str(outcome["receiver"])


def test_a_stranger_at_the_ipc_socket_is_turned_away_and_the_sender_gets_in():
    """Anyone in the host's network namespace can connect to the abstract socket. One
    without the secret is refused before the receiver shows its cache, and the receiver
    waits on for the sender it was told of."""
    receiver_cache = _cache("ipc")
    offer = listen("offered", "ipc", "", receiver_cache, timeout_s=10)
    thread, outcome = _accept_in_thread(offer)
    stranger = dataclasses.replace(offer.rendezvous, secret=bytes(32))
    with pytest.raises(KvTransferError, match="secret was not proved"):
        join(stranger, _cache("ipc"))
    sender = join(offer.rendezvous, _cache("ipc"))
    thread.join(timeout=15)
    receiver = outcome.get("receiver")
    assert not isinstance(receiver, BaseException) and not receiver.is_broken and not sender.is_broken
    sender.close()
    receiver.close()


@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_the_sender_given_the_offer_joins(transport):
    offer = listen("introduced", transport, "127.0.0.1", _cache(transport), timeout_s=10)
    thread, outcome = _accept_in_thread(offer)
    sender = join(offer.rendezvous, _cache(transport))
    thread.join(timeout=15)
    receiver = outcome.get("receiver")
    assert not isinstance(receiver, BaseException) and not receiver.is_broken and not sender.is_broken
    assert receiver.backend == sender.backend == transport
    assert "secret" not in repr(offer.rendezvous)
    sender.close()
    receiver.close()


def test_an_ipc_receiver_whose_cache_is_not_shared_refuses_to_offer():
    with pytest.raises(KvTransferError, match="not in shared memory"):
        listen("private", "ipc", "", KVCache(LAYOUT, 8, 0), timeout_s=1)


@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_a_receiver_cancelled_stops_waiting_for_its_peer(transport):
    """A pull cancelled before its prefill worker joined (a silent peer, the call gone) left
    the receiver's thread waiting out the rendezvous timeout, and a worker stopped meanwhile
    lingered that long (30 s; over ipc too: shutdown() does not wake an accept() on a Unix
    socket). Cancelled, the wait ends at once, and the next channel opens at once."""
    address = "" if transport == "ipc" else "127.0.0.1"
    cache = _cache(transport)
    offer = listen("abandoned", transport, address, cache, timeout_s=120)
    thread, outcome = _accept_in_thread(offer)
    offer.cancel()
    thread.join(timeout=30)  # well short of the 120 s it would otherwise wait
    assert not thread.is_alive() and isinstance(outcome.get("receiver"), KvTransferError), outcome
    assert "cancelled" in str(outcome["receiver"])
    # The next channel: its sender gets in, though the last one was given up.
    offer = listen("next", transport, address, cache, timeout_s=120)
    thread, outcome = _accept_in_thread(offer)
    sender = join(offer.rendezvous, _cache(transport))
    thread.join(timeout=30)
    assert not thread.is_alive() and not isinstance(outcome.get("receiver"), BaseException), outcome
    sender.close()
    outcome["receiver"].close()


def test_a_sender_given_up_stops_waiting_for_its_receiver():
    """A sender's wait, given up while the receiver it was told of has not come, ends at once."""
    unaccepted = listen("never-accepted", "gloo", "127.0.0.1", _cache("gloo"), timeout_s=120)
    cancelled, joined = threading.Event(), {}

    def sender() -> None:
        try:
            joined["sender"] = join(unaccepted.rendezvous, _cache("gloo"), cancelled)
        except BaseException as error:
            joined["sender"] = error

    thread = threading.Thread(target=sender)
    thread.start()
    cancelled.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(joined.get("sender"), KvTransferError), joined
    assert "cancelled" in str(joined["sender"])
