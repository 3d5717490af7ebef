"""The public contract: the OpenAI HTTP API, the gRPC service and its protos, bad input, n,
structured output, the wire records, settings.
They start processes or wait on time: `make test` runs them one at a time
(tests/support/phases.py)."""
