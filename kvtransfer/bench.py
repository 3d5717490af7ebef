"""KV block transfer vs one raw send/recv of the same bytes, between the same two processes.

    python -m kvtransfer.bench --blocks 64 512

Both measurements run alternately on one channel, timed on the receiver from a
start signal until the bytes are in place. By default the block ids are scattered and
unordered on both sides, the worst case (one message per block); `--ids contiguous`
gives both sides one run of ids (messages of up to message_bytes).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from kvtransfer.wire import TAG_BITS

SECRET = bytes(range(32))  # both ranks are the bench's own

# SmolLM2-135M's KV block: 30 layers, 3 KV heads of 64, blocks of 16 tokens, float32
# (737,280 bytes per block: 64 blocks are 47 MB, 512 blocks 377 MB).
SMOLLM2 = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")

_START_TAG = 1 << (TAG_BITS - 1)  # raw start signals; transfer tags count up from 1, far below


def measure(
    num_layers: int = SMOLLM2["num_layers"],
    block_size: int = SMOLLM2["block_size"],
    num_kv_heads: int = SMOLLM2["num_kv_heads"],
    head_dim: int = SMOLLM2["head_dim"],
    dtype: str = SMOLLM2["dtype"],
    num_blocks_to_send: int = 64,
    repeats: int = 9,
    *,
    message_bytes: int | None = None,
    ids: str = "scattered",
    timeout_s: float = 60.0,
) -> dict:
    """Median seconds and GB/s of the block transfer and of a raw send/recv of the same
    bytes, and ratio = raw seconds / block seconds (above 1.0: faster than one raw message)."""
    layout = dict(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, dtype=dtype)
    if ids not in ("scattered", "contiguous"):
        raise ValueError(f"ids must be 'scattered' or 'contiguous', got {ids!r}")
    tuning = {"message_bytes": message_bytes} if message_bytes is not None else {}
    ctx = mp.get_context("spawn")
    (to_sender, sender_end), (to_receiver, receiver_end) = ctx.Pipe(), ctx.Pipe()
    args = (layout, num_blocks_to_send, repeats, tuning, ids, timeout_s)
    processes = [
        ctx.Process(target=_run, args=(0, sender_end, *args), daemon=True),
        ctx.Process(target=_run, args=(1, receiver_end, *args), daemon=True),
    ]
    for process in processes:
        process.start()
    try:
        deadline = time.monotonic() + timeout_s * (2 * repeats + 4)
        to_sender.send(_receive(to_receiver, processes, deadline))  # the store port, receiver to sender
        result = _receive(to_receiver, processes, deadline)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if "error" in result:
        raise RuntimeError(f"benchmark receiver failed: {result['error']}")
    block_s = statistics.median(result["block"])
    raw_s = statistics.median(result["raw"])
    num_bytes = result["num_bytes"]
    return {
        "num_blocks": num_blocks_to_send,
        "num_bytes": num_bytes,
        "repeats": repeats,
        "num_messages": result["num_messages"],
        "block_seconds": block_s,
        "raw_seconds": raw_s,
        "block_gbps": num_bytes / block_s / 1e9,
        "raw_gbps": num_bytes / raw_s / 1e9,
        "ratio": raw_s / block_s,
    }


def _receive(conn, processes: list, deadline: float):
    """The receiver's next message; RuntimeError once a side died or the deadline passed."""
    while not conn.poll(0.2):
        dead = [p.name for p in processes if p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"benchmark processes {dead or 'timed out'}; see their output above")
    return conn.recv()


def _run(
    rank: int, conn, layout: dict, num_blocks: int, repeats: int, tuning: dict, ids: str, timeout_s: float
) -> None:
    """One side: build a cache, join the channel, alternate block and raw transfers."""
    from engine.envs import configure_process
    from engine.kv_cache import KVCache, KVLayout
    from kvtransfer.channel import KvChannel
    from kvtransfer.wire import plan_messages
    from kvtransfer.layout import KvLayoutSpec

    configure_process(1)  # two processes on a small machine: leave cores to the transport
    try:
        spec = KvLayoutSpec(**layout)
        kv_layout = KVLayout(spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim,
                             spec.torch_dtype)
        pool = 2 * num_blocks + 8
        cache = KVCache(kv_layout, pool, 0)
        cache.blocks.view(torch.uint8).random_()
        if ids == "contiguous":
            src_ids, dst_ids = list(range(3, 3 + num_blocks)), list(range(5, 5 + num_blocks))
        else:  # both sides draw both lists from the same seeds
            src_ids, dst_ids = (torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:num_blocks]
                                .tolist() for seed in (1234, 1235))
        if rank == 1:
            store = KvChannel.host_store()
            conn.send(store.port)
            channel = KvChannel.connect(channel_id="bench", host="127.0.0.1", port=store.port, rank=1,
                                        secret=SECRET, device="cpu", timeout_s=timeout_s, store=store, **tuning)
        else:
            channel = KvChannel.connect(channel_id="bench", host="127.0.0.1", port=conn.recv(), rank=0,
                                        secret=SECRET, device="cpu", timeout_s=timeout_s, **tuning)
        num_bytes = num_blocks * spec.bytes_per_block
        raw = torch.empty(num_bytes, dtype=torch.uint8)
        raw.random_()
        signal = torch.zeros(1)
        times: dict[str, list[float]] = {"block": [], "raw": []}
        tag = 0
        for _ in range(repeats + 1):  # the first round warms both paths up
            for kind in ("block", "raw"):
                tag += 1
                # The receiver says "go", then times until its bytes are in place.
                if rank == 1:
                    channel.raw_send(signal, _START_TAG + tag)
                    started = time.perf_counter()
                    if kind == "block":
                        channel.recv_blocks(cache, dst_ids, tag, src_ids)
                    else:
                        channel.raw_recv(raw, tag)
                    times[kind].append(time.perf_counter() - started)
                else:
                    channel.raw_recv(signal, _START_TAG + tag)
                    if kind == "block":
                        channel.send_blocks(cache, src_ids, tag, dst_ids)
                    else:
                        channel.raw_send(raw, tag)
        if rank == 1:
            conn.send({
                "block": times["block"][1:],
                "raw": times["raw"][1:],
                "num_bytes": num_bytes,
                "num_messages": plan_messages(src_ids, dst_ids, spec.bytes_per_block, channel.message_bytes).num_messages,
            })
        channel.close()
    except Exception as error:  # report to the parent instead of leaving it waiting
        if rank == 1:
            conn.send({"error": f"{type(error).__name__}: {error}"})
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--message-mb", type=float, default=None, help="target message size")
    parser.add_argument("--ids", choices=["scattered", "contiguous"], default="scattered",
                        help="block ids on both sides: scattered (one message per block) or one run")
    args = parser.parse_args()
    message_bytes = int(args.message_mb * (1 << 20)) if args.message_mb else None
    for blocks in args.blocks:
        r = measure(num_blocks_to_send=blocks, repeats=args.repeats, message_bytes=message_bytes,
                    ids=args.ids)
        print(f"{blocks} {args.ids} blocks ({r['num_bytes'] / 1e6:.1f} MB, {r['num_messages']} messages): "
              f"block {r['block_gbps']:.2f} GB/s ({r['block_seconds'] * 1e3:.1f} ms), "
              f"raw {r['raw_gbps']:.2f} GB/s ({r['raw_seconds'] * 1e3:.1f} ms), ratio {r['ratio']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
