"""Proposals by prompt lookup (n-gram speculation): the tokens that followed the latest
earlier occurrence of a row's last n tokens, in its prompt and output so far. No model:
it pays off where the output copies its input (rewriting, summarising, code edits)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int] | np.ndarray, num_tokens: int, max_n: int = 4,
                  min_n: int = 1) -> list[int]:
    """Up to `num_tokens` proposals: for the longest n in max_n..min_n whose last-n tokens
    occurred earlier, the tokens after the latest such occurrence ([]: none found). A match
    that overlaps the end goes on as the repeat it is (the copy reads its own output, as
    in LZ77): after ... 7 8 7 8 7, it proposes 8 7 8 7, not only the one 8 that follows."""
    if num_tokens <= 0 or not 0 < min_n <= max_n:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        # Windows that start before the suffix itself, each compared with the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # what followed the latest match
            period = len(ids) - start  # the copy's distance back
            return np.resize(ids[start:], min(num_tokens, period * num_tokens)).tolist()
    return []


class NgramIndex:
    """`propose_ngram` for one row whose tokens only grow, kept up to date instead of
    searched: where each n-gram (min_n <= n <= max_n) of the row last ended, so that a
    step's proposal costs the new tokens' few dictionary updates, not a pass over all of
    them (a row's every step, at every batch size)."""

    __slots__ = ("min_n", "max_n", "latest", "indexed")

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram: where its latest occurrence ended
        self.indexed = 0  # every n-gram ending at or before this position is in `latest`

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """What propose_ngram(token_ids, num_tokens, max_n, min_n) proposes, for `token_ids`
        that extend those of the call before."""
        last = len(token_ids) - 1  # n-grams that end before the last token may match its suffix
        if last < self.indexed:  # (the tokens shrank: start over)
            self.latest.clear()
            self.indexed = 0
        latest, min_n, max_n = self.latest, self.min_n, self.max_n
        for end in range(self.indexed + 1, last + 1):
            for n in range(min_n, min(max_n, end) + 1):
                latest[tuple(token_ids[end - n:end])] = end
        self.indexed = max(self.indexed, last)
        if num_tokens <= 0 or not 0 < min_n <= max_n:
            return []
        for n in range(min(max_n, last), min_n - 1, -1):
            start = latest.get(tuple(token_ids[-n:]))
            if start is not None:
                period = len(token_ids) - start  # an overlapping match repeats (see propose_ngram)
                return [token_ids[start + i % period] for i in range(num_tokens)]
        return []
