"""Where the eager training step's copies and multiplies come from (issue 48 item 5), on CPU.

Builds the trainer the way `trainer_gpu.py --small --device cpu --compile-backend eager` does
(FSDP2 computing in bfloat16, activation checkpointing every layer, chunked loss), runs one step to
warm up, then counts every copy (`aten::copy_`, `_to_copy`, `clone`: each is one copy kernel) and
every `aten::mul` of the next step, with the bytes it writes, by phase and by source line:

    PYTHONPATH=. python benchmarks/eager_copies.py [--seq-len 512 --loss-chunk-tokens 64] [--rows 200]

The GDN core runs cpcompile's Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1, set
here unless given), so that its Python wrappers' copies are the GPU path's; the eager GDN backend's
backward (`torch.func.vjp`) does not run under a dispatch mode. The GDN layers take the eager CUDA
layer's core with the q/k norm inside (`kernels/gdn/normalising_core.py`, which applies to CUDA
tensors only, forced here), unless `--stated-norm`.

How an op is placed. A dispatch mode sees each op below autograd, so `.to()` arrives as
`_to_copy` and `.contiguous()` as `clone`. The phase: no autograd node running -> forward (or
optimizer, when the stack passes through the optimizer or the gradient clip); a node running and
`torch/utils/checkpoint.py` on the stack -> recompute; else backward. The source: the innermost
frame in cpcompile/ or transformers/ on the Python stack. A backward op of a C++ autograd node has
no Python stack, so it is put on the forward line that made the node (anomaly mode records that
line on every node) and named with the node's class ("MulBackward0 of ...").
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch._library.custom_ops import _maybe_get_opdef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

COPIES = ("aten.copy_.default", "aten._to_copy.default", "aten.clone.default")
COPY_NAMES = {"copy_": "copy_", "_to_copy": "_to_copy", "clone": "clone", "contiguous": "clone"}  # `to` = _to_copy
MULS = ("aten.mul.Tensor", "aten.mul.Scalar", "aten.mul_.Tensor", "aten.mul_.Scalar")
OURS = re.compile(r"(cpcompile/.*|transformers/.*|torch/(distributed|optim|utils/checkpoint).*)")
FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64", torch.int64: "i64"}


def short(dtype) -> str:
    return DTYPES.get(dtype, str(dtype).replace("torch.", ""))


def user_line(frames: list[tuple[str, int, str]]) -> str | None:
    """The innermost frame in cpcompile/ or transformers/ (not this script), or in torch's FSDP2,
    optimizer or checkpoint code (their own copies), as `path:line (fn)`."""
    for filename, line, name in reversed(frames):
        match = OURS.search(filename)
        if match and "benchmarks/" not in filename:
            where = match.group(1)
            return f"{'torch/' + where[6:] if where.startswith('torch/') else where}:{line} ({name})"
    return None


def torch_line(frames: list[tuple[str, int, str]]) -> str:
    """The innermost frame in torch's distributed, optim or utils code: FSDP2, the optimizer, AC."""
    for filename, line, name in reversed(frames):
        match = re.search(r"torch/(distributed|optim|utils|nn)/.*", filename)
        if match:
            return f"torch/{match.group(0)[6:]}:{line} ({name})"
    return "(no Python frame)"


def forward_line(node) -> str:
    """The forward source line that made the autograd `node` (anomaly mode's traceback)."""
    lines = node.metadata.get("traceback_") if node is not None else None
    if not lines:
        return "(no forward traceback)"
    frames = [(m.group(1), int(m.group(2)), m.group(3)) for m in map(FRAME.search, lines) if m]
    return user_line(frames) or torch_line(frames)


def phase_of(node, filenames: list[str]) -> str:
    if node is None:
        optimizer = any("torch/optim" in f or "trainer/optimizer.py" in f for f in filenames)
        return "optimizer" if optimizer else "forward"
    return "recompute" if any(f.endswith("torch/utils/checkpoint.py") for f in filenames) else "backward"


def is_copy(func, args, out) -> bool:
    """A copy kernel: `copy_`, `_to_copy`, `clone`, and (inside a custom op, where the mode sees
    them before they decompose) a `to` or `contiguous` that did not return its input."""
    name = str(func)
    if name in COPIES:
        return True
    composite = name.startswith(("aten.to.", "aten.contiguous."))
    return composite and isinstance(out, torch.Tensor) and out is not args[0]


def written_bytes(func, args, out) -> int:
    target = args[0] if str(func) == "aten.copy_.default" else out
    return target.numel() * target.element_size() if isinstance(target, torch.Tensor) else 0


def dtype_change(func, args, out) -> str:
    """`bf16->f32` for a cast, the dtype alone for a same-dtype copy or multiply."""
    name = str(func)
    if name == "aten.copy_.default":
        source, result = args[1], args[0]
    elif name in ("aten._to_copy.default", "aten.clone.default") or name.startswith(("aten.to.", "aten.contiguous.")):
        source, result = args[0], out
    else:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        kinds = "*".join(short(t.dtype) + ("" if t.dim() else "(0d)") for t in tensors)
        return kinds + ("*scalar" if len(tensors) < 2 else "")
    if source.dtype == result.dtype:
        return short(result.dtype) + (" clone" if name in ("aten.clone.default", "aten.contiguous.default") else "")
    return f"{short(source.dtype)}->{short(result.dtype)}"


class CountCopies(TorchDispatchMode):
    """Counts copies and multiplies by (phase, op, source line, dtypes): [calls, bytes written]."""

    def __init__(self):
        super().__init__()
        self.counts: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
        self.cores: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "cpcompile":
            # a custom op (the GDN core, the attention kernels): the mode is off while it handles an op,
            # so the op's own Python implementation runs with the mode entered again, to count its copies
            self.cores[str(func)] += 1
            definition = _maybe_get_opdef(func)
            if definition is not None:
                with self:
                    return definition._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if is_copy(func, args, out) or str(func) in MULS:
            self._count(func, args, out)
        return out

    def _count(self, func, args, out) -> None:
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack()[:-3]]
        if any("triton/runtime/interpreter" in f[0] for f in frames):
            return  # TRITON_INTERPRET's own tensor handling stands for a kernel's insides on GPU
        node = torch._C._current_autograd_node()
        phase = phase_of(node, [f[0] for f in frames])
        if node is not None:  # the engine runs on this thread: the frames up to `.backward()` are no source
            engine = [i for i, f in enumerate(frames) if f[0].endswith("torch/autograd/graph.py")]
            frames = frames[engine[-1] + 1:] if engine else frames
        source = user_line(frames)
        if source is None and phase == "backward":
            source = f"{type(node).__name__} of {forward_line(node)}"
        elif source is None:
            source = torch_line(frames)
        op = "mul" if str(func) in MULS else COPY_NAMES.get(str(func).split(".")[1], "_to_copy")
        entry = self.counts[(phase, op, source, dtype_change(func, args, out))]
        entry[0] += 1
        entry[1] += written_bytes(func, args, out)


def train_config(args):
    import trainer_gpu

    namespace = argparse.Namespace(cp=1, small=True, device="cpu", gdn_backend="triton",
                                   steps=2, seq_len=args.seq_len, loss_chunk_tokens=args.loss_chunk_tokens,
                                   compile_backend="eager")
    from cpcompile.trainer import load_train_config

    return load_train_config(trainer_gpu.config(namespace))


def count_step(args) -> CountCopies:
    from cpcompile.trainer.loop import build_trainer

    trainer = build_trainer(train_config(args))
    trainer.step(0)  # warm-up: the first step builds optimizer state
    counter = CountCopies()
    with torch.autograd.set_detect_anomaly(True, check_nan=False), counter:
        trainer.step(1)
    return counter


def source_class(source: str) -> str:
    """a: transformers' model code; b: cpcompile's own; c: FSDP2, the optimizer, autograd or AC
    mechanics (a backward op is its forward line's class)."""
    line = source.split(" of ", 1)[-1]
    if line.startswith("transformers/"):
        return "a"
    return "b" if line.startswith("cpcompile/") else "c"


def report(counter: CountCopies, rows: int) -> str:
    totals = collections.defaultdict(lambda: [0, 0])
    for (phase, op, source, _), (calls, nbytes) in counter.counts.items():
        kind = "mul" if op == "mul" else "copy"
        for key in ((phase, op), ("all", op), (f"class {source_class(source)}", kind)):
            totals[key][0] += calls
            totals[key][1] += nbytes
    cores = ", ".join(f"{name} x{n}" for name, n in sorted(counter.cores.items()))
    lines = [f"cpcompile:: custom ops called (their Python implementations counted inside): {cores}", "",
             "| phase | op | calls | MB written |", "|---|---|---|---|"]
    lines += [f"| {p} | {o} | {c} | {b / 1e6:.2f} |" for (p, o), (c, b) in sorted(totals.items())]
    lines += ["", "| phase | op | source | dtypes | class | calls | MB written |", "|---|---|---|---|---|---|---|"]
    ranked = sorted(counter.counts.items(), key=lambda kv: (-kv[1][1], kv[0]))
    for (phase, op, source, dtypes), (calls, nbytes) in ranked[:rows]:
        lines.append(f"| {phase} | {op} | {source} | {dtypes} | {source_class(source)} | {calls} | "
                     f"{nbytes / 1e6:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--loss-chunk-tokens", type=int, default=64, help="8 chunks a step, as 32K / 4096 on GPU")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--stated-norm", action="store_true",
                        help="GDN q/k norm as stated (fp32, then gdn_chunk): the eager CUDA path before 2026-12-07")
    args = parser.parse_args()
    if not args.stated_norm:  # the eager CUDA layer's core with the norm inside applies to CUDA tensors: forced
        from cpcompile.kernels.gdn import normalising_core

        normalising_core.applies = lambda x, backend: backend == "triton" and not torch.compiler.is_compiling()
    print(report(count_step(args), args.rows), flush=True)


if __name__ == "__main__":
    main()
