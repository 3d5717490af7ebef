"""Which phase of `make test` a folder's tests run in: its conftest.py says.

`make test` runs the tests marked `parallel` first, two at a time (pytest-xdist, one
thread each), then everything else one at a time. A folder whose tests run in this
process only, compute-bound, with no timing and no server (a short git or python
subprocess is fine), marks them all `parallel` from its conftest.py
(`run_in_parallel`); the others (servers, deployments,
deadlines, machine-wide checks such as /dev/shm and network namespaces, which
concurrency would disturb) mark nothing. Tests that start processes on a GPU
(`gpu_servers`) stay out of the parallel phase wherever they live."""

from __future__ import annotations

from pathlib import Path

import pytest


def run_in_parallel(items: list[pytest.Item], conftest: str) -> None:
    """Mark the items of the folder of `conftest` (its __file__) `parallel`."""
    folder = Path(conftest).resolve().parent
    for item in items:
        if item.path.is_relative_to(folder) and item.get_closest_marker("gpu_servers") is None:
            item.add_marker(pytest.mark.parallel)
