"""The sampler's logit edits and a grammar's bitmask on a CUDA GPU (marker `gpu`): the same
logits as on the CPU, and an engine stepping penalties, biases, allowed ids, bad words
and grammars, overlapped and replayed as graphs, with no wait on the device but for its
tokens; every constrained output validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.dummy_models import DummyModel
from engine.request import PENDING_TOKEN
from engine.sampling.batch import PENDING_OUTPUT, SamplingBatch
from engine.sampling.grammar import apply_bitmask
from engine.sampling.inputs import bad_word_bans
from engine.sampling.sampler import apply_logit_edits
from engine.structured_output import StructuredOutput
from engine.tokenizer import dummy_tokenizer
from tests.support.tiny_models import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

VOCAB = 320
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 500},
                                           "tag": {"enum": ["a", "bb", "ccc"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def test_logit_edits_and_the_bitmask_on_cuda_equal_the_cpus():
    params = [SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5),
              SamplingParams(logit_bias={3: 7.0, 9: -3.0}), SamplingParams(allowed_token_ids=[1, 2, 40]),
              SamplingParams(), SamplingParams(frequency_penalty=2.0)]
    histories = [[4, 4, 7], [], [], [1, 5, PENDING_TOKEN], [3, PENDING_OUTPUT]]
    bans = [bad_word_bans([], h) for h in histories[:3]] + [bad_word_bans([(5, 6), (8,)], histories[3])] + [([], [])]
    logits = torch.randn(len(params), 64, generator=torch.Generator().manual_seed(0))
    last = torch.tensor([7, 1, 2, 5, 9])
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 2), dtype=torch.int32)
    results = []
    for device in ("cpu", "cuda"):
        batch = SamplingBatch.build(params, output_histories=[[t if t != PENDING_TOKEN else PENDING_OUTPUT for t in h]
                                                              for h in histories],
                                    banned_token_ids=[b[0] for b in bans], ban_conditions=[b[1] for b in bans],
                                    device=device)
        x = logits.clone().to(device)  # on the CPU .to() would edit `logits` itself
        apply_logit_edits(x, batch, last.to(device))
        apply_bitmask(x, torch.tensor([1, 4], device=device), bitmask.to(device))
        results.append(x.cpu())
    assert torch.equal(results[0], results[1])
    assert results[0][3, 6] == float("-inf") and results[0][3, 8] == float("-inf")


def test_constrained_and_penalized_steps_wait_on_the_device_only_for_their_tokens(tmp_path):
    _, model_dir = make_tiny_model(tmp_path, "llama", 4, 2, 16, True, dtype=torch.float32, vocab_size=VOCAB)
    dummy_tokenizer(DummyModel("llama", {"vocab_size": VOCAB, "eos_token_id": 2})).save_pretrained(model_dir)
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
              num_kv_blocks=256)
    engine = llm.engine
    assert engine.overlap.enabled and engine.graph_capture is not None
    options = [
        SamplingParams(temperature=1.0, seed=5, max_tokens=60, structured_output=StructuredOutput(
            json_schema=json.dumps(SCHEMA))),
        SamplingParams(temperature=0.0, max_tokens=60, structured_output=StructuredOutput(regex="[a-d]{2,6}-[0-9]{3}")),
        SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={97: 5.0, 98: 5.0},
                       bad_words=["ab"]),
        SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, allowed_token_ids=list(range(40, 90))),
    ]
    outputs = {}
    for round_index in range(2):  # the first compiles the kernels and fills the caches
        for i, params in enumerate(options):
            engine.add_request([10 + i + j for j in range(5 + 7 * i)], params, request_id=f"{round_index}-{i}")
        torch.cuda.set_sync_debug_mode("error" if round_index else "default")
        try:
            while engine.has_unfinished_requests():
                for out in engine.step().outputs:
                    outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == 256
    tokenizer = engine.tokenizer
    for round_index in range(2):
        texts = [tokenizer.decode(outputs[f"{round_index}-{i}"]) for i in range(len(options))]
        jsonschema.validate(json.loads(texts[0]), SCHEMA)
        assert re.fullmatch("[a-d]{2,6}-[0-9]{3}", texts[1])
        ids = outputs[f"{round_index}-3"]
        assert (97, 98) not in zip(ids, ids[1:])
        assert all(40 <= t < 90 for t in outputs[f"{round_index}-4"])
