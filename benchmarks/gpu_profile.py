"""Where a decode step's device time goes: torch.profiler over steady decode steps of
benchmarks/gpu.py's decode engine, kernels summed by name, per step.

    python -m benchmarks.gpu_profile --batches 1 64 --context 512 --out DIR

Each batch is profiled eagerly (every kernel launched on its own, so each is timed on
its own) and with CUDA graphs + overlap (what serving runs; the profiler sees the
kernels a graph replays where CUPTI traces them). Prints a table per (batch, mode) and
writes them, with the total device time per step, to DIR/profile.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.gpu_bandwidth import decoding, synchronize
from benchmarks.gpu_latency import set_mode


def profile_steps(llm, mode: str, batch: int, context: int, num_steps: int, static_decode, top: int) -> dict:
    """Kernel time per step at (batch, context) in `mode`, the `top` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    cuda = engine.device.type == "cuda"
    set_mode(llm, mode, static_decode)
    with decoding(engine, batch, context, num_steps + 16, 4):
        synchronize(engine.device)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(num_steps):
                engine.step()
            synchronize(engine.device)
    set_mode(llm, "graphs+overlap", static_decode)
    kernels = []
    for event in prof.key_averages():
        # On CPU, the ops' own host time stands in for kernel time (the smoke run).
        device_us = getattr(event, "self_device_time_total", 0) if cuda else event.self_cpu_time_total
        if device_us > 0:
            kernels.append({"name": event.key[:110], "calls_per_step": event.count / num_steps,
                            "us_per_step": device_us / num_steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    total = sum(k["us_per_step"] for k in kernels)
    return {"mode": mode, "batch": batch, "context": context, "device_us_per_step": total,
            "num_kernels_per_step": sum(k["calls_per_step"] for k in kernels), "top": kernels[:top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--modes", nargs="+", default=["eager", "graphs+overlap"])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (the smoke run)")
    parser.add_argument("--out", default="benchmarks/results/gpu-profile")
    args = parser.parse_args()
    from engine import LLM

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    llm = LLM(args.model, device=args.device, dtype=dtype, max_model_len=args.context + 512,
              max_num_seqs=max(args.batches), gpu_memory_utilization=0.85, seed=0)
    static_decode = llm.engine.runner.static_decode
    results = []
    for batch in args.batches:
        for mode in args.modes:
            result = profile_steps(llm, mode, batch, args.context, args.steps, static_decode, args.top)
            results.append(result)
            print(f"== batch {batch}, {mode}: {result['device_us_per_step'] / 1e3:.3f} ms of kernels a step, "
                  f"{result['num_kernels_per_step']:.0f} kernels", flush=True)
            for kernel in result["top"]:
                print(f"  {kernel['us_per_step']:9.1f} us  x{kernel['calls_per_step']:6.1f}  {kernel['name']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
