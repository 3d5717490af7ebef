"""The prefix cache's host tier over real processes: gateway + prefill worker + decode
worker (or a decode worker alone, colocated), each with a device cache of about one
conversation and `--kv-offload-memory`. Chats that come back after the others have filled
the device caches find their history in the host tiers: the worker that prefills copies it
back instead of computing it, the decode worker of a handoff instead of receiving it; every
token is transformers', and the usage says how much came from the host tier."""

from __future__ import annotations

import random

import grpc
import pytest
import torch

from baton.cli.local import start_deployment
from baton.wire.v1 import generation_pb2_grpc
from tests.serving.test_serving import greedy_request, stream_all
from tests.support.tiny_models import hf_greedy, make_tiny_model

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("disaggregated", [True, False], ids=["disaggregated", "colocated"])
def test_chats_that_come_back_find_their_history_in_the_host_tiers(tmp_path, disaggregated):
    model, path = make_tiny_model(tmp_path / "model", dtype=torch.float64)
    worker_args = ["--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "24", "--kv-offload-memory", "16M",
                   "--verify-kv"]
    deployment = start_deployment(path, tmp_path / "logs", worker_args=worker_args, prefill=disaggregated,
                                  gateway_args=["--max-prefill-queue-tokens", "0"])  # disaggregated: all handed off
    try:
        rng = random.Random(3)
        system = [rng.randrange(3, 160) for _ in range(40)]
        histories = [system + [rng.randrange(3, 160) for _ in range(rng.randrange(4, 12))] for _ in range(6)]
        host_cached = 0
        with grpc.insecure_channel(deployment.gateway) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for turn in range(2):
                for user, prompt in enumerate(histories):
                    tokens, _, messages = stream_all(stub, greedy_request(prompt, 8, f"u{user}-t{turn}"))
                    assert tokens == hf_greedy(model, prompt, 8), (user, turn)
                    histories[user] = prompt + tokens + [3 + turn, 4 + user, 5]
                    usage = messages[-1].usage
                    if turn:  # the system prompt and the history: cached somewhere
                        assert usage.cached_tokens >= 40
                    assert 0 <= usage.host_cached_tokens <= usage.cached_tokens
                    host_cached += usage.host_cached_tokens
        roles = ("prefill", "decode") if disaggregated else ("decode",)
        prefill, decode = deployment.stats(roles[0]), deployment.stats("decode")
        assert prefill.prefix_cache_host_hit_tokens > 0 and prefill.kv_offload_reloaded_bytes > 0
        assert prefill.kv_offload_reload_seconds > 0
        # The usage's split: what the prefilling worker's host tier gave back (its first admissions').
        assert 0 < host_cached <= prefill.prefix_cache_host_hit_tokens
        if disaggregated:
            assert decode.prefix_cache_host_reused_blocks > 0, "the decode worker received what its host tier held"
            assert decode.num_transfers_verified == decode.num_transfers and decode.num_transfer_failures == 0
        deployment.wait_idle(60)
        for stats in (deployment.stats(role) for role in roles):
            assert stats.num_kv_blocks_used == 0 and stats.num_kv_offload_blocks_cached > 0
    finally:
        codes = deployment.stop()
    assert codes == {"gateway": 0, "decode": 0, **({"prefill": 0} if disaggregated else {})}, deployment.logs()
