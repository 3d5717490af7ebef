"""The sampler's inputs for one step, decided on the host and sent in one copy.

`SamplingBatch.build` reads only the rows' SamplingParams (host data), so every
branch the sampler takes is known before it launches anything. The rows fall
into three classes: greedy rows (argmax), unseeded rows (the engine generator)
and seeded rows (each its own generator). Every number the device needs goes
into one int64 host buffer (pinned for CUDA), float32 parts two to an int64,
and reaches the device in one non-blocking copy; the batch's tensors are views
of it:

    [ greedy rows | unseeded: rows, top_k, temperature, top_p, min_p | seeded: the same
      | penalty rows, penalties, seen ids P x L
      | output-penalty rows, presence, frequency, output ids Q x L
      | bias rows, ids, biases B x M | allowed rows, ids A x M
      | banned rows, banned ids, conditions B x M | logprob rows ]

Ragged id lists are padded with -1 (the seen and output ids; the sampler reads a
pad as no token), or with the row's first entry again (bias, allowed and banned
lists, written with an accumulating scatter or one value, so a repeated entry
changes nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.sampling_params import SamplingParams

# In an output history (`output_histories`): a generated token still on the device.
PENDING_OUTPUT = -2


@dataclass(frozen=True, slots=True)
class SamplingRows:
    """One class of sampled rows: the unseeded rows or the seeded ones, ordered

        [ nucleus rows | other rows without top-k | rows with top-k ]

    The first `num_wide` rows have no top-k, so their support may pass the
    candidates; the first `num_nucleus` of them have a top-p, so their nucleus
    may too. A row with top-k keeps at most its k best tokens, all candidates.
    Parameters are in this order."""

    rows: Tensor | None  # [N] int64 batch rows; None: every batch row, in batch order
    temperature: Tensor  # [N] float32
    top_k: Tensor  # [N] int64, 0 = off
    top_p: Tensor  # [N] float32, 1.0 = off
    min_p: Tensor  # [N] float32, 0.0 = off
    num_wide: int
    num_nucleus: int
    max_top_k: int
    any_top_p: bool
    any_min_p: bool
    generators: tuple[torch.Generator, ...] | None  # seeded rows: row j's own; None: unseeded

    @property
    def any_top_k(self) -> bool:
        return self.max_top_k > 0


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Sampling inputs for the S rows that sample this step, in row order; built by
    the runner each step with `build`. Tensors live on the step's device."""

    num_rows: int
    all_greedy: bool
    greedy_rows: Tensor | None  # [G] int64; None when no row is greedy or every row is
    unseeded: SamplingRows | None  # rows drawing from the engine generator
    seeded: SamplingRows | None  # rows drawing from their own generators
    penalty_rows: Tensor | None  # [P] int64 rows with a repetition penalty; None: none
    repetition_penalty: Tensor | None  # [P] float32
    # [P, L] int64: the ids each has seen (prompt + output), -1 where unknown (padding,
    # or PENDING_TOKEN: a token still on the device, which `last_token_ids` supplies).
    seen_token_ids: Tensor | None
    # OpenAI's presence and frequency penalties, over each row's generated tokens.
    output_penalty_rows: Tensor | None  # [Q] int64; None: no row has one
    presence_penalty: Tensor | None  # [Q] float32
    frequency_penalty: Tensor | None  # [Q] float32
    # [Q, L] int64 generated ids: -1 padding, PENDING_OUTPUT where the token is still on
    # the device (the step's `last_token_ids` holds it).
    output_token_ids: Tensor | None
    bias_rows: Tensor | None  # [B] int64 rows with a logit_bias; None: none
    bias_token_ids: Tensor | None  # [B, M] int64
    bias_values: Tensor | None  # [B, M] float32 (a pad repeats the row's first id with bias 0)
    allowed_rows: Tensor | None  # [A] int64 rows sampling only among allowed_token_ids
    allowed_token_ids: Tensor | None  # [A, M] int64
    banned_rows: Tensor | None  # [B] int64 rows with ids masked to -inf; None: none
    # [B, M] int64: EOS / stop ids before min_tokens, bad words' ids. A ban holds where its
    # condition [B, M] is -1, or is the row's last token (`last_token_ids`: a bad word's
    # second-last token, still on the device when overlapped); None: every ban holds.
    banned_token_ids: Tensor | None
    ban_conditions: Tensor | None
    logprob_rows: Tensor | None  # [L] int64 rows that asked for logprobs; None: all (or none)
    num_logprobs: tuple[int | None, ...]  # per row, from SamplingParams.logprobs
    max_num_logprobs: int | None  # None when no row asked for logprobs

    @property
    def needs_last_token(self) -> bool:
        """Whether `Sampler.sample` reads the tokens the rows were fed this step."""
        return self.penalty_rows is not None or self.output_penalty_rows is not None or self.ban_conditions is not None

    @property
    def edits_logits(self) -> bool:
        return (self.penalty_rows is not None or self.output_penalty_rows is not None or self.bias_rows is not None
                or self.allowed_rows is not None or self.banned_rows is not None)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        token_histories: Sequence[Sequence[int]] | None = None,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
        device: torch.device | str = "cpu",
        output_histories: Sequence[Sequence[int]] | None = None,
        ban_conditions: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """`generators[i]`: row i's own generator (on `device`) when its request is
        seeded, else None. `token_histories[i]` (prompt + output ids) is read only for
        rows with a repetition penalty, `output_histories[i]` (generated ids,
        PENDING_OUTPUT for a token still on the device) for rows with an output penalty.
        `banned_token_ids[i]` lists ids masked to -inf for row i, each where its
        `ban_conditions[i]` entry is -1 or the row's last token (None: always)."""
        num_rows = len(params)
        if generators is None:
            generators = (None,) * num_rows
        assert len(generators) == num_rows
        greedy: list[int] = []
        unseeded: list[int] = []
        seeded: list[int] = []
        for row, (p, generator) in enumerate(zip(params, generators)):
            (greedy if p.is_greedy else unseeded if generator is None else seeded).append(row)
        asked = [row for row, p in enumerate(params) if p.logprobs is not None]

        buffer = _HostBuffer()
        parts: dict[str, int] = {}  # a field of the batch -> its part of the buffer
        if greedy and len(greedy) < num_rows:
            parts["greedy_rows"] = buffer.ints(greedy)
        make_unseeded = _plan_rows(buffer, params, unseeded, None, num_rows) if unseeded else None
        make_seeded = _plan_rows(buffer, params, seeded, generators, num_rows) if seeded else None
        _plan_penalties(buffer, parts, params, token_histories, output_histories)
        _plan_masks(buffer, parts, params, banned_token_ids or (), ban_conditions)
        if asked and len(asked) < num_rows:
            parts["logprob_rows"] = buffer.ints(asked)
        views = buffer.send(device)
        return cls(
            num_rows=num_rows,
            all_greedy=len(greedy) == num_rows,
            unseeded=None if make_unseeded is None else make_unseeded(views),
            seeded=None if make_seeded is None else make_seeded(views),
            num_logprobs=tuple(p.logprobs for p in params),
            max_num_logprobs=max((params[row].logprobs for row in asked), default=None),
            **{name: views[parts[name]] if name in parts else None for name in _PARTS},
        )


# The batch's tensors that are parts of the buffer, None where no row needs one.
_PARTS = (
    "greedy_rows", "penalty_rows", "repetition_penalty", "seen_token_ids", "output_penalty_rows", "presence_penalty",
    "frequency_penalty", "output_token_ids", "bias_rows", "bias_token_ids", "bias_values", "allowed_rows",
    "allowed_token_ids", "banned_rows", "banned_token_ids", "ban_conditions", "logprob_rows",
)


def _plan_penalties(buffer: _HostBuffer, parts: dict[str, int], params: Sequence[SamplingParams],
                    token_histories: Sequence[Sequence[int]] | None,
                    output_histories: Sequence[Sequence[int]] | None) -> None:
    """The repetition penalty's rows, values and seen ids; the output penalties' likewise."""
    penalized = [row for row, p in enumerate(params) if p.repetition_penalty != 1.0]
    if penalized and token_histories is None:
        raise ValueError("token_histories are required when a row has a repetition penalty")
    output_penalized = [row for row, p in enumerate(params) if p.has_output_penalty]
    if output_penalized and output_histories is None:
        raise ValueError("output_histories are required when a row has a presence or frequency penalty")
    if penalized:
        parts["penalty_rows"] = buffer.ints(penalized)
        parts["repetition_penalty"] = buffer.floats([params[row].repetition_penalty for row in penalized])
        parts["seen_token_ids"] = buffer.id_lists([token_histories[row] for row in penalized])
    if output_penalized:
        parts["output_penalty_rows"] = buffer.ints(output_penalized)
        parts["presence_penalty"] = buffer.floats([params[row].presence_penalty for row in output_penalized])
        parts["frequency_penalty"] = buffer.floats([params[row].frequency_penalty for row in output_penalized])
        parts["output_token_ids"] = buffer.id_lists([output_histories[row] for row in output_penalized])


def _plan_masks(buffer: _HostBuffer, parts: dict[str, int], params: Sequence[SamplingParams],
                banned_token_ids: Sequence[Sequence[int]], ban_conditions: Sequence[Sequence[int]] | None) -> None:
    """What each row's logits are shifted or masked by: its logit_bias, its allowed ids,
    and its banned ids (with their conditions, where any has one)."""
    biased = [row for row, p in enumerate(params) if p.logit_bias]
    if biased:
        parts["bias_rows"] = buffer.ints(biased)
        parts["bias_token_ids"] = buffer.id_lists([[i for i, _ in params[row].logit_bias] for row in biased],
                                                  pad_first=True)
        parts["bias_values"] = buffer.float_lists([[b for _, b in params[row].logit_bias] for row in biased])
    allowed = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed:
        parts["allowed_rows"] = buffer.ints(allowed)
        parts["allowed_token_ids"] = buffer.id_lists([params[row].allowed_token_ids for row in allowed],
                                                     pad_first=True)
    banned = [row for row, ids in enumerate(banned_token_ids) if ids]
    if banned:
        parts["banned_rows"] = buffer.ints(banned)
        parts["banned_token_ids"] = buffer.id_lists([banned_token_ids[row] for row in banned], pad_first=True)
        if ban_conditions is not None and any(c >= 0 for row in banned for c in ban_conditions[row]):
            parts["ban_conditions"] = buffer.id_lists([ban_conditions[row] for row in banned], pad_first=True)


def _plan_rows(
    buffer: _HostBuffer,
    params: Sequence[SamplingParams],
    rows: list[int],
    generators: Sequence[torch.Generator | None] | None,
    num_batch_rows: int,
) -> Callable[[dict[int, Tensor]], SamplingRows]:
    """Add one class of rows to `buffer`, in SamplingRows order; returns the function
    that makes its SamplingRows from the sent parts."""
    # Stable: nucleus rows, then other rows without top-k, then rows with top-k.
    order = sorted(rows, key=lambda row: (params[row].top_k > 0, params[row].top_p == 1.0))
    ordered = [params[row] for row in order]
    in_batch_order = len(order) == num_batch_rows and order == list(range(num_batch_rows))
    rows_part = None if in_batch_order else buffer.ints(order)
    top_k = buffer.ints([p.top_k for p in ordered])
    temperature = buffer.floats([p.temperature for p in ordered])
    top_p = buffer.floats([p.top_p for p in ordered])
    min_p = buffer.floats([p.min_p for p in ordered])

    def make(views: dict[int, Tensor]) -> SamplingRows:
        return SamplingRows(
            rows=views.get(rows_part),
            temperature=views[temperature],
            top_k=views[top_k],
            top_p=views[top_p],
            min_p=views[min_p],
            num_wide=sum(p.top_k == 0 for p in ordered),
            num_nucleus=sum(p.top_k == 0 and p.top_p < 1.0 for p in ordered),
            max_top_k=max(p.top_k for p in ordered),
            any_top_p=any(p.top_p < 1.0 for p in ordered),
            any_min_p=any(p.min_p > 0.0 for p in ordered),
            generators=None if generators is None else tuple(generators[row] for row in order),
        )

    return make


class _HostBuffer:
    """Parts of one int64 host buffer, sent to the device in one non-blocking copy
    (from pinned memory for CUDA). Each `ints` / `floats` / `id_lists` call returns
    its part's index in what `send` returns: views of the device copy."""

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []  # each part as int64 words
        self._shapes: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def ints(self, values: Sequence[int]) -> int:
        return self._add(np.asarray(values, dtype=np.int64), torch.int64, (len(values),))

    def floats(self, values: Sequence[float]) -> int:
        """float32 values (one dimension), two to an int64 word."""
        array = np.zeros(len(values) + len(values) % 2, dtype=np.float32)
        array[: len(values)] = values
        return self._add(array.view(np.int64), torch.float32, (len(values),))

    def id_lists(self, lists: Sequence[Sequence[int]], pad_first: bool = False) -> int:
        """Ragged id lists as [len(lists), the longest (at least 1)], padded with -1, or
        with each list's first id (`pad_first`: every list has one)."""
        array = np.full((len(lists), max(1, max(map(len, lists)))), -1, dtype=np.int64)
        for row, ids in enumerate(lists):
            array[row, : len(ids)] = ids
            if pad_first:
                array[row, len(ids):] = ids[0]
        return self._add(array.reshape(-1), torch.int64, array.shape)

    def float_lists(self, lists: Sequence[Sequence[float]]) -> int:
        """Ragged float32 lists as [len(lists), the longest], padded with 0."""
        array = np.zeros((len(lists), max(1, max(map(len, lists)))), dtype=np.float32)
        for row, values in enumerate(lists):
            array[row, : len(values)] = values
        words = array.reshape(-1)
        if len(words) % 2:
            words = np.append(words, np.float32(0))
        return self._add(words.view(np.int64), torch.float32, array.shape)

    def _add(self, words: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        self._arrays.append(words)
        self._shapes.append((dtype, shape))
        return len(self._arrays) - 1

    def send(self, device: torch.device | str) -> dict[int, Tensor]:
        """Each part's view of the device copy, by part index."""
        if not self._arrays:
            return {}
        sizes = [len(words) for words in self._arrays]
        host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
        np.concatenate(self._arrays, out=host.numpy())
        buffer = host.to(device, non_blocking=True)  # no copy on CPU
        views = {}
        for index, (part, (dtype, shape)) in enumerate(zip(buffer.split(sizes), self._shapes)):
            if dtype == torch.int64:
                views[index] = part.view(shape)
            else:
                views[index] = part.view(dtype)[: int(np.prod(shape))].view(shape)
        return views
