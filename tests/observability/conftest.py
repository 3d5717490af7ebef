"""What a deployment shows of itself: metrics, traces, logs, latency phases, timelines, `baton
status`.
They start processes or wait on time: `make test` runs them one at a time
(tests/support/phases.py)."""
