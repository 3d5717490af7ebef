"""Baton's serving layers, bottom to top (docs/ARCHITECTURE.md draws them):

    baton.wire       the wire contract: stubs generated from protos/, records, conversion
    baton.runtime    what every process shares: settings, gRPC server and worker bases,
                     clients of the internal services, tracing, metrics
    (gateway, prefill_worker, decode_worker: the roles, top-level packages)
    baton.cli        the `baton` command, the only code that imports the roles
    baton.devtools   the stub generator and an in-memory OTLP receiver (tests, benchmarks)
"""

import importlib.metadata
from pathlib import Path


def version() -> str:
    """Baton's version: the installed package's; from a source tree that is not installed
    (the GPU machines run it so), its pyproject's."""
    try:
        return importlib.metadata.version("baton")
    except importlib.metadata.PackageNotFoundError:
        import tomllib

        return tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
