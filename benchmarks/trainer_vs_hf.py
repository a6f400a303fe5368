"""The cpcompile trainer against plain transformers (+ fla-core) on one GPU (issue 32 item 5).

    python benchmarks/trainer_vs_hf.py                     # 32K, 64K, 128K, then the longest that fits
    options: --seq-lens 32K,64K,128K --max-seq-len 4M --warmup 3 --repeat 5 --max-seconds 300 --total-seconds 450
             --compile-backend inductor --gdn-checkpoint-around-core --offload-layer-inputs --sdpa-backend cudnn
             --methods cpcompile,hf,hf_fused_ce --profile --out FILE
    python benchmarks/trainer_vs_hf.py --small --device cpu --seq-lens 256 --out /tmp/r.md   # smoke (no search)
    (--warmup 0 --repeat 1 with cpcompile alone: one step, for the longest lengths; the allocator runs with
    expandable segments unless PYTORCH_CUDA_ALLOC_CONF says otherwise)

Three ways to train the same model (trainer_gpu.py's Qwen3.5-shaped 0.57B, random weights, seed 0)
on the same tokens (the trainer's synthetic rows) at the same precision (float32 parameters,
bfloat16 compute), AdamW (lr 3e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01), gradient
clipping at 1.0, batch 1:

- `cpcompile`: the trainer (`cpcompile.trainer`: `build_trainer`, `Trainer.step`) at cp 1: FSDP2 on
  one rank computing in bfloat16 (its mixed precision) and reducing in float32, the chunked loss
  (`train.loss: chunked`, no logits), activation checkpointing on every layer, GDN on cpcompile's
  Triton core (eager on CPU), `--compile-backend` if given (else the trainer's default: inductor on CUDA).
- `hf`: plain transformers: `AutoModelForCausalLM.from_config` (SDPA attention), float32 parameters
  under `torch.autocast(bfloat16)`, `gradient_checkpointing_enable()` (non-reentrant), the model's own
  loss (`labels=`: the whole logits, upcast to float32). transformers runs its GDN layers on fla-core's
  kernels when fla-core is importable (its `chunk_gated_delta_rule`), else on its reference PyTorch
  code; the row says which ran (the Python functions called during a warm-up forward, `gdn kernel`).
  fla-core 0.6 refuses its gated backward on Hopper with Triton < 3.7.1 (its issue #640); for timing
  the guard is lifted, as in gdn_kernels.py (no correctness claim rests on the peer's gradients).
- `hf_fused_ce`: the same, the loss by a fused linear cross-entropy on the last hidden state
  (cut-cross-entropy's `linear_cross_entropy` on bf16 casts of the hidden state and head, else
  liger-kernel's `LigerFusedLinearCrossEntropyLoss`); without either installed the row says so.
  transformers 5.x has no fused linear cross-entropy of its own.

Each attempt (method, length) runs in a fresh subprocess, so an out-of-memory attempt cannot spoil
the next one. Lengths: `--seq-lens`, then doubling from the last one that fit up to `--max-seq-len`
(those attempts: 1 warm-up + 1 measured step: they ask whether it fits, and how fast), stopping at
the first that runs out of memory. Every method has a time budget: `--max-seconds`, or what is
left of `--total-seconds` when less (the defaults, 300 and 450, keep the run within ~8 minutes on an
H200). An attempt whose set-up, warm-up and one measured step are predicted to go past it (from the
last attempt: its set-up time, and its step ~3x as long at twice the length) is not started, and a
started one stops measuring when its next step would pass it (at least one measured step); the
table says how many ran. With `--profile` every attempt runs one step more after them, under
PyTorch's profiler, and the results file gets that step's ops by device time (step_profile.py). MFU: (6 x matmul parameters, the head's included,
+ 6 x attention layers x seq_len x heads x head_dim) per token (no recompute counted), against
`--peak-tflops` (H200 dense bf16: 989). Results: `benchmarks/results/trainer_vs_hf_<date>_<device>.md`.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from cpcompile.trainer.sdpa_backend import SDPA_BACKENDS  # noqa: E402

METHODS = ("cpcompile", "hf", "hf_fused_ce")
ROW_MARK = "ATTEMPT_ROW "
SEARCH_STEPS = (1, 1)  # (warm-up, measured) of a doubling-search attempt
GROWTH = 3.0  # a step at twice the length takes about this much longer (linear layers 2x, attention 4x)
GIB = 2.0 ** 30


# ------------------------------------------------------------------------------ the child


def compiles_layers(args) -> bool:
    """Whether the trainer compiles its layers here (`--compile-backend`, else its default)."""
    from cpcompile.trainer.config import TrainSettings

    return TrainSettings(compile_backend=args.compile_backend, device=args.device).layer_compile_backend() \
        is not None


def build_cpcompile(args, seq_len: int, steps: int):
    """-> (one training step as a function of its index, the model) for the trainer at cp 1."""
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.loop import build_trainer
    from trainer_gpu import config

    settings = argparse.Namespace(cp=1, steps=steps, seq_len=seq_len, small=args.small, device=args.device,
                                  loss_chunk_tokens=args.loss_chunk_tokens, compile_backend=args.compile_backend,
                                  gdn_backend=None, gdn_checkpoint_around_core=args.gdn_checkpoint_around_core,
                                  offload_layer_inputs=args.offload_layer_inputs, sdpa_backend=args.sdpa_backend)
    trainer = build_trainer(load_train_config(config(settings, "chunked", "every_layer")))
    return (lambda index: trainer.step(index)["loss"]), trainer.model


def synthetic_batches(args, seq_len: int, vocab_size: int):
    """The trainer's synthetic rows (same seed): `batch(step)` -> input_ids, labels on the device."""
    from cpcompile.trainer import load_train_config
    from cpcompile.trainer.data import TokenStream
    from trainer_gpu import config

    settings = argparse.Namespace(cp=1, steps=1, seq_len=seq_len, small=args.small, device=args.device,
                                  loss_chunk_tokens=args.loss_chunk_tokens, compile_backend=None, gdn_backend=None)
    train_config = load_train_config(config(settings))
    return TokenStream(train_config.data, train_config.train, vocab_size)


def fused_linear_cross_entropy():
    """-> (name, loss(hidden [T, D], weight [V, D], targets [T]) -> mean loss), or (None, why not)."""
    try:
        from cut_cross_entropy import linear_cross_entropy

        import torch

        # its backward takes bf16/fp16 operands only; the casts are autograd ops, so the float32
        # head still gets its gradient (what autocast does to nn.Linear)
        return "cut-cross-entropy", lambda hidden, weight, targets: linear_cross_entropy(
            hidden.to(torch.bfloat16), weight.to(torch.bfloat16), targets)
    except ImportError:
        pass
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        return "liger-kernel", lambda hidden, weight, targets: liger(weight, hidden, targets)
    except ImportError:
        return None, "not available: neither cut-cross-entropy nor liger-kernel is installed"


def build_hf(args, seq_len: int, fused: bool):
    """-> (one training step as a function of its index, the model) for plain transformers."""
    import torch

    from cpcompile.trainer.hf_config import model_config, transformers_module
    from trainer_gpu import MODEL, SMALL

    from fla_guard import lift_fla_hopper_guard

    transformers = transformers_module()
    try:  # timing only (fla_guard.py)
        lift_fla_hopper_guard()
    except ImportError:
        pass  # transformers then runs its PyTorch reference; the row says which kernel ran
    loss_name, fused_loss = fused_linear_cross_entropy() if fused else ("transformers (whole logits)", None)
    if loss_name is None:
        raise Unavailable(fused_loss)  # why it is not available
    torch.manual_seed(0)
    config = model_config(dict(SMALL if args.small else MODEL))
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    stream = synthetic_batches(args, seq_len, config.get_text_config().vocab_size)

    def step(index: int) -> float:
        batch = stream.batch(index)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            if fused_loss is None:
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
            else:
                hidden = model.model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
                loss = fused_loss(hidden[0, :-1], model.lm_head.weight, batch["labels"][0, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step.loss_name = loss_name
    return step, model


class Unavailable(Exception):
    """A method this machine cannot run (a package missing): its row says why."""


def python_modules_called(run, prefix: str) -> list[str]:
    """Run `run()`, -> the qualified names of the functions of modules under `prefix` it called
    (this thread's Python calls: which GDN kernel transformers picked, seen, not guessed)."""
    seen = set()

    def profile(frame, event, _arg):
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith(prefix):
                seen.add(f"{module}.{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def gdn_kernel(step) -> str:
    """The GDN kernel a transformers step ran: fla-core's, or transformers' reference code."""
    called = python_modules_called(lambda: step(0), "fla.")
    chunk = [name for name in called if name.endswith("chunk_gated_delta_rule")]
    if chunk:
        return f"fla-core ({chunk[0]})"
    return "transformers' PyTorch reference (fla-core not used)" + ("" if not called else f"; fla called: {called[0]}")


def run_attempt(args, spec: dict) -> dict:
    """Build one method at one length, warm up, measure within `spec['deadline_s']`; -> its row."""
    import torch

    from trainer_gpu import flops_per_token

    start = time.perf_counter()
    row = dict(spec)
    cuda = args.device == "cuda"
    row["device_name"] = torch.cuda.get_device_name().replace(" ", "-") if cuda else "cpu"
    phase = "build"
    try:
        total_steps = spec["warmup"] + spec["repeat"] + int(args.profile)
        if spec["method"] == "cpcompile":
            step, model = build_cpcompile(args, spec["seq_len"], total_steps)
            row["loss_fn"], row["gdn_kernel"] = "chunked (cpcompile)", "cpcompile Triton" if cuda else "cpcompile eager"
        else:
            step, model = build_hf(args, spec["seq_len"], fused=spec["method"] == "hf_fused_ce")
            row["loss_fn"] = step.loss_name
        row["setup_s"] = time.perf_counter() - start
        phase = "warm-up"
        for index in range(spec["warmup"]):
            if index == 0 and spec["method"] != "cpcompile":
                row["gdn_kernel"] = gdn_kernel(step)  # runs step 0
            else:
                step(index)
        phase = "measured steps"
        with adam_state_stand_in(model, row, cuda and spec["warmup"] == 0):
            seconds = measure(step, spec, cuda, deadline=start + spec["deadline_s"])
        if args.profile:
            phase = "profiled step"
            row["profile"] = profiled_step(step, spec["warmup"] + len(seconds), args.device)
    except torch.OutOfMemoryError as exc:
        held = f"; peak allocated {torch.cuda.max_memory_allocated() / GIB:.1f} GiB" if cuda else ""
        return {**row, "note": f"OOM ({phase}: {oom_summary(exc)}{held})"}
    except Unavailable as exc:
        return {**row, "note": str(exc)}
    per_token = flops_per_token(model, spec["seq_len"])
    mean = sum(seconds) / len(seconds)
    return {**row, "repeat": len(seconds), "seconds": mean, "tokens_per_s": spec["seq_len"] / mean,
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
            "mfu": per_token * spec["seq_len"] / mean / (args.peak_tflops * 1e12)}


def profiled_step(step, index: int, device: str) -> str:
    """One more step under PyTorch's profiler -> its ops by device time (step_profile.py)."""
    from step_profile import kernel_table

    tables: list[str] = []
    with kernel_table(device, tables, rows=40):
        step(index)
    return tables[0]


def oom_summary(exc: Exception) -> str:
    """The allocator's own account (what was asked, what PyTorch held, what was reserved but free:
    fragmentation), without its advice."""
    text = " ".join(str(exc).split())
    return text.split(" If reserved but unallocated")[0].split(" See documentation")[0][:400]


@contextlib.contextmanager
def adam_state_stand_in(model, row: dict, needed: bool):
    """With no warm-up the measured step is the first: AdamW allocates its two float32 moments a
    parameter only in that step's optimizer update, after the backward's peak, so a later step's
    peak would be higher by their bytes. A buffer of those bytes, held from the step's start until
    its optimizer update begins (when the real moments appear), puts them in the measured peak; the
    row says so (and that its time includes the kernels' first compilation)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    if not needed:
        yield
        return
    state_bytes = 2 * 4 * sum(p.numel() for p in model.parameters())
    row["note_warmup"] = (f"no warm-up: the first step, its time with the kernels' first compilation; "
                          f"AdamW's {state_bytes / GIB:.2f} GiB of moments held by a stand-in buffer up to its update")
    held = [torch.empty(state_bytes, dtype=torch.uint8, device="cuda")]
    release = register_optimizer_step_pre_hook(lambda *_: held.clear())
    try:
        yield
    finally:
        release.remove()
        held.clear()


def measure(step, spec: dict, cuda: bool, deadline: float) -> list[float]:
    """Time up to `spec['repeat']` steps after the warm-up (peak memory from the first of them); stop
    early when the next step would end past `deadline` (one step at least)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for index in range(spec["repeat"]):
        if seconds and time.perf_counter() + seconds[-1] > deadline:
            break
        begin = time.perf_counter()
        step(spec["warmup"] + index)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - begin)
    return seconds


# ----------------------------------------------------------------------------- the parent


def parse_lengths(text: str) -> list[int]:
    from simulate_cp import parse_tokens

    return parse_tokens(text)


def attempt(args, argv: list[str], spec: dict) -> dict:
    command = [sys.executable, os.path.abspath(__file__), *argv, "--attempt", json.dumps(spec)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=spec["deadline_s"] + 60)
    except subprocess.TimeoutExpired:
        return {**spec, "note": "stopped: over the time budget", "wall_s": time.perf_counter() - started}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(ROW_MARK):
            return {**json.loads(line[len(ROW_MARK):]), "wall_s": time.perf_counter() - started}
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {**spec, "note": f"failed (exit {done.returncode}): {last[:200]}", "wall_s": time.perf_counter() - started}


def predicted_seconds(last: dict | None, warmup: int) -> float:
    """What the next attempt needs at least (its set-up, its warm-up and one measured step), from the
    last one at half its length (module doc); 0 without one."""
    if last is None or "seconds" not in last:
        return 0.0
    return last["setup_s"] + (warmup + 1) * last["seconds"] * GROWTH


def run_method(args, argv: list[str], method: str, budget: float) -> list[dict]:
    """Every length of one method within `budget` seconds: the fixed ones, then the doubling search."""
    start, rows, last = time.perf_counter(), [], None
    lengths = list(args.seq_lens)
    while lengths:
        seq_len = lengths.pop(0)
        searching = seq_len > args.seq_lens[-1]
        warmup, repeat = SEARCH_STEPS if searching else (args.warmup, args.repeat)
        if method == "cpcompile" and searching and compiles_layers(args):
            warmup += 1  # its second step compiles (cpcompile.compiled): not the one to time
        spec = {"method": method, "seq_len": seq_len, "warmup": warmup, "repeat": repeat}
        left = budget - (time.perf_counter() - start)
        need = predicted_seconds(last, warmup)
        if left <= 0 or need > left:
            rows.append({**spec, "note": f"not run: over the time budget ({need:.0f} s predicted, "
                                         f"{max(left, 0):.0f} s left)"})
            break
        row = attempt(args, argv, {**spec, "deadline_s": left})
        rows.append(row)
        print(describe(row), flush=True)
        if "note" in row:
            break
        last = row
        if not lengths and seq_len * 2 <= args.max_seq_len:
            lengths.append(seq_len * 2)  # the doubling search past the fixed lengths
    return rows


def describe(row: dict) -> str:
    where = f"{row['method']} {short(row['seq_len'])}"
    if "note" in row:
        return f"{where}: {row['note']}"
    return f"{where}: {row['seconds']:.3f} s/step, {row['tokens_per_s']:.0f} tokens/s, peak {_gib(row['peak_gib'])}"


def short(count: int) -> str:
    from simulate_cp import short_tokens

    return short_tokens(count)


def _gib(value) -> str:
    return "-" if value is None else f"{value:.2f} GiB"


def table(rows: list[dict]) -> str:
    lines = ["| method | seq len | warmup/repeat | tokens/s | s/step | peak GiB | MFU | loss | GDN kernel |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        first = f"| {row['method']} | {short(row['seq_len'])} | {row['warmup']}/{row['repeat']} |"
        if "note" in row:
            lines.append(f"{first} {row['note']} | | | | | |")
            continue
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        lines.append(f"{first} {row['tokens_per_s']:.0f} | {row['seconds']:.3f} | {peak} | {100 * row['mfu']:.1f}% | "
                     f"{row.get('loss_fn', '')} | {row.get('gdn_kernel', '')} |")
    notes = [f"- {row['method']} {short(row['seq_len'])}: {row['note_warmup']}" for row in rows if "note_warmup" in row]
    return "\n".join(lines + ([""] + notes if notes else []))


def profiles(rows: list[dict]) -> str:
    """With --profile: each attempt's profiled step (after its measured ones), ops by device time."""
    return "".join(f"\n\n### Profile: {row['method']} {short(row['seq_len'])} (one step after the measured ones)"
                   f"\n\n```\n{row['profile']}\n```" for row in rows if "profile" in row)


def longest(rows: list[dict]) -> str:
    """One line per method: the longest length that ran, and what stopped the search."""
    lines = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        ran = [r for r in mine if "note" not in r]
        stop = next((r for r in mine if "note" in r), None)
        fit = short(ran[-1]["seq_len"]) if ran else "none"
        after = f"; {short(stop['seq_len'])}: {stop['note']}" if stop else ""
        lines.append(f"- {method}: longest that ran {fit}{after}")
    return "\n".join(lines)


def write_results(args, rows: list[dict], text: str) -> str:
    device = next((r["device_name"] for r in rows if "device_name" in r), args.device)
    path = args.out or os.path.join(HERE, "results", f"trainer_vs_hf_{datetime.date.today()}_{device}.md")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"# cpcompile trainer vs transformers + fla-core, one {device} - {datetime.date.today()}\n\n")
        handle.write(f"Command: `python benchmarks/trainer_vs_hf.py {' '.join(sys.argv[1:])}`; "
                     f"{versions()}; PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}.\n\n{text}\n")
    return path


def versions() -> str:
    import importlib.metadata as metadata

    found = []
    for package in ("torch", "transformers", "triton", "fla-core", "cut-cross-entropy", "liger-kernel"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seq-lens", default="32K,64K,128K", help="then doubling from the last up to --max-seq-len")
    parser.add_argument("--max-seq-len", default=None, help="4M; with --small: the last --seq-lens (no search)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=300.0, help="per method")
    parser.add_argument("--total-seconds", type=float, default=450.0, help="for the whole run")
    parser.add_argument("--loss-chunk-tokens", type=int, default=4096)
    parser.add_argument("--compile-backend", default=None, help="the cpcompile trainer's train.compile_backend")
    parser.add_argument("--gdn-checkpoint-around-core", action="store_true",
                        help="the trainer's train.gdn_checkpoint_around_core (docs/trainer.md)")
    parser.add_argument("--offload-layer-inputs", action="store_true",
                        help="the trainer's train.offload_layer_inputs (docs/trainer.md)")
    parser.add_argument("--sdpa-backend", default=None, choices=tuple(SDPA_BACKENDS),
                        help="the trainer's train.sdpa_backend (docs/trainer.md); the peers keep PyTorch's choice")
    parser.add_argument("--profile", action="store_true",
                        help="one more step an attempt, profiled; its ops by device time in the results file")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="trainer_gpu.py's tiny model (smoke runs)")
    parser.add_argument("--out", default=None, help="the results file (default benchmarks/results/...)")
    parser.add_argument("--attempt", default=None, help=argparse.SUPPRESS)  # one attempt, in a child process
    args = parser.parse_args()
    if args.attempt:
        row = run_attempt(args, json.loads(args.attempt))
        print(ROW_MARK + json.dumps(row), flush=True)
        return
    methods = args.methods.split(",")
    one_step = methods == ["cpcompile"] and args.warmup == 0 and args.repeat == 1
    if any(m not in METHODS for m in methods) or args.repeat < 1 or (args.warmup < 1 and not one_step):
        parser.error(f"--methods takes {', '.join(METHODS)}; --warmup and --repeat are >= 1, but for cpcompile "
                     "alone --warmup 0 --repeat 1 (one step, for the longest lengths; compiled layers would compile "
                     "in it)")
    # every attempt's allocator (the children inherit it): at 512K+ tokens the largest tensors are GiBs
    # of varying sizes, and the default segments left 5 GiB free but unusable in a 1M attempt
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args.seq_lens = parse_lengths(args.seq_lens)
    (args.max_seq_len,) = parse_lengths(args.max_seq_len or ("4M" if not args.small else str(args.seq_lens[-1])))
    start, rows = time.perf_counter(), []
    for method in methods:  # each within its own budget and what is left of the whole run's
        left = args.total_seconds - (time.perf_counter() - start)
        rows += run_method(args, sys.argv[1:], method, min(args.max_seconds, left))
    text = (f"{'tiny model' if args.small else 'Qwen3.5-shaped 0.57B'}, {args.device}, batch 1, fp32 parameters + "
            f"bf16 compute, AdamW, grad clip 1.0; MFU against {args.peak_tflops:g} TFLOP/s.\n\n"
            f"{table(rows)}\n\n{longest(rows)}{profiles(rows)}")
    print("\n" + text, flush=True)
    print(f"\nwritten: {write_results(args, rows, text)}", flush=True)


if __name__ == "__main__":
    main()
