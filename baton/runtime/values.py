"""How settings' values are written on a command line or in an environment variable:
sizes (512M), lists (a,b), Linux CPU lists (0-3,8), port ranges (40000-40099), booleans.
Each parser raises ValueError with a one-line message naming the expected form."""

from __future__ import annotations

from collections.abc import Iterable


def parse_size(text: str) -> int:
    """Bytes from '512M', '2G', '1.5GiB', '1048576'."""
    units = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if value and value[-1] in units:
            return int(float(value[:-1]) * units[value[-1]])
        return int(value)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 2G or a number of bytes)") from None


def format_size(num_bytes: int) -> str:
    """The shortest exact form parse_size reads back: 1073741824 -> '1G'."""
    for unit, size in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)


def parse_list(text: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _parse_range(part: str) -> tuple[int, int]:
    """'3-7' -> (3, 7); '3' -> (3, 3). ValueError if not numbers (bounds unchecked)."""
    first, dash, last = part.strip().partition("-")
    return int(first), int(last if dash else first)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A Linux CPU list, '0-3,8' -> (0, 1, 2, 3, 8) (as taskset -c and cpuset files write them)."""
    cpus: set[int] = set()
    for part in parse_list(text):
        try:
            low, high = _parse_range(part)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (use e.g. 0-3,8)") from None
        if not 0 <= low <= high:
            raise ValueError(f"not a CPU list: {text!r} (ranges go low-high, from 0)")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))  # empty: every core


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8', what parse_cpu_list reads back."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{low}-{high}" if high > low else str(low) for low, high in runs)


def parse_port_range(text: str) -> tuple[int, int]:
    """'40000-40099' -> (40000, 40099); '40000' -> (40000, 40000)."""
    try:
        low, high = _parse_range(text)
    except ValueError:
        raise ValueError(f"not a port range: {text!r} (use e.g. 40000-40099)") from None
    if not 1 <= low <= high <= 65535:
        raise ValueError(f"not a port range: {text!r} (low-high, within 1-65535)")
    return low, high


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")
