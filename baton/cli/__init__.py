"""The command line, the top of the stack: `baton` and its subcommands, the client,
the local launcher and deployment, and `baton status`. The only code that imports
the role packages (gateway, prefill_worker, decode_worker)."""
