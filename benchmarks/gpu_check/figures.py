"""Phase 5 of the GPU check: the headline figures, measured by benchmarks/gpu.py's sections at
its `--check` sizes (a dummy Llama-3.1-8B in bfloat16; on CPU, `--tiny` on dummy:tiny), each
section's targets written as checks the moment the section ends.

    bandwidth  copy bandwidth: what the decode figures are held to
    latency    batch-1 decode against the weights' read time at that bandwidth; CUDA graphs
               against eager at batch 1 (and 64, for the record); the GPU's idle share
               between steps at batch 64
    offline    output tokens/s of Baton continuous against Baton static batching on the mixed
               workload at its full size (512 requests: eight static batches, so that continuous
               batching has waves to fill; at two batches it could not reach 2x). transformers'
               static batching, 13x slower a step, would take minutes there: `make bench-gpu`
               measures it (16.6x at 128 requests, H200, 2026-11-26)
    handoff    KV over CUDA IPC against a same-process copy; disaggregated on one GPU
               against colocated serving
    models     dummy:qwen3-30b-a3b (bfloat16) and dummy:llama-3.1-8b in FP8, an engine each
               (on CPU dummy:tiny-moe and dummy:tiny in FP8): batch-1 decode against the
               floor of the bytes a step reads (the routed experts only; FP8 weights a byte),
               batch 64, 64 requests offline. Targets: the MoE batch-1 step >= 0.5 of its
               floor; the FP8 batch-1 step <= 0.6x the latency section's bfloat16 one. Last,
               so that a deadline cuts it, not the figures before it

On CPU the figures are measured and shown, not judged: their targets are a GPU's.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_check.records import FAIL, PASS, SKIP, CheckLog

SECTIONS = ("bandwidth", "latency", "offline", "handoff", "models")
SYSTEMS = ("baton-continuous", "baton-static")


def benchmark_args(device: str, work: Path) -> list[str]:
    sizes = ["--model", "dummy:llama-3.1-8b", "--check"] if device == "cuda" else \
        ["--model", "dummy:tiny", "--tiny"]
    return ["--device", device, *sizes, "--out", str(work / "figures"), "--sections", ",".join(SECTIONS),
            "--workloads", "mixed", "--systems", ",".join(SYSTEMS)]


def section_checks(log: CheckLog, device: str, name: str, section: dict | None, error: str | None) -> None:
    """The checks of one finished section: its targets, and a few figures worth a row."""
    if section is None:
        log.add(f"{name} section", FAIL, detail=(error or "")[-1500:])
        return
    for row_name, fields in _figure_rows(name, section):
        log.add(row_name, PASS, **fields)
    capture = section.get("graph_capture") if name == "latency" else None
    if capture is not None and capture["reserve_bytes"] is not None:
        # Sizing the KV cache kept room for the graphs: did they fit in it?
        log.add("graph memory within its reserve", PASS if capture["memory_bytes"] <= capture["reserve_bytes"]
                else FAIL, value=capture["memory_bytes"] / 2**20, unit="MiB",
                target=f"<= {capture['reserve_bytes'] / 2**20:.0f}",
                detail="this process's allocator growth over the capture, against engine/runner/memory.py's reserve")
    for target in section.get("targets", []):
        name_, value, minimum = target["name"], target["value"], target["minimum"]
        if name_.startswith(("offline-sharegpt", "offline-mixed-vs-hf")):
            continue  # systems and workloads the check does not run
        fields = dict(value=value, target=f">= {minimum:g}", detail=target["description"])
        if value is None:
            log.add(name_, SKIP, **{**fields, "detail": f"not measured on {device}: {target['description']}"})
        elif device != "cuda":
            log.add(name_, PASS, **{**fields, "detail": f"measured, not judged on CPU: {target['description']}"})
        else:
            log.add(name_, PASS if target["passed"] else FAIL, **fields)


def _figure_rows(name: str, section: dict) -> list[tuple[str, dict]]:
    if name == "bandwidth":
        return [("copy bandwidth", dict(value=section["gb_per_s"], unit="GB/s",
                                        detail="device-to-device copy, bytes read + written"))]
    if name == "latency":
        points = {(p["mode"], p["batch_size"]): p for p in section["points"]}
        rows = []
        batches = sorted({batch for _, batch in points})
        best = "graphs+overlap" if ("graphs+overlap", batches[0]) in points else "overlap"
        rows.append((f"decode ms/token at batch {batches[0]}", dict(
            value=points[best, batches[0]]["ms_per_token"], unit="ms",
            detail=f"{best}; the weights' read time at copy bandwidth: {section['hbm_floor_ms_per_token']:.3g} ms")))
        largest = batches[-1]
        if ("graphs+overlap", largest) in points:
            rows.append((f"graphs vs eager at batch {largest}", dict(
                value=points["overlap", largest]["ms_per_step"] / points["graphs+overlap", largest]["ms_per_step"],
                unit="x", detail="eager / CUDA graphs time per step, both overlapped")))
        capture = section.get("graph_capture")
        if capture is not None:
            rows.append(("CUDA graphs capture", dict(
                value=capture["seconds"], unit="s",
                detail=f"{capture['num_graphs']} graphs, {capture['memory_bytes'] / 2**20:.0f} MiB, "
                       f"{(capture['reserve_bytes'] or 0) / 2**20:.0f} MiB reserved for them")))
        return rows
    if name == "offline":
        entry = section["workloads"]["mixed"]
        return [(f"offline {system}", dict(value=result["output_tokens_per_second"], unit="tok/s",
                                           detail=f"mixed workload, {entry['num_requests']} requests"))
                for system, result in entry["systems"].items()]
    if name == "handoff":
        serving = section["serving"]["systems"]
        return [(f"serving {system}", dict(value=result["output_tokens_per_second"], unit="tok/s",
                                           detail=f"{section['serving']['num_requests']} requests, Poisson"))
                for system, result in serving.items()]
    if name == "models":
        return [row for entry in section["models"].values() for row in _model_rows(entry)]
    return []


def _model_rows(entry: dict) -> list[tuple[str, dict]]:
    rows = [(f"{entry['title']} decode at batch {point['batch_size']}", dict(
        value=point["ms_per_step"], unit="ms",
        detail=f"{point['mode']}, ms/step; the read time of the {point['weight_bytes'] / 1e9:.3g} GB of "
               f"weights it reads at copy bandwidth: {point['floor_ms']:.3g} ms")) for point in entry["points"]]
    offline = entry["offline"]
    if offline is not None:
        rows.append((f"{entry['title']} offline", dict(
            value=offline["output_tokens_per_second"], unit="tok/s",
            detail=f"mixed workload, {offline['num_requests']} requests, one engine")))
    return rows


def run(log: CheckLog, device: str, work: Path) -> None:
    from benchmarks import gpu

    args = gpu.parse_args(benchmark_args(device, work))
    bench = gpu.start_run(args)
    if bench is None:
        log.add("figures", FAIL, detail=f"no {device} device")
        return

    def finished(name: str, section: dict | None, error: str | None) -> None:
        section_checks(log, device, name, section, error)
        if section is not None:
            log.add(f"{name} section", PASS, seconds=section.get("seconds"))

    for name in SECTIONS:  # one at a time: a section killed at the deadline shows as such
        log.start(f"{name} section")
        bench.args.sections = [name]
        gpu.run_sections(bench, finished)
