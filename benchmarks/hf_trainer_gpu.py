"""A Hugging Face `Trainer` with cpcompile's two lines against cpcompile's own trainer, on one device
(issue 52's GPU row): rank 0 of a CP=2 job under PyTorch's fake process group, same model, same length.

    python benchmarks/hf_trainer_gpu.py                     # 32K tokens a rank (64K a step), H100/H200
    options: --seq-len 32768 --warmup 2 --steps 3 --max-seconds 240 --trainer-loss chunked|full
             --hf-loss chunked|model --compile-backend inductor|eager --gdn-backend triton|eager
             --rows hf_trainer,sft_trainer,cpcompile_trainer --out FILE   (exit status 1 when a row failed)
    python benchmarks/hf_trainer_gpu.py --small --device cpu --seq-len 64 --warmup 1 --steps 1   # smoke

Three rows (by default the first and the last), each in its own subprocess (one that fails or runs
out of memory is a row saying so, and the others still run), each playing rank 0 of CP=2
(`dist.init_process_group("fake", rank=0, world_size=2)`: every collective returns at once; memory
and compute are the rank's, communication costs nothing, the loss is meaningless):

- `hf_trainer`: a stock `transformers.Trainer` (the class examples/hf_trainer_sft.py's TRL `SFTTrainer`
  subclasses; TRL is not installed on the lent GPU machines) on the model, then
  `context_parallel(trainer, plan)`, then `trainer.train()`. accelerate sees a 2-process job (RANK,
  WORLD_SIZE, LOCAL_RANK as torchrun sets them, the fake group already initialised, so it creates
  none), so the Trainer wraps the model in DDP over the 2 fake ranks and shards the loader as under
  torchrun. The one thing that blocks it: the fake group's all-reduce future carries no tensor, and
  DDP's reducer asserts on that ("expected the hook result is either a Tensor or a TensorList found
  None"); so, in this script only, DDP gets a comm hook doing its default work (divide by the world,
  all-reduce) that returns the bucket. float32 parameters under bf16 autocast (`bf16=True`),
  gradient checkpointing on every decoder layer (non-reentrant), the integration's defaults: the
  decoder layers compiled (inductor on CUDA) and the chunked loss (`--hf-loss model`: the model's own,
  the whole logits upcast to float32), AdamW (lr 3e-4, weight decay 0.01), clipping at 1.0, batch 1,
  logging off. A step is timed from one
  `on_step_end` to the next (the data, the step and the optimizer; a callback synchronises the device).
- `sft_trainer` (needs trl and datasets): examples/hf_trainer_sft.py's class, TRL's `SFTTrainer`, with
  the same model, rows (tokenized, one sequence a row, no packing), settings and added line. TRL computes
  its own loss (its `compute_loss`, its fused LM head), so the integration keeps it: no chunked loss.
- `cpcompile_trainer`: cpcompile's trainer, what `trainer_gpu.py --simulate-cp 2 --tokens 2xSEQ
  --ranks first --sdpa all_gather` measures, run by that script (`--simulate-row`): FSDP2 over the 2
  fake ranks computing in bf16, activation checkpointing on every layer, `--trainer-loss` (the
  trainer's default `chunked`: no logits; `full` for the HF loss's memory), its layers compiled
  (inductor on CUDA, as the HF row's).

`--compile-backend` sets every row's layer backend (default: each one's own, inductor on CUDA);
`--rows` picks the rows.

All build trainer_gpu.py's Qwen3.5-shaped 0.57B model (random weights, seed 0; `--small`: its tiny
twin) and run the same plan (trainer_gpu.config: SDPA AllGather `sdpa_hf`, GDN State-P2P on the Triton
core, eager on CPU). The data: one unpadded sequence of 2 x `--seq-len` random tokens a step (no
packed documents), cut by `shard_batch` into `--seq-len` for rank 0. `--warmup` steps (the first
compiles the CP regions and the Triton kernels), then `--steps` measured ones: their mean time and
peak allocated memory. The table's last column is tokens/s against the cpcompile row (issue 52: the
integration may cost at most 10%, >= 0.90).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

CP, RANK = 2, 0
ROW_MARK = "HF_GPU_ROW "
SIMULATED_ROW_MARK = "SIMULATED_ROW "  # simulate_cp.ROW_MARK, read without importing torch here
ROWS = ("hf_trainer", "sft_trainer", "cpcompile_trainer")
IN_PROCESS_ROWS = ("hf_trainer", "sft_trainer")  # run by this script in a child (`--row`)
# what a row that is not last leaves to the rows after it (imports, model build, CP rewrite, a step)
RESERVE_SECONDS = 90


# ------------------------------------------------------------------------------ row A: HF Trainer


def plan_dict(args) -> dict:
    """trainer_gpu.py's plan at cp 2 (the cpcompile row runs the same one)."""
    from trainer_gpu import config

    settings = argparse.Namespace(cp=CP, steps=1, seq_len=CP * args.seq_len, small=args.small, device=args.device,
                                  loss_chunk_tokens=4096, compile_backend=None, gdn_backend=args.gdn_backend)
    full = config(settings)
    return {"accelerator": full["accelerator"], "plan_overrides": full["plan_overrides"]}


def start_fake_job() -> None:
    """Rank 0 of 2 under the fake process group, with the environment torchrun gives a rank, so
    accelerate (inside the Trainer) takes the job for a 2-process one and creates no group of its own."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(RANK=str(RANK), LOCAL_RANK="0", WORLD_SIZE=str(CP), LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=CP)


def fake_allreduce_hook(state, bucket):
    """DDP's default hook (divide by the world, all-reduce), returning the bucket itself: the fake
    group's all-reduce future carries no tensor, which DDP's reducer asserts on."""
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(buffer)  # returns at once under the fake group
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def step_timer(device: str, warmup: int):
    """A TrainerCallback recording the time at each step's end (device synchronised), resetting the
    peak memory at the end of the last warm-up step; at the start it gives the DDP wrapper the
    Trainer made (set `.trainer`) `fake_allreduce_hook`."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.trainer = None

        def on_train_begin(self, args, state, control, **kwargs):
            if isinstance(self.trainer.model_wrapped, DistributedDataParallel):
                self.trainer.model_wrapped.register_comm_hook(None, fake_allreduce_hook)

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
            if len(self.ends) == warmup and device == "cuda":
                torch.cuda.reset_peak_memory_stats()

    return StepTimer()


def model_and_rows(args):
    """trainer_gpu.py's model (seed 0, SDPA) and `--warmup + --steps` rows of 2 x `--seq-len` random ids."""
    import torch
    import transformers

    from cpcompile.trainer.hf_config import model_config
    from trainer_gpu import MODEL, SMALL

    config = model_config(SMALL if args.small else MODEL)
    config._attn_implementation = "sdpa"  # as the cpcompile trainer builds it
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (args.warmup + args.steps, CP * args.seq_len), generator=gen)
    return model, ids


def training_kwargs(args) -> dict:
    """What both Hugging Face rows set, in TrainingArguments' (and TRL's SFTConfig's) names."""
    return dict(output_dir=tempfile.mkdtemp(prefix="hf_trainer_gpu_"), use_cpu=args.device == "cpu", bf16=True,
                per_device_train_batch_size=1, max_steps=args.warmup + args.steps, learning_rate=3e-4,
                weight_decay=0.01, max_grad_norm=1.0, gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": False}, logging_strategy="no", save_strategy="no",
                report_to=[], disable_tqdm=True, dataloader_num_workers=0)


def train_measured(trainer, timer, model, args) -> dict:
    """Train warm-up + measured steps; their mean time, peak memory, and the tokens the model saw."""
    from cpcompile.trainer.metrics import peak_memory_gib

    timer.trainer = trainer
    seen = []  # the tokens the model is called with: rank 0's slice, not the whole sequence
    model.register_forward_pre_hook(lambda module, a, kw: seen.append(kw["input_ids"].shape[-1]), with_kwargs=True)
    trainer.train()
    measured = [b - a for a, b in zip(timer.ends[args.warmup - 1:], timer.ends[args.warmup:])]
    seconds = sum(measured) / len(measured)
    return {"seconds": seconds, "tokens_per_s": args.seq_len / seconds, "peak_gib": peak_memory_gib(args.device),
            "parallel": type(trainer.model_wrapped).__name__, "local_tokens": seen[-1],
            "cp_compiled": trainer._cp.compiled}


def hf_trainer_row(args) -> dict:
    """Row A: build the HF Trainer, add CP with the two lines, train warm-up + measured steps."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from cpcompile.integrations.transformers import context_parallel

    start_fake_job()
    model, ids = model_and_rows(args)
    timer = step_timer(args.device, args.warmup)
    trainer = Trainer(model=model, args=TrainingArguments(**training_kwargs(args)),
                      train_dataset=[{"input_ids": row, "labels": row} for row in ids],
                      data_collator=default_data_collator, callbacks=[timer])
    trainer = context_parallel(trainer, plan=plan_dict(args), compile_backend=args.compile_backend,
                               loss=args.hf_loss)  # the added line
    return train_measured(trainer, timer, model, args)


def sft_trainer_row(args) -> dict:
    """Row A': examples/hf_trainer_sft.py's class, TRL's SFTTrainer, on the same model and rows (tokenized,
    one sequence a row, no packing: the rows are the sequence), with the same added line. TRL computes
    its own loss (its `compute_loss`), so the integration's default keeps it (docs/hf_trainer.md)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from cpcompile.integrations.transformers import context_parallel

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from hf_trainer_sft import tiny_tokenizer  # the example's word-level tokenizer, over any vocabulary

    start_fake_job()
    model, ids = model_and_rows(args)
    timer = step_timer(args.device, args.warmup)
    config = SFTConfig(**training_kwargs(args), max_length=CP * args.seq_len, packing=False)
    trainer = SFTTrainer(model=model, args=config, processing_class=tiny_tokenizer(model.config.vocab_size),
                         train_dataset=Dataset.from_list([{"input_ids": row.tolist()} for row in ids]),
                         callbacks=[timer])
    trainer = context_parallel(trainer, plan=plan_dict(args), compile_backend=args.compile_backend)  # the added line
    return train_measured(trainer, timer, model, args)


# ------------------------------------------------------------------------- row B: cpcompile trainer


def cpcompile_command(args) -> list[str]:
    """trainer_gpu.py's child for rank 0 of CP=2 at 2 x seq_len tokens (simulate_cp.run_row)."""
    spec = {"method": "all_gather", "cp": CP, "tokens": CP * args.seq_len, "rank": RANK}
    return [sys.executable, os.path.join(HERE, "trainer_gpu.py"), "--simulate-cp", str(CP),
            "--tokens", str(CP * args.seq_len), "--sdpa", "all_gather", "--ranks", "first",
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--device", args.device,
            "--loss", args.trainer_loss, "--ac", "every_layer", *(["--small"] if args.small else []),
            *(["--gdn-backend", args.gdn_backend] if args.gdn_backend else []),
            *(["--compile-backend", args.compile_backend] if args.compile_backend else []),
            "--simulate-row", json.dumps(spec)]


def from_simulated(row: dict) -> dict:
    if "note" in row:
        return {"note": row["note"]}
    return {"seconds": row["compute_s"], "tokens_per_s": row["tokens_per_s"], "peak_gib": row["peak_gib"],
            "parallel": "FSDP2", "local_tokens": row["local_tokens"]}


# ---------------------------------------------------------------------------------- the parent


def run_row(args, name: str, seconds: float) -> dict:
    """One row in a fresh subprocess within `seconds`; -> its numbers or a `note` saying why not."""
    if name in IN_PROCESS_ROWS:
        command, mark = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--row", name], ROW_MARK
    else:
        command, mark = cpcompile_command(args), SIMULATED_ROW_MARK
    env = {**os.environ}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the same allocator for every row
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"note": f"stopped after {seconds:.0f} s: over the --max-seconds budget"}
    row = _marked(done.stdout, mark)
    if row is None:
        print(done.stdout[-2000:] + done.stderr[-4000:], file=sys.stderr, flush=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"note": f"failed (exit {done.returncode}): {last[:200]}"}
    row = row if name in IN_PROCESS_ROWS else from_simulated(row)
    return {**row, "wall_s": time.perf_counter() - started}


def _marked(stdout: str, mark: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(mark):
            return json.loads(line[len(mark):])
    return None


def table(args, rows: dict) -> str:
    reference = rows.get("cpcompile_trainer", {}).get("tokens_per_s")
    model = "tiny Qwen3.5" if args.small else "Qwen3.5-shaped 0.57B"
    lines = [f"{model}, {args.device}, rank {RANK} of CP={CP} (fake process group), {CP * args.seq_len} tokens a step "
             f"(one unpadded sequence), {args.seq_len} on this rank; cpcompile trainer loss: {args.trainer_loss}", "",
             "| method | parallel | global x local tokens | warm-up/measured | s/step | tokens/s (rank) | peak GiB | "
             "tokens/s vs cpcompile trainer |", "|---|---|---|---|---|---|---|---|"]
    for name in rows:
        row = rows[name]
        first = f"| {name} | {row.get('parallel', '-')} | {CP * args.seq_len} x {row.get('local_tokens', '-')} | " \
                f"{args.warmup}/{args.steps} |"
        if "note" in row:
            lines.append(f"{first} {row['note']} | | | |")
            continue
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        ratio = f"{row['tokens_per_s'] / reference:.3f}" if reference else "-"
        lines.append(f"{first} {row['seconds']:.3f} | {row['tokens_per_s']:.0f} | {peak} | {ratio} |")
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=32768, help="tokens on rank 0 (the step has 2x)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="a tiny model of the same shape family (smoke runs)")
    parser.add_argument("--trainer-loss", default="chunked", choices=("chunked", "full"),
                        help="the cpcompile trainer's loss (the HF row's is always the model's own, full logits)")
    parser.add_argument("--gdn-backend", default=None, choices=("triton", "eager"),
                        help="every row's GDN core: default triton on cuda, eager on cpu (triton on cpu: "
                             "TRITON_INTERPRET=1)")
    parser.add_argument("--hf-loss", default=None, choices=("chunked", "model"),
                        help="the HF row's context_parallel(loss=...); default: the integration's (chunked)")
    parser.add_argument("--compile-backend", default=None,
                        help="every row's decoder-layer torch.compile backend (eager: none); default: each one's own")
    parser.add_argument("--rows", default="hf_trainer,cpcompile_trainer",
                        help="comma-separated, of " + ", ".join(ROWS) + " (sft_trainer needs trl)")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="for the rows together")
    parser.add_argument("--out", default=None, help="write the table here (markdown)")
    parser.add_argument("--row", default=None, choices=IN_PROCESS_ROWS, help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup >= 1 (the first step compiles) and --steps >= 1")
    if not args.rows or set(args.rows.split(",")) - set(ROWS):
        parser.error(f"--rows {args.rows!r}: name some of {', '.join(ROWS)}")
    return args


def main() -> None:
    args = parse()
    if args.row:
        row = {"hf_trainer": hf_trainer_row, "sft_trainer": sft_trainer_row}[args.row]
        print(ROW_MARK + json.dumps(row(args)), flush=True)
        return
    start, rows = time.perf_counter(), {}
    names = [name for name in ROWS if name in args.rows.split(",")]
    for index, name in enumerate(names):
        left = args.max_seconds - (time.perf_counter() - start)
        budget = left - RESERVE_SECONDS * (len(names) - 1 - index)
        rows[name] = run_row(args, name, max(budget, 1.0))
        print(f"[{time.perf_counter() - start:.0f} s] {name}: {rows[name]}", flush=True)
    text = table(args, rows)
    print("\n" + text, flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    if any("note" in row for row in rows.values()):
        sys.exit(1)  # the table says which row and why


if __name__ == "__main__":
    main()
