"""Issue 52: TRL's `SFTTrainer` with packing (`SFTConfig(packing=True)`: best-fit packed rows, which
TRL trains padding-free: one flattened row, position ids restarting at 0 per document, and flash
attention's varlen keys `cu_seq_lens_q/k`, `max_length_q/k`, `seq_idx` beside them) at cp 2
(`context_parallel`, gloo) equals the stock SFTTrainer in one process, step by step: loss within
1e-5 relative, gradient norm, eval loss, the number of model calls (TRL's own loss path, its fused
LM head, reads no logits: no extra forward), and a checkpoint `from_pretrained` reads back. A tiny
Llama and a tiny Qwen3.5 (3 GDN layers, 1 attention layer) in float32, one launch per world size for
both, TRL's defaults otherwise (gradient checkpointing on). Qwen3.5's one-process reference runs
cpcompile's GDN statement reset at each document: transformers 5.25's own GDN layer refuses the
varlen keys on CPU (it keeps packed documents apart only with the causal_conv1d / fla kernels)."""
from __future__ import annotations

import random
import time

import pytest

from dist_utils import run_distributed
from hf_trainer_cases import PLAN_LENGTH, fresh_out_dir, saved_matches

pytest.importorskip("accelerate")
pytest.importorskip("trl")

STEPS, GRAD_ACCUM, ROW = 3, 2, 32  # packed rows of at most ROW tokens, padded to ROW (one trace)
MODELS = ("llama", "qwen3_5")  # one launch per world size runs both


def _tokenizer():
    """A word-level tokenizer over the tiny model's vocabulary (SFTTrainer needs one; no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from cp_harness import VOCAB

    words = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")


def _documents(seed: int, count: int):
    """Tokenized documents of 3 to 12 tokens, several to a packed row."""
    import torch
    from datasets import Dataset

    from cp_harness import VOCAB

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 13, (count,), generator=gen).tolist()
    return Dataset.from_list([{"input_ids": torch.randint(2, VOCAB, (n,), generator=gen).tolist()} for n in lengths])


def _model(name: str, seed: int, reference: bool):
    """Float32. `reference` (the one-process run): Qwen3.5's GDN layers reset at packed documents,
    as under CP (given TRL's varlen keys on CPU, transformers 5.25's own raise: docs/hf_trainer.md)."""
    import torch

    from cp_harness import tiny_llama
    from gdn_harness import tiny_qwen3_5
    from hf_trainer_cases import use_document_gdn

    if name == "llama":
        return tiny_llama(seed)
    model = tiny_qwen3_5(seed, torch.float32)
    return use_document_gdn(model) if reference else model


def _run_all(rank: int, world: int, seed: int, cp: int | None) -> dict:
    return {name: _run_sft(seed, cp, name) for name in MODELS}


def _run_sft(seed: int, cp: int | None, name: str) -> dict:
    """`cp=None`: the stock SFTTrainer; otherwise through `context_parallel` with the suggested plan."""
    from accelerate.state import AcceleratorState
    from trl import SFTConfig, SFTTrainer

    AcceleratorState._reset_state(reset_partial_state=True)  # a forked rank must not inherit the parent's
    start, out_dir = time.perf_counter(), fresh_out_dir()
    args = SFTConfig(
        output_dir=out_dir, use_cpu=True, packing=True, max_length=ROW, pad_to_multiple_of=ROW,
        per_device_train_batch_size=1, per_device_eval_batch_size=1, gradient_accumulation_steps=GRAD_ACCUM,
        max_steps=STEPS, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=seed, train_sampling_strategy="sequential",
        bf16=False)  # TRL's default bf16=True autocasts on CPU too: this compares float32
    trainer = SFTTrainer(model=_model(name, seed, cp is None), args=args, train_dataset=_documents(seed, 40),
                         eval_dataset=_documents(seed + 1, 8), processing_class=_tokenizer())
    if cp is not None:
        import cpcompile
        from cpcompile.integrations.transformers import context_parallel

        plan = cpcompile.suggest_plan(_model(name, seed, False), cp, PLAN_LENGTH, gdn_backend="eager").plan
        trainer = context_parallel(trainer, plan=plan)
    calls = []  # model calls with labels: training and evaluation (not cpcompile's recording calls)
    trainer.model.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append(1) if "labels" in kwargs or "shift_labels" in kwargs else None,
        with_kwargs=True)
    trainer.train()
    history = trainer.state.log_history
    return {"loss": [h["loss"] for h in history if "loss" in h],
            "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
            # TRL's own metrics, gathered over every process: each cp rank adds its own tokens
            "trl_metrics": [(h["entropy"], h["mean_token_accuracy"], h["num_tokens"])
                            for h in history if "entropy" in h],
            "eval_loss": trainer.evaluate()["eval_loss"], "calls": len(calls),
            "saved": saved_matches(trainer, name, out_dir), "seconds": time.perf_counter() - start}


def _close(got: float, want: float, tol: float) -> bool:
    return abs(got - want) <= tol * abs(want)


def test_sft_trainer_packing_at_cp_2_equals_one_process():
    seed = random.randrange(1 << 20)
    wants = run_distributed(_run_all, 1, seed, None, timeout=300, init_pg=False)[0]
    runs = run_distributed(_run_all, 2, seed, 2, timeout=300)
    for name in MODELS:
        _assert_same_run([run[name] for run in runs], wants[name], f"{name} SFTTrainer packing at cp=2 (seed {seed})")


def _assert_same_run(results: list[dict], want: dict, what: str) -> None:
    assert len(want["loss"]) == STEPS, want
    for rank, got in enumerate(results):
        where = f"{what}, rank {rank}"
        assert len(got["loss"]) == STEPS, where
        for step, (g, w) in enumerate(zip(got["loss"], want["loss"])):
            assert _close(g, w, 1e-5), f"{where}: step {step} loss {g} vs {w}"
        for step, (g, w) in enumerate(zip(got["grad_norm"], want["grad_norm"])):
            assert _close(g, w, 1e-4), f"{where}: step {step} grad norm {g} vs {w}"
        assert _close(got["eval_loss"], want["eval_loss"], 1e-5), where
        for step, (g, w) in enumerate(zip(got["trl_metrics"], want["trl_metrics"], strict=True)):
            assert _close(g[0], w[0], 1e-5) and _close(g[1], w[1], 1e-5) and g[2] == w[2], \
                f"{where}: step {step} (entropy, accuracy, tokens) {g} vs {w}"
        assert got["calls"] == want["calls"], f"{where}: {got['calls']} model calls vs {want['calls']}"
    assert results[0]["saved"] == 0.0, f"{what}: saved checkpoint differs"
