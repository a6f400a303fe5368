"""A tiny real tokenizer folder, built offline in milliseconds, for tests and examples.

    from tokenizer_folder import write_tokenizer_folder
    folder = write_tokenizer_folder(tmp_path / "tok")    # tokenizer.json, tokenizer_config.json,
    AutoTokenizer.from_pretrained(folder)                 # chat_template.jinja

A byte-level BPE (any text encodes, nothing is unknown) trained on a few lines, with Qwen-style
special tokens and a ChatML chat template shaped like Qwen3's where it matters to label masks: a
default system prompt when the conversation has none, an empty think block on the *last*
assistant turn only, and a generation prompt that opens a think block. So rendering a prefix of
a conversation does not give a prefix of its rendering, as with the real Qwen templates.
Its ids are 0..`VOCAB_SIZE - 1`: a model for it needs `vocab_size >= VOCAB_SIZE`.
"""
from __future__ import annotations

import os

EOS = "<|endoftext|>"  # ends (and separates) documents, as Qwen's base tokenizer's does
SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 320
DEFAULT_SYSTEM = "You are a tiny model."
CORPUS = (
    "the user asks and the assistant answers",
    "hello world, this is a tiny corpus for a tiny tokenizer",
    "what is two plus two? two plus two is four.",
    "<think> reasoning </think> answers in a few words",
)
CHAT_TEMPLATE = (
    "{%- if messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def build_tokenizer(chat_template: str | None = CHAT_TEMPLATE, eos: str | None = EOS):
    """A `PreTrainedTokenizerFast` (byte-level BPE of `VOCAB_SIZE` ids) with `chat_template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(CORPUS * 4, trainer)
    extra = {} if eos is None else {"eos_token": eos, "pad_token": eos}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **extra)
    tokenizer.chat_template = chat_template
    return tokenizer


def write_tokenizer_folder(folder, chat_template: str | None = CHAT_TEMPLATE, eos: str | None = EOS) -> str:
    """Save the tokenizer of `build_tokenizer` to `folder` (created); -> its path."""
    os.makedirs(folder, exist_ok=True)
    build_tokenizer(chat_template, eos).save_pretrained(str(folder))
    return str(folder)
