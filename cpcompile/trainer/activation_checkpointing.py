"""Activation checkpointing of the decoder layers (`train.activation_checkpointing`).

    off             every activation kept for the backward
    every_layer     each decoder layer under non-reentrant `torch.utils.checkpoint`: only its inputs
                    are kept, its forward is replayed in the backward
    {every_n: k}    the same on layers k, 2k, 3k, ... (counted from 1, as torchtitan's layer
                    selective checkpointing counts), the others keep everything; k = 1 is every_layer
    selective       every layer under the checkpoint with an op-level policy (PyTorch's selective
                    activation checkpointing, `create_selective_checkpoint_contexts`):
                    `selective_policy` keeps the outputs of the costly ops and of the collectives,
                    and the replay recomputes only the cheap ones in between

The layer's own `__call__` (FSDP2's hooks) stays outside the checkpoint: FSDP2 unshards the
parameters before the backward reaches the layer, and so before its replay.

Collectives in a replay: a CP region inside a checkpointed layer issues its collectives from the
layer's forward, so a replay issues them again. Every rank replays the same layers at the same
point of its backward (the same model, the same autograd graph), stops it at the same point
(the non-reentrant checkpoint ends a replay once it has recomputed what the backward reads),
and whether an op is replayed depends only on which op it is (`selective_policy` reads no
tensor, no rank), so every rank issues the same collectives in the same order: they match.
Under `selective` the collectives' outputs come from the saved ones and the replay issues none
(see `selective_policy`). A region that traces a new input signature inside a selective forward
does so with the checkpoint's dispatch modes set aside (`installed_region._saving_nothing_for_checkpoints`),
so the trace's ops are not taken for the layer's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .. import collectives
from .. import tp as _tp_ops  # noqa: F401  (registers torch.ops.cpcompile.tp_*)
from ..errors import PlanError, short_repr
from ..kernels.attention import op as _attention_ops  # noqa: F401  (registers torch.ops.cpcompile.*_attention)
from ..kernels.gdn import layer_ops as _gdn_ops  # noqa: F401  (registers torch.ops.cpcompile.gdn_*)

FIELD = "train.activation_checkpointing"


@dataclass(frozen=True)
class ACMode:
    """One `train.activation_checkpointing` setting: `kind` is off, every_layer, every_n or
    selective; `every_n` is k (1 but for every_n)."""

    kind: str
    every_n: int = 1

    def layers(self, count: int) -> list[int]:
        """The indices, among `count` decoder layers, of those run under the checkpoint."""
        if self.kind == "off":
            return []
        return [index for index in range(count) if (index + 1) % self.every_n == 0]


EVERY_LAYER = ACMode("every_layer")


def parse_ac_mode(value: Any) -> ACMode:
    """`off` (YAML's bare `off` reads as False), `every_layer`, `selective`, or the mapping
    `{every_n: k}` with k an integer >= 1; anything else is a `PlanError` naming the field."""
    if value is False or value == "off":
        return ACMode("off")
    if value in ("every_layer", "selective"):
        return ACMode(value)
    if isinstance(value, dict):
        return _every_n(value)
    raise PlanError(FIELD, f"must be off, every_layer, selective or {{every_n: k}}, got {short_repr(value)}")


def _every_n(value: dict) -> ACMode:
    if list(value) != ["every_n"]:
        raise PlanError(FIELD, f"a mapping must be {{every_n: k}} alone, got {short_repr(value)}")
    k = value["every_n"]
    if type(k) is not int or k < 1:  # type(): True is an int to isinstance
        raise PlanError(f"{FIELD}.every_n", f"must be an integer >= 1 (checkpoint layers k, 2k, ...), "
                                            f"got {short_repr(k)}")
    return ACMode("every_n", k) if k > 1 else EVERY_LAYER


def check_layer_count(mode: ACMode, count: int) -> None:
    """`every_n` larger than the model's layer count would checkpoint none of them: say so."""
    if mode.kind == "every_n" and mode.every_n > count:
        raise PlanError(f"{FIELD}.every_n", f"is {mode.every_n} but the model has {count} decoder layers, so no "
                                            "layer would be checkpointed; use off, or a smaller k")


def checkpoint_layers(layers: torch.nn.ModuleList, mode: ACMode) -> list[int]:
    """Run the forward of the layers `mode` picks under non-reentrant `torch.utils.checkpoint`
    (with `selective_policy` for `selective`); -> their indices."""
    chosen = mode.layers(len(layers))
    options = {"context_fn": selective_contexts} if mode.kind == "selective" else {}
    for index in chosen:
        _checkpoint_forward(layers[index], options)
    return chosen


def offload_layer_inputs(layers: torch.nn.ModuleList, mode: ACMode, pin_memory: bool) -> list[int]:
    """Keep the hidden-state input of the layers `mode` checkpoints in host memory between their
    forward and their backward (`train.offload_layer_inputs`); -> their indices. The checkpoint
    saves its positional inputs through autograd's saved-tensor hooks, outside its own, so hooks
    around the layer's forward see the input and nothing the checkpoint replays; the backward
    brings it back before the replay. Only that tensor moves: PyTorch's `save_on_cpu` would move
    everything saved there, which for an eager layer is the same, but for a compiled one includes
    its parameters (FSDP2's unsharded copies) and the rotary tables."""
    chosen = mode.layers(len(layers))
    for index in chosen:
        _offload_hidden_states(layers[index], pin_memory)
    return chosen


def _offload_hidden_states(layer: torch.nn.Module, pin_memory: bool) -> None:
    inner = layer.forward

    @functools.wraps(inner)
    def forward(hidden_states, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved: no hooks, and no read of the input's address
            return inner(hidden_states, *args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(*_to_host_hooks(hidden_states, pin_memory)):
            return inner(hidden_states, *args, **kwargs)

    layer.forward = forward


def _to_host_hooks(moved: torch.Tensor, pin_memory: bool):
    """(pack, unpack): `moved` goes to host memory (pinned: its copies are asynchronous, ordered on
    the stream that made it) and comes back to its device; any other saved tensor stays as it is.
    `moved` is recognised by its data, not its identity: a compiled layer saves an alias of it. The
    hooks hold its address and layout, never the tensor: autograd keeps both hooks with every tensor
    saved under them until the backward, and `pack` closing over `moved` kept the device copy alive
    beside the host one (the first version did). Its address cannot name another tensor while pack
    runs (inside the layer's forward, whose frame holds `moved`)."""
    layout = (moved.data_ptr(), moved.shape, moved.stride(), moved.dtype)

    def is_moved(tensor) -> bool:
        return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype) == layout

    def pack(tensor):
        if not is_moved(tensor):
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=pin_memory)
        host.copy_(tensor, non_blocking=pin_memory)
        return tensor.device, host

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=pin_memory)

    return pack, unpack


def _checkpoint_forward(layer: torch.nn.Module, options: dict) -> None:
    inner = layer.forward

    @functools.wraps(inner)  # `del layer.forward` gives the layer its own forward back
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **options, **kwargs)

    layer.forward = forward


# --------------------------------------------------------------------------- the selective policy


def _aten_ops(*names: str) -> frozenset:
    """The `.default` overloads of the named ATen ops this torch has (the SDPA backends differ
    between releases and builds)."""
    packets = (getattr(torch.ops.aten, name, None) for name in names)
    return frozenset(packet.default for packet in packets if packet is not None)


# Matmuls: every nn.Linear (addmm / mm after `linear` decomposes), batched matmuls (GQA scores in
# transformers' math path, the P2P state step M @ H). Costly to recompute and what most backward
# kernels read.
MATMUL_OPS = _aten_ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
# The fused attention kernels, as SDPA dispatches to them outside CP (cp 1, regions not rewritten).
ATTENTION_OPS = _aten_ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                          "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                          "_scaled_dot_product_fused_attention_overrideable")
# cpcompile's own cores, each one op at dispatch (their kernels run inside): a rank's local
# attention after its collectives (out + log-sum-exp, both read by its backward), the GDN chunk
# core and its (M, S) summary for State-P2P / State-AllGather, and the Triton State-P2P op, whose
# forward also exchanges the state with the ring neighbours (replaying it would exchange again).
CPCOMPILE_CORE_OPS = frozenset({
    torch.ops.cpcompile.chunk_attention.default,
    torch.ops.cpcompile.tiled_attention.default,
    torch.ops.cpcompile.gdn_chunk.default,
    torch.ops.cpcompile.gdn_summary.default,
    torch.ops.cpcompile.gdn_p2p_chunk.default,
    torch.ops.cpcompile.tp_reduce.default,  # an all-reduce over tp: a collective, see below
})
FLEX_ATTENTION = getattr(torch.ops.higher_order, "flex_attention", None)  # the masked path on CUDA
SAVED_OPS = MATMUL_OPS | ATTENTION_OPS | CPCOMPILE_CORE_OPS | ({FLEX_ATTENTION} if FLEX_ATTENTION else set())


def is_saved_collective(op: Any) -> bool:
    """A functional collective (launch or wait, autograd namespace or not: `_c10d_functional*`).

    Saved rather than replayed, a memory-for-communication trade: the outputs are the
    all-gathered K/V (cp x the local K/V of one attention: what the attention backward reads
    anyway), the Ulysses all-to-all exchanges (the size of their inputs) and the State-P2P
    chain's fp32 states (tiny). Replaying them would repeat the forward's communication in the
    backward, where it overlaps nothing (a replay computes only what the backward needs next),
    and the State-P2P chain is cp - 1 exchanges in series. A wait's output is its launch's
    buffer, so saving both costs one tensor. The in-place c10d collectives (`dist.all_reduce`,
    e.g. CPCOMPILE_CHECK_FINITE's agreement) are not functional: they are replayed, on every rank
    alike."""
    return collectives.is_launch(op) or collectives.is_wait(op)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save (`MUST_SAVE`) the outputs of the compute-heavy ops — matmuls (`MATMUL_OPS`), fused
    attention (`ATTENTION_OPS`, FlexAttention), cpcompile's attention and GDN cores
    (`CPCOMPILE_CORE_OPS`) — and of the functional collectives (`is_saved_collective`); recompute
    the rest (norms, activations, RoPE, gates, the GDN conv, casts, views: cheap elementwise
    work whose outputs would cost as much memory as the saved ones). `PREFER_RECOMPUTE` lets
    `torch.compile`'s partitioner keep some of them if it finds that cheaper; `MUST_SAVE` it may
    not override. The decision reads the op alone, so every rank decides alike."""
    if op in SAVED_OPS or is_saved_collective(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# what `checkpoint(context_fn=...)` takes: a fresh pair of (forward, recompute) contexts per call
selective_contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)
