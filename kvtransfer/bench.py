"""KV block transfer vs one raw send/recv of the same bytes, between the same two processes.

    python -m kvtransfer.bench --blocks 64
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from engine.kv_cache import KVCache, KVLayout

# SmolLM2-135M's cache block.
SMOLLM2_LAYOUT = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")


def _worker(rank: int, conn, layout: dict, num_blocks: int, repeats: int) -> None:
    from kvtransfer.channel import KvChannel

    torch.set_num_threads(1)
    dtype = getattr(torch, layout["dtype"])
    kv_layout = KVLayout(layout["num_layers"], layout["block_size"], layout["num_kv_heads"], layout["head_dim"], dtype)
    pool = 2 * num_blocks + 7
    cache = KVCache(kv_layout, pool, 0)
    for keys, values in cache.layers:
        keys.normal_()
        values.normal_()
    # Scattered ids: every other block, reversed on one side.
    block_ids = list(range(0, 2 * num_blocks, 2))
    if rank == 1:
        block_ids.reverse()
        store = KvChannel.host_store()
        conn.send(store.port)
        channel = KvChannel.connect(channel_id="bench", host="127.0.0.1", port=store.port, rank=1,
                                    device="cpu", timeout_s=60, store=store)
    else:
        port = conn.recv()
        channel = KvChannel.connect(channel_id="bench", host="127.0.0.1", port=port, rank=0,
                                    device="cpu", timeout_s=60)
    num_bytes = num_blocks * kv_layout.bytes_per_block
    raw = torch.randn(num_bytes // dtype.itemsize if hasattr(dtype, "itemsize") else num_bytes // 4, dtype=dtype)
    block_times, raw_times = [], []
    tag = 0
    for _ in range(repeats + 1):  # the first round warms both paths up
        for kind in ("block", "raw"):
            tag += 1
            sync = torch.zeros(1)
            channel.raw_send(sync, 10_000 + tag) if rank == 0 else channel.raw_recv(sync, 10_000 + tag)
            started = time.perf_counter()
            if kind == "block":
                if rank == 0:
                    channel.send_blocks(cache, block_ids, tag)
                else:
                    channel.recv_blocks(cache, block_ids, tag)
            else:
                channel.raw_send(raw, 20_000 + tag) if rank == 0 else channel.raw_recv(raw, 20_000 + tag)
            (block_times if kind == "block" else raw_times).append(time.perf_counter() - started)
    if rank == 1:
        conn.send({"block": block_times[1:], "raw": raw_times[1:], "num_bytes": num_bytes})
    channel.close()


def measure(
    num_blocks_to_send: int = 64,
    repeats: int = 9,
    layout: dict | None = None,
) -> dict:
    """Median seconds and GB/s of the block transfer and of a raw send/recv, and their ratio."""
    layout = layout or SMOLLM2_LAYOUT
    ctx = mp.get_context("spawn")
    parent0, child0 = ctx.Pipe()
    parent1, child1 = ctx.Pipe()
    procs = [
        ctx.Process(target=_worker, args=(0, child0, layout, num_blocks_to_send, repeats)),
        ctx.Process(target=_worker, args=(1, child1, layout, num_blocks_to_send, repeats)),
    ]
    for proc in procs:
        proc.start()
    parent0.send(parent1.recv())  # the store port, receiver to sender
    result = parent1.recv()
    for proc in procs:
        proc.join(timeout=60)
    block_s = statistics.median(result["block"])
    raw_s = statistics.median(result["raw"])
    num_bytes = result["num_bytes"]
    return {
        "num_blocks": num_blocks_to_send,
        "num_bytes": num_bytes,
        "repeats": repeats,
        "block_seconds": block_s,
        "raw_seconds": raw_s,
        "block_gbps": num_bytes / block_s / 1e9,
        "raw_gbps": num_bytes / raw_s / 1e9,
        "ratio": raw_s / block_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    for blocks in args.blocks:
        r = measure(blocks, args.repeats)
        print(f"{blocks} blocks ({r['num_bytes'] / 1e6:.1f} MB): block {r['block_gbps']:.2f} GB/s, "
              f"raw {r['raw_gbps']:.2f} GB/s, ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
