"""Incremental detokenization with stop strings: token ids in, text deltas out.

Decoding uses the prefix/read offset window (as in TGI and vLLM):

    tokens:  ... | prefix_offset ....... read_offset ....... end |
                   \\__ prefix_text __/   \\__ not yet emitted __/

    new_text = decode(tokens[prefix_offset:]); delta = new_text[len(prefix_text):]

Decoding a few tokens before the new ones gives the new text its correct
leading space (SentencePiece drops it at the start of a decode) and keeps the
cost O(1) per token. When new_text ends in U+FFFD the last token stopped
inside a multi-byte character: nothing is emitted until a later token
completes it, so every delta is whole characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded ahead of the output, for the spacing of its first token.
NUM_CONTEXT_TOKENS = 5
# Drop consumed tokens from the window once this many pile up (amortized O(1)).
_TRIM_TOKENS = 64
_REPLACEMENT_CHAR = "\ufffd"


def detokenize(tokenizer: Any, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """One-shot decode, consistent with IncrementalDetokenizer (no space clean-up)."""
    return tokenizer.decode(
        list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas as they arrive.

    `append(ids)` returns the newly finalized text; concatenating every delta
    and `flush()` gives `detokenize(output ids)` (cut at a stop string).
    Deltas never end inside a character. With `stop` strings, the longest tail
    that could still begin a stop string is held back, so a stop string split
    across steps is never emitted in part. When a stop string appears,
    `stop_matched` is set, the text ends before it (or after it with
    `include_stop_str_in_output`), and later calls return "". Of several stop
    strings, the one completed first wins (see `_find_stop`).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        # The decode window: only tokens from prefix_offset on are ever decoded.
        context_start = max(len(prompt_token_ids) - NUM_CONTEXT_TOKENS, 0)
        self._token_ids = list(prompt_token_ids[context_start:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_text: str | None = None  # decode(tokens[prefix:read]), cached
        self._held = ""  # decoded, not yet emitted: might begin a stop string
        self._chunks: list[str] = []
        self._text: str | None = ""
        self._done = False
        self.stop_matched: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._text = "".join(self._chunks)
            self._chunks = [self._text]
        return self._text

    def append(self, new_token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text they finalize (possibly "")."""
        if self._done:
            return ""
        self._token_ids.extend(new_token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of generation: return all text still held back (a trailing
        incomplete character decodes to U+FFFD, as in a one-shot decode)."""
        if self._done:
            return ""
        delta = self._emit(self._decode_new(final=True), final=True)
        self._done = True
        return delta

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past read_offset, if it ends on a whole character."""
        if self._read_offset == len(self._token_ids):
            return ""
        if self._prefix_text is None:
            prefix_ids = self._token_ids[self._prefix_offset : self._read_offset]
            self._prefix_text = self._decode(prefix_ids)
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text):
            return ""  # e.g. only skipped special tokens so far
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # incomplete character: wait for its next bytes
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_TOKENS:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _emit(self, delta: str, final: bool) -> str:
        """Apply stop strings to newly decoded text; record and return what is emitted."""
        if self._stop:
            # A stop string cannot start in already emitted text: that text
            # ends before the held-back tail, which covers any partial match.
            text = self._held + delta
            match = _find_stop(text, self._stop)
            if match is not None:
                position, stop = match
                self.stop_matched = stop
                self._done = True
                delta = text[: position + len(stop) if self._include_stop else position]
                self._held = ""
            else:
                num_held = 0 if final else _partial_stop_length(text, self._stop)
                delta = text[: len(text) - num_held]
                self._held = text[len(text) - num_held :]
        if delta:
            self._chunks.append(delta)
            self._text = None
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The (position, stop string) that the text completes first: the match that ends
    earliest, and of those the one that starts earliest. Generation stops as soon as
    any stop string is complete, so this is the answer however the text was split
    into steps ("\n\n" wins over "\n\nUser" in "\n\nUser", whether "User" came in
    the same step or a later one)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        position = text.find(stop)
        if position != -1:
            candidate = (position + len(stop), position, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    return None if best is None else (best[1], best[2])


def _partial_stop_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
