"""A stock Hugging Face SFT script (TRL-style packing: documents packed into fixed-length rows, position
ids restarting at 0 at each document) plus the two lines that give it context parallelism.

    torchrun --nproc-per-node 2 examples/hf_trainer_sft.py --plan plan.yaml      # cp 2 (the plan's cp_size)
    torchrun --nproc-per-node 4 examples/hf_trainer_sft.py --cp 2 --fsdp         # dp 2 x cp 2, FSDP2 over all 4
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer_sft.py  # cp 2 (accelerate's torchrun;
                                                                                 # on CPU too: use_cpu keeps gloo)
    python examples/hf_trainer_sft.py                                            # one process, no CP

Without `--plan` the script writes cpcompile's suggestion for this model (`cpcompile.suggest_plan`,
what `cpcompile plan` prints) to OUTPUT_DIR/plan.yaml first and trains with it: read it, keep it,
pass it with `--plan` next time. The model is a tiny Qwen3.5 (3 GDN layers, 1 attention layer)
built from its config, so this runs on CPU (`--cpu`, the default without CUDA: gloo, and the eager
GDN kernels in the suggested plan; on GPUs: NCCL and the Triton ones). docs/hf_trainer.md says what
the two lines do and what they refuse. `--fsdp` shards the model with FSDP2 over dp x cp instead of
the Trainer's DDP (`context_parallel(..., fsdp=True)`). TRL's `SFTTrainer(args=SFTConfig(packing=True))`
takes the same two lines: its padding-free batches (position ids and flash attention's varlen keys) are
read as packed documents (tests/integrations/test_trl_sft.py).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Trainer, TrainingArguments, default_data_collator

from cpcompile.integrations.transformers import context_parallel  # added line 1 of 2


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", help="cpcompile plan (YAML); default: the suggestion, written to "
                        "OUTPUT_DIR/plan.yaml")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per packed row")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cp", type=int, help="cp size of the suggested plan (default: every process); "
                        "dp = world / cp")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 over dp x cp instead of DDP")
    parser.add_argument("--output-dir", default="hf_trainer_sft_out")
    parser.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=not torch.cuda.is_available())
    parser.add_argument("--print-losses", action="store_true", help="print each step's loss in full precision "
                        "at the end (the log rounds it), and the world size: to compare launches")
    return parser.parse_args()


def tiny_model() -> Qwen3_5ForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank (or from_pretrained)
    config = Qwen3_5TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    return Qwen3_5ForCausalLM(config)


def packed_rows(count: int, seq_len: int, vocab: int) -> list[dict]:
    """What TRL's `packing=True` gives a Trainer: rows of exactly `seq_len` tokens, several documents
    each, `position_ids` restarting at 0 at every document (synthetic tokens stand in for a chat set)."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(count):
        lengths, left = [], seq_len
        while left:
            length = min(left, int(torch.randint(seq_len // 8, seq_len // 2, (1,), generator=gen)))
            lengths.append(length)
            left -= length
        ids = torch.randint(1, vocab, (seq_len,), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lengths])
        rows.append({"input_ids": ids, "labels": ids, "position_ids": positions})
    return rows


def suggested_plan(model, seq_len: int, output_dir: str, cpu: bool, cp: int | None) -> str:
    """cpcompile's suggestion for this model at `cp` (default: the launch's world size, one dp rank), as YAML."""
    import cpcompile

    cp = cp or int(os.environ.get("WORLD_SIZE", "1"))
    path = os.path.join(output_dir, "plan.yaml")
    suggestion = cpcompile.suggest_plan(model, cp, seq_len, gdn_backend="eager" if cpu else "triton")
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(output_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(suggestion.text)
        print(f"wrote the suggested plan to {path}")
    if dist.is_initialized():
        dist.barrier()
    return path


def main() -> None:
    opts = parse()
    model = tiny_model()
    args = TrainingArguments(output_dir=opts.output_dir, use_cpu=opts.cpu, per_device_train_batch_size=2,
                             max_steps=opts.steps, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                             report_to=[], disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=packed_rows(4 * opts.steps, opts.seq_len, 512),
                      data_collator=default_data_collator)
    plan = opts.plan or suggested_plan(tiny_model(), opts.seq_len, opts.output_dir, opts.cpu, opts.cp)
    trainer = context_parallel(trainer, plan=plan, fsdp=opts.fsdp)  # added line 2 of 2
    trainer.train()
    if opts.print_losses and trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"world {trainer.args.world_size} losses {' '.join(repr(loss) for loss in losses)}")
    trainer.save_model(os.path.join(opts.output_dir, "final"))  # a normal checkpoint: from_pretrained reads it


if __name__ == "__main__":
    main()
