"""Generated stubs of protos/baton/internal/v1. Do not edit."""
