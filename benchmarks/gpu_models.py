"""The models beyond the dense bfloat16 Llama, for benchmarks/gpu.py's `models` section: a
mixture of experts (dummy:qwen3-30b-a3b in bfloat16) and FP8 weights (dummy:llama-3.1-8b
with quantization="fp8": per-channel weights, activations quantized per token), one
engine each, at the latency section's context and steps:

    decode    steady decode at the latency batches (1 and 64), CUDA graphs and overlap on
              as the latency section measures them: ms per step against the floor of the
              weight bytes the step reads at copy bandwidth, which counts only the experts
              the batch routes to and FP8 weights at a byte each, plus their scales
              (gpu_bandwidth.decode_weight_bytes)
    offline   output tokens/s of a small mixed workload (at most 64 requests) through the
              same engine, after a warmup (gpu_offline.time_generation)

Targets: the MoE model's batch-1 step within 2x its floor (floor / step >= 0.5), and the
FP8 model's batch-1 step at most 0.6x the same model's in bfloat16 (bf16 / FP8 >= 1 / 0.6).
The bfloat16 step is the latency section's when this run measured it on that model (as
`make gpu-check` does: its --model is dummy:llama-3.1-8b), else it is measured here on a
third engine. With --tiny (the CPU run) the models are dummy:tiny-moe and dummy:tiny.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from benchmarks.gpu_latency import measure_steady_decode, set_mode
from benchmarks.gpu_offline import release_memory, time_generation
from benchmarks.gpu_targets import Target
from benchmarks.workload import make_workload, total_output_tokens


@dataclass(frozen=True)
class ModelCase:
    """One model the section measures, on an engine of its own."""

    label: str  # its key in the section's "models"
    model: str  # a dummy:<name> model
    quantization: str | None = None  # EngineConfig.quantization

    @property
    def title(self) -> str:
        return self.model + (f" {self.quantization}" if self.quantization else "")


# The mixture of experts, and the model served in FP8, by run: --tiny (CPU), or any other.
#
# Cost at --check on an H200, an estimate that no run has measured yet: the 30B model's 61 GB
# of random weights are made on the device in a few seconds; its engine profiles a step of
# 8,192 tokens and captures 16 graphs (~10 s); the fused-MoE kernel compiles a variant per
# batch bucket and projection on first use (~8 compiles, 15-30 s; fewer where the engine
# phase's tests left them in Triton's cache); batch 1 and 64 at context 512 take ~2 s; 64
# requests offline with a 16-request warmup ~5-8 s: 35-55 s. The FP8 8B model (16 GB made in
# bfloat16, quantized per channel on the device) with its engine and graphs ~15 s, its steps
# and offline run ~8 s: ~25 s. The bfloat16 step comes from the latency section. In all
# 60-80 s, out of the figures phase's share.
CASES = {
    "tiny": (ModelCase("moe", "dummy:tiny-moe"), ModelCase("fp8", "dummy:tiny", "fp8")),
    "full": (ModelCase("moe", "dummy:qwen3-30b-a3b"), ModelCase("fp8", "dummy:llama-3.1-8b", "fp8")),
}
MAX_OFFLINE_REQUESTS = 64
MOE_FLOOR_FRACTION = 0.5  # the MoE batch-1 step within 2x its floor
FP8_STEP_RATIO = 0.6  # the FP8 batch-1 step at most this fraction of the bfloat16 one


def section_models(run) -> dict:
    """benchmarks/gpu.py's `models` section (see the module docstring)."""
    run.release_decode_llm()
    copy_gb_per_s = run.copy_bandwidth()
    moe, fp8 = CASES["tiny" if run.args.tiny else "full"]
    section = {"copy_gb_per_s": copy_gb_per_s, "context_len": run.sizes.latency_context,
               "num_steps": run.sizes.decode_steps, "models": {}, "targets": []}
    for case in (moe, fp8):
        section["models"][case.label] = measure_model(run, case, copy_gb_per_s)
        run.record("models", section)  # a section cut short keeps the models it measured
    section["fp8_baseline"] = bf16_baseline(run, fp8, copy_gb_per_s)
    moe_step = section["models"]["moe"]["points"][0]
    fp8_step = section["models"]["fp8"]["points"][0]
    targets = [
        Target("moe-batch1-vs-active-floor", f"{moe.model} batch-{moe_step['batch_size']} decode: (weight bytes "
               "of the routed experts and the rest / copy bandwidth) / time per step",
               moe_step["floor_ms"] / moe_step["ms_per_step"], MOE_FLOOR_FRACTION),
        Target("fp8-batch1-vs-bf16", f"{fp8.model} batch-{fp8_step['batch_size']} decode: unquantized (bfloat16 "
               f"on a GPU) / FP8 time per step (FP8 at most {FP8_STEP_RATIO}x)",
               section["fp8_baseline"]["ms_per_step"] / fp8_step["ms_per_step"], 1 / FP8_STEP_RATIO),
    ]
    for target in targets:
        print(target.line(), flush=True)
    section["targets"] = [target.to_json() for target in targets]
    return section


def bf16_baseline(run, case: ModelCase, copy_gb_per_s: float) -> dict:
    """The batch-1 step of `case`'s model unquantized: the latency section's, when this run
    measured it on that model (same sizes, same mode), else measured here."""
    batch = run.sizes.latency_batches[0]
    latency = run.payload["sections"].get("latency")
    if "latency" in run.sections_measured and run.args.model == case.model:
        points = {(p["mode"], p["batch_size"]): p for p in latency["points"]}
        mode = "graphs+overlap" if ("graphs+overlap", batch) in points else "overlap"
        return {"model": case.model, "source": "latency section", "mode": mode,
                "ms_per_step": points[mode, batch]["ms_per_step"]}
    measured = measure_model(run, replace(case, label="bf16", quantization=None), copy_gb_per_s,
                             batches=(batch,), offline=False)
    point = measured["points"][0]
    return {"model": case.model, "source": "measured here", "mode": point["mode"],
            "ms_per_step": point["ms_per_step"]}


def measure_model(run, case: ModelCase, copy_gb_per_s: float, batches: tuple[int, ...] | None = None,
                  offline: bool = True) -> dict:
    """`case` on one engine: its decode steps at `batches` (default the latency batches)
    against their floors, then (if `offline`) the small offline workload."""
    from engine import LLM
    from engine.dummy_models import dummy_model
    from engine.model import load_model

    started = time.perf_counter()
    args, sizes = run.args, run.sizes
    batches = batches or sizes.latency_batches
    requests = []
    if offline:
        config = replace(sizes.mixed, num_requests=min(sizes.mixed.num_requests, MAX_OFFLINE_REQUESTS),
                         seed=args.seed)
        requests = make_workload(dummy_model(case.model).vocab_size, config)
    longest = max((r.num_prompt_tokens + r.max_tokens for r in requests), default=0)
    max_model_len = max(sizes.latency_context + 512, -(-(longest + 16) // 256) * 256)
    print(f"{case.title}:", flush=True)
    loaded = load_model(case.model, run.dtype, max_model_len, device=run.device, seed=args.seed,
                        quantization=case.quantization)
    # On CUDA the weights are FP8 as the GPU stores them; a CPU keeps the FP8-rounded ones in its dtype.
    quantization = loaded.quantization if run.device.type == "cuda" else None
    release_memory(run.device)  # a quantized model's 16-bit weights, made first, stay out of the KV sizing
    llm = LLM(case.model, loaded_model=loaded, device=str(run.device), dtype=run.dtype,
              max_model_len=max_model_len, max_num_seqs=max(batches),
              max_num_batched_tokens=sizes.decode_max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed)
    del loaded
    try:
        engine = llm.engine
        static_decode = engine.runner.static_decode
        mode = "graphs+overlap" if static_decode is not None else "overlap"
        set_mode(llm, mode, static_decode)
        capture = engine.graph_capture
        ready_seconds = time.perf_counter() - started
        print(f"  ready in {ready_seconds:.1f} s ({engine.kv_cache.num_blocks} KV blocks"
              + (f", {len(capture.graph_keys)} graphs in {capture.seconds:.1f} s" if capture else "") + ")",
              flush=True)
        points = []
        for batch in batches:
            point = measure_steady_decode(llm, mode, batch, sizes.latency_context, sizes.decode_steps,
                                          sizes.decode_warmup_steps, args.seed, quantization)
            floor_ms = point.weight_bytes / (copy_gb_per_s * 1e9) * 1e3
            print(f"  {mode:<15} batch {batch:>4}: {point.ms_per_step:8.2f} ms/step, floor {floor_ms:.3g} ms "
                  f"({point.weight_bytes / 1e9:.3g} GB of weights)", flush=True)
            points.append({**point.__dict__, "floor_ms": floor_ms})
        result = None
        if requests:
            result = time_generation(llm, f"{case.label}-offline", requests,
                                     min(sizes.num_warmup_requests, len(requests)), run.device)
            print(f"  offline: {len(requests)} requests in {result.seconds:.2f} s, "
                  f"{result.tokens_per_second:.1f} output tok/s", flush=True)
    finally:
        del llm
        release_memory(run.device)
    return {
        "model": case.model, "title": case.title, "quantization": case.quantization,
        "ready_seconds": ready_seconds,
        "graph_capture": None if capture is None else {"num_graphs": len(capture.graph_keys),
                                                        "seconds": capture.seconds},
        "points": points,
        "offline": None if result is None else {
            "num_requests": len(requests), "num_output_tokens": total_output_tokens(requests),
            "seconds": result.seconds, "output_tokens_per_second": result.tokens_per_second, **result.extra},
        "seconds": time.perf_counter() - started,
    }
