"""kvtransfer: layout check, checksums, the wire plan, and block transfers between
two real processes over a Gloo channel (spawned children, joined with timeouts)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import threading
import time
import traceback

import pytest
import torch

from engine.kv.cache import KVCache, KVLayout
from kvtransfer import (
    KvChannel,
    KvLayoutMismatchError,
    KvLayoutSpec,
    KvTransferError,
    block_checksums,
)
from kvtransfer.wire import MAX_DATA_MESSAGES, TransferHeader, plan_digest, plan_messages, wire_tag

SMALL = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
SENTINEL = -7.0  # the receiver's fill: blocks not sent must still hold it


def filled_cache(layout: KVLayout, num_blocks: int, seed: int) -> KVCache:
    """A cache of random bits (any value, NaNs included: transfers move bits, not numbers)."""
    cache = KVCache(layout, num_blocks, 0)
    generator = torch.Generator().manual_seed(seed)
    for keys, values in cache.layers:
        for half in (keys, values):
            half.view(torch.uint8).copy_(
                torch.randint(0, 256, half.view(torch.uint8).shape, dtype=torch.uint8, generator=generator)
            )
    return cache


# ---------------------------------------------------------------- layout


def test_layout_mismatch_names_every_differing_field():
    ours = KvLayoutSpec(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
    theirs = KvLayoutSpec(num_layers=30, block_size=16, num_kv_heads=3, head_dim=32, dtype="bfloat16")
    with pytest.raises(KvLayoutMismatchError) as raised:
        ours.check_matches(theirs)
    assert str(raised.value) == "KV layout mismatch: head_dim 64 != 32, dtype float32 != bfloat16"
    assert isinstance(raised.value, ValueError)
    ours.check_matches(KvLayoutSpec(30, 16, 3, 64, "float32"))  # equal: no error


def test_layout_spec_from_kv_layout():
    layout = KVLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    spec = KvLayoutSpec.from_kv_layout(layout)
    assert spec == KvLayoutSpec(30, 16, 3, 64, "bfloat16")
    assert spec.torch_dtype is torch.bfloat16
    assert spec.bytes_per_block == layout.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 2
    with pytest.raises(KvLayoutMismatchError, match="unknown dtype"):
        KvLayoutSpec(30, 16, 3, 64, "float33")
    with pytest.raises(KvLayoutMismatchError, match="head_dim must be a positive int"):
        KvLayoutSpec(30, 16, 3, 0, "float32")  # e.g. a missing protobuf field


# ---------------------------------------------------------------- checksums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_checksum_is_deterministic_and_sees_every_bit(dtype):
    layout = KVLayout(3, 4, 2, 8, dtype)
    cache = filled_cache(layout, 10, seed=1)
    ids = [7, 2, 5]
    before = block_checksums(cache, ids)
    assert before == block_checksums(cache, ids)
    assert before == block_checksums(filled_cache(layout, 10, seed=1), ids)  # same bits, same sums
    assert all(0 <= c < 2**64 for c in before) and len(set(before)) == 3
    generator = torch.Generator().manual_seed(2)
    for layer in range(layout.num_layers):
        for half in range(2):
            tensor = cache.layers[layer][half]
            bits = tensor[2].view(torch.uint8).view(-1)  # block 2 = ids[1]
            byte = int(torch.randint(0, bits.numel(), (1,), generator=generator))
            bit = int(torch.randint(0, 8, (1,), generator=generator))
            bits[byte] ^= 1 << bit
            after = block_checksums(cache, ids)
            assert after[1] != before[1], f"flipped bit {bit} of byte {byte} in layer {layer} {'KV'[half]}"
            assert after[0] == before[0] and after[2] == before[2]
            bits[byte] ^= 1 << bit
    assert block_checksums(cache, ids) == before
    assert block_checksums(cache, []) == []


def test_checksum_sees_swapped_blocks_and_positions():
    cache = filled_cache(SMALL, 10, seed=3)
    ids = [4, 8]
    before = block_checksums(cache, ids)
    for keys, values in cache.layers:  # swap blocks 4 and 8 everywhere
        for half in (keys, values):
            half[[4, 8]] = half[[8, 4]].clone()
    assert block_checksums(cache, ids) == before[::-1] != before
    keys = cache.layers[1][0]
    keys[4, 0, 0, [0, 1]] = keys[4, 0, 0, [1, 0]].clone()  # two positions inside a block
    assert block_checksums(cache, ids)[0] != before[1]
    # Values whose bits differ only at bit 62 (0.0 and 2.0): a plain weighted sum would
    # miss this swap whenever the two weights agree mod 4.
    cache64 = KVCache(KVLayout(1, 1, 1, 2, torch.float64), 1, 0)
    cache64.layers[0][0][0, 0, 0] = torch.tensor([0.0, 2.0], dtype=torch.float64)
    first = block_checksums(cache64, [0])
    cache64.layers[0][0][0, 0, 0] = torch.tensor([2.0, 0.0], dtype=torch.float64)
    assert block_checksums(cache64, [0]) != first


# ---------------------------------------------------------------- wire


_PERM = torch.randperm(600, generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize(
    "src, dst, bytes_per_block, message_bytes",
    [
        (_PERM[:64], _PERM[64:128], 737_280, 4 << 20),  # scattered large blocks: one per message
        (list(range(512)), list(range(7, 519)), 737_280, 4 << 20),  # one run, cut at 5 blocks
        (list(range(10)), list(range(10)), 737_280, 100),  # blocks larger than a message travel alone
        (_PERM[:500], _PERM[100:600], 46_080, 1 << 20),  # scattered small blocks: all staged
        ([1, 2, 7, 30, 31, 32, 15, 16], [5, 6, 20, 33, 34, 35, 0, 9], 131_072, 600_000),  # mixed
        ([], [], 1000, 1 << 20),
    ],
)
def test_message_plan_covers_every_position_once(src, dst, bytes_per_block, message_bytes):
    plan = plan_messages(src, dst, bytes_per_block, message_bytes)
    covered = [p for run in plan.runs for p in range(run.start, run.stop)] + list(plan.staged)
    assert sorted(covered) == list(range(len(src)))
    for run in plan.runs:
        # In place: consecutive on both sides, long enough, no longer than a message (or one block).
        assert src[run.start : run.stop] == list(range(src[run.start], src[run.start] + run.num_blocks))
        assert dst[run.start : run.stop] == list(range(dst[run.start], dst[run.start] + run.num_blocks))
        assert run.num_blocks == 1 or run.num_blocks * bytes_per_block <= message_bytes
    staged_sizes = [(end - begin) * bytes_per_block for begin, end in plan.staged_slices()]
    assert all(size <= max(message_bytes, bytes_per_block) for size in staged_sizes)
    assert plan.num_messages == len(plan.runs) + len(staged_sizes) <= MAX_DATA_MESSAGES
    assert plan.num_messages <= len(src)


def test_message_plan_shapes():
    scattered = plan_messages(_PERM[:64], _PERM[64:128], 737_280, 4 << 20)
    assert len(scattered.runs) == 64 and not scattered.staged
    one_run = plan_messages(list(range(512)), list(range(7, 519)), 737_280, 4 << 20)
    sizes = [run.num_blocks for run in one_run.runs]  # 5 blocks fit in 4 MB
    assert len(sizes) == -(-512 // 5) and max(sizes) == 5 and min(sizes) == 4  # balanced cuts: no runt
    small = plan_messages(_PERM[:500], _PERM[100:600], 46_080, 1 << 20)
    assert not small.runs and small.staged_per_message == 22 and small.num_staged_messages == 23  # 1 MB / 45 KB
    mixed = plan_messages([1, 2, 7, 30, 31, 32, 15, 16], [5, 6, 20, 33, 34, 35, 0, 9], 131_072, 600_000)
    assert [(r.start, r.stop) for r in mixed.runs] == [(0, 2), (3, 6)] and mixed.staged == (2, 6, 7)


def test_message_plan_refuses_what_it_cannot_bound():
    with pytest.raises(ValueError, match="sender blocks for"):
        plan_messages([1, 2], [3], 1000, 1 << 20)
    many = list(range(0, 2 * (MAX_DATA_MESSAGES + 1), 2))  # scattered, each block its own message
    with pytest.raises(ValueError, match="more than"):
        plan_messages(many, many, 1 << 20, 1 << 20)


def test_plan_digest_sees_any_difference():
    base = plan_digest([4, 5, 9], [0, 1, 2])
    assert base == plan_digest([4, 5, 9], [0, 1, 2])
    others = {plan_digest([4, 5, 8], [0, 1, 2]), plan_digest([4, 5, 9], [0, 2, 1]),
              plan_digest([4, 5], [0, 1]), plan_digest([0, 1, 2], [4, 5, 9])}
    assert base not in others and len(others) == 4 and all(0 <= d < 2**63 for d in others | {base})


def test_wire_tags_and_header():
    tags = {wire_tag(tag, index) for tag in (0, 1, 2**16 - 1) for index in (0, 1, MAX_DATA_MESSAGES)}
    assert len(tags) == 9 and all(0 <= t < 2**31 for t in tags)
    spec = KvLayoutSpec(30, 16, 3, 64, "bfloat16")
    header = TransferHeader(spec, num_blocks=12, tag=2**40 + 5, digest=2**62 + 3)
    assert TransferHeader.decode(header.encode()) == header
    with pytest.raises(ValueError):
        TransferHeader.decode(torch.zeros_like(header.encode()))


# ---------------------------------------------------------------- two processes

TIMEOUT_S = 10.0
SECRET = bytes(range(32))  # both ranks are ours (the serving path makes one per channel)


def _child(role, port_queue: mp.Queue, results: mp.Queue, *args) -> None:
    """Run `role` (a function below) and report ("ok", name, value) or ("error", name, traceback)."""
    torch.set_num_threads(1)
    try:
        results.put(("ok", role.__name__, role(port_queue, *args)))
    except BaseException:
        results.put(("error", role.__name__, traceback.format_exc()))


def _join(port_queue, *, timeout_s: float, rank: int, **tuning) -> KvChannel:
    """Receiver: host the store and publish its port. Sender: take the port and join."""
    if rank == 1:
        store = KvChannel.host_store()
        port_queue.put(store.port)
        return KvChannel.connect(channel_id="test", host="127.0.0.1", port=store.port, rank=1,
                                 secret=SECRET, device="cpu", timeout_s=timeout_s, store=store, **tuning)
    port = port_queue.get(timeout=30)
    return KvChannel.connect(channel_id="test", host="127.0.0.1", port=port, rank=0,
                             secret=SECRET, device="cpu", timeout_s=timeout_s, **tuning)


# (layout, sender ids, receiver ids) of each transfer on the happy path, all in one channel
# (message_bytes 600,000). Blocks: SMALL 1.5 KB, MEDIUM 128 KB, LARGE 256 KB (MIN_RUN_BYTES).
MEDIUM = KVLayout(4, 16, 4, 64, torch.float32)
LARGE = KVLayout(8, 16, 4, 64, torch.float32)
_MANY = torch.randperm(40, generator=torch.Generator().manual_seed(5))[:33].tolist()
TRANSFERS = [
    (SMALL, [17, 3, 29, 4, 11], [5, 38, 0, 21, 12]),  # staged: one message
    (SMALL, _MANY, _MANY[::-1]),
    (KVLayout(2, 4, 2, 8, torch.float64), [1, 9, 6], [30, 2, 14]),
    (KVLayout(4, 2, 1, 16, torch.bfloat16), [0, 39, 20, 8], [8, 0, 1, 2]),
    (LARGE, [3, 4, 5, 9, 20, 21, 22, 23], [10, 11, 12, 0, 30, 31, 32, 33]),  # in place, runs cut at 2
    (LARGE, [37, 1, 14], [2, 19, 6]),  # in place, a block per message
    (MEDIUM, [1, 2, 7, 30, 31, 32, 15, 16], [5, 6, 20, 33, 34, 35, 0, 9]),  # runs in place, the rest staged
]
POOL = 40


def sender(port_queue) -> list[list[int]]:
    channel = _join(port_queue, timeout_s=TIMEOUT_S, rank=0, message_bytes=600_000)
    checksums = []
    for tag, (layout, src, dst) in enumerate(TRANSFERS, start=1):
        cache = filled_cache(layout, POOL, seed=tag)
        stats = channel.send_blocks(cache, src, tag, dst)
        assert stats.num_blocks == len(src) and stats.num_bytes == len(src) * layout.bytes_per_block
        checksums.append(block_checksums(cache, src))
    # The receiver will expect float32 for a float64 cache: its header check fails.
    mismatched = filled_cache(KVLayout(3, 4, 2, 8, torch.float64), POOL, seed=99)
    with pytest.raises(KvTransferError):
        channel.send_blocks(mismatched, [1, 2], 99, [3, 4])
    channel.close()
    return checksums


def receiver(port_queue) -> list[list[int]]:
    channel = _join(port_queue, timeout_s=TIMEOUT_S, rank=1, message_bytes=600_000)
    assert channel.backend == "gloo"
    checksums = []
    for tag, (layout, src, dst) in enumerate(TRANSFERS, start=1):
        cache = sentinel_cache(layout)
        stats = channel.recv_blocks(cache, dst, tag, src)
        assert stats.num_blocks == len(dst)
        expected = filled_cache(layout, POOL, seed=tag)  # the sender's cache, rebuilt from its seed
        untouched = sorted(set(range(POOL)) - set(dst))
        for layer, (got_kv, want_kv) in enumerate(zip(cache.layers, expected.layers)):
            for name, got, want in zip("KV", got_kv, want_kv):
                same = torch.equal(got[dst].view(torch.uint8), want[src].view(torch.uint8))  # bits, NaNs too
                assert same, (tag, layer, name)
                assert bool((got[untouched] == SENTINEL).all()), (tag, layer, name)
        checksums.append(block_checksums(cache, dst))
    rejecting = sentinel_cache(SMALL)
    with pytest.raises(KvTransferError, match="dtype float32 != float64") as raised:
        channel.recv_blocks(rejecting, [3, 4], 99, [1, 2])
    assert isinstance(raised.value.__cause__, KvLayoutMismatchError)
    assert bool((rejecting.blocks == SENTINEL).all()), "a rejected transfer wrote into the cache"
    assert channel.is_broken
    with pytest.raises(KvTransferError, match="broken"):
        channel.recv_blocks(KVCache(SMALL, POOL, 0), [3, 4], 100, [1, 2])
    channel.close()
    return checksums


def sentinel_cache(layout: KVLayout) -> KVCache:
    cache = KVCache(layout, POOL, 0)
    cache.blocks.fill_(SENTINEL)
    return cache


def other_ids_sender(port_queue) -> str:
    channel = _join(port_queue, timeout_s=TIMEOUT_S, rank=0)
    with pytest.raises(KvTransferError) as raised:
        channel.send_blocks(filled_cache(LARGE, POOL, seed=1), [1, 2, 3], 1, [4, 5, 6])
    return str(raised.value)


def other_ids_receiver(port_queue) -> str:
    """Same layout, count and tag, but the two sides were given different receiver ids."""
    channel = _join(port_queue, timeout_s=TIMEOUT_S, rank=1)
    cache = sentinel_cache(LARGE)
    with pytest.raises(KvTransferError, match="different block ids") as raised:
        channel.recv_blocks(cache, [4, 5, 7], 1, [1, 2, 3])
    assert bool((cache.blocks == SENTINEL).all()), "a rejected transfer wrote into the cache"
    channel.close()
    return str(raised.value)


def silent_sender(port_queue, release: mp.Event) -> None:
    channel = _join(port_queue, timeout_s=2.0, rank=0)
    release.wait(30)  # never sends; leaves once the receiver gave up
    channel.close()


def waiting_receiver(port_queue, release: mp.Event) -> dict:
    channel = _join(port_queue, timeout_s=2.0, rank=1)
    started = time.monotonic()
    try:
        channel.recv_blocks(KVCache(SMALL, POOL, 0), [1, 2, 3], 1, [1, 2, 3])
    except KvTransferError as error:
        waited, message = time.monotonic() - started, str(error)
    else:
        raise AssertionError("recv_blocks returned without a sender")
    broken = channel.is_broken
    release.set()
    time.sleep(0.5)  # the peer is gone now
    closing = time.monotonic()
    channel.close()
    return {"waited": waited, "message": message, "broken": broken, "close_s": time.monotonic() - closing}


def mistagged_sender(port_queue) -> dict:
    channel = _join(port_queue, timeout_s=20.0, rank=0)
    started = time.monotonic()
    with pytest.raises(KvTransferError) as raised:
        channel.send_blocks(filled_cache(SMALL, POOL, seed=1), [1, 2, 3], 2, [1, 2, 3])
    return {"waited": time.monotonic() - started, "message": str(raised.value), "broken": channel.is_broken}


def expecting_receiver(port_queue) -> None:
    channel = _join(port_queue, timeout_s=2.0, rank=1)
    with pytest.raises(KvTransferError, match="timed out"):
        channel.recv_blocks(KVCache(SMALL, POOL, 0), [1, 2, 3], 1, [1, 2, 3])
    time.sleep(3)  # still alive, channel not closed by hand: the failure itself let go of the group


def run_pair(sender_role, receiver_role, *args, timeout_s: float = 60.0) -> dict[str, object]:
    """Run both roles in spawned processes: their return values by role name, or a failure
    that shows the children's tracebacks."""
    ctx = mp.get_context("spawn")
    port_queue, results = ctx.Queue(), ctx.Queue()
    args = tuple(arg(ctx) if callable(arg) else arg for arg in args)
    processes = [ctx.Process(target=_child, args=(role, port_queue, results, *args), daemon=True)
                 for role in (receiver_role, sender_role)]
    for process in processes:
        process.start()
    outcomes, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(outcomes) < 2:
            status, name, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            outcomes[name] = (status, value)
    except queue.Empty:
        pass
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    errors = [f"--- {name} ---\n{value}" for name, (status, value) in outcomes.items() if status == "error"]
    missing = {sender_role.__name__, receiver_role.__name__} - set(outcomes)
    if errors or missing:
        pytest.fail("\n".join(errors + [f"{name} did not report within {timeout_s:g} s" for name in missing]))
    assert [process.exitcode for process in processes] == [0, 0]
    return {name: value for name, (_, value) in outcomes.items()}


def test_transfers_between_two_processes():
    results = run_pair(sender, receiver)
    assert results["sender"] == results["receiver"]  # checksums agree, transfer by transfer
    assert [len(c) for c in results["sender"]] == [len(src) for _, src, _ in TRANSFERS]


def test_sides_given_different_block_ids_fail_cleanly():
    results = run_pair(other_ids_sender, other_ids_receiver)
    assert "different block ids" in results["other_ids_receiver"]
    assert "transfer failed" in results["other_ids_sender"]


def test_receiver_times_out_when_nothing_is_sent():
    results = run_pair(silent_sender, waiting_receiver, lambda ctx: ctx.Event())
    outcome = results["waiting_receiver"]
    assert outcome["broken"]
    assert "timed out" in outcome["message"]
    assert 1.9 <= outcome["waited"] < 6.0
    assert outcome["close_s"] < 2.0


def test_a_failed_transfer_fails_the_peer_at_once():
    # The receiver gives up after its 2 s timeout; the sender, with 20 s to wait, fails
    # right then (its connection closes), not at its own timeout.
    outcome = run_pair(mistagged_sender, expecting_receiver)["mistagged_sender"]
    assert outcome["broken"] and "transfer failed" in outcome["message"]
    assert outcome["waited"] < 8.0


def test_connect_times_out_without_a_peer():
    store = KvChannel.host_store()
    started = time.monotonic()
    with pytest.raises(KvTransferError, match="did not join"):
        KvChannel.connect(channel_id="alone", host="127.0.0.1", port=store.port, rank=0,
                          secret=SECRET, device="cpu", timeout_s=1.0)
    assert time.monotonic() - started < 5.0


def test_a_sender_that_cannot_reach_the_rendezvous_says_where_and_what_to_check():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(KvTransferError, match=rf"could not reach the receiver's rendezvous at 127.0.0.1:{port}.*"
                                              "--transfer-host"):
        KvChannel.connect(channel_id="nowhere", host="127.0.0.1", port=port, rank=0,
                          secret=SECRET, device="cpu", timeout_s=1.0)


def test_connect_refuses_sides_that_disagree_on_message_size():
    # Both ranks in this process (two threads): enough to check the agreement at connect.
    store = KvChannel.host_store()
    outcome: dict[str, BaseException] = {}

    def join_as_receiver() -> None:
        try:
            KvChannel.connect(channel_id="sizes", host="127.0.0.1", port=store.port, rank=1, device="cpu",
                              secret=SECRET, timeout_s=10, store=store, message_bytes=1 << 20)
        except BaseException as error:
            outcome["receiver"] = error

    receiver_thread = threading.Thread(target=join_as_receiver)
    receiver_thread.start()
    with pytest.raises(KvTransferError, match="message_bytes 2097152 != 1048576"):
        KvChannel.connect(channel_id="sizes", host="127.0.0.1", port=store.port, rank=0, device="cpu",
                          secret=SECRET, timeout_s=10, message_bytes=2 << 20)
    receiver_thread.join(timeout=15)
    assert isinstance(outcome.get("receiver"), KvTransferError)

