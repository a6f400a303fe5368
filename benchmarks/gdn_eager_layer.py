"""Benchmark one eager Qwen3.5 GDN layer at the trainer model's shapes (issue 48 item 5): cpcompile's
layer as Qwen3.5 states it (the q/k norm in fp32, then `cpcompile::gdn_chunk`), the same layer with
the norm inside the core (`kernels/gdn/normalising_core.py`, what the eager CUDA layer now runs),
and transformers' own layer (on fla-core's kernels when fla-core is importable: the plain stack's).

    python benchmarks/gdn_eager_layer.py [--T 32768] [--warmup 5] [--repeat 20] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/gdn_eager_layer.py --smoke     # CPU, tiny shape, no timing claim

bf16 parameters and activations, batch 1, hidden 1024, 16 key and 16 value heads of 128 (the
0.57B model of trainer_gpu.py). Forward: the layer; forward+backward: every input and parameter
gradient of a weighted sum. Times: median of `repeat` CUDA-event timings after `warmup`; peak: the
most allocated during one forward+backward above what was allocated before it.
"""
from __future__ import annotations

import argparse
import datetime as _dt

import torch

from cpcompile.adapters import qwen3_5
from cpcompile.kernels.gdn import CHUNK_SIZE, normalising_core
from gdn_kernels import time_cuda

SHAPE = dict(hidden_size=1024, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
             linear_num_value_heads=16, linear_conv_kernel_dim=4)
SMOKE = dict(SHAPE, hidden_size=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4)


def build_layer(shape: dict, device: str, dtype):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=128, num_hidden_layers=1, **shape)
    return Qwen3_5GatedDeltaNet(config, layer_idx=0).to(device, dtype)


def cpcompile_layer(norm_in_core: bool):
    def forward(layer, hidden):
        stated = normalising_core.applies
        normalising_core.applies = lambda x, backend: norm_in_core  # both forms on one device
        try:
            return qwen3_5.gdn_layer_forward(layer, hidden, None, chunk_size=CHUNK_SIZE, backend="triton")
        finally:
            normalising_core.applies = stated
    return forward


def transformers_layer(layer, hidden):
    return layer(hidden, attention_mask=None)


def fla_available() -> str:
    try:
        from fla_guard import lift_fla_hopper_guard

        lift_fla_hopper_guard()  # timing only (fla_guard.py)
        return "fla-core"
    except ImportError:
        return "its PyTorch reference (no fla-core)"


def measure(forward, layer, hidden, weight, warmup: int, repeat: int) -> tuple[float, float, float | None]:
    leaves = [hidden, *layer.parameters()]

    def fwd():
        with torch.no_grad():
            forward(layer, hidden)

    def fwd_bwd():
        torch.autograd.grad((forward(layer, hidden) * weight).sum(), leaves)

    peak = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    return time_cuda(fwd, warmup, repeat), time_cuda(fwd_bwd, warmup, repeat), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    length = 2 * CHUNK_SIZE + 5 if args.smoke else args.T
    layer = build_layer(SMOKE if args.smoke else SHAPE, device, dtype)
    hidden = torch.randn(1, length, layer.hidden_size, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn_like(hidden)
    rows = {"cpcompile, norm stated (fp32, then gdn_chunk)": cpcompile_layer(False),
            "cpcompile, norm in the core (eager CUDA default)": cpcompile_layer(True)}
    if not args.smoke:
        rows[f"transformers' layer on {fla_available()}"] = transformers_layer
    lines = ["| layer | T | warmup/repeat | fwd ms | fwd+bwd ms | peak GiB |", "|---|---|---|---|---|---|"]
    for name, forward in rows.items():
        fwd, fwd_bwd, peak = measure(forward, layer, hidden, weight, args.warmup, args.repeat)
        peak_text = "-" if peak is None else f"{peak:.2f}"
        lines.append(f"| {name} | {length} | {args.warmup}/{args.repeat} | {fwd:.2f} | {fwd_bwd:.2f} | {peak_text} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    if args.out:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(f"# Eager GDN layer, {name}, {_dt.date.today()}\n\nCommand: `python benchmarks/"
                         f"gdn_eager_layer.py --T {args.T} --warmup {args.warmup} --repeat {args.repeat}`\n\n{text}\n")


if __name__ == "__main__":
    main()
