"""OpenAI's presence and frequency penalties, logit_bias, allowed_token_ids and bad_words:
against a reference of their formulas over Hugging Face logits, row by row in mixed
batches, with overlapped scheduling, and refused when they name ids outside the vocabulary."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.dummy_models import DummyModel
from engine.request import PENDING_TOKEN, InvalidRequestError
from engine.sampling.batch import PENDING_OUTPUT, SamplingBatch
from engine.sampling.inputs import bad_word_bans
from engine.sampling.request_inputs import bad_word_ids
from engine.sampling.sampler import apply_logit_edits
from engine.sampling_params import SamplingParamError
from engine.tokenizer import dummy_tokenizer
from tests.support.tiny_models import make_tiny_model

VOCAB = 320
EOS = 2


def reference_edits(logits: torch.Tensor, params: SamplingParams, generated: list[int],
                    bad_words: list[list[int]] = ()) -> torch.Tensor:
    """The formulas, one row, in plain Python over the vocabulary: OpenAI's penalties over
    the generated tokens, then the biases, then the allowed set, then the bad words."""
    x = logits.clone()
    frequency, presence = f32(params.frequency_penalty), f32(params.presence_penalty)
    for token_id in set(generated):
        x[token_id] -= generated.count(token_id) * frequency + presence
    for token_id, bias in params.logit_bias:
        x[token_id] += f32(bias)
    if params.allowed_token_ids is not None:
        for token_id in range(len(x)):
            if token_id not in params.allowed_token_ids:
                x[token_id] = -math.inf
    for word in bad_words:
        if len(word) == 1 or generated[len(generated) - len(word) + 1:] == list(word[:-1]):
            x[word[-1]] = -math.inf
    return x


def f32(value: float) -> float:
    """The sampler carries penalties and biases as float32."""
    return float(torch.tensor(value, dtype=torch.float32))


def edit_params() -> list[SamplingParams]:
    return [
        SamplingParams(),
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(logit_bias={5: 100.0, 7: -100.0, 9: 3.5}),
        SamplingParams(allowed_token_ids=[3, 4, 5, 40]),
        SamplingParams(frequency_penalty=-2.0, logit_bias={"11": 1.0}, allowed_token_ids=[11, 12, 13]),
        SamplingParams(temperature=0.0, presence_penalty=2.0, logit_bias={6: -1.0}),
    ]


def test_edits_match_the_formulas_and_each_row_gets_what_it_would_alone():
    params = edit_params()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(params), 64, generator=generator, dtype=torch.float64)
    generated = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (0, 5, 9, 3, 0, 7, 4)]
    bad_words = [[], [], [[8], [1, 2]], [], [], [[3, 4, 5]], []]
    generated[2][-1] = 1  # the word [1, 2] follows: 2 is banned on row 2
    batch = build(params, generated, bad_words)
    edited = logits.clone()
    apply_logit_edits(edited, batch)
    for row, p in enumerate(params):
        want = reference_edits(logits[row], p, generated[row], bad_words[row])
        assert torch.equal(edited[row], want), row
        alone = logits[row: row + 1].clone()
        apply_logit_edits(alone, build([p], [generated[row]], [bad_words[row]]))
        assert torch.equal(alone[0], edited[row]), row


def build(params, generated, bad_words, last_token_ids=None):
    bans = [bad_word_bans(words, history) for words, history in zip(bad_words, generated)]
    return SamplingBatch.build(params, output_histories=generated, banned_token_ids=[ids for ids, _ in bans],
                               ban_conditions=[conditions for _, conditions in bans])


def test_a_token_still_on_the_device_counts_and_completes_a_bad_word():
    """Overlapped: the last generated token is PENDING on the host; the sampler reads it on
    the device for the penalties' counts and for a bad word it may complete."""
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    logits = torch.zeros(2, 16, dtype=torch.float64)
    bans = [bad_word_bans([], [4, 4, PENDING_TOKEN]), bad_word_bans([(9, 3), (5, 6)], [1, PENDING_TOKEN])]
    batch = SamplingBatch.build(params, output_histories=[[4, 4, PENDING_OUTPUT], []],
                                banned_token_ids=[ids for ids, _ in bans],
                                ban_conditions=[conditions for _, conditions in bans])
    assert bans[1] == ([3, 6], [9, 5])
    last = torch.tensor([4, 9])  # row 1 was fed 9: "9 3" is completed by a 3, "5 6" not
    apply_logit_edits(logits, batch, last)
    assert logits[0, 4] == -3.0 and logits[0].sum() == -3.0
    assert logits[1, 3] == -math.inf and logits[1, 6] == 0.0


def test_bad_word_bans_read_the_generated_tokens():
    assert bad_word_bans([(7,)], []) == ([7], [-1])
    assert bad_word_bans([(1, 2, 3)], [0, 1, 2]) == ([3], [-1])
    assert bad_word_bans([(1, 2, 3)], [1, 2, 0]) == ([], [])
    assert bad_word_bans([(1, 2, 3)], [0, 1, PENDING_TOKEN]) == ([3], [2])
    assert bad_word_bans([(1, 2, 3)], [0, 5, PENDING_TOKEN]) == ([], [])
    assert bad_word_bans([(1, 2)], [PENDING_TOKEN]) == ([2], [1])
    assert bad_word_bans([(1, 2)], []) == ([], [])


@pytest.mark.parametrize("value, field", [
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -3]), "allowed_token_ids"),
    (dict(bad_words=["ok", ""]), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
])
def test_out_of_range_values_name_their_field(value, field):
    with pytest.raises(SamplingParamError) as error:
        SamplingParams(**value)
    assert error.value.name == field


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A float64 tiny Llama with a byte-level tokenizer of its vocabulary."""
    directory = tmp_path_factory.mktemp("tiny")
    hf_model, path = make_tiny_model(directory, vocab_size=VOCAB, dtype=torch.float64)
    dummy_tokenizer(DummyModel("llama", {"vocab_size": VOCAB, "eos_token_id": EOS})).save_pretrained(path)
    return hf_model, path


@torch.no_grad()
def hf_reference(model, prompt: list[int], params: SamplingParams, bad_words=()) -> list[int]:
    """Greedy decoding of the edited Hugging Face logits, recomputed from scratch each token."""
    generated: list[int] = []
    for _ in range(params.max_tokens):
        logits = model(torch.tensor([prompt + generated])).logits[0, -1].double()
        generated.append(int(reference_edits(logits, params, generated, bad_words).argmax()))
    return generated


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_parity_with_the_formulas_over_hf_logits_in_a_mixed_batch(tiny, overlap):
    hf_model, path = tiny
    llm = LLM(path, dtype="float64", block_size=4, max_num_seqs=16, overlap_scheduling=overlap)
    tokenizer = llm.engine.tokenizer
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (5, 12, 3, 9, 7, 6, 10)]
    words = ["w300", "ab"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **extra) for extra in (
        {},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 2.0},
        {"frequency_penalty": -0.5, "presence_penalty": 0.5, "logit_bias": {17: 5.0, 18: -100.0}},
        {"allowed_token_ids": list(range(40, 80))},
        {"bad_words": words, "presence_penalty": 0.3},
        {"logit_bias": {int(t): -100.0 for t in range(3, 60)}},
    )]
    outputs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        bad = bad_word_ids(tokenizer, p.bad_words) if p.bad_words else ()
        assert out.token_ids == hf_reference(hf_model, prompt, p, bad), p
    # Each alone gives what it gave in the batch (float64: the batch changes no row's logits).
    for prompt, p, out in zip(prompts, params, outputs):
        assert llm.generate([prompt], [p])[0].token_ids == out.token_ids
    assert all(40 <= t < 80 for t in outputs[4].token_ids)
    assert not any(w in tokenizer.decode(outputs[5].token_ids) for w in words)


def test_bad_words_are_never_generated_while_sampling(tiny):
    """A word made likely by a bias on each of its tokens never appears whole, sampled with
    overlapped scheduling (its second token's ban waits on the first, still on the device)."""
    _, path = tiny
    llm = LLM(path, dtype="float64", block_size=4, overlap_scheduling=True)
    word = "ab"
    ids = llm.engine.tokenizer.encode(word, add_special_tokens=False)  # bytes: [97, 98]
    assert len(ids) == 2
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True, bad_words=[word],
                             logit_bias={ids[0]: 5.0, ids[1]: 5.0}) for seed in range(8)]
    free = llm.generate([[5, 6, 7]] * 8, [dataclasses.replace(p, bad_words=None) for p in params])
    assert any(tuple(ids) in zip(o.token_ids, o.token_ids[1:]) for o in free), "the biases make the word likely"
    for out in llm.generate([[5, 6, 7]] * 8, params):
        assert ids[0] in out.token_ids
        assert tuple(ids) not in zip(out.token_ids, out.token_ids[1:])


@pytest.mark.parametrize("field, extra", [
    ("stop_token_ids", dict(stop_token_ids=[1, VOCAB])),
    ("logit_bias", dict(logit_bias={3: 1.0, VOCAB + 5: 1.0})),
    ("allowed_token_ids", dict(allowed_token_ids=[4, 5, VOCAB])),
])
def test_ids_outside_the_vocabulary_are_refused_before_a_tensor_sees_them(tiny, field, extra):
    _, path = tiny
    llm = LLM(path, dtype="float64", block_size=4)
    with pytest.raises(InvalidRequestError) as error:
        llm.engine.add_request([5, 6], SamplingParams(**extra))
    assert error.value.name == f"sampling_params.{field}"
    assert error.value.index == (VOCAB + 5 if field == "logit_bias" else 2 if field == "allowed_token_ids" else 1)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[5, 6]], [SamplingParams(max_tokens=3)])[0].token_ids
