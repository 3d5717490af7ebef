"""Structured output across the handoff and a worker's death, over real processes: a gateway,
a prefill worker and two decode workers (every prompt handed off). The prefill worker
samples the first token under the grammar, the decode worker rebuilds the matcher from the
tokens so far; a decode worker killed (-9) mid-stream, its streams move and the worker they
land on replays their tokens into a new matcher: every output still validates, and equals
the undisturbed run's (greedy and seeded)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from baton.cli.local import start_deployment
from baton.wire.v1 import generation_pb2 as pb
from benchmarks.chaos import Streams
from engine.dummy_models import DummyModel
from engine.tokenizer import dummy_tokenizer
from tests.serving.test_chaos import GATEWAY_ARGS, WORKER_ARGS, DecodeKill
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

VOCAB = 320
# 20 five-digit numbers and a short name: about 130 tokens of a byte-level tokenizer, so a
# stream is mid-output when its worker is killed.
SCHEMA = {"type": "object", "properties": {
    "ids": {"type": "array", "items": {"type": "integer", "minimum": 10000, "maximum": 99999},
            "minItems": 20, "maxItems": 20},
    "name": {"type": "string", "maxLength": 6}},
    "required": ["ids", "name"], "additionalProperties": False}
NUM_STREAMS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("structured-model")
    _, model_dir = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64, vocab_size=VOCAB)
    dummy_tokenizer(DummyModel("llama", {"vocab_size": VOCAB, "eos_token_id": 2})).save_pretrained(model_dir)
    deployment = start_deployment(model_dir, tmp_path_factory.mktemp("structured-logs"), num_decode=2,
                                  worker_args=WORKER_ARGS, gateway_args=GATEWAY_ARGS)
    yield deployment
    deployment.stop()


def requests() -> list[pb.GenerateRequest]:
    """Half greedy, half seeded, each its own prompt, all under the schema."""
    out = []
    for i in range(NUM_STREAMS):
        sampling = pb.SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=400, json_schema=json.dumps(SCHEMA))
        if i % 2 == 0:
            sampling.seed = 100 + i
        out.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(20 + i, 30 + 2 * i))), sampling=sampling))
    return out


def texts(streams: Streams) -> list[str]:
    tokenizer = dummy_tokenizer(DummyModel("llama", {"vocab_size": VOCAB, "eos_token_id": 2}))
    return [tokenizer.decode(tokens) for tokens in streams.tokens]


def test_constrained_streams_survive_the_handoff_and_a_decode_worker_killed(cluster):
    undisturbed = Streams(requests(), timeout_s=120)
    asyncio.run(undisturbed.run(cluster.gateway))
    for text in texts(undisturbed):
        jsonschema.validate(json.loads(text), SCHEMA)
    handoffs = sum(cluster.stats(p).num_transfers for p in cluster.workers("decode"))
    assert handoffs >= NUM_STREAMS, "every prompt was prefilled on the prefill worker and handed off"

    kill = DecodeKill(cluster)
    disturbed = Streams(requests(), timeout_s=120)
    asyncio.run(disturbed.run(cluster.gateway, kill, when_tokens=30))
    assert disturbed.tokens == undisturbed.tokens, cluster.logs()
    for text in texts(disturbed):
        jsonschema.validate(json.loads(text), SCHEMA)
    cluster.restart(kill.victim)
    cluster.wait_idle()
