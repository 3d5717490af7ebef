"""Stubs of the internal services (gateway to workers, KV handoff control plane)."""
