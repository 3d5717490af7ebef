"""Decode worker: continuous batching over decodes; pulls handed-off KV, or prefills itself (colocated)."""
