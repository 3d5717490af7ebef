"""Decode latency for benchmarks/gpu.py: steady-state decode steps with CUDA graphs and
overlapped scheduling each on and off, the host's time per step, and the GPU's idle
time between steps.

One engine serves every mode: graphs off is its runner without a static decode
path (every step eager), overlap off its engine stepping plainly. Per mode and
batch size, `measure_steady_decode` prefills the batch, then times consecutive
`engine.step()` calls with no synchronization between them (as a serving loop runs):

    ms per step     wall time of the timed steps / their number
    host ms / step  time in engine.step() not spent waiting for the device
    GPU idle        on CUDA, from the events each step records before its first and
                    after its last launch: the gaps between one step's end and the
                    next one's start, over the span of the timed steps
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from time import perf_counter

import torch

from benchmarks.gpu_bandwidth import decode_weight_bytes, decoding, synchronize

MODES = {  # name: (CUDA graphs, overlapped scheduling)
    "graphs+overlap": (True, True),
    "graphs": (True, False),
    "overlap": (False, True),
    "eager": (False, False),
}


@dataclass(frozen=True)
class LatencyPoint:
    mode: str
    batch_size: int
    context_len: int
    num_steps: int
    ms_per_step: float
    host_ms_per_step: float  # median host time of a step, waits on the device excluded
    gpu_idle_fraction: float | None  # None on CPU
    weight_bytes: int

    @property
    def ms_per_token(self) -> float:
        return self.ms_per_step / self.batch_size


def set_mode(llm, mode: str, static_decode) -> None:
    """Switch the engine's graphs and overlap (nothing may be in flight)."""
    graphs, overlap = MODES[mode]
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.runner.static_decode = static_decode if graphs else None
    engine.overlap.enabled = overlap


def measure_steady_decode(llm, mode: str, batch_size: int, context_len: int, num_steps: int,
                          warmup_steps: int, seed: int = 0, quantization=None) -> LatencyPoint:
    """`num_steps` steady decode steps of `batch_size` sequences in `mode`; `quantization`:
    the model's FP8 layout on this device, for the weight bytes (gpu_bandwidth.decode_weight_bytes)."""
    engine = llm.engine
    runner = engine.runner
    launched = []
    launch = runner.launch

    def recording_launch(*args, **kwargs):
        step = launch(*args, **kwargs)
        launched.append(step)
        return step

    step_seconds = []
    with decoding(engine, batch_size, context_len, warmup_steps + num_steps + 8, warmup_steps, seed):
        runner.launch = recording_launch
        try:
            synchronize(engine.device)
            started = perf_counter()
            for _ in range(num_steps):
                step_start = perf_counter()
                out = engine.step()
                step_seconds.append(perf_counter() - step_start)
                if len(out.outputs) != batch_size:
                    raise RuntimeError(f"{mode}, batch {batch_size}: a step reported {len(out.outputs)} sequences")
            synchronize(engine.device)
            wall = perf_counter() - started
        finally:
            runner.launch = launch
    waits = [step.result().wait_seconds for step in launched]
    # Step i reports the tokens of the step launched at i (plain) or i - 1 (overlapped):
    # the host time of a call is its wall time less the wait inside it, whichever step it waited for.
    offset = 1 if MODES[mode][1] else 0
    host = [s - (waits[i - offset] if 0 <= i - offset < len(waits) else 0.0) for i, s in enumerate(step_seconds)]
    host_seconds = host[offset:] if offset else host
    return LatencyPoint(
        mode=mode,
        batch_size=batch_size,
        context_len=context_len,
        num_steps=num_steps,
        ms_per_step=wall / num_steps * 1e3,
        host_ms_per_step=statistics.median(host_seconds) * 1e3,
        gpu_idle_fraction=_idle_fraction(launched),
        weight_bytes=decode_weight_bytes(runner.model.arch, engine.kv_layout.dtype, quantization, batch_size),
    )


def _idle_fraction(steps) -> float | None:
    """The device's idle share between consecutive steps, from their CUDA events."""
    events = [step.events for step in steps if step.events is not None]
    if len(events) < 2:
        return None
    torch.cuda.synchronize()
    span = events[0][0].elapsed_time(events[-1][1])
    gaps = sum(max(0.0, end.elapsed_time(next_start)) for (_, end), (next_start, _) in zip(events, events[1:]))
    return gaps / span if span > 0 else None


def section_latency(run) -> dict:
    """benchmarks/gpu.py's `latency` section: every mode at each of the sizes' latency batches."""
    from benchmarks.gpu_targets import Target

    sizes = run.sizes
    copy_gb_per_s = run.copy_bandwidth()
    llm = run.decode_llm()
    static_decode = llm.engine.runner.static_decode
    capture = llm.engine.graph_capture
    modes = [mode for mode, (graphs, _) in MODES.items() if static_decode is not None or not graphs]
    print(f"steady decode at context {sizes.latency_context}, modes {', '.join(modes)}"
          + (f"; {len(capture.graph_keys)} graphs ({len(capture.batch_sizes)} batch sizes) captured in "
             f"{capture.seconds:.1f} s, "
             f"{capture.memory_bytes / 2**20:.0f} MiB" if capture is not None else ""), flush=True)
    points: dict[tuple[str, int], LatencyPoint] = {}
    try:
        for mode in modes:
            set_mode(llm, mode, static_decode)
            for batch in sizes.latency_batches:
                point = measure_steady_decode(llm, mode, batch, sizes.latency_context, sizes.decode_steps,
                                              sizes.decode_warmup_steps, run.args.seed)
                idle = "" if point.gpu_idle_fraction is None else f", GPU idle {point.gpu_idle_fraction:.1%}"
                print(f"  {mode:<15} batch {batch:>4}: {point.ms_per_step:8.2f} ms/step, "
                      f"host {point.host_ms_per_step:.3f} ms/step{idle}", flush=True)
                points[mode, batch] = point
    finally:
        set_mode(llm, "graphs+overlap", static_decode)
    smallest, largest = sizes.latency_batches[0], sizes.latency_batches[-1]
    best = "graphs+overlap" if static_decode is not None else "overlap"
    floor_ms = points[best, smallest].weight_bytes / (copy_gb_per_s * 1e9) * 1e3
    graphs_ratio = None
    if ("graphs+overlap", smallest) in points:
        graphs_ratio = points["overlap", smallest].ms_per_step / points["graphs+overlap", smallest].ms_per_step
    idle = points[best, largest].gpu_idle_fraction
    targets = [
        Target("decode-batch1-vs-hbm-floor", f"batch {smallest} decode: (weight bytes / copy bandwidth) / "
               "time per token", floor_ms / points[best, smallest].ms_per_token, 0.8),
        Target("graphs-vs-eager", f"batch {smallest} decode: eager / CUDA graphs time per step", graphs_ratio, 1.5),
        Target("gpu-busy-between-steps", f"batch {largest} steady decode: 1 - GPU idle share between steps",
               None if idle is None else 1.0 - idle, 0.9),
    ]
    for target in targets:
        print(target.line(), flush=True)
    return {
        "context_len": sizes.latency_context,
        "copy_gb_per_s": copy_gb_per_s,
        "hbm_floor_ms_per_token": floor_ms,
        "graph_capture": None if capture is None else {
            "batch_sizes": list(capture.batch_sizes), "num_graphs": len(capture.graph_keys),
            "seconds": capture.seconds, "memory_bytes": capture.memory_bytes,
            # what sizing the KV cache kept for the graphs (engine/runner/memory.py); None: a sized cache
            "reserve_bytes": llm.engine.graph_reserve_bytes},
        "points": [{**point.__dict__, "ms_per_token": point.ms_per_token} for point in points.values()],
        "targets": [target.to_json() for target in targets],
    }
