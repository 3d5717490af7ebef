"""What a phase of the GPU check reports: one `Check` per line of a JSON-lines file,
appended and flushed as each check ends, so a phase killed at its deadline still leaves
every check it finished (and the one it had started, which the runner marks TIMEOUT)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

PASS, FAIL, TIMEOUT, SKIP = "PASS", "FAIL", "TIMEOUT", "SKIP"
STARTED = "STARTED"  # a check begun and not (yet) ended: a line of its own before its result
# The file a test phase's pytest plugin (pytest_records.py) writes to, and the phase's name.
RECORDS_ENV = "BATON_GPU_CHECK_RECORDS"
PHASE_ENV = "BATON_GPU_CHECK_PHASE"


@dataclass(frozen=True)
class Check:
    """One check: a test, an environment fact, or a figure against its target."""

    phase: str
    name: str
    status: str  # PASS / FAIL / TIMEOUT / SKIP, or STARTED
    value: float | None = None  # the figure, where there is one
    target: str = ""  # e.g. ">= 0.8", or "" for a plain pass/fail check
    unit: str = ""
    detail: str = ""  # why it failed or was skipped, or what the figure means
    seconds: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    def figure(self) -> str:
        """The value as the table prints it."""
        if self.value is None or not math.isfinite(self.value):
            return ""
        text = f"{self.value:.3g}"
        return f"{text} {self.unit}" if self.unit else text


class CheckLog:
    """Appends a phase's checks to its file, one JSON line each, flushed at once."""

    def __init__(self, path: Path, phase: str) -> None:
        self.path = path
        self.phase = phase

    def start(self, name: str) -> None:
        self.write(Check(self.phase, name, STARTED))

    def write(self, check: Check) -> None:
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(json.dumps(check.to_json()) + "\n")
            out.flush()

    def add(self, name: str, status: str, **fields) -> Check:
        check = Check(self.phase, name, status, **fields)
        self.write(check)
        return check


def read_checks(path: Path, phase: str, killed: bool) -> list[Check]:
    """The checks a phase wrote, in order, each name once (its last line). A check that
    started and never ended is TIMEOUT if the phase was killed, else FAIL (it crashed)."""
    if not path.exists():
        return []
    checks: dict[str, Check] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            check = Check(**json.loads(line))
        except (ValueError, TypeError):  # a line cut short by the kill
            continue
        checks.pop(check.name, None)  # ordered by when each check last reported
        checks[check.name] = check
    ended = []
    for check in checks.values():
        if check.status == STARTED:
            status = TIMEOUT if killed else FAIL
            detail = "killed at the phase's deadline while running" if killed else "the phase ended while it ran"
            check = Check(phase, check.name, status, detail=detail)
        ended.append(check)
    return ended
