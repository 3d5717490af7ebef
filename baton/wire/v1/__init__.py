"""Generated stubs of protos/baton/v1 (the public Generation service). Do not edit."""
