"""The prefill side's one record of a request's handoff (kvtransfer/lease.py): claimed by
its KV token at the Prefill, HELD under a lease, SENDING, and gone when the blocks are
to be freed."""

from __future__ import annotations

import pytest

from kvtransfer import KvLeaseTable, LeaseState


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def held(table: KvLeaseTable, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float):
    table.claim(request_id, "t" * 32)
    return table.hold(request_id, block_ids, num_tokens, lease_s)


def test_lease_claim_hold_release_and_expiry():
    clock = FakeClock()
    table = KvLeaseTable(clock)
    table.claim("a", "t" * 32)
    assert "a" in table and table.num_held == 0 and table.release("a") is False  # claimed: nothing to free
    assert table.owns("a", "t" * 32) and not table.owns("a", "u" * 32) and not table.owns("b", "t" * 32)
    pytest.raises(ValueError, table.claim, "a", "u" * 32)
    pytest.raises(KeyError, table.begin_send, "a")  # nothing held yet
    table.hold("a", [1, 2, 3], num_tokens=40, lease_s=10)
    held(table, "b", [4], num_tokens=3, lease_s=20)
    assert table.num_held == 2 and "a" in table and table.num_blocks_held == 4
    pytest.raises(ValueError, table.hold, "a", [9], num_tokens=1, lease_s=10)
    pytest.raises(ValueError, table.disown, "a")  # held: only a release (or the sweep) ends it
    pytest.raises(KeyError, table.hold, "unclaimed", [9], num_tokens=1, lease_s=10)
    assert table.release("b") is True  # HELD: the caller frees now
    assert "b" not in table and table.release("b") is False
    clock.now = 109.0
    assert table.expired(clock.now) == []
    clock.now = 110.0
    with pytest.raises(KeyError):
        table.begin_send("a")  # past its deadline, even before the sweep
    assert [lease.request_id for lease in table.expired(clock.now)] == ["a"]
    assert "a" not in table and table.num_held == 0 and table.num_blocks_held == 0
    table.claim("c", "t" * 32)
    table.disown("c")  # its prefill ended holding nothing
    assert "c" not in table


def test_lease_send_and_release_while_sending():
    clock = FakeClock()
    table = KvLeaseTable(clock)
    held(table, "a", [1, 2], num_tokens=20, lease_s=5)
    lease = table.begin_send("a")
    assert lease.state is LeaseState.SENDING and lease.block_ids == [1, 2]
    with pytest.raises(ValueError):
        table.begin_send("a")
    with pytest.raises(KeyError):
        table.begin_send("missing")
    assert table.release("a") is False  # SENDING: the sender frees after end_send
    assert lease.release_requested
    clock.now += 60
    assert table.expired(clock.now) == []  # a send never expires; its timeout covers it
    assert table.num_blocks_held == 2
    table.end_send("a")
    assert "a" not in table
    with pytest.raises(KeyError):
        table.end_send("a")
    held(table, "b", [3], num_tokens=1, lease_s=5)
    with pytest.raises(ValueError):
        table.end_send("b")  # no send began
