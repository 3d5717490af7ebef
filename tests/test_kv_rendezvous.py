"""The KV channel's rendezvous accepts only the peer introduced over the control plane:
a TCPStore is open to whoever reaches its port, so each side proves it holds the
channel's one-time secret (kvtransfer/group.py)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from kvtransfer import KvTransferError
from kvtransfer.connect import join, listen


def test_a_stranger_at_the_store_cannot_join_as_the_peer():
    """The store is open to anyone who reaches its port, and its keys can be listed; a
    stranger who joins an offered channel under its id, without the secret that went
    to the real sender over the control plane, is refused, and so is its own side."""
    offer = listen("offered", "127.0.0.1", "cpu", timeout_s=10)
    outcome: dict[str, BaseException | object] = {}

    def accept() -> None:
        try:
            outcome["receiver"] = offer.accept()
        except BaseException as error:
            outcome["receiver"] = error

    receiver_thread = threading.Thread(target=accept)
    receiver_thread.start()
    stranger = dataclasses.replace(offer.rendezvous, secret=bytes(32))
    with pytest.raises(KvTransferError, match="secret"):
        join(stranger, "cpu")
    receiver_thread.join(timeout=15)
    assert isinstance(outcome.get("receiver"), KvTransferError), outcome
    assert "does not hold the channel's secret" in str(outcome["receiver"])


def test_the_sender_given_the_offer_joins():
    offer = listen("introduced", "127.0.0.1", "cpu", timeout_s=10)
    accepted: list = []
    receiver_thread = threading.Thread(target=lambda: accepted.append(offer.accept()))
    receiver_thread.start()
    sender = join(offer.rendezvous, "cpu")
    receiver_thread.join(timeout=15)
    assert accepted and not accepted[0].is_broken and not sender.is_broken
    assert "secret" not in repr(offer.rendezvous)
    sender.close()
    accepted[0].close()
