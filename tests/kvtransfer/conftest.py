"""KV handoff between real processes: ipc, Gloo and NCCL transports, negotiation, rendezvous,
senders and receivers.
They start processes or wait on time: `make test` runs them one at a time
(tests/support/phases.py)."""
