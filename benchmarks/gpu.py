"""Baton on one GPU: how close decode comes to the memory bandwidth, and offline
throughput against Hugging Face transformers on the same random weights.

Sections (pick with --sections; each writes gpu.json when it ends, so a run cut
short keeps what finished; a section that fails is recorded and the rest still run):

  bandwidth  device-to-device copy of a large buffer: the bandwidth the rest is held to
  decode     Baton's decode step at batch 1, 8, 64, 256 and ~1k context: ms per step and per token
  roofline   decode steps at several (batch, context): bytes read per step (weights + KV)
             over step time, as a fraction of the copy bandwidth
  latency    steady decode at batch 1 and 64 with CUDA graphs and overlapped scheduling each on
             and off: ms per step, the host's ms per step, the GPU's idle share between steps
  attention  the Triton paged attention kernel alone, decode batches of batch x context = 65536
             tokens over scattered blocks: KV bytes of one layer over kernel time
  offline    output tokens per second of baton-continuous, baton-static, hf-static and
             hf-continuous on a ShareGPT-like and on the mixed workload (benchmarks/workload.py)
  handoff    the KV handoff on one GPU (benchmarks/gpu_handoff.py): ipc between two processes
             against a same-process copy, and serving disaggregated on the GPU against colocated
  models     a mixture of experts (dummy:qwen3-30b-a3b) and FP8 weights (dummy:llama-3.1-8b,
             quantization fp8), one engine each (benchmarks/gpu_models.py): decode at batch 1 and
             64 against the floor of the bytes a step reads, offline throughput of 64 requests

Targets are printed PASS/FAIL and recorded in gpu.json, never asserted: the exit code
is 0 unless a section raised. Targets: the roofline point at batch 256 x context 1024
reads >= 60% of the copy bandwidth; every attention shape >= 70%; batch-1 decode per
token within 1.25x of the weights' read time at copy bandwidth (>= 0.8 of it); CUDA
graphs >= 1.5x faster than eager at batch 1; the GPU idle <= 10% between steady decode
steps at batch 64; baton-continuous >= 3x hf-static and >= 1.5x hf-continuous
(transformers' generate_batch) on the mixed workload, and >= 2.5x baton-static on each workload;
KV over ipc at >= 0.8x a same-process copy's speed, checksums equal; disaggregated on one
GPU at >= 0.85x colocated output tokens/s, with no fallback and no block left held; the MoE
model's batch-1 step within 2x the read time of its routed experts' and other weights
(>= 0.5 of it); the FP8 8B batch-1 step <= 0.6x the bfloat16 one.
Plots (PNG, matplotlib) go beside gpu.json when matplotlib is installed. An existing
gpu.json in --out (same model and device) keeps the sections this run does not measure.

Run from the repository root (GPU machine: `source .gpu/env.sh` first):
    python -m benchmarks.gpu --out benchmarks/results/gpu [--quick] [--sections decode,roofline]
CPU smoke (tiny sizes, every section, the attention kernel under Triton's interpreter):
    python -m benchmarks.gpu --device cpu --model dummy:smollm2-135m --quick --tiny --out /tmp/gpu-smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.gpu_bandwidth import (
    attention_cache,
    decode_blocks_needed,
    measure_attention,
    measure_copy_bandwidth,
    measure_decode,
    num_streaming_multiprocessors,
)
from benchmarks.gpu_handoff import section_handoff
from benchmarks.gpu_latency import section_latency
from benchmarks.gpu_models import section_models
from benchmarks.gpu_offline import ALL_SYSTEMS, HF_CB_CUDA_GRAPHS, WORKLOADS, release_memory, section_offline
from benchmarks.gpu_sizes import CHECK, FULL, QUICK, TINY, BenchSizes
from benchmarks.gpu_targets import Target

SECTIONS = ("bandwidth", "decode", "roofline", "latency", "attention", "offline", "handoff", "models")
JSON_NAME = "gpu.json"


class BenchRun:
    """One invocation: its options, the payload written to gpu.json, and the decode
    engine and copy bandwidth that several sections share."""

    def __init__(self, args: argparse.Namespace, sizes: BenchSizes) -> None:
        self.args = args
        self.sizes = sizes
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.out_dir = Path(args.out)
        self.payload = self._initial_payload()
        self._decode_llm = None
        self._decode_points = {}
        self.copy_gb_per_s: float | None = None
        self.sections_measured: set[str] = set()  # by this run; the payload may keep older ones

    def _initial_payload(self) -> dict:
        path = self.out_dir / JSON_NAME
        env = environment(self.device)
        sections, errors = {}, {}
        previous = json.loads(path.read_text()) if path.exists() else {}
        if (previous.get("model") == self.args.model
                and previous.get("environment", {}).get("device_name") == env["device_name"]):
            sections = {k: v for k, v in previous.get("sections", {}).items() if k not in self.args.sections}
            errors = {k: v for k, v in previous.get("errors", {}).items() if k not in self.args.sections}
            if sections:
                print(f"keeping {', '.join(sections)} from the existing {path}", flush=True)
        return {"environment": env, "model": self.args.model, "dtype": str(self.dtype),
                "mode": mode(self.args),
                "args": vars(self.args), "sections": sections, "errors": errors, "targets": []}

    def write(self) -> None:
        targets = [t for section in self.payload["sections"].values() for t in section.get("targets", [])]
        self.payload["targets"] = targets
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed, so a run killed mid-write leaves the previous file whole.
        partial = self.out_dir / (JSON_NAME + ".partial")
        partial.write_text(json.dumps(self.payload, indent=2, default=str))
        partial.replace(self.out_dir / JSON_NAME)

    def record(self, name: str, section: dict) -> None:
        self.sections_measured.add(name)
        self.payload["sections"][name] = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                          "mode": self.payload["mode"], **section}
        self.write()

    # ------------------------------------------------------------------ shared state
    def decode_llm(self):
        if self._decode_llm is None:
            from engine import LLM

            sizes = self.sizes
            contexts = [c for _, c in sizes.roofline_points] + [sizes.decode_context]
            batches = [b for b, _ in sizes.roofline_points] + list(sizes.decode_batches)
            self._decode_llm = LLM(
                self.args.model, device=str(self.device), dtype=self.dtype, max_model_len=max(contexts) + 512,
                max_num_seqs=max(batches), max_num_batched_tokens=sizes.decode_max_num_batched_tokens,
                gpu_memory_utilization=self.args.gpu_memory_utilization, seed=self.args.seed,
            )
            print(f"decode engine: {self._decode_llm.engine.kv_cache.num_blocks} KV blocks", flush=True)
        return self._decode_llm

    def release_decode_llm(self) -> None:
        self._decode_llm = None
        self._decode_points.clear()
        release_memory(self.device)

    def decode_point(self, batch: int, context: int):
        """The measurement at (batch, context), made once per run; None if it does not fit."""
        key = (batch, context)
        if key not in self._decode_points:
            llm, sizes = self.decode_llm(), self.sizes
            needed = decode_blocks_needed(llm, batch, context, sizes.decode_steps, sizes.decode_warmup_steps)
            if needed > llm.engine.kv_cache.num_blocks:
                print(f"  skip batch {batch} x context {context}: needs {needed} KV blocks", flush=True)
                self._decode_points[key] = None
            else:
                point = measure_decode(llm, batch, context, sizes.decode_steps, sizes.decode_warmup_steps,
                                       self.args.seed)
                print(f"  batch {batch:>4} x context {context:>6} (~{point.mean_context_len:.0f} while timed): "
                      f"{point.ms_per_step:8.2f} ms/step "
                      f"{point.ms_per_token:8.3f} ms/token {point.gb_per_s:8.1f} GB/s", flush=True)
                self._decode_points[key] = point
        return self._decode_points[key]

    def copy_bandwidth(self) -> float:
        """GB/s of the copy benchmark, measured now if no section has yet."""
        if self.copy_gb_per_s is None:
            section_bandwidth(self)
        return self.copy_gb_per_s


def mode(args: argparse.Namespace) -> str:
    return "tiny" if args.tiny else "check" if args.check else "quick" if args.quick else "full"


SIZES = {"tiny": TINY, "check": CHECK, "quick": QUICK, "full": FULL}


def environment(device: torch.device) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    is_cuda = device.type == "cuda"
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if is_cuda else platform.processor() or "cpu",
        "num_sms": num_streaming_multiprocessors(device),
        "total_memory_bytes": torch.cuda.get_device_properties(device).total_memory if is_cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------- sections


def section_bandwidth(run: BenchRun) -> dict:
    sizes = run.sizes
    result = measure_copy_bandwidth(run.device, sizes.copy_bytes, sizes.copy_iters)
    run.copy_gb_per_s = result.gb_per_s
    print(f"copy: {result.buffer_bytes / 2**30:.2f} GiB buffer x {result.iterations}, "
          f"{result.gb_per_s:.1f} GB/s median ({result.best_gb_per_s:.1f} best), read + written", flush=True)
    return {**asdict(result), "gb_per_s": result.gb_per_s, "best_gb_per_s": result.best_gb_per_s,
            "timer": "cuda events" if run.device.type == "cuda" else "perf_counter"}


def _point_json(point) -> dict:
    return {**asdict(point), "ms_per_step": point.ms_per_step, "ms_per_token": point.ms_per_token,
            "tokens_per_second": point.tokens_per_second, "bytes_per_step": point.bytes_per_step,
            "gb_per_s": point.gb_per_s}


def section_decode(run: BenchRun) -> dict:
    sizes = run.sizes
    print(f"decode steps at context {sizes.decode_context}:", flush=True)
    points = [run.decode_point(b, sizes.decode_context) for b in sizes.decode_batches]
    skipped = [b for b, p in zip(sizes.decode_batches, points) if p is None]
    return {"context_len": sizes.decode_context, "num_steps": sizes.decode_steps,
            "points": [_point_json(p) for p in points if p is not None], "skipped_batches": skipped}


def section_roofline(run: BenchRun) -> dict:
    copy_gb_per_s = run.copy_bandwidth()
    print(f"decode steps against bytes read (copy bandwidth {copy_gb_per_s:.1f} GB/s):", flush=True)
    points, skipped = [], []
    for batch, context in run.sizes.roofline_points:
        point = run.decode_point(batch, context)
        if point is None:
            skipped.append({"batch_size": batch, "context_len": context, "reason": "does not fit the KV cache"})
            continue
        points.append({**_point_json(point), "fraction_of_copy": point.gb_per_s / copy_gb_per_s})
    target_batch, target_context = run.sizes.roofline_target
    at_target = [p for p in points if (p["batch_size"], p["context_len"]) == (target_batch, target_context)]
    target = Target("roofline", f"decode step at batch {target_batch} x context {target_context}, "
                    "bytes read / step time as a fraction of copy bandwidth",
                    at_target[0]["fraction_of_copy"] if at_target else None, 0.60)
    print(target.line(), flush=True)
    return {"copy_gb_per_s": copy_gb_per_s, "points": points, "skipped": skipped, "targets": [target.to_json()]}


def section_attention(run: BenchRun) -> dict:
    from transformers import AutoConfig

    from engine.dummy_models import dummy_model
    from engine.kv.cache import KVLayout
    from engine.model.arch import ModelArch

    run.release_decode_llm()
    copy_gb_per_s = run.copy_bandwidth()
    spec = dummy_model(run.args.model)
    arch = ModelArch.from_hf_config(AutoConfig.for_model(spec.model_type, **spec.config))
    layout = KVLayout(num_layers=arch.num_layers, block_size=16, num_kv_heads=arch.num_kv_heads,
                      head_dim=arch.head_dim, dtype=run.dtype)
    num_sms = num_streaming_multiprocessors(run.device)
    cache = attention_cache(layout, max(b * c for b, c in run.sizes.attention_shapes), run.device, run.args.seed)
    print(f"paged attention, one layer of {layout} ({cache.num_blocks} blocks):", flush=True)
    points = []
    try:
        for batch, context in run.sizes.attention_shapes:
            point = measure_attention(cache, arch.num_heads, batch, context, run.sizes.attention_iters, num_sms,
                                      run.args.seed)
            fraction = point.gb_per_s / copy_gb_per_s
            print(f"  batch {batch:>4} x context {context:>6}: {point.median_seconds * 1e6:9.1f} us "
                  f"{point.gb_per_s:8.1f} GB/s ({fraction:.0%} of copy), {point.num_splits} splits", flush=True)
            points.append({**asdict(point), "gb_per_s": point.gb_per_s, "fraction_of_copy": fraction})
    finally:
        del cache
        release_memory(run.device)
    target = Target("attention", "paged attention KV read bandwidth, the lowest of the shapes, "
                    "as a fraction of copy bandwidth", min(p["fraction_of_copy"] for p in points), 0.70)
    print(target.line(), flush=True)
    return {"copy_gb_per_s": copy_gb_per_s, "num_sms": num_sms, "num_heads": arch.num_heads,
            "layout": {k: str(v) for k, v in asdict(layout).items()}, "points": points,
            "targets": [target.to_json()]}


SECTION_RUNNERS = {"bandwidth": section_bandwidth, "decode": section_decode, "roofline": section_roofline,
                   "latency": section_latency, "attention": section_attention, "offline": section_offline,
                   "handoff": section_handoff, "models": section_models}


# ----------------------------------------------------------------------------- main


def _comma_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (got {text!r})")
        return items

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary, _, details = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=" ".join(summary.split()), epilog=details,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/gpu", help="directory for gpu.json and the plots")
    p.add_argument("--model", default="dummy:llama-3.1-8b", help="a dummy:<name> model (engine/dummy_models.py)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the smoke run)")
    p.add_argument("--quick", action="store_true", help="fewer points and requests")
    p.add_argument("--check", action="store_true", help="the sizes `make gpu-check` measures (benchmarks/gpu_check)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: the CPU smoke run")
    p.add_argument("--sections", type=_comma_list(SECTIONS), default=list(SECTIONS),
                   help=f"comma list from {', '.join(SECTIONS)}")
    p.add_argument("--workloads", type=_comma_list(WORKLOADS), default=list(WORKLOADS),
                   help="offline: comma list from sharegpt, mixed")
    p.add_argument("--systems", type=_comma_list(ALL_SYSTEMS), default=list(ALL_SYSTEMS),
                   help=f"offline: comma list from {', '.join(ALL_SYSTEMS)}")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="Baton's share of GPU memory (weights, activations, KV cache)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="offline: baton-continuous's sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="offline: token budget per step of Baton and hf-continuous")
    p.add_argument("--static-batch-size", type=int, default=None,
                   help="offline: hf-static's batch and baton-static's max_num_seqs (default 64; tiny 4)")
    p.add_argument("--hf-cb-cuda-graphs", choices=tuple(HF_CB_CUDA_GRAPHS), default="on",
                   help="hf-continuous CUDA graphs: on (falls back to auto if it fails), off, or auto "
                        "(transformers' own choice)")
    p.add_argument("--hf-cb-max-requests", type=int, default=None,
                   help="hf-continuous requests per step (default: 64 under sdpa, transformers' own with flash)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def start_run(args: argparse.Namespace) -> BenchRun | None:
    """The run `args` describe, its device readied; None (after a message) if there is no such device."""
    if torch.device(args.device).type == "cpu":
        from engine.envs import use_triton_interpreter

        use_triton_interpreter()  # the attention section's kernel on CPU tensors
    elif not torch.cuda.is_available():
        print(f"--device {args.device}: torch sees no CUDA device (use --device cpu --tiny for a smoke run)",
              file=sys.stderr)
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    run = BenchRun(args, SIZES[mode(args)])
    env = run.payload["environment"]
    print(f"{env['device_name']} ({env['device']}), torch {env['torch']}, triton {env['triton']}, "
          f"transformers {env['transformers']}; model {args.model} {run.dtype}; {run.payload['mode']} run; "
          f"sections {', '.join(args.sections)}", flush=True)
    return run


def run_sections(run: BenchRun, on_section=None) -> list[str]:
    """Every section the run's args name, in SECTIONS' order; `on_section(name, section, error)`
    after each (section None and the traceback if it raised). The names of those that failed."""
    failed = []
    for name in (s for s in SECTIONS if s in run.args.sections):
        started = time.perf_counter()
        print(f"\n== {name}", flush=True)
        try:
            section = SECTION_RUNNERS[name](run)
        except Exception:  # noqa: BLE001 - recorded; the other sections still run
            traceback.print_exc()
            run.payload["errors"][name] = traceback.format_exc()[-4000:]
            failed.append(name)
            run.write()
            if on_section is not None:
                on_section(name, None, run.payload["errors"][name])
            continue
        run.payload["errors"].pop(name, None)
        run.record(name, {**section, "seconds": time.perf_counter() - started})
        print(f"== {name}: {time.perf_counter() - started:.1f} s", flush=True)
        if on_section is not None:
            on_section(name, run.payload["sections"][name], None)
    run.release_decode_llm()
    return failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = start_run(args)
    if run is None:
        return 2
    failed = run_sections(run)

    from benchmarks.gpu_plots import write_plots

    print()
    for path in write_plots(run.payload, run.out_dir):
        print(f"plot: {path}")
    print(f"results: {run.out_dir / JSON_NAME}")
    for target in run.payload["targets"]:
        print(Target(**{k: v for k, v in target.items() if k != "passed"}).line())
    if failed:
        print(f"sections that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
