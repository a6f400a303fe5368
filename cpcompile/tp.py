"""Tensor parallelism inside a CP region: the region traced as one TP rank's local computation.

Ordering rule: **tensor parallelism first, then `cpcompile.compile`** (then FSDP), as the trainer
RFC orders them (TP placement → CP wrapper → FSDP). The user applies PyTorch's own TP
(`parallelize_module(model, mesh.root["tp"], {...: ColwiseParallel(), ...: RowwiseParallel()})`)
and compile finds DTensor parameters in a region. `compile` refuses a `tp_size > 1` model without
any DTensor parameter (TP not applied yet), and a region refuses to run when a parameter became a
DTensor after it was traced (TP applied after compile).

Why the region is traced locally: `torch.export` does not carry DTensor parameters as trainable
inputs (they become constants, and no gradient reaches them). So while a region is traced, each
TP linear in it runs its local form — what one TP rank computes, with the two tensor-parallel
collectives as custom ops that keep their own backward:

- colwise (weight `Shard(0)`, input replicated): `linear(tp_copy(x), w_local, b_local)`, where
  `tp_copy` is the identity forward and an all-reduce of the input gradient backward;
- rowwise (weight `Shard(1)`, output replicated): `tp_reduce(linear(x, w_local)) + b`, where
  `tp_reduce` all-reduces the partial sums forward and is the identity backward.

These are exactly ColwiseParallel / RowwiseParallel with their default layouts
(`use_local_output=True`); other TP styles (sequence parallel, Shard outputs) in a region are
refused. Between them, attention sees this rank's heads only, so the CP rewrite runs on the
TP-local heads (head counts come from the traced tensors, never the model config) with its
collectives on the cp group. At call time the graph takes each DTensor parameter's local shard
(`to_local()`, differentiable: its gradient lands in the DTensor's `.grad` with its placement).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .errors import CPConfigError, UnsupportedError
from .passes.graph_utils import Emitter

ORDERING_RULE = "apply tensor parallelism first (parallelize_module over mesh.root['tp']), then cpcompile.compile, then FSDP"


def is_dtensor(t: object) -> bool:
    return isinstance(t, torch.Tensor) and hasattr(t, "placements") and hasattr(t, "to_local")


# --- the two tensor-parallel collectives, one node each in a traced graph ----------------------


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    funcol = torch.ops._c10d_functional
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group_name))


@torch.library.custom_op("cpcompile::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over the tp group (a colwise input)."""
    return x.clone()


@tp_copy.register_fake
def _(x, group_name):
    return torch.empty_like(x)


tp_copy.register_autograd(lambda ctx, grad: (_all_reduce(grad, ctx.group_name), None),
                          setup_context=lambda ctx, inputs, output: setattr(ctx, "group_name", inputs[1]))


@torch.library.custom_op("cpcompile::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """All-reduce (sum) over the tp group forward; identity backward (a rowwise output)."""
    return _all_reduce(x, group_name)


@tp_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x)


tp_reduce.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


# --- finding the TP linears of a region and tracing their local form -------------------------


@dataclass(frozen=True)
class TPLinear:
    """A Linear inside a region whose weight is a DTensor over the tp mesh."""

    fqn: str
    module: nn.Linear
    style: str  # "colwise" | "rowwise"
    group_name: str
    group_size: int


def tp_group_ranks(mesh) -> list[int] | None:
    """Global ranks of this rank's tp group in the cpcompile mesh (None when tp_size is 1)."""
    root = getattr(mesh, "root", None)
    if root is None or "tp" not in (root.mesh_dim_names or ()) or root["tp"].size() == 1:
        return None
    return dist.get_process_group_ranks(root["tp"].get_group())


def tp_size(linears: list[TPLinear]) -> int:
    """How many TP ranks a region's heads are split over (1 when it has no TP linear)."""
    return linears[0].group_size if linears else 1


def find_tp_linears(fqn: str, module: nn.Module, mesh) -> list[TPLinear]:
    """The TP linears of region `fqn`; an error for a DTensor parameter cpcompile cannot trace."""
    found = []
    for name, sub in module.named_modules():
        where = f"{fqn}.{name}" if name else fqn
        own = [(n, p) for n, p in sub.named_parameters(recurse=False) if is_dtensor(p)]
        if not own:
            continue
        if not isinstance(sub, nn.Linear) or not is_dtensor(sub.weight):
            raise UnsupportedError(
                f"{where}: a {type(sub).__name__} with DTensor parameters ({', '.join(n for n, _ in own)}) inside a CP "
                f"region; only nn.Linear under ColwiseParallel/RowwiseParallel can be tensor-parallel there ({ORDERING_RULE})"
            )
        found.append(_tp_linear(where, sub, mesh))
    return found


def _tp_linear(where: str, linear: nn.Linear, mesh) -> TPLinear:
    weight = linear.weight
    placements = tuple(weight.placements)
    if weight.device_mesh.ndim != 1 or len(placements) != 1:
        raise UnsupportedError(f"{where}: weight is a DTensor over a {weight.device_mesh.ndim}-D mesh; "
                               "a CP region takes tensor parallelism over the 1-D tp mesh only")
    expected = tp_group_ranks(mesh)
    group = weight.device_mesh.get_group()
    if expected is None:
        raise UnsupportedError(f"{where}: weight is a DTensor {placements} but the mesh has tp_size=1 (FSDP applied "
                               f"before compile?); {ORDERING_RULE}")
    if dist.get_process_group_ranks(group) != expected:
        raise CPConfigError(
            f"{where}: weight is sharded over ranks {dist.get_process_group_ranks(group)}, not this rank's tp "
            f"group of the cpcompile mesh ({expected}); parallelize over mesh.root['tp']"
        )
    placement = placements[0]
    style = {0: "colwise", 1: "rowwise"}.get(getattr(placement, "dim", None))
    if style is None:
        raise UnsupportedError(f"{where}: weight placement {placement} is neither Shard(0) (ColwiseParallel) "
                               "nor Shard(1) (RowwiseParallel)")
    _check_default_layouts(where, linear, style)
    bias = linear.bias
    bias_ok = bias is None or (style == "colwise") == (getattr(bias.placements[0], "dim", None) == 0)
    if not bias_ok:
        raise UnsupportedError(f"{where}: bias placement {bias.placements[0]} does not fit a {style} linear")
    return TPLinear(where, linear, style, group.group_name, group.size())


def _default_layouts(style: str) -> dict[str, tuple]:
    """The arguments ColwiseParallel() / RowwiseParallel() give their hooks — (input layouts,
    desired input layouts) and (output layouts, use_local_output) — which the local forms above
    reproduce: replicated outside the pair, this rank's shards between, plain tensors out."""
    from torch.distributed.tensor import Replicate, Shard

    if style == "colwise":
        return {"ColwiseParallel._prepare_input_fn": ((Replicate(),), (Replicate(),)),
                "ColwiseParallel._prepare_output_fn": ((Shard(-1),), True)}
    return {"RowwiseParallel._prepare_input_fn": ((Shard(-1),), (Shard(-1),)),
            "RowwiseParallel._prepare_output_fn": ((Replicate(),), True)}


def _hook_layouts(module: nn.Module) -> dict[str, tuple]:
    """The layouts in `parallelize_module`'s hooks on `module`: each hook closes over a
    `functools.partial` of the style's `_prepare_input_fn` / `_prepare_output_fn` and its layouts."""
    found = {}
    for hook in [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]:
        for cell in getattr(hook, "__closure__", None) or ():
            fn = cell.cell_contents
            if isinstance(fn, functools.partial):
                found[getattr(fn.func, "__qualname__", "")] = fn.args
    return found


def _check_default_layouts(where: str, linear: nn.Linear, style: str) -> None:
    found, expected = _hook_layouts(linear), _default_layouts(style)
    if found != expected:
        shown = "; ".join(f"{name.rpartition('.')[0] or '?'} {args}" for name, args in found.items()) or "no readable TP hooks"
        raise UnsupportedError(
            f"{where}: tensor-parallel as {shown}; inside a CP region only ColwiseParallel() and RowwiseParallel() "
            "with their default layouts (replicated input/output, use_local_output=True) are supported: "
            "sequence parallel and other layouts not yet"
        )


def _local_forward(tp: TPLinear):
    linear, group = tp.module, tp.group_name
    if tp.style == "colwise":
        return lambda x: F.linear(tp_copy(x, group), linear.weight, linear.bias)

    def rowwise(x):
        out = tp_reduce(F.linear(x, linear.weight), group)
        return out if linear.bias is None else out + linear.bias
    return rowwise


@contextlib.contextmanager
def local_tp_view(linears: list[TPLinear]) -> Iterator[None]:
    """While tracing: each TP linear holds its local shards as plain parameters, runs its local
    form, and its TP hooks are set aside (they would make DTensors again). Restored after."""
    saved = []
    try:
        for tp in linears:
            module = tp.module
            saved.append((module, dict(module._parameters), module._forward_pre_hooks, module._forward_hooks,
                          module.__dict__.get("forward")))
            for name, param in list(module._parameters.items()):
                if is_dtensor(param):
                    module._parameters[name] = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
            module._forward_pre_hooks, module._forward_hooks = type(module._forward_pre_hooks)(), type(module._forward_hooks)()
            module.forward = _local_forward(tp)
        yield
    finally:
        for module, params, pre_hooks, hooks, forward in reversed(saved):
            module._parameters.update(params)
            module._forward_pre_hooks, module._forward_hooks = pre_hooks, hooks
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward


def live_local(value: torch.Tensor, fqn: str, name: str, traced_as_tp: bool) -> torch.Tensor:
    """A region parameter as its graph takes it: a TP parameter's local shard (differentiable)."""
    if traced_as_tp:
        return value.to_local()
    if is_dtensor(value):
        raise UnsupportedError(
            f"{fqn}: parameter {name!r} became a DTensor after cpcompile.compile traced the region with a plain "
            f"tensor; {ORDERING_RULE}"
        )
    return value


def check_tp_applied(model: nn.Module, tp_size: int) -> None:
    """With tp_size > 1, the model must already be tensor-parallel when compile runs."""
    if tp_size > 1 and not any(is_dtensor(p) for p in model.parameters()):
        raise UnsupportedError(
            f"accelerator.tp_size={tp_size} but no parameter of {type(model).__name__} is a DTensor: tensor "
            f"parallelism has not been applied; {ORDERING_RULE}"
        )


def full_gradients_for_replicated_params(gm, program, group_name: str):
    """Make every replicated parameter that meets TP-local values get its full gradient.

    A plain parameter applied to this rank's heads only (Qwen3's q_norm / k_norm between the
    colwise and rowwise linears) would get a partial gradient: the sum over its heads, not all.
    PyTorch TP gives it the full one when the parameter is a Replicate DTensor; here each such
    use reads the parameter through `tp_copy` (identity forward, gradient all-reduced over tp),
    while uses on replicated values (before a colwise or after a rowwise linear) stay direct.
    """
    tp_state = program.tp_state
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    local = {placeholders[i] for i in tp_state}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is torch.ops.cpcompile.tp_reduce.default:
            continue  # a rowwise output is replicated again
        if any(arg in local for arg in node.all_input_nodes):
            local.add(node)
    params = [placeholders[i] for i, ref in enumerate(program.state) if i not in tp_state and _is_trainable(ref)]
    for param in params:
        local_users = [user for user in param.users if user in local]
        if not local_users:
            continue
        emit = Emitter(gm.graph, _first(gm, local_users), "tp_gradients")
        copied = emit(torch.ops.cpcompile.tp_copy.default, param, group_name)
        for user in local_users:
            user.replace_input_with(param, copied)
    gm.graph.lint()
    gm.recompile()
    return gm


def _is_trainable(ref) -> bool:
    """A state entry that is a parameter of its module, trained."""
    if not isinstance(ref, tuple):
        return False
    owner, name = ref
    param = owner._parameters.get(name)
    return param is not None and param.requires_grad


def _first(gm, nodes):
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return min(nodes, key=order.__getitem__)
