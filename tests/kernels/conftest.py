"""Native CPU and Triton kernels, and the attention backends, against plain-torch references.
In-process and compute-bound: `make test` runs them in its parallel phase
(tests/support/phases.py)."""

from tests.support.phases import run_in_parallel


def pytest_collection_modifyitems(items):
    run_in_parallel(items, __file__)
