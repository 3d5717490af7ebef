"""One phase of the GPU check, in a process of its own: `python -m benchmarks.gpu_check.phase
NAME --device cuda|cpu --work DIR`. Its checks go to DIR/NAME.jsonl as they end; what it
prints goes to the phase's log (the runner's redirection)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks.gpu_check.phases import HANG_ENV, PHASE_NAMES, PHASES, PLANTED_SERVER
from benchmarks.gpu_check.records import FAIL, CheckLog


def records_path(work: Path, name: str) -> Path:
    return work / f"{name}.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", choices=PHASE_NAMES)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args(argv)
    phase = next(p for p in PHASES if p.name == args.name)
    log = CheckLog(records_path(args.work, phase.name), phase.name)
    if os.environ.get(HANG_ENV) == phase.name:
        log.start("planted hang")
        # Like a server a test starts in a session of its own: out of the phase group's reach.
        subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(3600)  # {PLANTED_SERVER}"],
                         start_new_session=True)
        print(f"{HANG_ENV}={phase.name}: hanging until killed", flush=True)
        while True:
            time.sleep(60)
    try:
        phase.run(log, args.device, args.work)
    except Exception:  # noqa: BLE001 - the phase's own failure, reported as a check
        traceback.print_exc()
        log.add(f"{phase.name} phase", FAIL, detail=traceback.format_exc()[-1500:])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
