"""`baton generate`: one request to a gateway, from the command line."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import grpc

from baton.runtime.clients import GenerationClient
from baton.runtime.settings import DEFAULT_GATEWAY_ADDRESS, add_flags, from_args, setting
from baton.wire.records import ChatMessage, GenerateRequest, TextDelta
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GatewayAddress:
    """Where a client command finds the gateway."""

    gateway: str = setting(DEFAULT_GATEWAY_ADDRESS, "gateway address")


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    add_flags(parser, GatewayAddress)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, help="(default: 1.0, off)")
    parser.add_argument("--top-k", type=int, help="(default: 0, off)")
    parser.add_argument("--seed", type=int, help="(default: none)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
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
    )
    if args.chat:
        return GenerateRequest("", "messages", (ChatMessage("user", args.prompt),), params)
    return GenerateRequest("", "text", args.prompt, params)


def generate_command(args: argparse.Namespace) -> int:
    gateway = from_args(GatewayAddress, args).gateway
    try:
        request = build_request(args)
    except ValueError as error:
        print(f"baton generate: error: {error}", file=sys.stderr)
        return 2
    with grpc.insecure_channel(gateway) as channel:
        client = GenerationClient(channel)
        try:
            if args.stream:
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
