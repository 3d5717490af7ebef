"""Rules the source keeps, checked on the source itself."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("baton", "engine", "gateway", "prefill_worker", "decode_worker", "kvtransfer")


def source_files() -> list[Path]:
    """Every hand-written Python file of the packages (generated stubs excluded)."""
    files = []
    for package in PACKAGES:
        files += [p for p in (REPO_ROOT / package).rglob("*.py") if "_pb2" not in p.name]
    return sorted(files)


def test_no_task_is_left_without_a_reference():
    """asyncio keeps only a weak reference to a task: one created and dropped may be
    collected mid-run. Every create_task / ensure_future result is kept (assigned,
    returned, awaited or passed on), never a bare expression statement."""
    dropped = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                function = node.value.func
                name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
                if name in ("create_task", "ensure_future"):
                    dropped.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert not dropped, f"tasks created without a kept reference: {dropped}"
