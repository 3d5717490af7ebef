"""kvtransfer: layout check, checksums, leases, and block transfers between two real processes."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from engine.kv_cache import KVCache, KVLayout
from kvtransfer import KvLayoutMismatchError, KvLayoutSpec, KvLeaseTable, block_checksums

LAYOUT = dict(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)


def make_cache(dtype=torch.float32, num_blocks=40, fill: float | None = None, seed: int = 0) -> KVCache:
    cache = KVCache(KVLayout(**LAYOUT, dtype=dtype), num_blocks, 0)
    generator = torch.Generator().manual_seed(seed)
    for keys, values in cache.layers:
        for half in (keys, values):
            if fill is None:
                half.copy_(torch.randn(half.shape, generator=generator, dtype=torch.float64).to(dtype))
            else:
                half.fill_(fill)
    return cache


def test_layout_mismatch_names_every_field():
    a = KvLayoutSpec(30, 16, 3, 64, "float32")
    a.check_matches(KvLayoutSpec(30, 16, 3, 64, "float32"))
    with pytest.raises(KvLayoutMismatchError) as error:
        a.check_matches(KvLayoutSpec(30, 16, 3, 32, "bfloat16"))
    assert "head_dim 64 != 32" in str(error.value) and "dtype float32 != bfloat16" in str(error.value)
    assert a.bytes_per_block == KVLayout(30, 16, 3, 64, torch.float32).bytes_per_block


def test_checksums_detect_flipped_bits_and_swapped_blocks():
    cache = make_cache()
    ids = [3, 7, 11]
    reference = block_checksums(cache, ids)
    assert reference == block_checksums(make_cache(), ids)  # deterministic
    assert len(set(reference)) == 3
    for layer in range(LAYOUT["num_layers"]):
        for half in (0, 1):
            tensor = cache.layers[layer][half]
            bits = tensor.view(torch.int32)
            bits[7, 2, 1, 5] ^= 1 << 13
            assert block_checksums(cache, ids)[1] != reference[1]
            bits[7, 2, 1, 5] ^= 1 << 13
    assert block_checksums(cache, ids) == reference
    assert block_checksums(cache, [7, 3, 11]) == [reference[1], reference[0], reference[2]]
    # Two positions swapped inside a block.
    keys = cache.layers[0][0]
    keys[3, [0, 1]] = keys[3, [1, 0]]
    assert block_checksums(cache, ids)[0] != reference[0]


def test_lease_table_semantics():
    leases = KvLeaseTable()
    leases.hold("a", [1, 2], 8, lease_s=0.05)
    leases.hold("b", [3], 4, lease_s=10)
    assert len(leases) == 2 and leases.num_blocks_held == 3
    with pytest.raises(ValueError):
        leases.hold("a", [9], 1, 1)
    lease = leases.begin_send("b")
    assert lease.block_ids == [3]
    with pytest.raises(ValueError):
        leases.begin_send("b")
    assert leases.release("b") is False  # sending: freed when the send ends
    time.sleep(0.06)
    assert leases.expired(time.monotonic()) == ["a"]  # "b" is sending: not expired
    leases.end_send("b")
    assert len(leases) == 0 and "b" not in leases
    with pytest.raises(KeyError):
        leases.begin_send("b")
    leases.hold("c", [5], 2, 10)
    assert leases.release("c") is True and leases.release("c") is False


def _peer(rank: int, conn, dtype_name: str, plan: list[tuple[list[int], list[int]]], never_send: bool) -> None:
    from kvtransfer import KvChannel, KvTransferError

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    try:
        if rank == 1:
            store = KvChannel.host_store()
            conn.send(store.port)
            channel = KvChannel.connect(channel_id="t", host="127.0.0.1", port=store.port, rank=1,
                                        device="cpu", timeout_s=2 if never_send else 30, store=store)
        else:
            channel = KvChannel.connect(channel_id="t", host="127.0.0.1", port=conn.recv(), rank=0,
                                        device="cpu", timeout_s=30)
        results = []
        for tag, (src_ids, dst_ids) in enumerate(plan, start=1):
            if rank == 0:
                cache = make_cache(dtype, seed=tag)
                if not never_send:
                    channel.send_blocks(cache, src_ids, tag)
                results.append(block_checksums(cache, src_ids))
            else:
                cache = make_cache(dtype, fill=-7.0)
                try:
                    stats = channel.recv_blocks(cache, dst_ids, tag)
                except KvTransferError as error:
                    results.append(("error", str(error), channel.is_broken))
                    continue
                expected = make_cache(dtype, seed=tag)
                exact = all(
                    torch.equal(mine[dst_ids], theirs[src_ids])
                    for (mk, mv), (tk, tv) in zip(cache.layers, expected.layers)
                    for mine, theirs in ((mk, tk), (mv, tv))
                )
                others = [b for b in range(cache.num_blocks) if b not in dst_ids]
                untouched = all(bool((half[others] == -7.0).all()) for layer in cache.layers for half in layer)
                results.append((exact, untouched, block_checksums(cache, dst_ids), stats.num_bytes))
        if never_send and rank == 0:
            time.sleep(4)  # stay alive while the receiver times out
        conn.send(results)
        channel.close()
    except BaseException as error:  # report, never hang the parent
        conn.send(("crash", repr(error)))
        raise


def run_pair(dtype_name: str, plan, never_send: bool = False):
    ctx = mp.get_context("spawn")
    ends = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_peer, args=(rank, ends[rank][1], dtype_name, plan, never_send)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        assert ends[1][0].poll(60), "receiver did not start"
        ends[0][0].send(ends[1][0].recv())
        results = []
        for rank in (0, 1):
            assert ends[rank][0].poll(120), f"rank {rank} hung"
            results.append(ends[rank][0].recv())
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    for result in results:
        assert not (isinstance(result, tuple) and result[0] == "crash"), result
    return results


@pytest.mark.timeout(180)
def test_blocks_arrive_bitwise_in_scattered_blocks():
    plan = [
        ([17, 3, 29, 4, 11], [8, 31, 0, 22, 5]),
        (list(range(39, 0, -2)), list(range(0, 40, 2))),  # 20 blocks, reversed and interleaved
    ]
    sent, received = run_pair("float32", plan)
    for (exact, untouched, checksums, num_bytes), sender_checksums, (src, _) in zip(received, sent, plan):
        assert exact and untouched
        assert checksums == sender_checksums
        assert num_bytes == len(src) * KVLayout(**LAYOUT, dtype=torch.float32).bytes_per_block


@pytest.mark.timeout(180)
def test_bfloat16_blocks_arrive_bitwise():
    sent, received = run_pair("bfloat16", [([1, 2, 3, 9], [30, 4, 5, 6])])
    exact, untouched, checksums, _ = received[0]
    assert exact and untouched and checksums == sent[0]


@pytest.mark.timeout(180)
def test_receive_times_out_and_breaks_the_channel():
    _, received = run_pair("float32", [([1, 2], [3, 4])], never_send=True)
    kind, message, broken = received[0]
    assert kind == "error" and broken
    assert "timed out" in message or "imeout" in message
