"""Baton's command line (`baton up`, `baton generate`, one role per process) and the
Python stubs generated from protos/: `baton.wire.v1` (public) and `baton.wire.internal.v1`."""
