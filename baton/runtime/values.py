"""How settings' values are written on a command line or in an environment variable:
sizes (512M), one of a fixed set of names (cpu, cuda:N), lists (a,b), Linux CPU lists
(0-3,8), port ranges (40000-40099), booleans. Each parser raises ValueError with a
one-line message naming the expected form."""

from __future__ import annotations

import re
from collections.abc import Iterable

_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
# A number, then optionally K/M/G/T (with an optional iB or B) or B alone: 512M, 4GiB, 1.5G, 1048576B, 4.
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:I?B)?|(B))?", re.IGNORECASE | re.ASCII)


def _size_match(text: str) -> re.Match[str]:
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 4GiB or 1048576B)")
    return match


def parse_size(text: str, bare_unit: int = 1) -> int:
    """Bytes from '512M', '4GiB', '1.5G', '4096K', '1048576B'; a bare number ('4') counts
    `bare_unit` bytes each (the setting decides, and says so in its help: see is_bare_size)."""
    number, unit, byte = _size_match(text).groups()
    scale = _SIZE_UNITS[unit.upper()] if unit else 1 if byte else bare_unit
    return int(float(number) * scale)


def is_bare_size(text: str) -> bool:
    """Whether a size is written without a unit ('4', not '4G' or '4B'): its meaning is
    then the setting's, which may surprise (vLLM reads --swap-space 4 as 4 GiB)."""
    _, unit, byte = _size_match(text).groups()
    return not unit and not byte


def format_size(num_bytes: int) -> str:
    """The shortest exact form parse_size reads back, always with a unit (so whatever a
    setting makes of a bare number does not apply): 1073741824 -> '1G', 1000 -> '1000B'."""
    for unit, size in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return f"{num_bytes}B"


def parse_choice(text: str, choices: tuple[str, ...]) -> str:
    """The one of `choices` that `text` names, spelled as `choices` spell it (case aside);
    a choice ending in ':N' stands for any ':<number>' ('cuda:N' takes 'CUDA:1', as 'cuda:1')."""
    value = text.strip()
    for choice in choices:
        if choice.endswith(":N"):
            head, colon, index = value.partition(":")
            prefix = choice.removesuffix(":N")
            if colon and head.lower() == prefix.lower() and index.isascii() and index.isdigit():
                return f"{prefix}:{int(index)}"
        elif value.lower() == choice.lower():
            return choice
    raise ValueError(f"{text!r} is not one of {', '.join(choices)}")


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
