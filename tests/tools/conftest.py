"""The project's own tools: `make gpu-check` on CPU, the kernel build, the benchmarks' smoke
runs.
They start processes or wait on time: `make test` runs them one at a time
(tests/support/phases.py)."""
