"""The GPU check's one-screen table, from its summary: a line per phase, then a row per
check (a test function's parametrized cases folded into one row), then the first line of
each failure's reason."""

from __future__ import annotations

from benchmarks.gpu_check.records import FAIL, PASS, SKIP, TIMEOUT, Check

NAME_WIDTH = 58
MAX_FAILURES = 12


def _fold(checks: list[Check]) -> list[tuple[str, str, str, str]]:
    """(name, status, figure, target) rows: tests grouped by function, other checks as they are."""
    rows: list[tuple[str, str, str, str]] = []
    groups: dict[str, list[Check]] = {}
    for check in checks:
        if "::" in check.name:
            groups.setdefault(check.name.split("[")[0], []).append(check)
        else:
            rows.append((check.name, check.status, check.figure(), check.target))
    for name, cases in groups.items():
        statuses = [c.status for c in cases]
        status = next((s for s in (FAIL, TIMEOUT) if s in statuses), SKIP if set(statuses) == {SKIP} else PASS)
        passed = statuses.count(PASS)
        figure = f"{passed}/{len(cases)} pass" if len(cases) > 1 or status != PASS else ""
        rows.append((name, status, figure, ""))
    return rows


def render(summary: dict) -> str:
    env = summary.get("environment", {})
    machine = env.get("gpu") or f"{summary['device']} ({env.get('cpu_count', '?')} cores)"
    lines = [f"Baton GPU check on {machine}: torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
             f"transformers {env.get('transformers', '?')}; {summary['elapsed_s']:.0f} s of {summary['budget_s']:.0f}"]
    failures = []
    for phase in summary["phases"]:
        lines.append(f"\n{phase['name'].upper():<12} {phase['status']:<8} {phase['seconds']:5.0f} s of "
                     f"{phase['deadline_s']:.0f}  {phase['title']}")
        checks = [Check(**c) for c in phase["checks"]]
        for name, status, figure, target in _fold(checks):
            short = name if len(name) <= NAME_WIDTH else "…" + name[-(NAME_WIDTH - 1):]
            lines.append(f"  {short:<{NAME_WIDTH}} {status:<7} {figure:>14}  {target}")
        failures += [c for c in checks if c.status in (FAIL, TIMEOUT)]
    if failures:
        lines.append("\nfailures:")
        for check in failures[:MAX_FAILURES]:
            reason = next((line for line in reversed(check.detail.splitlines()) if line.strip()), "")
            lines.append(f"  {check.phase}/{check.name}: {reason[:150]}")
        if len(failures) > MAX_FAILURES:
            lines.append(f"  ... {len(failures) - MAX_FAILURES} more in summary.json")
    return "\n".join(lines)
