"""`train.loss: chunked` against `train.loss: full` in the trainer (float64, gloo): the same
per-step losses and gradient norms at cp 2 and at dp_shard 2 x cp 2 (FSDP2), for a tiny Qwen3.5
(GDN State-P2P + SDPA AllGather) and a tiny Qwen3 with tied embeddings (the head's weight is the
embedding's, one FSDP2 parameter of the root), on packed documents (Qwen3.5, synthetic) and on
right-padded rows of a JSONL file (Qwen3: label -100 from a row's end, across the rank boundary).

One forked job per world size runs every trainer (processes are the cost here)."""
from __future__ import annotations

import json
import random

from cp_harness import sdpa_plan
from dist_utils import run_distributed
from gdn_harness import TEXT, gdn_plan

STEPS = 2
# local tokens a step: 2 rows x 16 at cp 2, which 6 does not divide (nor, mostly, the valid ones)
CHUNK_TOKENS = 6
QWEN3_TIED = dict(model_type="qwen3", vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
# one GDN and one attention layer: what the loss sees is the same as with 3:1, at half the cost
QWEN3_5 = dict(model_type="qwen3_5_text", **{**TEXT, "num_hidden_layers": 2,
                                             "layer_types": ["linear_attention", "full_attention"]})


def _config(model: str, seed: int, loss: str, cp: int, dp_shard: int, documents: str) -> dict:
    if model == "qwen3_5":
        plan, model_config = gdn_plan(cp, "p2p", sdpa="sdpa_hf"), QWEN3_5
        data = {"packing": True}  # documents: GDN state resets and labels ending at document ends
    else:
        plan, model_config, data = sdpa_plan(cp), QWEN3_TIED, {"source": "jsonl", "path": documents}
    plan["accelerator"]["dp_shard_size"] = dp_shard
    return {"model": model_config, **plan, "data": data,
            "train": {"steps": STEPS, "seq_len": 32, "batch_size": 2 * dp_shard, "lr": 1e-3, "seed": seed,
                      "dtype": "float64", "gdn_backend": "eager", "loss": loss,
                      "loss_chunk_tokens": CHUNK_TOKENS}}


def _both_losses(rank: int, world: int, seed: int, dp_shard: int, documents: str) -> dict:
    from cpcompile.trainer import load_train_config, train

    out = {}
    for model in ("qwen3_5", "qwen3_tied"):
        for loss in ("chunked", "full"):
            config = load_train_config(_config(model, seed, loss, cp=world // dp_shard, dp_shard=dp_shard,
                                                documents=documents))
            out[model, loss] = [(r["loss"], r["grad_norm"]) for r in train(config, log=lambda _: None)]
    return out


def _assert_equal_curves(per_rank: list[dict]) -> None:
    for model in ("qwen3_5", "qwen3_tied"):
        chunked, full = per_rank[0][model, "chunked"], per_rank[0][model, "full"]
        assert len(chunked) == len(full) == STEPS
        for got, want in zip(chunked, full):
            assert all(abs(g - w) <= 1e-6 * abs(w) for g, w in zip(got, want)), (model, chunked, full)
        # the global mean on every rank (to rounding: `global_mean_loss` adds the detached difference
        # to the rank's own share, so the last bit may depend on the share)
        assert all(all(abs(g - w) <= 1e-12 * abs(w) for g, w in zip(sum(r[model, "chunked"], ()), sum(chunked, ())))
                   for r in per_rank)


def _documents(folder) -> str:
    """A JSONL file of documents of 3 to 40 bytes: most rows (32 tokens) end in padding."""
    rng = random.Random(0)
    path = folder / "docs.jsonl"
    lines = [json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 40)))})
             for _ in range(12)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_chunked_loss_trains_as_the_full_loss_at_cp_2(tmp_path):
    _assert_equal_curves(run_distributed(_both_losses, 2, random.randrange(1 << 30), 1, _documents(tmp_path),
                                         timeout=300))


def test_chunked_loss_trains_as_the_full_loss_under_fsdp_dp_shard_2_x_cp_2(tmp_path):
    _assert_equal_curves(run_distributed(_both_losses, 4, random.randrange(1 << 30), 2, _documents(tmp_path),
                                         timeout=300))
