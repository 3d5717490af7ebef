"""Serving over real processes: deployments, bursts, deadlines, lost and restarted workers,
discovery, the engine thread under cancellation.
They start processes or wait on time: `make test` runs them one at a time
(tests/support/phases.py)."""
