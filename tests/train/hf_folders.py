"""Small Hugging Face folders for the trainer's weight tests, and what transformers computes from them.

`save_folder` builds a tiny model from its config with fresh random weights and writes it with
`save_pretrained`: Qwen3.5 (`qwen3_5_text`: 3 Gated DeltaNet layers and 1 full-attention layer,
untied embeddings; or the vision-language `qwen3_5`, whose checkpoint names the text model's
tensors `model.language_model.*`) or Qwen3 (tied embeddings, so the file has no
`lm_head.weight`). The
reference is always `AutoModelForCausalLM.from_pretrained` on the folder, in float32.
"""
from __future__ import annotations

import copy

import torch

from cp_harness import sdpa_plan
from gdn_harness import TEXT, gdn_plan, tiny_qwen3_5_vl

QWEN3_5 = {"model_type": "qwen3_5_text", **TEXT}
QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
MODELS = {"qwen3_5": QWEN3_5, "qwen3": QWEN3, "qwen3_5_vl": QWEN3_5}  # (the VL model's text part)


def save_folder(folder: str, name: str, seed: int, max_shard_size: str | None = None, dtype=torch.float32,
                **changes) -> str:
    """`folder` holding the model `name` (MODELS, with `changes` to its config; or `qwen3_5_vl`, the
    vision-language Qwen3.5 whose text weights are stored as `model.language_model.*`) with random
    weights of `seed` (scaled up from transformers' 0.02 std, so that a wrong or missing tensor
    moves the loss far beyond rounding), in `dtype`; sharded when `max_shard_size` is given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "qwen3_5_vl":
        model = tiny_qwen3_5_vl(seed)
    else:
        keys = {**MODELS[name], **changes}
        config = AutoConfig.for_model(keys.pop("model_type"), **keys)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(folder, **extra)
    return folder


def plan(name: str, cp: int, dp_shard: int = 1) -> dict:
    """The CP plan of the model `name`: GDN State-P2P and SDPA AllGather (Qwen3.5), SDPA AllGather (Qwen3)."""
    chosen = gdn_plan(cp, "p2p", sdpa="sdpa_hf") if name.startswith("qwen3_5") else sdpa_plan(cp)
    chosen = copy.deepcopy(chosen)
    chosen["accelerator"]["dp_shard_size"] = dp_shard
    return chosen


def train_config(folder: str, name: str, cp: int, dp_shard: int = 1, steps: int = 1, **sections) -> dict:
    """A float32 run of the model in `folder` on synthetic tokens (4 rows of 32)."""
    train = {"steps": steps, "seq_len": 32, "batch_size": 4, "lr": 1e-2, "seed": 0, "dtype": "float32",
             **({"gdn_backend": "eager"} if name.startswith("qwen3_5") else {})}
    return {"model": {"path": folder}, "train": train, "optimizer": {"warmup_steps": 0, "schedule": "constant"},
            **plan(name, cp, dp_shard), **sections}


def first_batch(config: dict, name: str, vocab_size: int | None = None) -> dict:
    """The whole global batch of step 1 (every replica's rows) of a run of the model `name` (with
    `vocab_size` when its folder was saved with another)."""
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.data import TokenStream

    loaded = load_train_config(config)
    return TokenStream(loaded.data, loaded.train, vocab_size or MODELS[name]["vocab_size"]).batch(0)


def transformers_loss(folder: str, batch: dict) -> float:
    """`from_pretrained(folder)`'s mean next-token loss on `batch` (labels -100 ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(**batch).loss.item()


def transformers_logits(folder: str, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=input_ids).logits
