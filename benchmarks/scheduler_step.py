"""CPU cost of one scheduler step at N running sequences: schedule + input preparation, no model.

    python -m benchmarks.scheduler_step [--num-seqs 256] [--context 512] [--steps 2000]

Builds N running requests mid-decode (contexts spread up to --context tokens,
block size 16), then times, per step, `Scheduler.schedule()` plus the input
preparation (token ids, positions, slot mapping, block tables, attention layout)
of each path, one step each in turn:

  eager       `prepare_forward_batch()`, the flattened batch of an eager step
  static      `StaticDecode.prepare()`, a CUDA graph's padded persistent inputs
              (here on CPU tensors: the host's work is the same)

and, reported separately, `complete_step()` (advance + resolve) with a fake
sampled token. Target: schedule + preparation <= 0.3 ms at 256 sequences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.config import SchedulerConfig
from engine.kv.manager import KVCacheManager, cdiv
from engine.request import Request
from engine.runner.decode_graphs import StaticDecode, graph_batch_sizes
from engine.runner.forward_batch import prepare_forward_batch
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler.preemption import PreemptionCostModel

TARGET_MS = 0.3


def build(num_seqs: int, context: int, block_size: int, max_model_len: int) -> Scheduler:
    num_blocks = num_seqs * cdiv(max_model_len, block_size)
    kv = KVCacheManager(num_blocks, 0, block_size, cdiv(max_model_len, block_size), initial_rows=num_seqs)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs)),
        kv,
        PreemptionCostModel(bytes_per_block=1),
        max_model_len=max_model_len,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_model_len, ignore_eos=True)
    for i in range(num_seqs):
        prompt_len = 16 + (i * 7919) % max(context - 16, 1)
        scheduler.add_request(Request(f"r{i}", list(range(1, prompt_len + 1)), params))
    # Prefill everything so that every request is decoding.
    while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        step(scheduler)
    return scheduler


def static_decode(kv: KVCacheManager, num_seqs: int, max_model_len: int) -> StaticDecode:
    """The graph path's input preparation, on CPU tensors (no model runs: only `prepare` is timed)."""
    from engine.attention.triton_backend import TritonAttentionBackend

    layer = torch.empty(1, kv.block_size, 8, 128)
    return StaticDecode(None, [(layer, layer)], kv, TritonAttentionBackend("cpu"),
                        batch_sizes=graph_batch_sizes(num_seqs), max_model_len=max_model_len, num_heads=32,
                        device=torch.device("cpu"))


def step(scheduler: Scheduler) -> None:
    out = scheduler.schedule()
    sampled = [r for r, n in zip(out.requests, out.num_scheduled_tokens) if r.num_computed_tokens + n == r.num_tokens]
    scheduler.complete_step(out, sampled, [7] * len(sampled))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    scheduler = build(args.num_seqs, args.context, args.block_size, max_model_len=args.context + args.steps + 64)
    kv = scheduler.kv
    static = static_decode(kv, args.num_seqs, scheduler.max_model_len)
    prepares = {"eager": lambda out: prepare_forward_batch(out, kv), "static": lambda out: static.prepare(out)[0]}
    timings: dict[str, list[float]] = {name: [] for name in prepares}
    update = []
    for index in range(args.steps):
        name = "eager" if index % 2 == 0 else "static"
        t0 = time.perf_counter()
        out = scheduler.schedule()
        batch = prepares[name](out)
        t1 = time.perf_counter()
        sampled = batch.sample_requests
        scheduler.complete_step(out, sampled, [7] * len(sampled))
        t2 = time.perf_counter()
        assert len(out.requests) == args.num_seqs and len(sampled) == args.num_seqs
        timings[name].append((t1 - t0) * 1e3)
        update.append((t2 - t1) * 1e3)
    scheduler.check_integrity()

    def summary(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"median_ms": statistics.median(xs), "p90_ms": xs[int(0.9 * len(xs))], "min_ms": xs[0]}

    result = {
        "num_seqs": args.num_seqs,
        "schedule_plus_prepare": {name: summary(values) for name, values in timings.items()},
        "complete_step": summary(update),
        "target_ms": TARGET_MS,
    }
    print(f"running sequences: {args.num_seqs}, steps timed: {args.steps} (alternating the two preparations)")
    for name, sp in result["schedule_plus_prepare"].items():
        print(f"schedule + {name:<6} input prep: median {sp['median_ms']:.3f} ms, p90 {sp['p90_ms']:.3f} ms, "
              f"min {sp['min_ms']:.3f} ms: {'PASS' if sp['median_ms'] <= TARGET_MS else 'FAIL'} (<= {TARGET_MS} ms)")
    up = result["complete_step"]
    print(f"complete_step:          median {up['median_ms']:.3f} ms, p90 {up['p90_ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
