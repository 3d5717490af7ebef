"""The same KV blocks moved four ways between the same two processes, side by side:

    ipc       IpcChannel: the sender copies into the receiver's cache (a memfd segment
              on CPU; through a CUDA IPC handle on a GPU)
    gloo      KvChannel over Gloo (loopback TCP; CPU only)
    raw gloo  one plain Gloo send/recv of the same number of bytes (CPU only)
    copy      one contiguous in-process copy of the same number of bytes (the floor;
              on a GPU a device-to-device copy)

    python -m kvtransfer.bench --blocks 64 512 [--device cuda:0]

The kinds run in turn, `repeats` rounds each after a warm-up round, on one pair of
processes with one thread each. The receiver times each: from the start signal it
sends until the bytes are in place (copy: the copy alone, in the receiver). By
default the block ids are scattered and unordered on both sides (one message or copy
per block); `--ids contiguous` gives both sides one run. At the end both sides
checksum the blocks and the receiver compares (`verified`).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

SECRET = bytes(range(32))  # both ranks are the bench's own
KINDS = ("ipc", "gloo", "raw_gloo", "copy")
CUDA_KINDS = ("ipc", "copy")  # NCCL refuses two ranks on one GPU, and Gloo moves CPU tensors

# SmolLM2-135M's KV block: 30 layers, 3 KV heads of 64, blocks of 16 tokens, float32
# (737,280 bytes per block: 64 blocks are 47 MB, 512 blocks 377 MB).
SMOLLM2 = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")



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
    device: str = "cpu",
) -> dict:
    """Median seconds and GB/s of each kind, and the ratios: `ratio` = raw gloo / gloo
    seconds (Gloo's block transfer against one raw message), `ipc_vs_gloo` = gloo / ipc
    seconds, `ipc_vs_copy` = copy / ipc seconds (1.0: ipc costs a plain copy). On CUDA
    (both processes on `device`) only ipc and copy run."""
    layout = dict(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, dtype=dtype)
    if ids not in ("scattered", "contiguous"):
        raise ValueError(f"ids must be 'scattered' or 'contiguous', got {ids!r}")
    tuning = {"message_bytes": message_bytes} if message_bytes is not None else {}
    ctx = mp.get_context("spawn")
    (to_sender, sender_end), (to_receiver, receiver_end) = ctx.Pipe(), ctx.Pipe()
    start_signal = ctx.Pipe()  # receiver -> sender: "go"
    args = (layout, num_blocks_to_send, repeats, tuning, ids, timeout_s, device, start_signal)
    processes = [
        ctx.Process(target=_run, args=(0, sender_end, *args), daemon=True),
        ctx.Process(target=_run, args=(1, receiver_end, *args), daemon=True),
    ]
    for process in processes:
        process.start()
    try:
        deadline = time.monotonic() + timeout_s * (4 * repeats + 8)
        to_sender.send(_receive(to_receiver, processes, deadline))  # where to join, receiver to sender
        result = _receive(to_receiver, processes, deadline)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if "error" in result:
        raise RuntimeError(f"benchmark receiver failed: {result['error']}")
    seconds = {kind: statistics.median(result[kind]) for kind in result["kinds"]}
    num_bytes = result["num_bytes"]
    report = {
        "device": device,
        "num_blocks": num_blocks_to_send,
        "num_bytes": num_bytes,
        "repeats": repeats,
        "ids": ids,
        "num_messages": result["num_messages"],
        "verified": result["verified"],
        "seconds": seconds,
        "gbps": {kind: num_bytes / s / 1e9 for kind, s in seconds.items()},
        "ipc_vs_copy": seconds["copy"] / seconds["ipc"],
    }
    if "gloo" in seconds:
        report.update(
            ratio=seconds["raw_gloo"] / seconds["gloo"],
            ipc_vs_gloo=seconds["gloo"] / seconds["ipc"],
            # Under the names the serving benchmark's report reads.
            block_gbps=num_bytes / seconds["gloo"] / 1e9,
            raw_gbps=num_bytes / seconds["raw_gloo"] / 1e9,
        )
    return report


def _receive(conn, processes: list, deadline: float):
    """The receiver's next message; RuntimeError once a side died or the deadline passed."""
    while not conn.poll(0.2):
        dead = [p.name for p in processes if p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"benchmark processes {dead or 'timed out'}; see their output above")
    return conn.recv()


def _run(rank: int, conn, layout: dict, num_blocks: int, repeats: int, tuning: dict, ids: str, timeout_s: float,
         device: str, start_signal) -> None:
    """One side: build a cache, open the channels, run every kind in turn."""
    from engine.envs import configure_process
    from engine.kv.cache import KVCache, KVLayout
    from kvtransfer.channel import KvChannel
    from kvtransfer.checksum import block_checksums
    from kvtransfer.connect import join, listen
    from kvtransfer.layout import KvLayoutSpec
    from kvtransfer.wire import plan_messages

    configure_process(1)  # two processes on a small machine: leave cores to the transport
    cuda = torch.device(device).type == "cuda"
    kinds = CUDA_KINDS if cuda else KINDS
    if cuda:
        torch.cuda.set_device(torch.device(device).index or 0)
    go = start_signal[0] if rank == 1 else start_signal[1]
    try:
        spec = KvLayoutSpec(**layout)
        kv_layout = KVLayout(spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim,
                             spec.torch_dtype)
        pool = 2 * num_blocks + 8
        cache = KVCache(kv_layout, pool, 0, device, shareable=rank == 1)  # the receiver's, for ipc
        cache.blocks.view(torch.uint8).random_()
        if ids == "contiguous":
            src_ids, dst_ids = list(range(3, 3 + num_blocks)), list(range(5, 5 + num_blocks))
        else:  # both sides draw both lists from the same seeds
            src_ids, dst_ids = (torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:num_blocks]
                                .tolist() for seed in (1234, 1235))
        gloo = None
        if rank == 1:
            store = None if cuda else KvChannel.host_store()
            offer = listen("bench-ipc", "ipc", "", cache, timeout_s)
            conn.send((None if store is None else store.port, offer.rendezvous))
            if store is not None:
                gloo = KvChannel.connect(channel_id="bench", host="127.0.0.1", port=store.port, rank=1,
                                         secret=SECRET, device="cpu", timeout_s=timeout_s, store=store, **tuning)
            ipc = offer.accept()
        else:
            port, rendezvous = conn.recv()
            if port is not None:
                gloo = KvChannel.connect(channel_id="bench", host="127.0.0.1", port=port, rank=0,
                                         secret=SECRET, device="cpu", timeout_s=timeout_s, **tuning)
            ipc = join(rendezvous, cache)
        num_bytes = num_blocks * spec.bytes_per_block
        raw = torch.empty(num_bytes if gloo is not None else 1, dtype=torch.uint8)  # raw Gloo's (CPU)
        copy_from, copy_to = (torch.empty(num_bytes, dtype=torch.uint8, device=device) for _ in range(2))
        raw.random_()
        copy_from.random_()
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        tag = 0
        for _ in range(repeats + 1):  # the first round warms every path up
            for kind in kinds:
                tag += 1
                if kind == "copy":
                    if rank == 1:
                        _sync(cuda)
                        started = time.perf_counter()
                        copy_to.copy_(copy_from)
                        _sync(cuda)
                        times[kind].append(time.perf_counter() - started)
                    continue
                # The receiver says "go", then times until its bytes are in place.
                if rank == 1:
                    _sync(cuda)
                    go.send(tag)
                    started = time.perf_counter()
                    if kind == "raw_gloo":
                        gloo.raw_recv(raw, tag)
                    else:
                        (ipc if kind == "ipc" else gloo).recv_blocks(cache, dst_ids, tag, src_ids)
                    times[kind].append(time.perf_counter() - started)
                else:
                    assert go.recv() == tag
                    if kind == "raw_gloo":
                        gloo.raw_send(raw, tag)
                    else:
                        (ipc if kind == "ipc" else gloo).send_blocks(cache, src_ids, tag, dst_ids)
        # Both sides checksum the blocks (on the device), the receiver compares.
        if rank == 0:
            go.send(block_checksums(cache, src_ids))
        else:
            verified = go.recv() == block_checksums(cache, dst_ids)
            message_bytes = gloo.message_bytes if gloo is not None else 1 << 62
            conn.send({
                **{kind: times[kind][1:] for kind in kinds},
                "kinds": kinds,
                "verified": verified,
                "num_bytes": num_bytes,
                "num_messages": plan_messages(src_ids, dst_ids, spec.bytes_per_block, message_bytes).num_messages,
            })
        ipc.close()
        if gloo is not None:
            gloo.close()
    except Exception as error:  # report to the parent instead of leaving it waiting
        if rank == 1:
            conn.send({"error": f"{type(error).__name__}: {error}"})
        raise


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def describe(result: dict) -> str:
    """One line per kind, then the ratios."""
    lines = [f"{result['num_blocks']} {result['ids']} blocks ({result['num_bytes'] / 1e6:.1f} MB) on "
             f"{result['device']}, median of {result['repeats']}, checksums "
             f"{'verified' if result['verified'] else 'DIFFER'}:"]
    names = {"ipc": "ipc", "gloo": "gloo", "raw_gloo": "raw gloo", "copy": "copy"}
    for kind, seconds in result["seconds"].items():
        lines.append(f"  {names[kind]:<9} {result['gbps'][kind]:7.2f} GB/s  {seconds * 1e3:8.2f} ms")
    summary = f"  ipc at {result['ipc_vs_copy']:.2f}x a plain copy's speed"
    if "ipc_vs_gloo" in result:
        summary += (f"; ipc {result['ipc_vs_gloo']:.2f}x faster than gloo; gloo blocks / raw gloo "
                    f"{result['ratio']:.2f} ({result['num_messages']} Gloo messages)")
    return "\n".join([*lines, summary])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--message-mb", type=float, default=None, help="Gloo's target message size")
    parser.add_argument("--ids", choices=["scattered", "contiguous"], default="scattered",
                        help="block ids on both sides: scattered (one message per block) or one run")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:N: both processes on that GPU (ipc, copy)")
    args = parser.parse_args()
    message_bytes = int(args.message_mb * (1 << 20)) if args.message_mb else None
    for blocks in args.blocks:
        print(describe(measure(num_blocks_to_send=blocks, repeats=args.repeats, message_bytes=message_bytes,
                               ids=args.ids, device=args.device)), flush=True)


if __name__ == "__main__":
    main()
