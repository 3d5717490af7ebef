"""The serving runtime every Baton process shares: settings, the gRPC server and
worker bases, typed clients of the internal services, tracing and metrics."""
