"""What one decoder layer and the final norm hold, per token, and what the chunked loss holds,
measured on CPU at the real widths: the numbers `cpcompile/trainer/memory_layers.py`'s per-token terms are
checked against (tests/train/test_memory_layers.py).

    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python benchmarks/layer_memory.py [--tokens 1536,2560] [--small]

A layer of each kind (GDN, attention) of benchmarks/trainer_gpu.py's `MODEL`, in bfloat16 (what
FSDP2's mixed precision computes in), runs its forward and backward checkpointed, selective or not
checkpointed, while `LiveBytes` counts the bytes of the storages its ops create. Per kind and
mode (and for GDN with the ops before and after its core under checkpoints of their own,
`train.gdn_checkpoint_around_core`), in bytes a token (the growth between two lengths, so that
what does not grow with the length drops out), as memory.py names them:

- `kept`: what the layer keeps from its forward to its backward (a checkpointed layer's input
  included, which the checkpoint keeps);
- `peak`: everything of the layer alive at its backward's peak: `kept`, the replay, the
  gradients in flight (the incoming one included) and the kernels' buffers.

GDN runs cpcompile's Triton core as on a GPU (`gdn_backend: triton`), its kernels skipped
(`triton_allocations_only`): every buffer the launchers in kernels/gdn/triton/ allocate is allocated
and counted; no kernel runs, so the values are garbage and the bytes exact. Attention runs PyTorch's
CPU flash kernel, whose outputs (the output, its log-sum-exp; dq, dk, dv) are the CUDA kernel's
sizes, but laid out [B, H, T, D]: `expected_layer_bytes` adds the copy that costs on CPU.

Not seen: an op's own temporaries (created and freed inside one ATen call: on CUDA, the flash
backward's dq accumulator, which memory.py counts from the code), parameters and their
gradients (dropped as they arrive, and tensors of a parameter's shape not counted: FSDP2 holds
them, memory.py counts them apart).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KINDS = ("linear_attention", "full_attention")
# the chunked loss at a vocabulary a CPU computes quickly: its buffers scale with each of these
LOSS_SHAPE = {"tokens": 1024, "vocab_size": 8192, "hidden_size": 256, "chunk": 256}


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that the ops run under this mode created and that are still
    alive (`live`), and their most since `reset_peak` (`peak`). Tensors of `ignored_shapes` (a
    layer's parameter shapes: their gradients and casts) are not counted.

    A storage counts from the op that returned it until Python frees it (a weakref finalizer),
    views and in-place results not again. cpcompile's custom ops (the GDN core) run their Python
    implementation under the mode, so the buffers they allocate inside count too; an ATen op's
    own temporaries do not."""

    def __init__(self, ignored_shapes: frozenset = frozenset()):
        super().__init__()
        self.live = self.peak = 0
        self.ignored_shapes = ignored_shapes
        self._alive: set[int] = set()
        # cpcompile op -> (live bytes at its last call, the most during it)
        self.inside: dict[str, tuple[int, int]] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "cpcompile":
            before, outer = self.live, self.peak
            self.peak = before
            with self:  # the op's own allocations, not only its outputs
                out = _custom_op_function(func)(*args, **kwargs)
            self.inside[func._schema.name] = (before, self.peak)
            self.peak = max(outer, self.peak)
        else:
            out = func(*args, **kwargs)
        existing = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) not in self.ignored_shapes:
                self._count(tensor.untyped_storage(), existing)
        return out

    def _count(self, storage, existing: set[int]) -> None:
        key, size = storage._cdata, storage.nbytes()
        if key in existing or key in self._alive or size == 0:
            return
        self._alive.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._alive.discard(key)
        self.live -= size


def _custom_op_function(func):
    """The Python function a `torch.library.custom_op` was defined with."""
    from torch._library.custom_ops import OPDEFS

    return OPDEFS[func._schema.name]._init_fn


@contextlib.contextmanager
def triton_allocations_only():
    """cpcompile's Triton GDN launch code with every kernel launch skipped: it allocates what it
    allocates on a GPU (on CPU: the interpreter's device checks pass with TRITON_INTERPRET=1)."""
    from cpcompile.kernels.gdn.triton import launching

    real = launching.launch
    launching.launch = lambda kernel, grid, *args, **options: None
    try:
        yield
    finally:
        launching.launch = real


def text_config(raw: dict):
    from cpcompile.trainer.hf_config import model_config

    config = model_config(raw)
    config._attn_implementation = "sdpa"
    return config.get_text_config()


def decoder_layer(text, kind: str, dtype=torch.bfloat16, gdn_inner: bool = False) -> torch.nn.Module:
    """A decoder layer of `kind` of the model `text` describes, in `dtype`, its GDN core on
    cpcompile's Triton backend (trainer/parallelize.py `use_cpcompile_gdn`; `gdn_inner`: the ops
    before and after the core under checkpoints of their own, `train.gdn_checkpoint_around_core`)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    from cpcompile.trainer.parallelize import use_cpcompile_gdn

    torch.manual_seed(0)
    layer = Qwen3_5DecoderLayer(text, text.layer_types.index(kind)).to(dtype)
    use_cpcompile_gdn(layer, "triton", checkpoint_around_core=gdn_inner)
    return layer


def _position_embeddings(text, tokens: int, dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    positions = torch.arange(tokens)[None]
    x = torch.zeros(1, tokens, text.hidden_size, dtype=dtype)
    return Qwen3_5TextRotaryEmbedding(text)(x, positions), positions


def _drop_parameter_gradients(module: torch.nn.Module) -> list:
    """Each parameter's gradient dropped as it arrives (FSDP2 holds them; memory.py counts them)."""
    def drop(parameter):
        parameter.grad = None
    return [p.register_post_accumulate_grad_hook(drop) for p in module.parameters()]


def parameter_shapes(module: torch.nn.Module) -> frozenset:
    """The shapes of `module`'s parameters and of their transposes (a weight gradient may come as either)."""
    shapes = {tuple(p.shape) for p in module.parameters()}
    return frozenset(shapes | {shape[::-1] for shape in shapes})


def measure_layer(text, kind: str, checkpointing: str, tokens: int, dtype=torch.bfloat16,
                  gdn_inner: bool = False) -> dict[str, int]:
    """{'kept', 'peak'} in bytes (module doc) of one layer's forward and backward over `tokens`;
    `checkpointing` as `memory_layers.layer_checkpointing` names it. A GDN layer also gives the Triton
    core backward's buffers (`core_buffers`) and the bytes of the layer at their peak (`at_core`)."""
    from cpcompile.trainer.activation_checkpointing import checkpoint_layers, parse_ac_mode

    layer = decoder_layer(text, kind, dtype, gdn_inner)
    mode = {"off": "off", "checkpointed": "every_layer", "selective": "selective"}[checkpointing]
    checkpoint_layers(torch.nn.ModuleList([layer]), parse_ac_mode(mode))
    hooks = _drop_parameter_gradients(layer)
    position_embeddings, positions = _position_embeddings(text, tokens, dtype)
    hidden = torch.randn(1, tokens, text.hidden_size, dtype=dtype, requires_grad=True)
    # the incoming gradient comes from an op's backward, held by autograd alone (as the next
    # layer's is; a gradient passed to `backward` would stay referenced, and not be summed in place)
    next_layer = torch.randn_like(hidden)
    tracker = LiveBytes(parameter_shapes(layer))
    with triton_allocations_only(), tracker:
        out = layer(hidden, position_embeddings=position_embeddings, attention_mask=None, position_ids=positions)
        output = out.untyped_storage().nbytes()
        kept = tracker.live - output
        tracker.reset_peak()
        (out * next_layer).sum().backward()
    for hook in hooks:
        hook.remove()
    # the layer's input, made before: a checkpointed layer keeps it (memory.py counts it in both)
    own_input = 0 if checkpointing == "off" else hidden.untyped_storage().nbytes()
    measured = {"kept": kept + own_input, "peak": tracker.peak - output + own_input}
    if kind == "linear_attention":  # the core's backward: its buffers, and all the layer holds then
        before, most = tracker.inside["cpcompile::gdn_chunk_backward"]
        measured.update(core_buffers=most - before, at_core=most - output + own_input)
    return measured


def measure_final_norm(text, tokens: int, dtype=torch.bfloat16) -> int:
    """Bytes the model's final RMSNorm keeps for its backward, its output included (the loss's input)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    norm = Qwen3_5RMSNorm(text.hidden_size, eps=text.rms_norm_eps).to(dtype)
    hidden = torch.randn(1, tokens, text.hidden_size, dtype=dtype, requires_grad=True)
    tracker = LiveBytes()
    with tracker:
        out = norm(hidden)
    return tracker.live


def measure_loss(tokens: int, vocab: int, hidden_size: int, chunk_tokens: int,
                 dtype=torch.bfloat16) -> dict[str, int]:
    """Peaks in bytes of the chunked loss's forward and backward (`linear_cross_entropy_sum`), above
    its inputs; the backward's with its results (the hidden states' and the head's gradients)."""
    from cpcompile.linear_cross_entropy import linear_cross_entropy_sum

    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=dtype, requires_grad=True)
    targets = torch.randint(vocab, (tokens,))
    tracker = LiveBytes()
    with tracker:
        loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens)
        forward = tracker.peak
        tracker.reset_peak()
        loss.backward()
        backward = tracker.peak
    return {"forward": forward, "backward": backward}


def per_token(measure, short: int, long: int) -> dict[str, float]:
    """`measure(tokens)`'s values as bytes a token: their growth from `short` to `long` tokens."""
    a, b = measure(short), measure(long)
    return {key: (b[key] - a[key]) / (long - short) for key in a}


def expected_layer_bytes(text, kind: str, checkpointing: str, device: str = "cpu",
                         gdn_inner: bool = False) -> dict[str, int]:
    """memory_layers.py's kept and peak bytes a token of one bfloat16 layer, as `measure_layer` sees them on
    `device`: on CPU the attention output is laid out [B, H, T, D] (CUDA's fused kernels give [B,
    T, H, D]), so transformers' `.transpose(1, 2).contiguous()` copies it, and the output gate's
    product keeps that copy beside the output (one more query width in c)."""
    from cpcompile.trainer import memory_layers

    sizes = memory_layers.ElementSizes(param=4, compute=2, reduce=4)
    kept = memory_layers.layer_kept_bytes(text, kind, sizes, 1, "all_gather", checkpointing, gdn_inner=gdn_inner)
    peak = memory_layers.layer_peak_bytes(text, kind, sizes, 1, "all_gather", checkpointing, gdn_inner=gdn_inner)
    copy = 0
    if device == "cpu" and kind == "full_attention":
        copy = text.num_attention_heads * text.head_dim * sizes.compute
    return {"kept": kept + (copy if checkpointing == "off" else 0), "peak": peak + copy}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1536,2560",
                        help="the two lengths the per-token growth is taken between; no width of the model (a tensor "
                             "of a parameter's shape is not counted)")
    parser.add_argument("--small", action="store_true", help="trainer_gpu.py's SMALL model (a smoke run)")
    args = parser.parse_args()
    from trainer_gpu import MODEL, SMALL

    from cpcompile.trainer import memory, memory_layers

    short, long = (int(n) for n in args.tokens.split(","))
    text = text_config(SMALL if args.small else MODEL)
    sizes = memory_layers.ElementSizes(param=4, compute=2, reduce=4)
    print(f"bytes a token ({short} -> {long} tokens, bfloat16 compute): measured on CPU | memory.py (+ CPU's copy)")
    print("| layer | checkpointing | kept | peak of the backward | memory.py kept | memory.py peak |")
    print("|---|---|---|---|---|---|")
    rows = [(kind, checkpointing, False) for kind in KINDS for checkpointing in ("checkpointed", "selective", "off")]
    rows += [("linear_attention", checkpointing, True) for checkpointing in ("checkpointed", "off")]
    for kind, checkpointing, inner in rows:
        got = per_token(lambda t: measure_layer(text, kind, checkpointing, t, gdn_inner=inner), short, long)
        want = expected_layer_bytes(text, kind, checkpointing, gdn_inner=inner)
        name = f"{checkpointing}{' + checkpointed around the core' if inner else ''}"
        print(f"| {kind} | {name} | {got['kept']:.0f} | {got['peak']:.0f} | {want['kept']} | "
              f"{want['peak']} |", flush=True)
    norm = per_token(lambda t: {"kept": measure_final_norm(text, t)}, short, long)["kept"]
    print(f"final norm + its output: {norm:.0f} bytes a token | memory.py {memory_layers.final_norm_bytes(text, sizes)}")
    loss = measure_loss(LOSS_SHAPE["tokens"], LOSS_SHAPE["vocab_size"], LOSS_SHAPE["hidden_size"], LOSS_SHAPE["chunk"])
    settings = argparse.Namespace(loss="chunked", loss_chunk_tokens=LOSS_SHAPE["chunk"])
    want = memory.loss_bytes(settings, argparse.Namespace(**LOSS_SHAPE), sizes, LOSS_SHAPE["tokens"])
    print(f"chunked loss at {LOSS_SHAPE}: backward peak {loss['backward']} bytes (forward {loss['forward']}) | "
          f"memory.py {want}")


if __name__ == "__main__":
    main()
