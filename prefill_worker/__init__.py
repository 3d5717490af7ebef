"""Prefill worker: chunked prefill, first token, KV held under a lease for the handoff."""
