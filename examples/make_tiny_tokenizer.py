"""Write the tiny tokenizer folder that examples/finetune_qwen3_5_chat.yaml reads.

A byte-level BPE of 320 ids with Qwen-style special tokens and a ChatML chat template, built offline
in milliseconds: the tokenizer the tests use (tests/train/tokenizer_folder.py). From the repository
root:

    .venv/bin/python examples/make_tiny_tokenizer.py            # writes examples/tiny_tokenizer/
    .venv/bin/python examples/make_tiny_tokenizer.py FOLDER
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "train"))

from tokenizer_folder import write_tokenizer_folder  # noqa: E402

if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "examples", "tiny_tokenizer")
    print(write_tokenizer_folder(folder))
