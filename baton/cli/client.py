"""`baton generate`: one request to a gateway, from the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from dataclasses import dataclass, field

import grpc

from baton.runtime.clients import GenerationClient
from baton.runtime.security import TlsConfig
from baton.runtime.server import open_blocking_channel
from baton.runtime.settings import (
    API_KEY_FILE_HELP,
    DEFAULT_GATEWAY_ADDRESS,
    TLS_SERVER_NAME_HELP,
    add_flags,
    from_args,
    load_api_key,
    setting,
)
from baton.wire.records import ChatMessage, GenerateRequest, TextDelta
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput


@dataclass(frozen=True)
class GatewayConnection:
    """Where and how a client command reaches the gateway: its address, TLS, the API key."""

    gateway: str = setting(DEFAULT_GATEWAY_ADDRESS, "gateway address")
    api_key: str | None = setting(None, "API key, sent as 'authorization: Bearer <key>'", shown="none",
                                  secret=True)
    api_key_file: str | None = setting(None, API_KEY_FILE_HELP)
    tls_ca: str | None = setting(None, "PEM CA bundle to verify the gateway's certificate against (TLS)",
                                 shown="plaintext")
    tls_cert: str | None = setting(None, "PEM client certificate (mutual TLS: the admin port with a CA)")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert")
    tls_server_name: str | None = setting(None, TLS_SERVER_NAME_HELP, shown="the host dialled")
    # Built from the settings above (files read on construction).
    tls: TlsConfig | None = field(init=False, repr=False, compare=False)
    bearer_key: str | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tls", TlsConfig.load(self.tls_cert, self.tls_key, self.tls_ca,
                                                       self.tls_server_name, serving=False))
        object.__setattr__(self, "bearer_key", load_api_key(self.api_key, self.api_key_file))

    def open_channel(self) -> grpc.Channel:
        return open_blocking_channel(self.gateway, self.tls)


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    add_flags(parser, GatewayConnection)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, help="(default: 1.0, off)")
    parser.add_argument("--top-k", type=int, help="(default: 0, off)")
    parser.add_argument("--seed", type=int, help="(default: none)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("-n", type=int, default=1, help="choices for the prompt, each printed under its index "
                        "(default: %(default)s)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default: off)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default: off)")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE",
                            help="the output is JSON valid against this schema (default: none)")
    constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object (default: off)")
    constraint.add_argument("--regex", help="the output matches this regular expression (default: none)")
    constraint.add_argument("--choice", action="append",
                            help="the output is one of these strings (repeatable; default: none)")
    constraint.add_argument("--grammar", metavar="FILE",
                            help="the output follows this Lark or GBNF grammar (default: none)")
    parser.add_argument("--pretty-json", action="store_true",
                        help="JSON with newlines and indentation (default: compact)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="(default: %(default)s)")


def build_request(args: argparse.Namespace) -> GenerateRequest:
    """ValueError (the engine's words) for out-of-range sampling flags."""
    defaults = SamplingParams()
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=defaults.top_p if args.top_p is None else args.top_p,
        top_k=defaults.top_k if args.top_k is None else args.top_k,
        seed=args.seed,
        stop=list(args.stop),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        structured_output=_structured_output(args),
        n=args.n,
    )
    if args.chat:
        return GenerateRequest("", "messages", (ChatMessage("user", args.prompt),), params)
    return GenerateRequest("", "text", args.prompt, params)


def _print_choices(deltas, n: int) -> TextDelta:
    """Each choice's text under its index, once all are done; the stream's last delta."""
    texts = [""] * n
    final = None
    for final in deltas:
        texts[final.index] += final.text
    for index, text in enumerate(texts):
        print(f"--- choice {index}\n{text}")
    return final


def _structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    """The flags' constraint (files read here); ValueError naming the flag at fault."""
    fields: dict = {}
    if args.json_schema or args.grammar:
        flag, path = ("--json-schema", args.json_schema) if args.json_schema else ("--grammar", args.grammar)
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"{flag}: {error}") from None
        fields["json_schema" if args.json_schema else "grammar"] = text
    elif args.json_object:
        fields["json_object"] = True
    elif args.regex:
        fields["regex"] = args.regex
    elif args.choice:
        fields["choice"] = tuple(args.choice)
    if not fields:
        return None
    return StructuredOutput(**fields, pretty_json=args.pretty_json)


def generate_command(args: argparse.Namespace) -> int:
    connection = from_args(GatewayConnection, args)
    try:
        request = build_request(args)
    except ValueError as error:
        print(f"baton generate: error: {error}", file=sys.stderr)
        return 2
    with connection.open_channel() as channel:
        client = GenerationClient(channel, connection.bearer_key)
        try:
            if request.params.n > 1:
                final = _print_choices(client.generate_stream(request, timeout=args.timeout_s), request.params.n)
            elif args.stream:
                final: TextDelta | None = None
                for final in client.generate_stream(request, timeout=args.timeout_s):
                    sys.stdout.write(final.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
            else:
                final = client.generate(request, timeout=args.timeout_s)
                print(final.text)
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    print(
        f"[finish: {final.finish_reason or 'unspecified'}; prompt tokens: {final.num_prompt_tokens}; "
        f"completion tokens: {final.num_completion_tokens}]",
        file=sys.stderr,
    )
    return 0
