"""Speculative decoding's model-free parts (engine/spec_decode): prompt-lookup proposals,
which rows propose on which steps (the off-switch's probes, the back-off after an empty lookup),
and acceptance that emits exactly the target's greedy tokens, or tokens distributed
exactly as the target samples them (a chi-square test over many draws), repeatably for a
seeded generator."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.runner.step_time import StepTimeModel
from engine.sampling_params import SamplingParams
from engine.scheduler.preemption import PreemptionCostModel
from engine.spec_decode.acceptance import accept_agreeing, accept_sampled
from engine.spec_decode.ngram import NgramIndex, propose_ngram
from engine.spec_decode.speculator import PROBE_STEPS, Speculator

# Chi-square critical values at significance 0.001 by degrees of freedom: a correct
# sampler fails one of these about once in a thousand runs; the draws are seeded, so a
# run that passes passes every time.
CHI2_CRITICAL_0_001 = {3: 16.27, 4: 18.47}


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    #           0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # The suffix [6, 7] occurred at 1 and at 6: the latest one wins, followed by 3, 4, 6, 7.
    assert propose_ngram(tokens, 3, max_n=2) == [3, 4, 6]
    # No earlier run of the last 4 or 3 tokens ([4, 6, 7] occurs only at the end): n=2 matches.
    assert propose_ngram(tokens, 2, max_n=4) == [3, 4]
    # A match that overlaps the end continues the repeat.
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], 5, max_n=3) == [3, 1, 2, 3, 1]
    assert propose_ngram([4, 9, 9, 9], 3, max_n=2) == [9, 9, 9]
    assert propose_ngram([1, 2, 3, 4], 3) == []  # nothing repeats
    assert propose_ngram([4], 3) == [] and propose_ngram([], 3) == []
    assert propose_ngram(tokens, 0) == []
    assert propose_ngram(tokens, 3, max_n=4, min_n=3) == []  # no match of 3 or more


def test_prompt_lookup_prefers_a_longer_match_over_a_later_shorter_one():
    tokens = [1, 2, 3, 50, 51, 9, 3, 60, 1, 2, 3]
    # [1, 2, 3] matched at 0 (then 50, 51); a later [3] at 6 would propose 60.
    assert propose_ngram(tokens, 2, max_n=3) == [50, 51]
    assert propose_ngram(tokens, 2, max_n=1) == [60, 1]


def test_greedy_acceptance_takes_the_longest_agreeing_prefix_then_the_targets_token():
    target = [4, 7, 2, 9]
    assert accept_agreeing([4, 7, 2], target).token_ids == [4, 7, 2, 9]  # all, and the bonus
    outcome = accept_agreeing([4, 8, 2], target)  # the 2 after a wrong 8 counts for nothing
    assert (outcome.token_ids, outcome.num_accepted) == ([4, 7], 1)
    assert accept_agreeing([5, 7, 2], target).token_ids == [4]
    assert accept_agreeing([], target[:1]).token_ids == [4]  # nothing proposed


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def sample_many(proposed, target, draft, trials: int, seed: int):
    """The first token's counts, and the second's counts among runs that accepted the first.
    With a draft distribution, each run's proposals are drawn from it (as a draft model's
    are); without, `proposed` is the point mass prompt lookup proposes."""
    generator = torch.Generator().manual_seed(seed)
    vocab = target.shape[1]
    first, second = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    for _ in range(trials):
        if draft is not None:
            proposed = torch.multinomial(draft, 1, generator=generator).squeeze(1)
        outcome = accept_sampled(proposed, target, generator, draft)
        first[outcome.token_ids[0]] += 1
        if outcome.num_accepted >= 1:
            second[outcome.token_ids[1]] += 1
    return first, second


def check_distribution(draft: torch.Tensor | None, seed: int) -> None:
    target = torch.tensor([[0.10, 0.40, 0.20, 0.25, 0.05],   # p_1
                           [0.30, 0.05, 0.15, 0.30, 0.20],   # p_2, after proposal 1 was accepted
                           [0.20, 0.20, 0.20, 0.20, 0.20]], dtype=torch.float64)
    proposed = torch.tensor([2, 0])
    first, second = sample_many(proposed, target, draft, 20000, seed)
    assert chi_square(first, target[0]) < CHI2_CRITICAL_0_001[4], first
    # Given proposal 1 was accepted, the next token is distributed as p_2.
    assert second.sum() > 1000
    assert chi_square(second, target[1]) < CHI2_CRITICAL_0_001[4], second


def test_rejection_sampling_keeps_the_targets_distribution_with_prompt_lookup_proposals():
    check_distribution(None, seed=11)  # a point mass at each proposal


def test_rejection_sampling_keeps_the_targets_distribution_with_a_draft_models_proposals():
    draft = torch.tensor([[0.30, 0.10, 0.40, 0.10, 0.10],
                          [0.50, 0.10, 0.10, 0.20, 0.10]], dtype=torch.float64)
    check_distribution(draft, seed=12)


def test_acceptance_rate_is_what_the_theory_says():
    """With a point mass at d, proposal 1 is accepted with probability p_1(d)."""
    target = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]], dtype=torch.float64)
    generator = torch.Generator().manual_seed(3)
    trials = 20000
    accepted = sum(accept_sampled(torch.tensor([1]), target, generator).num_accepted for _ in range(trials))
    assert abs(accepted / trials - 0.6) < 0.02


def test_a_seeded_generator_repeats_every_outcome():
    target = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    proposed = torch.tensor([3, 17, 8])
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(1234)
        runs.append([accept_sampled(proposed, target, generator).token_ids for _ in range(200)])
    assert runs[0] == runs[1] and len({tuple(r) for r in runs[0]}) > 10


def test_a_proposal_the_target_cannot_make_is_always_rejected():
    target = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    generator = torch.Generator().manual_seed(5)
    for _ in range(200):
        outcome = accept_sampled(torch.tensor([0]), target, generator)
        assert outcome.num_accepted == 0 and outcome.token_ids[0] in (1, 2)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3), st.integers(2, 20), st.integers(0, 2**31))
def test_the_lookup_index_proposes_what_the_search_does(min_n, extra_n, vocab_size, seed):
    import random

    rng = random.Random(seed)
    max_n = min_n + extra_n
    index = NgramIndex(max_n, min_n)
    tokens = [rng.randrange(vocab_size) for _ in range(rng.randrange(3))]
    for _ in range(30):  # a row's tokens grow by a step's accepted tokens at a time
        num_tokens = rng.randrange(6)
        assert index.propose(tokens, num_tokens) == propose_ngram(tokens, num_tokens, max_n, min_n)
        tokens += [rng.randrange(vocab_size) for _ in range(rng.randint(1, 4))]


def decoding_row(index: int, prompt: list[int]) -> Request:
    """A row whose last token is sampled and the rest computed."""
    request = Request(f"r{index}", prompt, SamplingParams(temperature=0.0, max_tokens=100))
    request.num_computed_tokens = len(prompt) - 1
    return request


def speculator_with_proposals_costing(seconds_per_entry: float, base_s: float = 0.010) -> Speculator:
    """An n-gram speculator whose step-time model says a step of e entries takes base + e x per entry."""
    step_time = StepTimeModel(PreemptionCostModel(bytes_per_block=1))
    for entries in (1, 2, 4, 8, 16):
        for _ in range(4):
            step_time.entries.observe(entries, base_s + seconds_per_entry * entries)
    return Speculator(SpeculativeConfig(method="ngram"), step_time, max_model_len=1000, vocab_size=50,
                      logits_dtype=torch.float32)


def test_rows_that_do_not_speculate_probe_together():
    """Each entry costs a whole step: no row speculates, and all probe with one proposal on
    the same step, one in PROBE_STEPS (an overlapping engine gives up one step's overlap)."""
    speculator = speculator_with_proposals_costing(0.010)
    rows = [decoding_row(i, list(range(10 * i, 10 * i + 12))) for i in range(8)]
    plans = [speculator.plan(rows) for _ in range(3 * PROBE_STEPS)]
    assert [i for i, plan in enumerate(plans) if plan] == [PROBE_STEPS - 1, 2 * PROBE_STEPS - 1, 3 * PROBE_STEPS - 1]
    assert all(sorted(k for _, k in plan) == [1] * 8 for plan in plans if plan)


@pytest.mark.parametrize("backoff", [True, False])
def test_a_row_whose_lookup_found_nothing_backs_off_in_an_overlapping_engine(backoff):
    speculator = speculator_with_proposals_costing(0.00001)  # proposals almost free: every row speculates
    speculator.backoff_empty = backoff
    rows = [decoding_row(0, list(range(20, 32))),  # no n-gram twice: nothing to look up
            decoding_row(1, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2])]  # ... 1 2: what followed "1 2" before
    plan = speculator.plan(rows)
    assert [k for _, k in plan] == [4, 4]
    speculator.propose(rows, plan)
    assert rows[0].spec_token_ids == [] and rows[1].spec_token_ids == [3, 4, 5, 6]
    assert rows[0].spec_backoff == backoff and not rows[1].spec_backoff
    plans = [speculator.plan(rows) for _ in range(PROBE_STEPS - 1)]
    expected = [rows[1]] if backoff else rows
    assert all([request for request, _ in plan] == expected for plan in plans[:-1])
    assert [request for request, _ in plans[-1]] == rows  # the probe step
