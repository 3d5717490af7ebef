"""The ipc transport between two real processes on this host: the sender copies blocks
straight into the receiver's cache, a memfd segment it mapped (kvtransfer/ipc.py).

Bitwise transfers of scattered and contiguous ids, blocks outside a transfer left
alone, refusals that leave the receiver's cache untouched, and peers that die or
freeze mid-copy: the survivor fails at once, or (frozen sender) knows its blocks are in
doubt until the sender answers. Nothing is ever left in /dev/shm.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback

import pytest
import torch

from engine.kv.cache import KVCache, KVLayout
from kvtransfer import KvTransferError, block_checksums
from kvtransfer.connect import join, listen

TIMEOUT_S = 10.0
SENTINEL = -7.0
POOL = 48
SMALL = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)  # 1.5 KB blocks
LARGE = KVLayout(num_layers=8, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)  # 256 KB blocks
HALF = KVLayout(num_layers=4, block_size=2, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16)
DOUBLE = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float64)

_PERM = torch.randperm(POOL, generator=torch.Generator().manual_seed(11)).tolist()
# (sender ids, receiver ids) of each transfer on one channel, in this order.
TRANSFERS = [
    (list(range(3, 19)), list(range(20, 36))),  # one contiguous run on both sides
    (_PERM[:12], _PERM[12:24]),  # scattered on both sides
    ([1, 2, 3, 30, 31, 7, 40], [10, 11, 12, 0, 1, 44, 5]),  # runs and single blocks mixed
    ([9], [47]),
]


def filled_cache(layout: KVLayout, seed: int, *, shareable: bool = False) -> KVCache:
    """A cache of random bits (NaNs included: transfers move bits, not numbers)."""
    cache = KVCache(layout, POOL, 0, shareable=shareable)
    generator = torch.Generator().manual_seed(seed)
    bytes_ = cache.blocks.view(torch.uint8)
    bytes_.copy_(torch.randint(0, 256, bytes_.shape, dtype=torch.uint8, generator=generator))
    return cache


def sentinel_cache(layout: KVLayout) -> KVCache:
    cache = KVCache(layout, POOL, 0, shareable=True)
    cache.blocks.fill_(SENTINEL)
    return cache


def shm_entries() -> set[str]:
    """What /dev/shm holds, but the semaphores of this test's own queues and events
    (multiprocessing's `sem.mp-*`, gone with them)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {name for name in names if not name.startswith("sem.mp-")}


# ---------------------------------------------------------------- two processes


def _child(role, rendezvous_queue, results, *args) -> None:
    torch.set_num_threads(1)
    try:
        results.put(("ok", role.__name__, role(rendezvous_queue, *args)))
    except BaseException:
        results.put(("error", role.__name__, traceback.format_exc()))


def start_pair(sender_role, receiver_role, *args):
    """The two roles' processes, by name, and the queues they share (keep them referenced
    until the children have started: a collected queue's semaphores are gone)."""
    ctx = mp.get_context("spawn")
    rendezvous_queue, results = ctx.Queue(), ctx.Queue()
    processes = {role.__name__: ctx.Process(target=_child, args=(role, rendezvous_queue, results, *args),
                                            daemon=True) for role in (receiver_role, sender_role)}
    for process in processes.values():
        process.start()
    return processes, results, rendezvous_queue


def collect(processes, results, names, timeout_s: float = 60.0) -> dict:
    outcomes, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(outcomes) < len(names):
            status, name, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            outcomes[name] = (status, value)
    except queue.Empty:
        pass
    errors = [f"--- {name} ---\n{value}" for name, (status, value) in outcomes.items() if status == "error"]
    missing = set(names) - set(outcomes)
    if errors or missing:
        for process in processes.values():
            process.kill()
        pytest.fail("\n".join(errors + [f"{name} did not report within {timeout_s:g} s" for name in missing]))
    return {name: value for name, (_, value) in outcomes.items()}


def finish(processes) -> None:
    for process in processes.values():
        process.join(timeout=15)
        if process.is_alive():
            process.kill()
            process.join()


def run_pair(sender_role, receiver_role, *args, timeout_s: float = 60.0) -> dict:
    processes, results, _queue = start_pair(sender_role, receiver_role, *args)
    try:
        outcome = collect(processes, results, [sender_role.__name__, receiver_role.__name__], timeout_s)
    finally:
        finish(processes)
    assert [p.exitcode for p in processes.values()] == [0, 0]
    return outcome


def _offer(rendezvous_queue, cache: KVCache, channel_id: str = "ipc-test", timeout_s: float = TIMEOUT_S):
    offer = listen(channel_id, "ipc", "", cache, timeout_s)
    rendezvous_queue.put(offer.rendezvous)
    return offer.accept()


def _join(rendezvous_queue, cache: KVCache):
    return join(rendezvous_queue.get(timeout=30), cache)


# ---------------------------------------------------------------- bitwise transfers


def sender(rendezvous_queue, layout) -> list[list[int]]:
    cache = filled_cache(layout, seed=1)
    channel = _join(rendezvous_queue, cache)
    assert channel.backend == "ipc"
    sums = []
    for tag, (src, dst) in enumerate(TRANSFERS, start=1):
        stats = channel.send_blocks(cache, src, tag, dst)
        assert stats.num_blocks == len(src) and stats.num_bytes == len(src) * layout.bytes_per_block
        sums.append(block_checksums(cache, src))
    channel.close()
    return sums


def receiver(rendezvous_queue, layout) -> list[list[int]]:
    cache = sentinel_cache(layout)
    channel = _offer(rendezvous_queue, cache)
    expected = filled_cache(layout, seed=1)  # the sender's cache, rebuilt from its seed
    written: set[int] = set()
    sums = []
    for tag, (src, dst) in enumerate(TRANSFERS, start=1):
        channel.recv_blocks(cache, dst, tag, src)
        written |= set(dst)
        rows, want = cache.block_rows.view(torch.uint8), expected.block_rows.view(torch.uint8)
        assert torch.equal(rows[dst], want[src]), tag  # bits, NaNs and all
        untouched = sorted(set(range(POOL)) - written)
        assert bool((cache.block_rows[untouched] == SENTINEL).all()), f"transfer {tag} wrote outside its blocks"
        sums.append(block_checksums(cache, dst))
    channel.close()
    return sums


@pytest.mark.parametrize("layout", [SMALL, LARGE, HALF, DOUBLE], ids=["small", "large", "bfloat16", "float64"])
def test_ipc_transfers_are_bitwise_and_touch_nothing_else(layout):
    before = shm_entries()
    results = run_pair(sender, receiver, layout)
    assert results["sender"] == results["receiver"]
    assert shm_entries() <= before, "a segment was left in /dev/shm"


# ---------------------------------------------------------------- refusals


def mismatched_sender(rendezvous_queue) -> str:
    """Its cache's dtype differs from the receiver's: refused at channel open."""
    with pytest.raises(KvTransferError, match="refused: KV layout mismatch") as raised:
        _join(rendezvous_queue, filled_cache(KVLayout(3, 4, 2, 8, torch.float64), seed=2))
    return str(raised.value)


def refusing_receiver(rendezvous_queue) -> str:
    cache = sentinel_cache(SMALL)
    with pytest.raises(KvTransferError, match="disagree") as raised:
        _offer(rendezvous_queue, cache)
    assert bool((cache.blocks == SENTINEL).all())
    return str(raised.value)


def test_a_layout_mismatch_is_refused_at_channel_open():
    results = run_pair(mismatched_sender, refusing_receiver)
    assert "dtype float32 != float64" in results["refusing_receiver"]
    assert "float64" in results["mismatched_sender"]


def wrong_header_sender(rendezvous_queue) -> list[str]:
    """Three transfers the receiver must refuse, each on a channel of its own: other
    receiver ids than the receiver was given, another tag, a cache of another layout."""
    errors = []
    cache = filled_cache(SMALL, seed=3)
    for src, dst, tag, send_from in (([1, 2, 3], [4, 5, 6], 1, cache), ([1, 2, 3], [4, 5, 7], 2, cache),
                                     ([1, 2], [4, 5], 1, filled_cache(KVLayout(3, 4, 2, 4, torch.float32), 4))):
        channel = _join(rendezvous_queue, cache)
        with pytest.raises(KvTransferError) as raised:
            channel.send_blocks(send_from, src, tag, dst)
        assert channel.is_broken
        errors.append(str(raised.value))
    return errors


def wrong_header_receiver(rendezvous_queue) -> list[str]:
    errors = []
    cache = sentinel_cache(SMALL)
    for expected_dst, expected_src, tag in (([4, 5, 7], [1, 2, 3], 1), ([4, 5, 7], [1, 2, 3], 3), ([4, 5], [1, 2], 1)):
        channel = _offer(rendezvous_queue, cache)
        with pytest.raises(KvTransferError, match="disagree") as raised:
            channel.recv_blocks(cache, expected_dst, tag, expected_src)
        assert bool((cache.blocks == SENTINEL).all()), "a refused transfer wrote into the cache"
        assert channel.is_broken
        errors.append(str(raised.value))
    return errors


def test_a_wrong_header_is_refused_before_any_byte_lands():
    results = run_pair(wrong_header_sender, wrong_header_receiver)
    ids, tag, layout = results["wrong_header_receiver"]
    assert "different block ids" in ids
    assert "transfer 2 of 3 blocks, receiver expects transfer 3" in tag
    assert "head_dim 8 != 4" in layout
    assert all("disagree" in error for error in results["wrong_header_sender"])


# ---------------------------------------------------------------- peers that die or freeze


def stop_after_first_copy(then) -> None:
    """Make this process's sender copy one run (or staged batch), report, then `then()`."""
    from kvtransfer import ipc

    copy_run = ipc.IpcChannel._check_abort
    calls = {"n": 0}

    def check_abort(self, tag):
        calls["n"] += 1
        if calls["n"] == 2:  # the first copy is done
            then()
        copy_run(self, tag)

    ipc.IpcChannel._check_abort = check_abort


def dying_sender(rendezvous_queue, mid_copy) -> None:
    cache = filled_cache(LARGE, seed=5)
    channel = _join(rendezvous_queue, cache)
    stop_after_first_copy(lambda: (mid_copy.set(), time.sleep(60)))  # killed there
    channel.send_blocks(cache, [1, 2, 3, 10, 20, 30], 1, [5, 6, 7, 8, 9, 11])


def surviving_receiver(rendezvous_queue, mid_copy) -> dict:
    cache = sentinel_cache(LARGE)
    channel = _offer(rendezvous_queue, cache, timeout_s=30.0)
    started = time.monotonic()
    with pytest.raises(KvTransferError) as raised:
        channel.recv_blocks(cache, [5, 6, 7, 8, 9, 11], 1, [1, 2, 3, 10, 20, 30])
    waited = time.monotonic() - started
    untouched = sorted(set(range(POOL)) - {5, 6, 7, 8, 9, 11})
    return {"waited": waited, "message": str(raised.value), "in_doubt": raised.value.in_doubt,
            "settled": channel.wait_settled(0.1), "untouched": bool((cache.block_rows[untouched] == SENTINEL).all()),
            "broken": channel.is_broken, "mid_copy": mid_copy.is_set()}


def test_a_sender_killed_mid_copy_fails_the_receiver_at_once_and_leaves_nothing_behind():
    before = shm_entries()
    ctx = mp.get_context("spawn")
    mid_copy = ctx.Event()
    processes, results, _queue = start_pair(dying_sender, surviving_receiver, mid_copy)
    try:
        assert mid_copy.wait(30), "the sender never reached the middle of its copy"
        killed_at = time.monotonic()
        os.kill(processes["dying_sender"].pid, signal.SIGKILL)
        outcome = collect(processes, results, ["surviving_receiver"])["surviving_receiver"]
        noticed_s = time.monotonic() - killed_at
    finally:
        finish(processes)
    # The socket closed with the sender: no wait for the channel's 30 s timeout.
    assert noticed_s < 5.0 and outcome["waited"] < 20.0, outcome
    assert "gone" in outcome["message"] and not outcome["in_doubt"] and outcome["settled"]
    assert outcome["broken"] and outcome["untouched"] and outcome["mid_copy"]
    assert processes["surviving_receiver"].exitcode == 0
    assert shm_entries() <= before, "a segment was left in /dev/shm"


def freezing_sender(rendezvous_queue, mid_copy, resumed, sender_up, checked) -> str:
    cache = filled_cache(LARGE, seed=6)
    sender_up.set()  # started: the receiver's 2 s timeout may run from now
    channel = _join(rendezvous_queue, cache)
    stop_after_first_copy(lambda: (mid_copy.set(), os.kill(os.getpid(), signal.SIGSTOP)))
    with pytest.raises(KvTransferError, match="gave up") as raised:
        channel.send_blocks(cache, [1, 2, 3, 10, 20, 30], 1, [5, 6, 7, 8, 9, 11])
    return str(raised.value)


def waiting_receiver(rendezvous_queue, mid_copy, resumed, sender_up, checked) -> dict:
    cache = sentinel_cache(LARGE)
    sender_up.wait(30)
    channel = _offer(rendezvous_queue, cache, timeout_s=2.0)
    with pytest.raises(KvTransferError, match="timed out") as raised:
        channel.recv_blocks(cache, [5, 6, 7, 8, 9, 11], 1, [1, 2, 3, 10, 20, 30])
    frozen_settled = channel.wait_settled(0.5)  # the sender is stopped: nobody can tell
    checked.set()
    resumed.wait(30)
    settled = channel.wait_settled(10.0)  # it answers the ABORT at its next copy
    snapshot = cache.blocks.view(torch.uint8).clone()  # bits: the blocks copied hold NaNs
    time.sleep(0.5)
    return {"in_doubt": raised.value.in_doubt, "frozen_settled": frozen_settled, "settled": settled,
            "quiet_after": torch.equal(snapshot, cache.blocks.view(torch.uint8)), "mid_copy": mid_copy.is_set()}


def test_a_frozen_sender_leaves_its_blocks_in_doubt_until_it_answers():
    ctx = mp.get_context("spawn")
    mid_copy, resumed, sender_up, checked = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    processes, results, _queue = start_pair(freezing_sender, waiting_receiver, mid_copy, resumed, sender_up, checked)
    try:
        assert mid_copy.wait(30)
        assert checked.wait(60)  # the receiver timed out (2 s) and found the transfer unsettled
        os.kill(processes["freezing_sender"].pid, signal.SIGCONT)
        resumed.set()
        outcome = collect(processes, results, ["freezing_sender", "waiting_receiver"])
    finally:
        finish(processes)
    receiver_side = outcome["waiting_receiver"]
    assert receiver_side["in_doubt"] and not receiver_side["frozen_settled"]
    assert receiver_side["settled"] and receiver_side["quiet_after"] and receiver_side["mid_copy"]
    assert "gave up" in outcome["freezing_sender"]


def surviving_sender(rendezvous_queue, receiver_gone) -> dict:
    cache = filled_cache(LARGE, seed=7)
    channel = _join(rendezvous_queue, cache)
    try:  # the receiver dies right after its GO: this copy may finish before it is gone, or not
        channel.send_blocks(cache, [1, 2, 3], 1, [4, 5, 6])
        message = ""
    except KvTransferError as error:
        message = str(error)
    receiver_gone.wait(30)
    # Between transfers the channel notices its peer is gone, and drops the dead cache's mapping.
    broken, released = channel.is_broken, channel._peer_rows is None
    gc.collect()
    with open("/proc/self/maps") as maps:
        unmapped = "baton-kv-cache" not in maps.read()  # the memfd's name, as /proc shows its mappings
    # Still serving: the next channel, to another receiver, works.
    channel = _join(rendezvous_queue, cache)
    channel.send_blocks(cache, [1, 2, 3], 1, [4, 5, 6])
    channel.close()
    return {"message": message, "broken": broken, "released": released, "unmapped": unmapped}


def die_right_after_go() -> None:
    """Make this process (an ipc receiver) kill itself (-9) the moment it has sent a GO."""
    from kvtransfer import ipc_frames

    send = ipc_frames.Frames.send

    def send_then_die(self, kind, payload=b"", fds=()):
        send(self, kind, payload, fds)
        if kind == ipc_frames.GO:
            os.kill(os.getpid(), signal.SIGKILL)

    ipc_frames.Frames.send = send_then_die


def dying_receiver(rendezvous_queue, receiver_gone) -> None:
    die_right_after_go()
    cache = sentinel_cache(LARGE)
    channel = _offer(rendezvous_queue, cache)
    channel.recv_blocks(cache, [4, 5, 6], 1, [1, 2, 3])


def second_receiver(rendezvous_queue) -> bool:
    cache = sentinel_cache(LARGE)
    channel = _offer(rendezvous_queue, cache, channel_id="second")
    channel.recv_blocks(cache, [4, 5, 6], 1, [1, 2, 3])
    want = filled_cache(LARGE, seed=7).block_rows.view(torch.uint8)
    return torch.equal(cache.block_rows.view(torch.uint8)[[4, 5, 6]], want[[1, 2, 3]])


def test_a_receiver_killed_mid_transfer_leaves_the_sender_serving():
    before = shm_entries()
    ctx = mp.get_context("spawn")
    receiver_gone = ctx.Event()
    processes, results, rendezvous_queue = start_pair(surviving_sender, dying_receiver, receiver_gone)
    second = None
    try:
        processes["dying_receiver"].join(30)
        assert processes["dying_receiver"].exitcode == -signal.SIGKILL
        receiver_gone.set()
        # A new receiver in a new process, found through the same queue.
        second = ctx.Process(target=_child, args=(second_receiver, rendezvous_queue, results), daemon=True)
        second.start()
        processes["second_receiver"] = second
        outcome = collect(processes, results, ["surviving_sender", "second_receiver"])
    finally:
        finish(processes)
    sender_side = outcome["surviving_sender"]
    assert sender_side["broken"] and sender_side["released"] and sender_side["unmapped"], sender_side
    assert sender_side["message"] == "" or "gone" in sender_side["message"], sender_side
    assert outcome["second_receiver"] is True
    assert shm_entries() <= before, "a segment was left in /dev/shm"
