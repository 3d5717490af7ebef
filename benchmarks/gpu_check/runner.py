"""Runs the GPU check's phases one after another, each in its own process group under its
own deadline, and keeps OUT's summary current.

    budget  |-- environment --|-- kernels --|-- engine --|-- handoff --|-- figures --|  margin
            each deadline: the time left, shared by the weights of the phases still to run,
            so time a phase does not use goes to the later ones

A phase past its deadline gets SIGINT (pytest then prints what it ran), a few seconds, then
SIGKILL for its whole group (servers it started included), and is reported TIMEOUT with the
check it was running; the next phase starts on time. A phase that ends leaves no process
behind either: its group is killed too, so no GPU memory outlives it.

OUT holds at most 8 files: summary.json (rewritten after every phase, and every few seconds
while one runs), summary.txt (the table), one log per phase and, on a GPU, nvidia-smi.csv.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpu_check.phase import records_path
from benchmarks.gpu_check.phases import PHASES, Phase
from benchmarks.gpu_check.records import FAIL, PASS, SKIP, TIMEOUT, Check, read_checks
from benchmarks.gpu_check.table import render

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_OUT_FILES = 8  # what comes back from a lent GPU machine
OUT_FILES = ("summary.json", "summary.txt", "nvidia-smi.csv")  # and a log per phase
assert len(OUT_FILES) + len(PHASES) <= MAX_OUT_FILES
KILL_GRACE_S = 5.0  # SIGINT, then this long before SIGKILL
END_MARGIN_S = 8.0  # kept at the end of the budget: the last kill, the last summary
POLL_S = 0.25
REWRITE_S = 5.0  # the summary's refresh while a phase runs


@dataclass
class PhaseResult:
    phase: Phase
    status: str = "PENDING"  # then RUNNING, and PASS / FAIL / TIMEOUT / SKIP
    seconds: float = 0.0
    deadline_s: float = 0.0  # how long it was given
    returncode: int | None = None
    checks: list[Check] = field(default_factory=list)

    def log_name(self) -> str:
        return f"{PHASES.index(self.phase) + 1}-{self.phase.name}.log"

    def to_json(self) -> dict:
        return {"name": self.phase.name, "title": self.phase.title, "status": self.status,
                "seconds": round(self.seconds, 1), "deadline_s": round(self.deadline_s, 1),
                "returncode": self.returncode, "log": self.log_name(),
                "checks": [check.to_json() for check in self.checks]}


class CheckRun:
    """One run of the check: `run()` goes through the phases and returns 0 if every one passed."""

    def __init__(self, device: str, budget_s: float, out: Path, phases: tuple[Phase, ...] = PHASES) -> None:
        self.device = device
        self.budget_s = budget_s
        self.out = out
        self.results = [PhaseResult(phase) for phase in phases]
        self.started = time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="baton-gpu-check-"))
        self.environment: dict = {}
        self.figures: dict = {}

    # ------------------------------------------------------------------ running
    def run(self) -> int:
        self._prepare_out()
        monitor = self._start_monitor()
        # Stopped from outside (a caller's time limit): the phase running is killed with its
        # group, and the summary says what had finished.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            for index, result in enumerate(self.results):
                self._run_phase(result, self.results[index:])
        finally:
            if monitor is not None:
                _kill_group(monitor)
            self.write_summary()
            shutil.rmtree(self.work, ignore_errors=True)
        print(render(self.summary()), flush=True)
        return 0 if all(r.status in (PASS, SKIP) for r in self.results) else 1

    def _deadline_s(self, remaining: list[PhaseResult]) -> float:
        left = self.budget_s - END_MARGIN_S - self.elapsed()
        return max(0.0, left * remaining[0].phase.weight / sum(r.phase.weight for r in remaining))

    def _run_phase(self, result: PhaseResult, remaining: list[PhaseResult]) -> None:
        name = result.phase.name
        result.deadline_s = self._deadline_s(remaining)
        if result.deadline_s < 2 * KILL_GRACE_S:
            result.status = SKIP
            result.checks = [Check(name, f"{name} phase", SKIP, detail="no time left in the budget")]
            self.write_summary()
            return
        result.status = "RUNNING"
        self.write_summary()
        records = records_path(self.work, name)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "benchmarks.gpu_check.phase", name, "--device", self.device,
                   "--work", str(self.work)]
        print(f"== phase {name}: {result.phase.title} (deadline {result.deadline_s:.0f} s)", flush=True)
        started = time.monotonic()
        with open(self.out / result.log_name(), "w") as log:
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        killed, last_write = False, started
        try:
            while process.poll() is None:
                now = time.monotonic()
                if now - started >= result.deadline_s:
                    killed = True
                    _stop(process)
                    break
                if now - last_write >= REWRITE_S:
                    result.checks = read_checks(records, name, killed=False)
                    self.write_summary()
                    last_write = now
                time.sleep(POLL_S)
        except KeyboardInterrupt:  # SIGINT, or SIGTERM (_interrupt)
            _kill_group(process)
            result.status, result.seconds = TIMEOUT, time.monotonic() - started
            result.checks = [*read_checks(records, name, killed=True),
                             Check(name, f"{name} phase", TIMEOUT, detail="the whole run was stopped")]
            raise
        _kill_group(process)  # whatever it started and left running
        result.seconds = time.monotonic() - started
        result.returncode = process.returncode
        result.checks = read_checks(records, name, killed)
        if killed:
            result.status = TIMEOUT
        else:
            if result.returncode != 0 and not any(c.status == FAIL for c in result.checks):
                result.checks.append(Check(name, f"{name} phase", FAIL,
                                           detail=f"exited with {_describe_exit(result.returncode)}; see "
                                                  f"{result.log_name()}"))
            result.status = FAIL if any(c.status in (FAIL, TIMEOUT) for c in result.checks) else PASS
        if name == "environment":
            self.environment = _read_json(self.work / "environment.json")
        elif name == "figures":
            self.figures = _read_json(self.work / "figures" / "gpu.json")
        print(f"== phase {name}: {result.status} in {result.seconds:.0f} s", flush=True)
        self.write_summary()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # ------------------------------------------------------------------ output
    def _prepare_out(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in (*OUT_FILES, *(r.log_name() for r in self.results)):
            (self.out / name).unlink(missing_ok=True)

    def _start_monitor(self) -> subprocess.Popen | None:
        if self.device != "cuda" or shutil.which("nvidia-smi") is None:
            return None
        with open(self.out / "nvidia-smi.csv", "w") as csv:
            return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,memory.used,utilization.gpu,power.draw",
                                     "--format=csv", "-l", "2"], stdout=csv, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def summary(self) -> dict:
        return {"device": self.device, "budget_s": self.budget_s, "elapsed_s": round(self.elapsed(), 1),
                "environment": self.environment, "phases": [r.to_json() for r in self.results],
                "figures": {k: self.figures.get(k) for k in ("mode", "model", "dtype", "sections", "errors")
                            if k in self.figures}}

    def write_summary(self) -> None:
        summary = self.summary()
        partial = self.out / "summary.json.partial"
        partial.write_text(json.dumps(summary, indent=1, default=str))
        partial.replace(self.out / "summary.json")  # a reader never sees half a file
        (self.out / "summary.txt").write_text(render(summary) + "\n")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop(process: subprocess.Popen) -> None:
    """SIGINT to the phase's group, then SIGKILL after a grace period."""
    try:
        os.killpg(process.pid, signal.SIGINT)
    except ProcessLookupError:
        return
    try:
        process.wait(KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(process)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
