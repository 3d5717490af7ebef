"""n > 1 over real processes (gateway + prefill worker + decode worker, every prompt handed
off): greedy choices equal one greedy run, a seeded choice i equals a request of its own
with seed + i (so it depends on nothing else in the batch), the prompt is prefilled and
moved once (the other choices move only its last, partial block), usage counts the prompt
once; the OpenAI client's n over completions and chat, streamed and not. And prompt logprobs,
which the prefill worker computes and the first message carries."""

from __future__ import annotations

import json

import grpc
import openai
import pytest
import torch

from baton.cli.local import start_deployment
from baton.wire.v1 import generation_pb2 as pb
from baton.wire.v1 import generation_pb2_grpc
from engine import LLM, SamplingParams
from engine.outputs import TokenLogprobs
from engine.request import InvalidRequestError
from engine.tokenizer import load_tokenizer
from tests.engine.test_prompt_logprobs import check, hf_prompt_logprobs
from tests.serving.test_serving import VOCAB_SIZE, greedy_request, stream_all
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (transformers', float64) and its directory."""
    directory = tmp_path_factory.mktemp("tiny-choices")
    model, path = make_tiny_model(directory, "llama", 4, 2, 16, True, dtype=torch.float64, vocab_size=VOCAB_SIZE)
    load_tokenizer("smollm2-135m").save_pretrained(directory)
    return model, path


@pytest.fixture(scope="module")
def system(tiny, tmp_path_factory):
    """test_serving's deployment (block size 4, prefix caching on), with the HTTP API."""
    _, path = tiny
    deployment = start_deployment(
        path, tmp_path_factory.mktemp("logs"), http_port=0,
        worker_args=["--dtype", "float64", "--block-size", "4", "--num-kv-blocks", "400"],
        gateway_args=["--max-prefill-queue-tokens", "0", "--max-queued-tokens", "100000"],
    )
    yield deployment
    assert deployment.stop() == {"gateway": 0, "decode": 0, "prefill": 0}, deployment.logs()


def test_llm_generate_runs_n_choices_off_one_prefill(tmp_path):
    """The offline API: n results per prompt, in order; the later choices find all but the
    prompt's last block in the prefix cache; seeded choice i is seed + i."""
    _, path = make_tiny_model(tmp_path, vocab_size=320, dtype=torch.float64)
    llm = LLM(path, dtype="float64", block_size=4)
    prompt = list(range(10, 71))  # 15 full blocks and one token
    outs = llm.generate([prompt, [5, 6, 7]],
                        [SamplingParams(temperature=0.0, max_tokens=5, n=3, ignore_eos=True),
                         SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=4, ignore_eos=True)])
    assert [o.index for o in outs] == [0, 1, 2, 0, 1]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 60, 60]
    alone = llm.generate([[5, 6, 7]] * 2, [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=4, ignore_eos=True)
                                           for i in range(2)])
    assert [o.token_ids for o in outs[3:]] == [o.token_ids for o in alone]
    with pytest.raises(InvalidRequestError) as error:
        llm.engine.add_request([5], SamplingParams(n=2))  # an engine runs one sequence a request
    assert error.value.name == "sampling_params.n"


def with_n(request: pb.GenerateRequest, n: int, **sampling) -> pb.GenerateRequest:
    request.sampling.n = n
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    return request


def test_greedy_choices_equal_one_greedy_run_and_the_usage_counts_the_prompt_once(system, stub):
    prompt = list(range(300, 341))
    single = stub.Generate(greedy_request(prompt, 12), timeout=120)
    answer = stub.Generate(with_n(greedy_request(prompt, 12), 3), timeout=120)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(list(c.token_ids) == list(single.token_ids) for c in answer.choices)
    assert list(answer.token_ids) == list(single.token_ids) and answer.text == single.text
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), 36)
    tokens, _, messages = stream_all(stub, with_n(greedy_request(prompt, 12), 3))
    assert sorted({m.index for m in messages}) == [0, 1, 2]
    finals = [m for m in messages if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert len(finals) == 3 and [m.HasField("usage") for m in finals] == [False, False, True]
    assert finals[-1].usage.prompt_tokens == len(prompt) and finals[-1].usage.completion_tokens == 36
    assert messages[-1] is finals[-1]


def test_seeded_choice_i_equals_its_own_request_with_seed_plus_i(system, stub):
    prompt = list(range(500, 530))

    def sampled(n: int, seed: int) -> list[list[int]]:
        request = with_n(greedy_request(prompt, 10), n, temperature=0.9, top_p=0.95, seed=seed)
        messages = list(stub.GenerateStream(request, timeout=120))
        return [[t for m in messages if m.index == i for t in m.token_ids] for i in range(n)]

    choices = sampled(4, 77)
    assert choices == sampled(4, 77)  # reproducible
    assert [sampled(1, 77 + i)[0] for i in range(4)] == choices  # choice i is seed + i, alone
    assert len({tuple(c) for c in choices}) > 1


def test_the_prompt_is_moved_once_and_the_other_choices_move_its_last_block(system, stub):
    decode = system.worker("decode")
    prompt = list(range(1000, 1061))  # 15 full blocks of 4 and 1 token in a 16th
    before = system.stats(decode)
    stub.Generate(with_n(greedy_request(prompt, 4), 4), timeout=120)
    after = system.stats(decode)
    moved_blocks = (after.num_transferred_bytes - before.num_transferred_bytes) // after.kv_block_bytes
    assert moved_blocks == 16 + 3, moved_blocks  # not 4 x 16


def test_n_is_refused_out_of_range(system, stub):
    for n, sampling, words in ((0, {}, "n must be"), (129, {}, "n must be"),
                               (2, {"seed": 2**63 - 1, "temperature": 1.0}, "seed must be")):
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(with_n(greedy_request([5, 6], 2), n, **sampling), timeout=60)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.value.details()


@pytest.fixture(scope="module")
def client(system):
    return openai.OpenAI(base_url=f"http://{system.http}/v1", api_key="none", max_retries=0)


def test_openai_n_over_completions_and_chat(system, client):
    model = client.models.list().data[0].id
    batch = client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=5, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text and batch.choices[2].text == batch.choices[3].text
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (5, 20)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=3,
                                          max_tokens=6, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=3,
                                                 max_tokens=6, seed=5, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    texts = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {c.index: c.message.content for c in chat.choices}
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 18
    json.dumps(chat.model_dump())  # a plain JSON answer


def test_prompt_logprobs_come_from_the_prefill_worker_over_the_handoff(system, stub, client, tiny):
    """Computed where the prompt is prefilled (the prefill worker, every prompt handed off),
    on the first message; equal to transformers' log-softmax; a cached prompt is computed
    again; with n > 1, once; over HTTP in vLLM's shape."""
    model, _ = tiny
    prompt = list(range(700, 730))
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, :-1].double().log_softmax(dim=-1)
    for _ in range(2):  # the second time the prefix caches hold the prompt
        messages = list(stub.GenerateStream(with_n(greedy_request(prompt, 3), 2, prompt_logprobs=2), timeout=120))
        assert len(messages[0].prompt_logprobs) == len(prompt) - 1
        assert all(not m.prompt_logprobs for m in messages[1:])
        for i, entry in enumerate(messages[0].prompt_logprobs):
            assert entry.token_id == prompt[i + 1]
            assert entry.logprob == pytest.approx(reference[i, prompt[i + 1]].item(), abs=1e-9)
            assert [t.token_id for t in entry.top_logprobs] == reference[i].topk(2).indices.tolist()
    unary = stub.Generate(with_n(greedy_request(prompt, 3), 1, prompt_logprobs=0), timeout=120)
    assert [e.logprob for e in unary.prompt_logprobs] == [e.logprob for e in messages[0].prompt_logprobs]
    model_id = client.models.list().data[0].id
    answer = client.completions.create(model=model_id, prompt=prompt, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1})
    shown = answer.choices[0].model_extra["prompt_logprobs"]
    assert shown[0] is None and len(shown) == len(prompt)
    assert shown[1][str(prompt[1])]["logprob"] == pytest.approx(reference[0, prompt[1]].item(), abs=1e-9)


def test_a_colocated_decode_worker_sends_prompt_logprobs_on_its_first_event(tmp_path):
    """A decode worker that prefills the prompt itself (no prefill worker) computes them and
    its first event carries them."""
    model, path = make_tiny_model(tmp_path, vocab_size=160, dtype=torch.float64)
    deployment = start_deployment(path, tmp_path / "logs", prefill=False,
                                  worker_args=["--dtype", "float64", "--block-size", "4"])
    try:
        prompt = list(range(40, 63))
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2))
        with grpc.insecure_channel(deployment.gateway) as channel:
            messages = list(generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=120))
        entries = [TokenLogprobs(e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top_logprobs))
                   for e in messages[0].prompt_logprobs]
        check(entries, hf_prompt_logprobs(model, prompt), prompt, 2)
        assert all(not m.prompt_logprobs for m in messages[1:])
    finally:
        assert deployment.stop() == {"gateway": 0, "decode": 0}, deployment.logs()
