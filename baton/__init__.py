"""Baton's command line (`baton up`, `baton generate`, one role per process) and the
Python stubs generated from protos/: `baton.v1` (public) and `baton.internal.v1`."""
