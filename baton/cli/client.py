"""`baton generate`: one request to a gateway, from the command line."""

from __future__ import annotations

import argparse
import sys

import grpc

from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.top_k is not None:
        sampling.top_k = args.top_k
    if args.seed is not None:
        sampling.seed = args.seed
    request = pb.GenerateRequest(sampling=sampling)
    if args.chat:
        request.messages.messages.add(role="user", content=args.prompt)
    else:
        request.text = args.prompt
    return request


def generate_command(args: argparse.Namespace) -> int:
    request = build_request(args)
    with grpc.insecure_channel(args.gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            if args.stream:
                final = None
                for message in stub.GenerateStream(request, timeout=args.timeout_s):
                    sys.stdout.write(message.text)
                    sys.stdout.flush()
                    final = message
                sys.stdout.write("\n")
            else:
                final = stub.Generate(request, timeout=args.timeout_s)
                print(final.text)
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    reason = pb.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
    print(
        f"[finish: {reason}; prompt tokens: {final.usage.prompt_tokens}; "
        f"completion tokens: {final.usage.completion_tokens}]",
        file=sys.stderr,
    )
    return 0
