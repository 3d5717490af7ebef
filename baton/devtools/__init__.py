"""Development and test tooling, apart from the runtime: the stub generator and an
in-memory OTLP receiver for tests and benchmarks. Nothing that serves imports it."""
