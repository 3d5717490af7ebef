"""The one line of an error that a one-line message quotes."""

from __future__ import annotations


def first_line(error: object, limit: int | None = None) -> str:
    """An error's message (or any object's text), its first line only and at most `limit`
    characters; its type's name if it has none."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if limit is None else line[:limit]
