"""Runs the GPU check's phases one after another, each in its own process group under its
own deadline, and keeps OUT's summary current.

    budget  |-- environment --|-- kernels --|-- engine --|-- handoff --|-- figures --|  margin
            each deadline: the time left, shared by the weights of the phases still to run,
            so time a phase does not use goes to the later ones; a phase given a deadline of
            its own (--deadline-s) gets that (at most the time left), set aside from the shares

A phase past its deadline gets SIGINT (pytest then prints what it ran), a few seconds, then
SIGKILL for its whole group, and is reported TIMEOUT with the check it was running; the next
phase starts on time. A phase that ends leaves no process behind either, so no GPU memory
outlives it: its group is killed, and so is every process that carries the phase's tag in
its environment (a server a test started in a session of its own, out of the group's reach).
A run stopped from outside (SIGTERM, SIGINT) does the same for the phase running, then writes
its summary (the signal only sets a flag, read while a phase runs: it never lands while a
phase starts or its results are written).

OUT holds at most 8 files: summary.json (rewritten after every phase, and every few seconds
while one runs; nvidia-smi's samples in it on a GPU), summary.txt (the table), one log per
phase, and for a moment summary.json's next version before it replaces the last.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import math
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpu_check.phase import records_path
from benchmarks.gpu_check.phases import PHASES, Phase
from benchmarks.gpu_check.records import FAIL, PASS, SKIP, TIMEOUT, Check, read_checks
from benchmarks.gpu_check.table import render

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_OUT_FILES = 8  # what comes back from a lent GPU machine
OUT_FILES = ("summary.json", "summary.txt", "summary.json.partial")  # and a log per phase
assert len(OUT_FILES) + len(PHASES) <= MAX_OUT_FILES
RUN_TAG_ENV = "BATON_GPU_CHECK_RUN"  # in each phase's environment: its processes, wherever they went
KILL_GRACE_S = 5.0  # SIGINT, then this long before SIGKILL
EXIT_WAIT_S = 30.0  # for a killed process to go (one stuck in the GPU driver may take a while)
NVIDIA_SMI_LINES = 400  # the last samples kept in the summary
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

    def __init__(self, device: str, budget_s: float, out: Path, phases: tuple[Phase, ...] = PHASES,
                 deadlines: dict[str, float] | None = None) -> None:
        self.device = device
        self.budget_s = budget_s
        self.deadlines = deadlines or {}  # phase name -> its own deadline, in place of its share
        self.out = out
        self.results = [PhaseResult(phase) for phase in phases]
        self.started = time.monotonic()
        self.work = Path(tempfile.mkdtemp(prefix="baton-gpu-check-"))
        self.tag = uuid.uuid4().hex
        self.stopped_by: int | None = None  # the signal that stopped the run
        self.environment: dict = {}
        self.figures: dict = {}

    # ------------------------------------------------------------------ running
    def run(self) -> int:
        self._prepare_out()
        monitor = self._start_monitor()
        # Stopped from outside (a caller's time limit): the phase running is killed with what it
        # started, the later ones are not started, and the summary says what had finished.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._stop_requested)
        try:
            for index, result in enumerate(self.results):
                if self.stopped_by is not None:
                    break
                self._run_phase(result, self.results[index:])
        finally:
            if monitor is not None:
                _kill_group(monitor)
            summary = self.write_summary()
            shutil.rmtree(self.work, ignore_errors=True)
        # The table printed is the one written (a second summary() would time a later moment).
        print(render(summary), flush=True)
        return 0 if all(r.status in (PASS, SKIP) for r in self.results) else 1

    def _stop_requested(self, signum, frame) -> None:
        self.stopped_by = signum

    def _deadline_s(self, remaining: list[PhaseResult]) -> float:
        left = self.budget_s - END_MARGIN_S - self.elapsed()
        phase = remaining[0].phase
        if phase.name in self.deadlines:
            return max(0.0, min(self.deadlines[phase.name], left))
        left -= sum(self.deadlines.get(r.phase.name, 0.0) for r in remaining)  # the later phases' own
        shared = [r.phase.weight for r in remaining if r.phase.name not in self.deadlines]
        return max(0.0, left * phase.weight / sum(shared))

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
        env = {**os.environ, "PYTHONUNBUFFERED": "1", RUN_TAG_ENV: f"{self.tag}-{name}"}
        command = [sys.executable, "-m", "benchmarks.gpu_check.phase", name, "--device", self.device,
                   "--work", str(self.work)]
        print(f"== phase {name}: {result.phase.title} (deadline {result.deadline_s:.0f} s)", flush=True)
        started = time.monotonic()
        with open(self.out / result.log_name(), "w") as log:
            # A group of its own (for the kill), in our session: a caller that ends our session ends it too.
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, process_group=0)
        killed, last_write = False, started
        while process.poll() is None:
            now = time.monotonic()
            if now - started >= result.deadline_s or self.stopped_by is not None:
                killed = True
                _stop(process)
                break
            if now - last_write >= REWRITE_S:
                result.checks = read_checks(records, name, killed=False)
                self.write_summary()
                last_write = now
            time.sleep(POLL_S)
        self._end_phase_processes(process, name)  # whatever it started and left running
        result.seconds = time.monotonic() - started
        result.returncode = process.returncode
        result.checks = read_checks(records, name, killed)
        if self.stopped_by is not None:
            result.checks.append(Check(name, f"{name} phase", TIMEOUT,
                                       detail=f"the whole run was stopped ({signal.Signals(self.stopped_by).name})"))
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

    def _end_phase_processes(self, process: subprocess.Popen, name: str) -> None:
        """SIGKILL the phase's group and every process carrying its tag; wait (a while) for the phase."""
        _kill_group(process)
        tagged = f"{RUN_TAG_ENV}={self.tag}-{name}".encode()
        for pid in _processes_with(tagged):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            print(f"== phase {name}: its process did not exit {EXIT_WAIT_S:.0f} s after SIGKILL", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # ------------------------------------------------------------------ output
    def _prepare_out(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in (*OUT_FILES, *(r.log_name() for r in self.results)):
            (self.out / name).unlink(missing_ok=True)

    def _start_monitor(self) -> subprocess.Popen | None:
        """nvidia-smi sampling the GPU every 2 s into the work directory (the summary keeps the tail)."""
        if self.device != "cuda" or shutil.which("nvidia-smi") is None:
            return None
        with open(self.work / "nvidia-smi.csv", "w") as csv:
            return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,memory.used,utilization.gpu,power.draw",
                                     "--format=csv", "-l", "2"], stdout=csv, stderr=subprocess.STDOUT,
                                    process_group=0)

    def _nvidia_smi(self) -> list[str]:
        path = self.work / "nvidia-smi.csv"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return lines[:1] + lines[1:][-NVIDIA_SMI_LINES:]

    def summary(self) -> dict:
        return {"device": self.device, "budget_s": self.budget_s, "elapsed_s": round(self.elapsed(), 1),
                "environment": self.environment, "phases": [r.to_json() for r in self.results],
                "figures": {k: self.figures.get(k) for k in ("mode", "model", "dtype", "sections", "errors")
                            if k in self.figures},
                "nvidia_smi": self._nvidia_smi()}

    def write_summary(self) -> dict:
        summary = self.summary()
        partial = self.out / "summary.json.partial"
        partial.write_text(json.dumps(_finite(summary), indent=1, default=str, allow_nan=False))
        partial.replace(self.out / "summary.json")  # a reader never sees half a file
        (self.out / "summary.txt").write_text(render(summary) + "\n")
        return summary


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
    try:
        process.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


def _processes_with(entry: bytes) -> list[int]:
    """The processes whose environment holds `entry` (NAME=value), this one excepted."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if entry in environ.split(b"\0"):
            found.append(int(proc.name))
    return found


def _finite(value):
    """`value` with every NaN and infinity as None: what strict JSON readers accept."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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
