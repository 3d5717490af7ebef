"""Sampler and SamplingBatch: support of each truncation, greedy parity, HF
repetition penalty parity, seeded reproducibility across batches, logprobs; on
CPU both the path that reads the data and the general path a GPU takes, and no
host reads while sampling launches (the meta device; a GPU test on CUDA).
SamplingParams' own checks: tests/engine/test_sampling_params.py."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from engine.request import PENDING_TOKEN
from engine.sampling import sampler as sampler_module
from engine.sampling.batch import SamplingBatch
from engine.sampling.sampler import Sampler, apply_repetition_penalty, make_generator, skip_sample_draw
from engine.sampling_params import SamplingParams

# Probabilities with no top-p / min-p boundary near a float tie; placed at
# shuffled token ids so that id order says nothing about rank.
PROBS = [0.30, 0.20, 0.15, 0.10, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.006, 0.004]
PERM = [7, 2, 11, 0, 5, 9, 3, 10, 1, 8, 6, 4]


def designed_logits() -> torch.Tensor:
    logits = torch.empty(len(PROBS), dtype=torch.float64)
    logits[PERM] = torch.tensor(PROBS, dtype=torch.float64).log()
    return logits.float()  # [V]


def reference_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Hugging Face warper order in float64: temperature, top-k, top-p, min-p."""
    x = logits.double() / params.temperature
    if params.top_k > 0:
        kth = x.sort(descending=True).values[min(params.top_k, len(x)) - 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        probs = x.softmax(-1)
        sorted_probs, order = probs.sort(descending=True)
        exclusive = sorted_probs.cumsum(-1) - sorted_probs
        assert (exclusive - params.top_p).abs().min() > 1e-6, "ambiguous test case"
        removed = order[exclusive >= params.top_p]
        x[removed] = float("-inf")
    if params.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return x.softmax(-1)


def sample_many(
    logits_row: torch.Tensor, params: SamplingParams, num_samples: int, seed: int = 0, seeded: bool = False
) -> torch.Tensor:
    """num_samples draws of one row, as a batch of identical rows; with
    `seeded` every row has its own generator (the full-vocab race)."""
    logits = logits_row.expand(num_samples, -1).contiguous()
    generators = [make_generator(seed + i) for i in range(num_samples)] if seeded else None
    batch = SamplingBatch.build([params] * num_samples, generators)
    out = Sampler(torch.Generator().manual_seed(seed))(logits, batch)
    return torch.tensor(out.token_ids)


@pytest.fixture(params=[4, 256], ids=["candidates4", "candidates256"])
def num_candidates(request, monkeypatch):
    """4 candidates of 12 forces the full-vocab race and the sorted top-p fallback."""
    monkeypatch.setattr(sampler_module, "NUM_CANDIDATES", request.param)
    return request.param


@pytest.fixture(params=["reads", "general"])
def path(request, monkeypatch):
    """With "general" the sampler cannot read device values on the host (as on a GPU),
    so it skips no work by looking at the data; it must be exact all the same."""
    if request.param == "general":
        monkeypatch.setattr(sampler_module, "_host_can_read", lambda tensor: False)
    return request.param


TRUNCATIONS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=3),
    SamplingParams(top_k=100),  # larger than the vocab: off
    SamplingParams(top_k=-1),
    SamplingParams(top_p=0.55),
    SamplingParams(top_p=0.7),
    SamplingParams(top_p=0.9),  # wider than 4 candidates: the sorted fallback
    SamplingParams(top_p=1.0),
    SamplingParams(min_p=0.3),
    SamplingParams(min_p=1.0),  # only the most likely token
    SamplingParams(top_k=5, top_p=0.7),
    SamplingParams(temperature=0.5, top_p=0.7),
    SamplingParams(temperature=1.5, top_k=6, top_p=0.9, min_p=0.1),
]


@pytest.mark.parametrize("params", TRUNCATIONS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_truncation_support_and_frequencies(params, num_candidates, seeded, path):
    logits = designed_logits()
    expected = reference_distribution(logits, params)  # [V]
    samples = sample_many(logits, params, num_samples=4000, seeded=seeded)
    counts = torch.bincount(samples, minlength=len(PROBS)).double()
    allowed = expected > 0
    assert set(samples.tolist()) == set(allowed.nonzero()[:, 0].tolist())
    # Frequencies within 5 sigma of the reference distribution.
    sigma = (expected * (1 - expected) / 4000).sqrt()
    assert ((counts / 4000 - expected).abs() <= 5 * sigma + 1e-9).all(), (counts / 4000, expected)


def test_wide_nucleus_on_a_large_vocab(path):
    """A flat distribution whose nucleus is far wider than the candidates."""
    logits = torch.zeros(2000)
    logits[:1000] = 1.0  # mass of the first 1000 ids: e / (e + 1) ~ 0.73
    samples = sample_many(logits, SamplingParams(top_p=0.7), num_samples=200)
    assert samples.max() < 1000 and len(set(samples.tolist())) > 150


def test_rows_of_every_truncation_in_one_batch(path, monkeypatch):
    """Rows of different truncations share a batch (the sampler regroups them, rows
    without top-k first): each row keeps its own distribution."""
    monkeypatch.setattr(sampler_module, "NUM_CANDIDATES", 4)
    kinds = [TRUNCATIONS[i] for i in (1, 2, 5, 7, 9, 13)] + [SamplingParams(temperature=0.0)]
    logits, num_each = designed_logits(), 1500
    params = kinds * num_each
    batch = SamplingBatch.build(params)
    samples = torch.tensor(Sampler(torch.Generator().manual_seed(0))(logits.expand(len(params), -1), batch).token_ids)
    assert (samples[len(kinds) - 1 :: len(kinds)] == logits.argmax()).all()  # the greedy rows
    for k, kind in enumerate(kinds[:-1]):
        expected = reference_distribution(logits, kind)
        mine = samples[k :: len(kinds)]
        assert set(mine.tolist()) == set(expected.nonzero()[:, 0].tolist()), kind
        frequencies = torch.bincount(mine, minlength=len(PROBS)).double() / num_each
        sigma = (expected * (1 - expected) / num_each).sqrt()
        assert ((frequencies - expected).abs() <= 5 * sigma + 1e-9).all(), (kind, frequencies, expected)


@settings(max_examples=40, deadline=None)
@given(
    num_rows=st.integers(1, 6),
    vocab_size=st.integers(2, 300),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_greedy_is_argmax(num_rows, vocab_size, dtype, seed):
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * num_rows)
    out = Sampler(torch.Generator())(logits, batch)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_are_argmax(num_candidates, path):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_p=0.8) for i in range(6)]
    before = logits.clone()
    out = Sampler(torch.Generator())(logits, SamplingBatch.build(params))
    assert [out.token_ids[i] for i in (1, 3, 5)] == logits[[1, 3, 5]].argmax(-1).tolist()
    assert torch.equal(logits, before), "the sampler must not edit the caller's logits"


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = random.Random(0)
    vocab_size = 40
    logits = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    penalties = [1.3, 1.0, 0.7, 2.0]
    histories = [[rng.randrange(vocab_size) for _ in range(n)] for n in (10, 5, 25, 1)]
    expected = logits.clone()
    for i, (penalty, history) in enumerate(zip(penalties, histories)):
        processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
        expected[i] = processor(torch.tensor([history]), logits[i : i + 1].clone())[0]

    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    batch = SamplingBatch.build(params, token_histories=histories)
    actual = logits.clone()
    apply_repetition_penalty(actual, batch)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)

    out = Sampler(torch.Generator())(logits, batch)
    assert out.token_ids == expected.argmax(-1).tolist()


def test_repetition_penalty_counts_the_last_token():
    """The token a row was fed this step counts as seen, whether the host history
    holds it, holds it as PENDING_TOKEN (still on the device), or not at all; a
    token seen again is penalized once (as transformers does)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1)) * 3
    histories = [[3, 4, 5], [3, 4, 5, PENDING_TOKEN], [7, 7, 9], [2]]
    last_token_ids = torch.tensor([6, 6, 7, 11])
    penalties = [1.5, 0.8, 1.5, 1.0]
    expected = logits.clone()
    for i, penalty in enumerate(penalties):
        seen = [t for t in histories[i] if t != PENDING_TOKEN] + [int(last_token_ids[i])]
        processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
        expected[i] = processor(torch.tensor([seen]), logits[i : i + 1].clone())[0]
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    actual = logits.clone()
    apply_repetition_penalty(actual, SamplingBatch.build(params, token_histories=histories), last_token_ids)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)

    # Without the last token, a pending one is not counted.
    actual = logits[1:2].clone()
    apply_repetition_penalty(actual, SamplingBatch.build(params[1:2], token_histories=histories[1:2]))
    expected = RepetitionPenaltyLogitsProcessor(penalty=0.8)(torch.tensor([[3, 4, 5]]), logits[1:2].clone())
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    out = Sampler(torch.Generator())(logits, SamplingBatch.build(params, token_histories=[[0]]))
    assert out.token_ids == [1]


SEEDED = [
    SamplingParams(seed=11, temperature=0.9),
    SamplingParams(seed=12, temperature=0.8, top_p=0.9),
    SamplingParams(seed=13, top_k=20, top_p=0.8),
    SamplingParams(seed=14, temperature=1.2, min_p=0.05),
    SamplingParams(seed=15, temperature=0.7, top_k=5, repetition_penalty=1.2),
]
COMPANIONS = [
    SamplingParams(temperature=0.0),
    SamplingParams(top_p=0.95),
    SamplingParams(temperature=0.6, top_k=3000),
    SamplingParams(seed=99, top_p=0.5),
    SamplingParams(min_p=0.2, repetition_penalty=1.1),
]


def step_logits(request_index: int, step: int, vocab_size: int) -> torch.Tensor:
    """Deterministic logits [V] for one request at one step."""
    generator = torch.Generator().manual_seed(1000 * request_index + step)
    return torch.randn(vocab_size, generator=generator) * 3


@pytest.mark.parametrize("num_candidates", [8, 256], indirect=True)
def test_seeded_rows_do_not_depend_on_the_batch(num_candidates, path):
    vocab_size, num_steps = 2000, 6
    rows = SEEDED + COMPANIONS

    def run(layouts: list[list[int]]) -> dict[int, list[int]]:
        """layouts[step] lists the request indices in row order for that step."""
        generators = {i: make_generator(p.seed) if p.seed is not None else None for i, p in enumerate(rows)}
        outputs: dict[int, list[int]] = {i: [] for i in range(len(rows))}
        sampler = Sampler(torch.Generator().manual_seed(0))
        for step, layout in enumerate(layouts):
            logits = torch.stack([step_logits(i, step, vocab_size) for i in layout])
            batch = SamplingBatch.build(
                [rows[i] for i in layout],
                [generators[i] for i in layout],
                token_histories=[[i, step] + outputs[i] for i in layout],
            )
            for i, token_id in zip(layout, sampler(logits, batch).token_ids):
                outputs[i].append(token_id)
        return outputs

    alone = {i: run([[i]] * num_steps)[i] for i in range(len(SEEDED))}
    rng = random.Random(0)
    for _ in range(3):
        layouts = [rng.sample(range(len(rows)), len(rows)) for _ in range(num_steps)]
        together = run(layouts)
        for i in range(len(SEEDED)):
            assert together[i] == alone[i], (i, layouts)
    assert len({tuple(tokens) for tokens in alone.values()}) == len(SEEDED)


def test_seed_changes_the_sample():
    logits = torch.zeros(1, 1000)
    firsts = set()
    for seed in range(5):
        batch = SamplingBatch.build([SamplingParams(seed=seed)], [make_generator(seed)])
        firsts.add(Sampler(torch.Generator())(logits, batch).token_ids[0])
    assert len(firsts) > 1


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), num_logprobs=st.lists(st.sampled_from([None, 0, 1, 5, 20]), min_size=1, max_size=5))
def test_logprobs_are_raw_log_softmax(seed, num_logprobs):
    num_rows, vocab_size = len(num_logprobs), 64
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 2
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.7, top_k=10, logprobs=n)
        for i, n in enumerate(num_logprobs)
    ]
    out = Sampler(torch.Generator().manual_seed(seed))(logits, SamplingBatch.build(params))
    reference = logits.log_softmax(-1)
    if all(n is None for n in num_logprobs):
        assert out.logprobs is None
        return
    for i, n in enumerate(num_logprobs):
        entry = out.logprobs[i]
        if n is None:
            assert entry is None
            continue
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(reference[i, entry.token_id].item(), abs=1e-5)
        assert len(entry.top_logprobs) == n
        values = [lp for _, lp in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        for token_id, lp in entry.top_logprobs:
            assert lp == pytest.approx(reference[i, token_id].item(), abs=1e-5)
        if n:
            assert entry.top_logprobs[0][0] == reference[i].argmax().item()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_banned_ids_are_never_sampled(seed, temperature):
    num_rows, vocab_size = 64, 30
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed))
    logits[:, 0] = 50.0  # the banned id would win every draw
    banned = [[0, 1] if i % 2 == 0 else [] for i in range(num_rows)]
    params = [SamplingParams(temperature=temperature)] * num_rows
    out = Sampler(torch.Generator().manual_seed(seed))(logits, SamplingBatch.build(params, banned_token_ids=banned))
    for i, token_id in enumerate(out.token_ids):
        if banned[i]:
            assert token_id not in (0, 1)
        else:
            assert token_id == 0


def test_float64_logits_are_supported():
    logits = torch.randn(3, 100, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(top_p=0.5), SamplingParams(seed=3, min_p=0.1)]
    out = Sampler(torch.Generator())(logits, SamplingBatch.build(params, [None, None, make_generator(3)]))
    assert out.token_ids[0] == logits[0].argmax().item()


def mixed_batch(generator_device: torch.device | str) -> tuple[list, list, list, list]:
    """(params, generators, token histories, banned ids) of a batch with a row of each
    kind: greedy (with a penalty and banned ids), unseeded without truncation, with
    top-k, top-p, min-p and all of them, and seeded ones; some ask for logprobs."""
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0.8),
        SamplingParams(top_k=5, logprobs=0),
        SamplingParams(top_p=0.9, repetition_penalty=0.8),
        SamplingParams(min_p=0.05),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.7, min_p=0.01, logprobs=5),
        SamplingParams(seed=5, top_p=0.8),
        SamplingParams(seed=6, temperature=0.7, top_k=3, repetition_penalty=1.1, logprobs=1),
    ]
    generators = [make_generator(p.seed, generator_device) if p.seed is not None else None for p in params]
    histories = [[1, 2, 3, PENDING_TOKEN], [4], [5, 6], [7, 8, 9, 7], [10], [11], [12], [13, 14]]
    banned = [[0, 1], [], [2], [], [3, 4, 5], [], [6], []]
    return params, generators, histories, banned


class HostTensorsToMeta(TorchDispatchMode):
    """Records each op that takes a host tensor (not a 0-dim scalar) and makes a meta one."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" and t.dim() for t in inputs) and any(t.device.type == "meta" for t in outputs):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("num_candidates", [4, 256], indirect=True)
def test_sampling_launches_without_reading_device_values(num_candidates):
    """On the meta device every data-dependent host read (bool(), .item(), .tolist(),
    nonzero()) raises: sampling a batch of every kind of row there proves the launch
    path reads nothing back. The seeded rows' generators are CPU ones (meta tensors
    take any generator and draw nothing); their CUDA draws are checked on a GPU. The
    batch's numbers reach the device in one copy, and nothing else crosses."""
    params, generators, histories, banned = mixed_batch("cpu")
    num_rows, vocab_size = len(params), 300
    logits = torch.empty(num_rows, vocab_size, device="meta")
    last_token_ids = torch.empty(num_rows, dtype=torch.int64, device="meta")
    with HostTensorsToMeta() as mode:
        batch = SamplingBatch.build(params, generators, histories, banned, device="meta")
        sampled = Sampler(torch.Generator()).sample(logits, batch, last_token_ids)
    assert mode.ops == ["aten._to_copy.default"]
    assert sampled.token_ids.device.type == "meta" and sampled.token_ids.shape == (num_rows,)
    assert sampled.token_ids.dtype == torch.int64
    num_asked = sum(p.logprobs is not None for p in params)
    assert sampled.logprobs.shape == (num_asked,) and sampled.top_token_ids.shape == (num_asked, 5)
    assert sampled.copied is None


@pytest.mark.gpu
def test_sampling_on_a_gpu_syncs_only_for_the_result():
    """Under CUDA's sync debug mode ("error": any host sync raises), building the
    batch and sampling it launch without a sync; `result()` then reads the tokens.
    Seeded rows draw from generators on the GPU: alone they sample what they sample
    in the batch, and skip_sample_draw advances a generator as sampling does."""
    device = torch.device("cuda")
    params, _, histories, banned = mixed_batch(device)
    num_rows, vocab_size = len(params), 5000
    logits = (torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(0)) * 3).to(device)
    last_token_ids = torch.arange(20, 20 + num_rows, device=device)
    sampler = Sampler(torch.Generator(device=device).manual_seed(0))

    def sample(rows: list[int], generators: list, sync_mode: str = "default"):
        batch_logits, batch_last = logits[rows], last_token_ids[rows]  # before the mode: indexing by a list syncs
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            batch = SamplingBatch.build([params[i] for i in rows], generators, [histories[i] for i in rows],
                                        [banned[i] for i in rows], device=device)
            sampled = sampler.sample(batch_logits, batch, batch_last)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sampled.result()

    every = list(range(num_rows))
    sample(every, mixed_batch(device)[1])  # warm up: first calls initialize lazily
    generators = mixed_batch(device)[1]
    out = sample(every, generators, sync_mode="error")
    greedy = logits[0].cpu()  # penalized for its history and last token (20), banned ids masked
    seen = torch.tensor([1, 2, 3, 20])
    greedy[seen] = torch.where(greedy[seen] < 0, greedy[seen] * 1.3, greedy[seen] / 1.3)
    greedy[[0, 1]] = float("-inf")
    assert out.token_ids[0] == greedy.argmax().item()
    for i, token_id in enumerate(out.token_ids):
        assert 0 <= token_id < vocab_size and token_id not in banned[i]
        assert (out.logprobs[i] is None) == (params[i].logprobs is None)
    assert out.logprobs[5].token_id == out.token_ids[5] and len(out.logprobs[5].top_logprobs) == 5
    for i, p in enumerate(params):
        if p.seed is not None:
            alone = sample([i], [make_generator(p.seed, device)])
            assert alone.token_ids == [out.token_ids[i]], i
            skipped = make_generator(p.seed, device)
            skip_sample_draw(skipped, vocab_size, logits.dtype)
            assert torch.equal(skipped.get_state(), generators[i].get_state())


def test_skip_sample_draw_advances_the_generator_as_sampling_does():
    generator, skipped = make_generator(3), make_generator(3)
    batch = SamplingBatch.build([SamplingParams(seed=3)] * 2, [None, generator])
    Sampler(torch.Generator())(torch.randn(2, 500), batch)
    skip_sample_draw(skipped, 500, torch.float32)
    assert torch.equal(skipped.get_state(), generator.get_state())


def test_batch_build_flags_row_order_and_ragged_ids():
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 3)
    assert batch.all_greedy and batch.unseeded is None and batch.seeded is None and batch.max_num_logprobs is None
    batch = SamplingBatch.build([SamplingParams(temperature=0, top_p=0.5), SamplingParams(top_k=4, logprobs=3)])
    assert not batch.all_greedy and batch.seeded is None and not batch.edits_logits
    assert not batch.unseeded.any_top_p and batch.unseeded.any_top_k and batch.unseeded.max_top_k == 4
    assert batch.greedy_rows.tolist() == [0] and batch.unseeded.rows.tolist() == [1]
    assert batch.max_num_logprobs == 3 and batch.logprob_rows.tolist() == [1]
    with pytest.raises(ValueError, match="token_histories"):
        SamplingBatch.build([SamplingParams(repetition_penalty=1.5)])

    params = [
        SamplingParams(top_k=5),
        SamplingParams(seed=1, top_p=0.5),
        SamplingParams(min_p=0.1, repetition_penalty=1.2),
        SamplingParams(temperature=0.5, top_p=0.9, repetition_penalty=0.9),
        SamplingParams(temperature=0),
    ]
    generators = [None, make_generator(1), None, None, None]
    batch = SamplingBatch.build(params, generators, token_histories=[[], [], [4, 5, 6], [7], []],
                                banned_token_ids=[[1], [], [], [2, 3, 4], []])
    unseeded = batch.unseeded
    # Nucleus rows, then other rows without top-k, then rows with top-k.
    assert unseeded.rows.tolist() == [3, 2, 0] and (unseeded.num_wide, unseeded.num_nucleus) == (2, 1)
    assert unseeded.temperature.tolist() == [0.5, 1.0, 1.0] and unseeded.top_k.tolist() == [0, 0, 5]
    assert unseeded.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0]) and unseeded.any_min_p
    assert batch.seeded.rows.tolist() == [1] and batch.seeded.generators == (generators[1],)
    assert batch.greedy_rows.tolist() == [4]
    assert batch.penalty_rows.tolist() == [2, 3]
    assert batch.repetition_penalty.tolist() == pytest.approx([1.2, 0.9])
    assert batch.seen_token_ids.tolist() == [[4, 5, 6], [7, -1, -1]]
    # A banned list's pad repeats its first id (every write of a (row, id) is the same).
    assert batch.banned_rows.tolist() == [0, 3] and batch.banned_token_ids.tolist() == [[1, 1, 1], [2, 3, 4]]
