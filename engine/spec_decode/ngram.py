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
