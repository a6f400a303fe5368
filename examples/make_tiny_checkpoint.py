"""Write the tiny Hugging Face folder that examples/finetune_qwen3_5_chat.yaml fine-tunes.

What a downloaded checkpoint folder holds, built offline in a second: a tiny Qwen3.5 (3 Gated
DeltaNet layers, 1 full-attention layer; random weights of seed 0) saved with `save_pretrained`,
and beside it the tokenizer the tests use (tests/train/tokenizer_folder.py: a byte-level BPE of
320 ids with Qwen-style special tokens and a ChatML chat template). From the repository root:

    .venv/bin/python examples/make_tiny_checkpoint.py            # writes examples/tiny_qwen3_5/
    .venv/bin/python examples/make_tiny_checkpoint.py FOLDER
"""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "train"))

from tokenizer_folder import VOCAB_SIZE, write_tokenizer_folder  # noqa: E402

MODEL = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_conv_kernel_dim=4, tie_word_embeddings=False)


def write_checkpoint(folder: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **MODEL))
    model.save_pretrained(folder)
    write_tokenizer_folder(folder)
    return folder


if __name__ == "__main__":
    print(write_checkpoint(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "examples", "tiny_qwen3_5")))
