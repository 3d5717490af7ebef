"""The prefill side's one record of a request's handoff (kvtransfer/lease.py): claimed by
its KV token at the Prefill, HELD under a lease, SENDING, and gone when the blocks are
to be freed."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from kvtransfer import KvLeaseTable, LeaseState, ReleasedBeforeHeld

TOKEN = "t" * 32


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
    assert "a" in table and table.num_held == 0
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


class PrefillWorkerLeases(RuleBasedStateMachine):
    """The lease table as a prefill worker drives it, in any interleaving of its verbs:
    a Prefill claims a request and, once its first token is out, holds the blocks its
    engine pinned (or frees them, if the table says its owner let it go meanwhile); the
    gateway releases it at any moment (before its prefill ends, while held, while sent);
    a decode worker sends it; the sweep expires it. The blocks the engine pins are the
    model's own. A probe once found two leases held about 25 s after 500 connections
    dropped: a release that arrived mid-prefill was dropped, and the hold after it then
    waited out its lease. Whatever the order, a request released by its owner holds no
    block once its verbs have run, and the table holds exactly the blocks the engine pins
    for requests not yet freed."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.table = KvLeaseTable(self.clock)
        self.next_id = 0
        self.prefilling: set[str] = set()  # claimed, first token not out yet
        self.pinned: dict[str, list[int]] = {}  # the engine's blocks, by request, until freed
        self.released: set[str] = set()  # released by their owner

    requests = Bundle("requests")

    @rule(target=requests)
    def claim(self) -> str:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.table.claim(request_id, TOKEN)
        self.prefilling.add(request_id)
        return request_id

    @rule(request_id=requests, num_blocks=st.integers(1, 4))
    def first_token(self, request_id: str, num_blocks: int) -> None:
        """The Prefill's engine pinned the prompt's blocks; the server holds them (server._run)."""
        if request_id not in self.prefilling:
            return
        self.prefilling.discard(request_id)
        blocks = [self.next_id * 10 + i for i in range(num_blocks)]
        self.pinned[request_id] = blocks
        try:
            self.table.hold(request_id, blocks, num_tokens=4 * num_blocks, lease_s=25.0)
        except ReleasedBeforeHeld:
            del self.pinned[request_id]  # the server frees them (release_kv)

    @rule(request_id=requests)
    def release(self, request_id: str) -> None:
        """The owner's ReleaseKv (KvSender.release): a HELD lease's blocks are freed now."""
        if not self.table.owns(request_id, TOKEN):
            return
        self.released.add(request_id)
        if self.table.release(request_id):
            del self.pinned[request_id]

    @rule(request_id=requests, released_meanwhile=st.booleans())
    def send(self, request_id: str, released_meanwhile: bool) -> None:
        """A decode worker's pull: begin_send, and end_send at once (the sender frees),
        perhaps with the owner's release while it sends."""
        try:
            self.table.begin_send(request_id)
        except (KeyError, ValueError):
            return
        if released_meanwhile:
            self.released.add(request_id)
            assert self.table.release(request_id) is False and self.table.get(request_id).release_requested
        self.table.end_send(request_id)
        del self.pinned[request_id]

    @rule(seconds=st.sampled_from([1.0, 10.0, 30.0]))
    def sweep(self, seconds: float) -> None:
        self.clock.now += seconds
        for lease in self.table.expired(self.clock.now):
            del self.pinned[lease.request_id]

    @invariant()
    def released_requests_hold_nothing(self) -> None:
        for request_id in self.released - self.prefilling:
            assert request_id not in self.pinned, f"{request_id} was released and still holds its blocks"
            assert request_id not in self.table

    @invariant()
    def the_table_holds_what_the_engine_pins(self) -> None:
        assert self.table.num_blocks_held == sum(len(blocks) for blocks in self.pinned.values())
        for request_id, blocks in self.pinned.items():
            assert self.table.get(request_id).block_ids == blocks


TestPrefillWorkerLeases = PrefillWorkerLeases.TestCase
TestPrefillWorkerLeases.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)


def test_a_release_during_prefill_frees_the_blocks_at_the_hold():
    """The interleaving the probe hit, spelled out: released mid-prefill, then held."""
    table = KvLeaseTable(FakeClock())
    table.claim("a", TOKEN)
    assert table.release("a") is False  # nothing pinned yet
    with pytest.raises(ReleasedBeforeHeld):
        table.hold("a", [1, 2], num_tokens=8, lease_s=25.0)
    assert "a" not in table and table.num_blocks_held == 0
