"""`make gpu-check`: python -m benchmarks.gpu_check [--device cuda|cpu] [--budget-s S] [--out DIR]."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.gpu_check import __doc__ as DESCRIPTION
from benchmarks.gpu_check.phases import PHASE_NAMES, PHASES
from benchmarks.gpu_check.runner import CheckRun


def main(argv: list[str] | None = None) -> int:
    summary, _, details = (DESCRIPTION or "").partition("\n\n")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: every phase on CPU tensors, a tiny model, the kernels under Triton's interpreter")
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("BUDGET_S", 480)),
                        help="the whole run's time limit (default: $BUDGET_S, else 480)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results/gpu-check")),
                        help="where the results go (default: $OUT, else benchmarks/results/gpu-check)")
    parser.add_argument("--phases", default=",".join(PHASE_NAMES), help="comma list: run only these phases")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.phases.split(",") if name.strip()]
    unknown = set(chosen) - set(PHASE_NAMES)
    if unknown or not chosen:
        parser.error(f"--phases: choose from {', '.join(PHASE_NAMES)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("torch sees no CUDA device here: `make gpu-check DEVICE=cpu` runs the check on CPU")
    phases = tuple(phase for phase in PHASES if phase.name in chosen)
    return CheckRun(args.device, args.budget_s, args.out, phases).run()


if __name__ == "__main__":
    raise SystemExit(main())
