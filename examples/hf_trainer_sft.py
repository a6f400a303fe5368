"""A stock TRL SFT script (`SFTTrainer`, `SFTConfig(packing=True)`) plus the two lines that give it
context parallelism. Write the plan once, read it, keep it:

    cpcompile plan MODEL_DIR --cp 2 --seq-len 32768 --out plan.yaml    # an explicit plan, each choice explained
    torchrun --nproc-per-node 2 examples/hf_trainer_sft.py --model MODEL_DIR --plan plan.yaml --seq-len 32768
    torchrun --nproc-per-node 4 examples/hf_trainer_sft.py --cp 2 --fsdp         # dp 2 x cp 2, FSDP2 over all 4
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer_sft.py  # cp 2 (accelerate's torchrun;
                                                                                 # on CPU too: use_cpu keeps gloo)
    python examples/hf_trainer_sft.py                                            # one process (cp 1)

Two conveniences that a stock script does not need, so that the demo runs anywhere with no download:
without `--model` it builds a tiny Qwen3.5 (3 GDN layers, 1 attention layer) from its config with a
word-level tokenizer, and trains on synthetic tokenized documents; without `--plan` it writes
cpcompile's suggestion for that model (`cpcompile.suggest_plan`, what `cpcompile plan` prints) to
OUTPUT_DIR/plan.yaml first and trains with it. `--cpu` (the default without CUDA) runs on gloo with the
eager GDN kernels; on GPUs it is NCCL, bf16 and the Triton kernels. TRL packs the documents into rows
and trains them padding-free (position ids restarting at each document, flash attention's varlen
keys): cpcompile reads those as packed documents. docs/hf_trainer.md says what the two lines do and
what they refuse; `--fsdp` shards the model with FSDP2 over dp x cp instead of the Trainer's DDP.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from cpcompile.integrations.transformers import context_parallel  # added line 1 of 2

TINY_VOCAB = 512


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face model folder (default: a tiny Qwen3.5, no download)")
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


def load(folder: str | None):
    """The model and its tokenizer: from `folder`, or the tiny demo model."""
    if folder:
        return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    return tiny_model(), tiny_tokenizer()


def tiny_model():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)  # the same weights on every rank (from_pretrained gives that for a real model)
    config = Qwen3_5TextConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    return Qwen3_5ForCausalLM(config)


def tiny_tokenizer(vocab: int = TINY_VOCAB):
    """A word-level tokenizer (token i is the word "t<i>"): an SFTTrainer needs one, none is downloaded."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")


def documents(count: int, seq_len: int, vocab: int) -> Dataset:
    """Tokenized documents of seq_len/8 to seq_len/2 tokens (synthetic tokens stand in for a chat set)."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(seq_len // 8, seq_len // 2, (count,), generator=gen).tolist()
    return Dataset.from_list([{"input_ids": torch.randint(2, vocab, (n,), generator=gen).tolist()} for n in lengths])


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
    model, tokenizer = load(opts.model)
    args = SFTConfig(output_dir=opts.output_dir, use_cpu=opts.cpu, bf16=not opts.cpu, packing=True,
                     max_length=opts.seq_len, pad_to_multiple_of=opts.seq_len,  # one row length: one compiled graph
                     per_device_train_batch_size=1, max_steps=opts.steps, learning_rate=1e-3, logging_steps=1,
                     save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=documents(8 * opts.steps, opts.seq_len, len(tokenizer)))
    plan = opts.plan or suggested_plan(model, opts.seq_len, opts.output_dir, opts.cpu, opts.cp)
    trainer = context_parallel(trainer, plan=plan, fsdp=opts.fsdp)  # added line 2 of 2
    trainer.train()
    if opts.print_losses and trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"world {trainer.args.world_size} losses {' '.join(repr(loss) for loss in losses)}")
    trainer.save_model(os.path.join(opts.output_dir, "final"))  # a normal checkpoint: from_pretrained reads it


if __name__ == "__main__":
    main()
