"""The engine's speculation: before each step it gives the decoding rows proposals
(prompt lookup, or a draft model: engine/spec_decode/draft.py), and after it keeps, per
row, the proposals the model's own samples agree with.

Checking. A row with proposals d_1..d_k runs its last token and them in one forward
pass and samples every position with the ordinary sampler: t_1..t_{k+1}, t_i being what
the model samples after d_{i-1}. The row keeps d_1..d_m for the longest prefix with
t_i = d_i, then t_{m+1}: m+1 tokens. For a greedy row t_i is the argmax, so the tokens
are exactly plain greedy decoding's. For a sampled row this is rejection sampling with
a point-mass proposal (engine/spec_decode/acceptance.py): d_i is kept with probability
p_i(d_i), and on rejection t_i, conditioned on differing from d_i, is distributed as the
residual p_i without d_i, renormalised; so the tokens are distributed exactly as plain
sampling's, with every logit edit (temperature, top-k/p, min-p, logit bias, allowed and
banned ids) applied by the sampler as before. A seeded row's generator made k+1 draws; it
is rewound to make only the m+1 that plain decoding would have made, so a seeded request
gives the same tokens with speculation as without.

Which rows speculate. Rows whose sampling depends on the tokens before each position in
ways the sampler reads from the request (repetition, presence and frequency penalties,
bad words, min_tokens not yet reached, a grammar) decode one token at a time, as do rows
still prefilling. Every other decoding row proposes as many tokens as pay: with its
acceptance rate a, k proposals yield E(k) = 1 + a + ... + a^k tokens for k extra tokens of
step time, and the step-time model (engine/runner/step_time.py) knows both: a step of e decode
entries (a row's token, or a proposal) takes base + per_entry * e. A row picks
the k that maximises the batch's tokens per second; 0 when speculating would be slower
(the off-switch), after which it still proposes one token on the engine's probe steps
(one in PROBE_STEPS, the same step for every row), to notice when its output starts copying.

Overlap. The steps that check nothing overlap (LLMEngine.step); one that checks waits for
the step in flight, since proposals follow each row's last token. In such an engine a row
whose lookup found nothing also waits for the next probe step before it looks again, and
rows that do not speculate probe together: speculation that does not pay costs the overlap
of one step in PROBE_STEPS, whatever the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import SpeculativeConfig
from engine.request import PENDING_TOKEN, Request
from engine.runner.step_time import StepTimeModel
from engine.sampling.sampler import skip_sample_draw
from engine.spec_decode.acceptance import accept_agreeing
from engine.spec_decode.draft import DraftProposer
from engine.spec_decode.ngram import NgramIndex

# A row that chose not to speculate proposes one token on one step in this many.
PROBE_STEPS = 16
# A row's acceptance rate is its own, pulled toward the engine's by this many proposals.
PRIOR_PROPOSALS = 4.0
INITIAL_ACCEPTANCE = 0.5


@dataclass(frozen=True, slots=True)
class SpecStats:
    """Speculation's counts since the engine started (all zero when it is off)."""

    num_checks: int  # rows that checked proposals, one per row and step
    num_proposed: int
    num_accepted: int
    num_emitted: int  # tokens those rows emitted (accepted proposals and one of the model's each)
    proposed_by_position: tuple[int, ...]  # [k]: rows that proposed a token at position i + 1
    accepted_by_position: tuple[int, ...]  # [k]: rows whose proposal i + 1 was accepted
    plain_steps_saved: float  # what those tokens would have taken as plain decode steps, less
    # what the checks cost, in decode steps (the step-time model's): the speed-up it earned

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0


class Speculator:
    """Proposals before a step, acceptance after it (see the module's docstring)."""

    def __init__(self, config: SpeculativeConfig, step_time: StepTimeModel, max_model_len: int,
                 vocab_size: int, logits_dtype: torch.dtype, draft: DraftProposer | None = None,
                 backoff_empty: bool = False) -> None:
        self.config = config
        self.draft = draft  # the draft model's proposals (method "draft"), else prompt lookup
        self.step_time = step_time
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.logits_dtype = logits_dtype
        k = config.num_speculative_tokens
        self.acceptance = INITIAL_ACCEPTANCE  # every row's checks so far, pooled
        self._checked = self._accepted = 0
        self._proposed_by_position = [0] * k
        self._accepted_by_position = [0] * k
        self._num_checks = self._num_emitted = 0
        self._steps_saved = 0.0
        self._relative_cost = 0.0  # an extra token's time, in decode steps, of the last plan
        self.backoff_empty = backoff_empty  # see `propose`: an engine that overlaps its steps
        self._num_plans = 0

    # ------------------------------------------------------------- proposals
    def plan(self, running: Sequence[Request]) -> list[tuple[Request, int]]:
        """The rows of the batch about to be scheduled that check proposals, and how many
        each at most: the off-switch and the probes. Called once a step, before its last
        tokens need be known: a row whose token is still in flight (overlapped scheduling)
        is planned as if it were. An empty plan lets the engine overlap the step."""
        num_rows = len(running)
        line = self.step_time.entry_line()
        step_s, token_s = line.seconds(num_rows), line.per_seq_s
        self._relative_cost = token_s / step_s if step_s > 0 else 0.0
        config = self.config
        self._num_plans += 1
        probe = self._num_plans % PROBE_STEPS == 0
        planned: list[tuple[Request, int]] = []
        for request in running:
            if not can_speculate(request, in_flight=True):
                continue
            k = config.num_speculative_tokens
            if config.adaptive:
                k = best_num_proposals(self.row_acceptance(request), num_rows, step_s, token_s, k)
            if k == 0 or request.spec_backoff:  # not paying, or backing off after an empty lookup
                if not probe:
                    continue
                k = max(k, 1)
            # Tokens it may still emit past the next one, and positions the model has.
            left = request.max_num_tokens(self.max_model_len) - len(request.all_token_ids)
            if min(k, left - 1) > 0:
                planned.append((request, min(k, left - 1)))
        return planned

    def propose(self, running: Sequence[Request], planned: Sequence[tuple[Request, int]]) -> None:
        """Give the planned rows, now that their last tokens are known, their proposals
        (`Request.spec_token_ids`; empty for every other row). With `backoff_empty` set, a
        row the proposer found nothing for waits for the next probe step before it looks
        again: an engine that overlaps its other steps gives that up for each step that checks."""
        for request in running:
            request.spec_token_ids = []
        live = set(id(request) for request in running)
        chosen = [(request, k) for request, k in planned if id(request) in live and can_speculate(request)]
        if self.draft is not None:
            self.draft.propose([request for request, _ in chosen], [k for _, k in chosen])
        for request, k in chosen:
            if self.draft is None:
                if request.spec_index is None:
                    request.spec_index = NgramIndex(self.config.prompt_lookup_max, self.config.prompt_lookup_min)
                request.spec_token_ids = request.spec_index.propose(request.all_token_ids, k)
            request.spec_backoff = self.backoff_empty and not request.spec_token_ids

    def forget(self, request: Request) -> None:
        """A request ended: what the proposer keeps for it goes (a draft's shadow and blocks)."""
        if self.draft is not None:
            self.draft.release(request.request_id)

    def row_acceptance(self, request: Request) -> float:
        """The row's acceptance rate so far, pulled toward the engine's."""
        return ((request.spec_num_accepted + PRIOR_PROPOSALS * self.acceptance)
                / (request.spec_num_checked + PRIOR_PROPOSALS))

    # ------------------------------------------------------------ acceptance
    def accept(self, requests: Sequence[Request], token_ids: Sequence[int], counts: Sequence[int],
               proposals: dict[str, list[int]]) -> list[tuple[int, int]]:
        """Each request's kept tokens after a step that checked proposals, as (first row, how
        many) in the step's sampled `token_ids` (`counts`: rows per request,
        ForwardBatch.sample_counts): a checking row keeps what `accept_agreeing` accepts."""
        kept: list[tuple[int, int]] = []
        row = 0
        for request, count in zip(requests, counts):
            num_kept = 1
            if count > 1:
                spec = proposals[request.request_id]
                num_accepted = accept_agreeing(spec, token_ids[row:row + count]).num_accepted
                self._record(request, len(spec), num_accepted)
                num_kept = num_accepted + 1
            kept.append((row, num_kept))
            row += count
        return kept

    def rewind(self, states: Sequence[tuple[Request, torch.Tensor]], num_kept: dict[str, int]) -> None:
        """Seeded rows that checked proposals: their generator back to its state before the
        step, then past the draws of the tokens kept, as plain decoding leaves it."""
        for request, state in states:
            request.generator.set_state(state)
            skip_sample_draw(request.generator, self.vocab_size, self.logits_dtype, num_kept[request.request_id])

    def _record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        num_checked = min(num_accepted + 1, num_proposed)  # up to the first rejection
        request.spec_num_checked += num_checked
        request.spec_num_accepted += num_accepted
        self._checked += num_checked
        self._accepted += num_accepted
        self.acceptance = ((self._accepted + PRIOR_PROPOSALS * INITIAL_ACCEPTANCE)
                           / (self._checked + PRIOR_PROPOSALS))
        for position in range(num_proposed):
            self._proposed_by_position[position] += 1
            self._accepted_by_position[position] += position < num_accepted
        self._num_checks += 1
        self._num_emitted += num_accepted + 1
        self._steps_saved += num_accepted - num_proposed * self._relative_cost

    def stats(self) -> SpecStats:
        return SpecStats(
            num_checks=self._num_checks,
            num_proposed=sum(self._proposed_by_position),
            num_accepted=sum(self._accepted_by_position),
            num_emitted=self._num_emitted,
            proposed_by_position=tuple(self._proposed_by_position),
            accepted_by_position=tuple(self._accepted_by_position),
            plain_steps_saved=self._steps_saved,
        )


def can_speculate(request: Request, in_flight: bool = False) -> bool:
    """Whether a running row may check proposals this step: it is decoding, its last token
    is known (or, `in_flight`, being sampled by the step in flight), and its sampling reads
    nothing of the tokens before each position but what the sampler takes per row (see the
    module's docstring)."""
    params = request.sampling_params
    token_ids = request.all_token_ids
    return (request.num_computed_tokens + 1 == len(token_ids) and (in_flight or token_ids[-1] != PENDING_TOKEN)
            and not request.prefill_only and request.grammar is None and not request.bad_word_ids
            and params.repetition_penalty == 1.0 and not params.has_output_penalty
            and request.num_output_tokens >= params.min_tokens)


def expected_tokens(acceptance: float, num_proposals: int) -> float:
    """Tokens a row emits checking `num_proposals` proposals, each accepted with probability
    `acceptance` once those before it were: 1 + a + ... + a^k."""
    return sum(acceptance ** i for i in range(num_proposals + 1))


def best_num_proposals(acceptance: float, num_rows: int, step_s: float, token_s: float, max_proposals: int) -> int:
    """The proposals (0..max_proposals) that maximise a batch of `num_rows` rows' tokens per
    second when this row alone speculates: (num_rows - 1 + E(k)) / (step_s + k * token_s).
    Without a step-time model yet (step_s 0): all of them if half are accepted, else none."""
    if step_s <= 0:
        return max_proposals if acceptance >= 0.5 else 0
    best, best_rate = 0, num_rows / step_s
    for k in range(1, max_proposals + 1):
        rate = (num_rows - 1 + expected_tokens(acceptance, k)) / (step_s + k * token_s)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
