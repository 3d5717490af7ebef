"""The `baton` command: run a local deployment, one role per process, or a client call.

    baton up [--model M] [--port P]          gateway + prefill worker + decode worker
             [--num-prefill-workers N] [--num-decode-workers N]
    baton gateway --decode-workers ADDR ...  one role per process
    baton prefill-worker --listen ADDR ...
    baton decode-worker --listen ADDR ...
    baton generate "prompt" [--stream] [--max-tokens N] [--chat] ...
    baton status [--gateway ADDR] [--queue-slo-ms MS] [--json]
    baton --version

Every setting of a role is a flag and an environment variable (BATON_ plus the
flag's name in capitals, e.g. --max-num-seqs <- BATON_MAX_NUM_SEQS); a flag given
on the command line wins. Settings, their defaults and the variables are declared
in baton/runtime/settings.py; `baton <command> --help` lists them. A bad value ends
the command with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from baton import version
from baton.cli.preflight import check_model
from baton.runtime.settings import (
    DecodeWorkerSettings,
    GatewaySettings,
    PrefillWorkerSettings,
    SettingsError,
    add_flags,
    from_args,
)

ROLES = {"gateway": GatewaySettings, "prefill-worker": PrefillWorkerSettings,
         "decode-worker": DecodeWorkerSettings}


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (the command and what is wrong), not the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> Parser:
    from baton.cli.client import add_generate_flags
    from baton.cli.launcher import UpSettings
    from baton.cli.status import add_status_flags

    parser = Parser(prog="baton", description="Baton: disaggregated LLM serving over gRPC")
    parser.add_argument("--version", action="version", version=f"baton {version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_flags(commands.add_parser("up", help="run a gateway, prefill workers and decode workers here"),
              UpSettings)
    add_flags(commands.add_parser("gateway", help="run the public gateway"), GatewaySettings)
    add_flags(commands.add_parser("prefill-worker", help="run a prefill worker"), PrefillWorkerSettings)
    add_flags(commands.add_parser("decode-worker", help="run a decode worker"), DecodeWorkerSettings)
    add_generate_flags(commands.add_parser("generate", help="send one request to a gateway"))
    add_status_flags(commands.add_parser(
        "status", help="each worker's health, load and scheduling, with findings"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _command(args.command)(args)
    except SettingsError as error:
        print(f"baton {args.command}: error: {error}", file=sys.stderr)
        return 2


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    if name == "generate":
        from baton.cli.client import generate_command

        return generate_command
    if name == "status":
        from baton.cli.status import status_command

        return status_command
    if name == "up":
        from baton.cli.launcher import up_command

        return up_command
    return _serve_role


def _serve_role(args: argparse.Namespace) -> int:
    """One role in this process, until SIGTERM."""
    from baton.runtime.logs import configure_logging

    settings = from_args(ROLES[args.command], args)
    check_model(settings.model, settings.revision, settings.tokenizer, weights=args.command != "gateway",
                quantization=getattr(settings, "quantization", None))
    configure_logging(settings.log_level, settings.log_format)
    if args.command == "gateway":
        from gateway.server import serve
    elif args.command == "prefill-worker":
        from prefill_worker.server import serve
    else:
        from decode_worker.server import serve
    return serve(settings) or 0  # a worker whose engine failed exits 1


if __name__ == "__main__":
    sys.exit(main())
