"""Stock Hugging Face `Trainer` runs on tiny models, for the integration tests: the same run at any
world size, plain (the CP=1 reference) or through `context_parallel`, reported step by step."""
from __future__ import annotations

import os
import tempfile
import time
import types

import torch

from cp_harness import VOCAB, tiny_llama
from gdn_harness import CHUNK, TWO_LAYERS, tiny_qwen3_5, use_reference_gdn

STEPS = 5
LENGTH = 30  # not a multiple of 2 cp: CP right-pads every batch to 32 (at CP=4 under Head-Tail: chunks of 4
# tokens, not shorter than the GDN conv halo of 3)
DOCUMENTS = 3
PLAN_LENGTH = 32768  # the plan is suggested for long sequences: Head-Tail / P2P in Head-Tail order at CP>1


def make_model(name: str, seed: int, packed_reference: bool = False):
    """`packed_reference`: the CP=1 model of a packed run, whose GDN layers reset at documents."""
    if name == "llama":
        return tiny_llama(seed)
    # float32 (the precision) with cpcompile's GDN statement as the reference (gdn_harness.use_reference_gdn)
    model = tiny_qwen3_5(seed, torch.float32, **TWO_LAYERS)  # one region of each kind (CI time: traces per rank)
    return use_document_gdn(model) if packed_reference else use_reference_gdn(model)


def use_document_gdn(model):
    """cpcompile's GDN statement with the packed documents of the call. transformers' Qwen3.5 decoder
    layer does not hand `position_ids` to its GDN layer, so its torch path carries the state across
    packed documents (its CP=1 run is not each document alone); this reference resets it, as CP does."""
    from cpcompile.adapters.qwen3_5 import gdn_layer_forward, is_gdn_layer

    call = {}
    model.register_forward_pre_hook(lambda _, args, kwargs: call.update(positions=kwargs.get("position_ids")),
                                    with_kwargs=True)

    def forward(self, hidden_states, attention_mask=None, **_):
        return gdn_layer_forward(self, hidden_states, attention_mask, call["positions"], chunk_size=CHUNK,
                                 backend="eager")

    for module in model.modules():
        if is_gdn_layer(module):
            module.forward = types.MethodType(forward, module)
    return model


def examples(seed: int, count: int, packed: bool) -> list[dict]:
    """Token sequences whose labels are the ids (the model shifts). Padded: random lengths up to
    `LENGTH`; packed: every `DOCUMENTS` consecutive ones fill exactly `LENGTH` tokens. One sequence
    length a batch keeps the rewritten graphs to one trace (docs/batch.md)."""
    gen = torch.Generator().manual_seed(seed)
    if packed:
        lengths = []
        for _ in range(count // DOCUMENTS):
            cuts = sorted(torch.randperm(LENGTH // 5 - 1, generator=gen)[:DOCUMENTS - 1].add(1).mul(5).tolist())
            lengths += [b - a for a, b in zip([0, *cuts], [*cuts, LENGTH])]
    else:
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (count,), generator=gen).tolist()
    out = []
    for length in lengths:
        ids = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def pad_collator(features: list[dict]) -> dict:
    """Right padding to `LENGTH` (a stock collator's `pad_to_multiple_of`): ids 0, mask 0, labels -100."""
    longest = LENGTH
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n], mask[row, :n], labels[row, :n] = torch.tensor(f["input_ids"]), 1, torch.tensor(f["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run_case(name: str, packed: bool, seed: int, cp: int | None, out_dir: str, grad_accum: int = 1,
             average_tokens: bool = True, fsdp: bool = False) -> dict:
    """Train `STEPS` steps and evaluate once; `cp=None`: the plain Trainer (no cpcompile at all).
    `average_tokens`: TrainingArguments.average_tokens_across_devices; `fsdp`: context_parallel's FSDP2."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    start = time.perf_counter()
    model = make_model(name, seed, packed_reference=packed and cp is None)
    # packed: DOCUMENTS documents flattened into one row, positions restarting at 0 at each
    per_batch = DOCUMENTS if packed else 2
    train = examples(seed, STEPS * per_batch * grad_accum, packed)
    evaluation = examples(seed + 1, 2 * per_batch, packed)
    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=per_batch, per_device_eval_batch_size=per_batch,
        gradient_accumulation_steps=grad_accum, max_steps=STEPS, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
        train_sampling_strategy="sequential", logging_steps=1, report_to=[], disable_tqdm=True,
        # a checkpoint during training, at the last step (FSDP2: the model only; optimizer states refused)
        save_strategy="steps", save_steps=STEPS, save_only_model=fsdp,
        seed=seed, dataloader_drop_last=True, average_tokens_across_devices=average_tokens)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                      data_collator=DataCollatorWithFlattening() if packed else pad_collator)
    if cp is not None:
        import cpcompile
        from cpcompile.integrations.transformers import context_parallel

        plan = cpcompile.suggest_plan(make_model(name, seed), cp, PLAN_LENGTH, gdn_backend="eager").plan
        trainer = context_parallel(trainer, plan=plan, fsdp=fsdp)
    # the chunked loss (the stock Trainer's default under CP) never runs the head whole in a step
    # (CP's own checks, run while it compiles at the first batch, do)
    head_calls = []
    compiling = lambda: not getattr(getattr(trainer, "_cp", None), "compiled", True)  # noqa: E731
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: compiling() or head_calls.append(1))
    trainer.train()
    hook.remove()
    history = trainer.state.log_history
    return {"loss": [h["loss"] for h in history if "loss" in h],
            "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
            "eval_loss": trainer.evaluate()["eval_loss"],
            "tokens": trainer.state.num_input_tokens_seen,
            "saved": saved_matches(trainer, name, out_dir, checkpoint_step=STEPS), "shards": _shards(trainer.model),
            "head_calls": len(head_calls),
            "seconds": time.perf_counter() - start}


def _shards(model) -> int:
    """Over how many ranks the parameters are sharded (1: whole on every rank)."""
    from torch.distributed.tensor import DTensor

    weight = next(model.parameters())
    return weight.device_mesh.size() if isinstance(weight, DTensor) else 1


def saved_matches(trainer, name: str, out_dir: str, checkpoint_step: int | None = None) -> float | None:
    """Save a normal checkpoint and load it back with `from_pretrained`, and the one the Trainer
    wrote at `checkpoint_step` (the last step) if given: the largest difference to the trained
    parameters (None on ranks that do not save)."""
    from cpcompile.integrations.hf_fsdp import full_state_dict, is_sharded

    folder = os.path.join(out_dir, "final")
    trainer.save_model(folder)
    sharded = is_sharded(trainer.model)
    want = full_state_dict(trainer.model) if sharded else trainer.model.state_dict()  # every rank gathers
    if not trainer.is_world_process_zero():
        return None
    # FSDP2 gave the model a class FSDP<its class> (FSDPModule first): load with the model's own
    model_class = type(trainer.model).__bases__[-1] if sharded else type(trainer.model)
    worst = 0.0
    during = [] if checkpoint_step is None else [os.path.join(out_dir, f"checkpoint-{checkpoint_step}")]
    for saved in [folder, *during]:
        got = model_class.from_pretrained(saved, torch_dtype=next(iter(want.values())).dtype).state_dict()
        assert set(got) == set(want), (saved, sorted(set(got) ^ set(want)))
        worst = max([worst] + [(got[k].double() - want[k].double()).abs().max().item() for k in want])
    return worst


def fresh_out_dir() -> str:
    return tempfile.mkdtemp(prefix="cp_hf_trainer_")
