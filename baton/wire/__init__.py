"""The wire contract, at the bottom of the serving stack: the stubs generated from
protos/ (`v1`, the public Generation service; `internal.v1`, the workers and the KV
handoff's control plane), the records the rest of Baton works on (`records`), and the
one module that converts between the two (`convert`)."""
