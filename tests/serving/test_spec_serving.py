"""Speculative decoding over real processes, on a mixture-of-experts model (Qwen3-MoE: q/k
norms, routed experts, a dense layer among the sparse ones), as `baton up` starts it
(baton.cli.local.start_deployment), the prefix cache on (the default): decode workers
started with `--speculative ngram` (or `draft`, with a draft model), disaggregated (every
prompt prefilled by the prefill worker and handed off, its KV laid out by the model's
head_dim: the layout check compares it) and colocated. Greedy streams equal transformers'
greedy tokens, seeded ones the tokens an engine without speculation samples; and with a
decode worker killed (-9) mid-stream, the streams it had move to the other decode worker,
which replays their tokens and goes on speculating: every stream equals the undisturbed
run's, and the second round's prompts hit the prefixes the first round cached."""

from __future__ import annotations

import asyncio

import pytest
import torch

from baton.cli.local import start_deployment
from baton.wire.v1 import generation_pb2 as pb
from benchmarks.chaos import Streams
from engine import LLM, SamplingParams
from tests.serving.test_chaos import GATEWAY_ARGS, WORKER_ARGS, DecodeKill
from tests.support.tiny_models import hf_greedy, make_tiny_model, tiny_configs_2026

pytestmark = pytest.mark.timeout(600)

NUM_STREAMS = 8
MAX_TOKENS = 160
SPEC_ARGS = ["--speculative", "ngram", "--num-speculative-tokens", "4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A mixture of experts (Qwen3-MoE: q/k norms, 8 experts, top-3): speculation's
    multi-token steps route each proposed token to its own experts."""
    arch, heads, kv_heads, head_dim, tied, extra = tiny_configs_2026()["qwen3-moe-no-norm-topk-dense-layer"]
    return make_tiny_model(tmp_path_factory.mktemp("spec-model"), arch, heads, kv_heads, head_dim, tied,
                           dtype=torch.float64, **extra)


def prompts() -> list[list[int]]:
    """Each its own phrase, repeated: the tiny model's greedy output falls into loops, and
    prompt lookup is accepted in part."""
    g = torch.Generator().manual_seed(4)
    out = []
    for i in range(NUM_STREAMS):
        phrase = torch.randint(3, 160, (3 + i % 4,), generator=g).tolist()
        out.append(phrase * 3 + [10 + i])
    return out


def requests() -> list[pb.GenerateRequest]:
    """Half greedy, half seeded sampling."""
    out = []
    for i, prompt in enumerate(prompts()):
        sampling = pb.SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=MAX_TOKENS, ignore_eos=True)
        if i % 2 == 0:
            sampling.seed = 200 + i
        out.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling))
    return out


def expected_tokens(tiny) -> list[list[int]]:
    """Greedy: transformers'. Seeded: an engine without speculation, on the same device type."""
    hf_model, model_dir = tiny
    llm = LLM(model_dir, dtype="float64", block_size=4)
    out = []
    for i, prompt in enumerate(prompts()):
        if i % 2:
            out.append(hf_greedy(hf_model, prompt, MAX_TOKENS))
        else:
            params = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=200 + i)
            out.append(llm.generate([prompt], params)[0].token_ids)
    return out


def accepted(deployment) -> int:
    return sum(deployment.stats(p).spec_num_accepted for p in deployment.workers("decode"))


@pytest.mark.parametrize("prefill,method", [(True, "ngram"), (False, "ngram"), (True, "draft")],
                         ids=["disaggregated", "colocated", "disaggregated-draft"])
def test_speculating_decode_workers_serve_the_tokens_of_plain_decoding(tiny, prefill, method, tmp_path):
    _, model_dir = tiny
    want = expected_tokens(tiny)
    # The draft: the served model itself (what matters here is the path, not the speed).
    spec_args = SPEC_ARGS if method == "ngram" else ["--speculative", "draft", "--draft-model", model_dir]
    deployment = start_deployment(model_dir, tmp_path, prefill=prefill, num_decode=2, worker_args=WORKER_ARGS,
                                  decode_args=spec_args, gateway_args=GATEWAY_ARGS)
    try:
        undisturbed = Streams(requests(), timeout_s=120)
        asyncio.run(undisturbed.run(deployment.gateway))
        assert undisturbed.tokens == want, deployment.logs()
        assert accepted(deployment) > 0, "the decode workers never accepted a proposal"
        if prefill:
            handoffs = sum(deployment.stats(p).num_transfers for p in deployment.workers("decode"))
            assert handoffs >= NUM_STREAMS, "every prompt was prefilled on the prefill worker and handed off"
        if not prefill:
            return
        kill = DecodeKill(deployment)
        survivor_accepted = {p.address: deployment.stats(p).spec_num_accepted for p in deployment.workers("decode")}
        disturbed = Streams(requests(), timeout_s=120)
        asyncio.run(disturbed.run(deployment.gateway, kill, when_tokens=20))
        assert disturbed.tokens == want, deployment.logs()
        # Each prompt (10 to 19 tokens, blocks of 4) was cached by the first round: at least
        # its first two blocks are hits on the prefill worker.
        hits = sum(deployment.stats(p).prefix_cache_hit_tokens for p in deployment.workers("prefill"))
        assert hits >= 8 * NUM_STREAMS, hits
        survivor = next(p for p in deployment.workers("decode") if p is not kill.victim)
        assert deployment.stats(survivor).spec_num_accepted > survivor_accepted[survivor.address]
        deployment.restart(kill.victim)
        deployment.wait_idle()
    finally:
        deployment.stop()
