"""The 2026 architectures over real processes: a Qwen3-MoE model (q/k norms, routed
experts, a dense layer among the sparse ones) served disaggregated, as
`baton up` starts them (baton.cli.local.start_deployment), with the prefix cache on (the
default) and n-gram speculation on the decode workers. Greedy streams equal
transformers' greedy tokens, the later prompts hit the cached prefix of the first, and
the decode workers accept proposals; disaggregated, every prompt is handed off, its KV
laid out by the model's head_dim (16 here, with hidden 64 and 4 heads: the layout
check compares it)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from baton.cli.local import start_deployment
from baton.wire.v1 import generation_pb2 as pb
from benchmarks.chaos import Streams
from tests.serving.test_chaos import GATEWAY_ARGS, WORKER_ARGS
from tests.support.tiny_models import hf_greedy, make_tiny_model, tiny_configs_2026

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 48
SPEC_ARGS = ["--speculative", "ngram", "--num-speculative-tokens", "3"]
MODEL = "qwen3-moe-no-norm-topk-dense-layer"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    arch, heads, kv_heads, head_dim, tied, extra = tiny_configs_2026()[MODEL]
    return make_tiny_model(tmp_path_factory.mktemp("moe-model"), arch, heads, kv_heads, head_dim, tied,
                           dtype=torch.float64, **extra)


def prompts() -> list[list[int]]:
    """A shared 12-token prefix (three blocks of 4), then each prompt's own repeated phrase
    (the tiny model falls into loops that prompt lookup can propose)."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 160, (12,), generator=g).tolist()
    return [prefix + torch.randint(3, 160, (2 + i % 3,), generator=g).tolist() * 3 for i in range(6)]


def requests(token_lists: list[list[int]]) -> list[pb.GenerateRequest]:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=sampling) for p in token_lists]


def test_a_moe_model_serves_transformers_greedy_tokens(tiny, tmp_path):
    """Disaggregated; tests/serving/test_spec_serving.py serves a MoE model colocated too."""
    prefill = True
    hf_model, model_dir = tiny
    token_lists = prompts()
    want = [hf_greedy(hf_model, p, MAX_TOKENS) for p in token_lists]
    deployment = start_deployment(model_dir, tmp_path, prefill=prefill, num_decode=1, worker_args=WORKER_ARGS,
                                  decode_args=SPEC_ARGS, gateway_args=GATEWAY_ARGS)
    try:
        first = Streams(requests(token_lists[:1]), timeout_s=120)  # its prefix is cached for the rest
        asyncio.run(first.run(deployment.gateway))
        rest = Streams(requests(token_lists[1:]), timeout_s=120)
        asyncio.run(rest.run(deployment.gateway))
        assert first.tokens + rest.tokens == want, deployment.logs()
        prefilling = deployment.workers("prefill" if prefill else "decode")
        assert sum(deployment.stats(p).prefix_cache_hit_tokens for p in prefilling) >= 12 * len(rest.requests)
        decoding = deployment.workers("decode")
        assert sum(deployment.stats(p).spec_num_accepted for p in decoding) > 0
        if prefill:
            assert sum(deployment.stats(p).num_transfers for p in decoding) >= len(token_lists)
        deployment.wait_idle()
    finally:
        deployment.stop()
