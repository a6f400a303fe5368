"""The trainer's tokenizers: UTF-8 bytes by default, or a local tokenizer folder (`data.tokenizer`).

Both give `eos_id` (ends every document: the separator between packed documents, and the padding
of unpacked rows), `vocab_size` (the ids it can produce: its largest id + 1, checked against the
model's embedding), `ids(text, opening)` and `encode(text)` (a document: its ids, then EOS).

A folder is loaded by transformers' `AutoTokenizer.from_pretrained(folder, local_files_only=True)`
(its `tokenizer.json` / `tokenizer_config.json` / chat template; nothing is downloaded). Every
problem with it is a `PlanError` naming `data.tokenizer`.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import PlanError, short_repr
from .hf_config import transformers_module

if TYPE_CHECKING:
    from .config_sections import DataSettings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; `eos_id` = 256 ends a document (and pads)."""

    eos_id = 256
    vocab_size = 257

    def ids(self, text: str, opening: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        """A document: its ids, then the end id."""
        return self.ids(text) + [self.eos_id]


class FolderTokenizer:
    """A transformers tokenizer loaded from a local folder (`hf`)."""

    def __init__(self, hf):
        self.hf = hf
        self.eos_id = hf.eos_token_id
        self.vocab_size = max(hf.get_vocab().values()) + 1

    def ids(self, text: str, opening: bool = True) -> list[int]:
        """`text`'s ids; `opening`: as the start of a document, with the special tokens the tokenizer
        puts first (a BOS, for tokenizers that add one). A tokenizer that also appends its EOS
        gets it dropped here: the caller decides where a document ends."""
        ids = self.hf(text, add_special_tokens=opening)["input_ids"]
        return ids[:-1] if opening and ids and ids[-1] == self.eos_id else ids

    def encode(self, text: str) -> list[int]:
        return self.ids(text) + [self.eos_id]

    def special_texts(self) -> list[str]:
        """The text of every special token (`<|im_end|>`, `</s>`, ...): what may close a turn."""
        return [token.content for token in self.hf.added_tokens_decoder.values() if token.special]


def tokenizer_for(data: DataSettings, vocab_size: int) -> ByteTokenizer | FolderTokenizer:
    """The tokenizer of a file source: `data.tokenizer`'s folder, else bytes; either must fit the
    model's `vocab_size`."""
    if data.tokenizer is not None:
        return load_tokenizer(data.tokenizer, vocab_size, chat=data.source == "chat")
    tokenizer = ByteTokenizer()
    if vocab_size < tokenizer.vocab_size:
        raise PlanError("model.vocab_size", f"the byte tokenizer needs {tokenizer.vocab_size} token ids, the "
                                            f"model has {vocab_size} (or set data.tokenizer)")
    return tokenizer


def load_tokenizer(folder: str, vocab_size: int, chat: bool = False) -> FolderTokenizer:
    """The tokenizer in `folder`, checked: it loads, has an EOS token, produces no id the model's
    embedding lacks, and (`chat`) has a chat template and token offsets."""
    hf = _load(folder)
    if hf.eos_token_id is None:
        raise PlanError("data.tokenizer", f"the tokenizer in {short_repr(folder)} has no EOS token (eos_token in "
                                          "tokenizer_config.json): documents are ended and separated by it")
    tokenizer = FolderTokenizer(hf)
    if tokenizer.vocab_size > vocab_size:
        raise PlanError("data.tokenizer", f"the tokenizer in {short_repr(folder)} has ids up to "
                                          f"{tokenizer.vocab_size - 1}, beyond the model's vocab_size {vocab_size}: "
                                          "those tokens would index past the embedding")
    if chat and not hf.chat_template:
        raise PlanError("data.tokenizer", f"the tokenizer in {short_repr(folder)} has no chat template "
                                          "(chat_template.jinja or chat_template in tokenizer_config.json): "
                                          "data.source chat renders conversations with it")
    if chat and not hf.is_fast:
        raise PlanError("data.tokenizer", f"the tokenizer in {short_repr(folder)} is not a fast (tokenizer.json) "
                                          "tokenizer: data.source chat needs its token offsets to find the "
                                          "assistant's tokens")
    return tokenizer


def check_tokenizer_folder(folder: str) -> None:
    """`folder` is a directory holding a tokenizer file (said before transformers is asked)."""
    if not os.path.isdir(folder):
        raise PlanError("data.tokenizer", f"no such folder: {short_repr(folder)}")
    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        raise PlanError("data.tokenizer", f"{short_repr(folder)} holds neither {' nor '.join(TOKENIZER_FILES)}")


def _load(folder: str):
    transformers = transformers_module()
    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # a damaged folder fails in many ways (JSON, the Rust tokenizer, a missing class)
        raise PlanError("data.tokenizer", f"transformers cannot load a tokenizer from {short_repr(folder)}: "
                                          f"{type(exc).__name__}: {exc}") from exc
