"""Phase 1 of the GPU check: the machine (GPU, driver, memory), the versions Baton runs on
(torch, CUDA, NCCL, Triton, transformers, grpcio, protobuf), and every module of Baton
imported, its tests and benchmarks included, each that fails named with its error."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import platform
import subprocess
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu_check.records import FAIL, PASS, SKIP, CheckLog

PACKAGES = ("baton", "engine", "gateway", "prefill_worker", "decode_worker", "kvtransfer", "benchmarks", "tests")
REPO_ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def _version(module: str) -> str | None:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "?"))
    except Exception as error:  # noqa: BLE001 - reported as the version
        return f"not importable: {error!r}"[:300]


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def describe_machine(device: str) -> dict:
    """The machine and the versions. Not benchmarks/gpu.py's environment(): this must report
    even where Baton's own modules, or the libraries they import, do not import."""
    facts = {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "grpcio": _version("grpc"),
        "protobuf": _version("google.protobuf"),
        "cpu_count": len(os.sched_getaffinity(0)),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        facts.update({
            "gpu": torch.cuda.get_device_name(0),
            "gpu_count": torch.cuda.device_count(),
            "compute_capability": f"{props.major}.{props.minor}",
            "num_sms": props.multi_processor_count,
            "gpu_memory_gib": round(total / GiB, 1),
            "gpu_memory_free_gib": round(free / GiB, 1),
            "driver": _driver(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
        })
    return facts


def baton_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package)
        path = REPO_ROOT / package
        for info in pkgutil.walk_packages([str(path)], prefix=f"{package}."):
            # Generated stubs come with the modules that use them; `__main__` modules run when imported.
            if "_pb2" not in info.name and not info.name.endswith(".__main__"):
                names.append(info.name)
    return sorted(set(names))


def run(log: CheckLog, device: str, work: Path) -> None:
    facts = describe_machine(device)
    (work / "environment.json").write_text(json.dumps(facts, indent=1))
    if device == "cuda":
        if "gpu" in facts:
            log.add("cuda device", PASS, value=facts["gpu_memory_gib"], unit="GiB",
                    detail=f"{facts['gpu']}, sm {facts['compute_capability']}, {facts['num_sms']} SMs, driver "
                           f"{facts['driver']}, torch {facts['torch']} (CUDA {facts['cuda']}), NCCL {facts['nccl']}")
            log.add("gpu memory free at start", PASS if facts["gpu_memory_free_gib"] > 0.9 * facts["gpu_memory_gib"]
                    else FAIL, value=facts["gpu_memory_free_gib"], unit="GiB", target=">= 0.9 of total",
                    detail="memory other processes hold: the later phases' shares must be free")
        else:
            log.add("cuda device", FAIL, detail=f"torch {facts['torch']} sees no CUDA device")
    else:
        log.add("cuda device", SKIP, detail="a CPU run: kernels under Triton's interpreter")
    log.add("versions", PASS, detail=", ".join(f"{k} {facts[k]}" for k in ("python", "torch", "triton",
                                                                            "transformers", "grpcio", "protobuf")))
    if device != "cuda":
        from engine.envs import use_triton_interpreter

        use_triton_interpreter()  # before any kernel module is imported, as a CPU engine does
    started = time.perf_counter()
    failed = []
    modules = baton_modules()
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as error:  # noqa: BLE001 - pytest's skip at import is a BaseException too
            if isinstance(error, KeyboardInterrupt):
                raise
            failed.append(name)
            hint = (" (the lent GPU machine: `make gpu-wheels` on the CPU box first)"
                    if isinstance(error, ModuleNotFoundError) else "")
            log.add(f"import {name}", FAIL,
                    detail="".join(traceback.format_exception_only(error)).strip()[-1000:] + hint)
    log.add("imports", FAIL if failed else PASS, value=len(modules) - len(failed), target=f"= {len(modules)}",
            unit="modules", seconds=time.perf_counter() - started,
            detail=f"not importable: {', '.join(failed)}" if failed else "every module of Baton, its tests and "
                   "benchmarks")
