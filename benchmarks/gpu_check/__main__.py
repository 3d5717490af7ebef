"""`make gpu-check`: python -m benchmarks.gpu_check [--device cuda|cpu] [--budget-s S] [--out DIR]."""

from __future__ import annotations

import argparse
import math
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
    parser.add_argument("--deadline-s", action="append", default=[], type=phase_deadline, metavar="PHASE=S",
                        help="a phase's own deadline, in place of its share of the budget (repeatable)")
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
    return CheckRun(args.device, args.budget_s, args.out, phases, dict(args.deadline_s)).run()


def phase_deadline(text: str) -> tuple[str, float]:
    """--deadline-s PHASE=SECONDS: the phase's name and its deadline."""
    name, _, seconds = text.partition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = math.nan
    if name not in PHASE_NAMES or not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: write PHASE=SECONDS, seconds > 0, PHASE one of "
                                         f"{', '.join(PHASE_NAMES)}")
    return name, value


if __name__ == "__main__":
    raise SystemExit(main())
