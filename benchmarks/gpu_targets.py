"""A figure benchmarks/gpu.py judges: its value against the minimum it should reach."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Target:
    """A figure the run should reach: `value` (None: not measured) >= `minimum`."""

    name: str
    description: str
    value: float | None
    minimum: float

    @property
    def passed(self) -> bool | None:
        return None if self.value is None else self.value >= self.minimum

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def line(self) -> str:
        if self.value is None:
            return f"SKIP  {self.name}: {self.description} (not measured)"
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.description}: {self.value:.3g}"

