"""Bytes a rank sends, counted from the collectives it runs (`CollectiveBytes`).

    with CollectiveBytes() as sent:
        trainer.step(0)
    sent.by_category()   # {"cp": bytes, "fsdp": bytes, "reductions": bytes}

What is counted, and where:

- the functional collectives (`_c10d_functional.*`, `_c10d_functional_autograd.*`): what the CP
  rewrites emit into their graphs (and what DTensor uses), forward and backward (an AllGather's
  backward reduce-scatter shows up as one). Seen by a `TorchDispatchMode`.
- the c10d collectives (`c10d.*`: what `torch.distributed.all_gather_into_tensor` & co. dispatch):
  FSDP2's parameter all-gathers and gradient reduce-scatters, the loss's all-reduce. Seen by the
  same mode.
- point-to-point sends: GDN State-P2P's `isend` runs inside the `cpcompile::gdn_p2p_chunk` custom
  op, whose body a dispatch mode does not see (the mode is off while it handles the op), so every
  `ProcessGroup.send` (what `dist.isend` / `dist.send` call) is counted by wrapping that method for
  the duration; `c10d.send` seen by the mode is skipped, so no send counts twice. A c10d collective
  other than a send issued inside a custom op would be missed: cpcompile issues none.

Custom ops (any namespace but aten, prim(s) and the collectives') run with the dispatch keys
excluded that a custom op's body normally runs with (`_keys_a_custom_op_excludes`): a dispatch mode
calls them with far more excluded (every key above its own), and then `torch.func.vjp` inside a
custom op fails ("Cannot access storage of TensorWrapper", torch 2.13), which the eager GDN
backend's backward does.
"""
from __future__ import annotations

import collections
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
SEEN_NAMESPACES = ("aten", "prim", "prims", "c10d", *FUNCTIONAL_NAMESPACES)  # the rest: custom ops
NOT_SENDING = ("wait_tensor", "irecv", "recv_", "recv_any_source_", "barrier", "monitored_barrier_",
               "check_for_nan", "send")  # send: counted by the ProcessGroup.send wrapper instead

# op name (without overload) -> (rule, the argument(s) whose bytes are B: the first name the op has)
RULES = {
    "all_gather_into_tensor": ("all_gather", ("input",)),
    "all_gather_into_tensor_out": ("all_gather", ("input",)),
    "all_gather_into_tensor_coalesced": ("all_gather", ("inputs",)),
    "_allgather_base_": ("all_gather", ("input_tensor",)),
    "allgather_": ("all_gather", ("input_tensors",)),
    "allgather_coalesced_": ("all_gather", ("input_list",)),
    "allgather_into_tensor_coalesced_": ("all_gather", ("inputs",)),
    "reduce_scatter_tensor": ("reduce_scatter", ("input",)),
    "reduce_scatter_tensor_out": ("reduce_scatter", ("input",)),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", ("inputs",)),
    "_reduce_scatter_base_": ("reduce_scatter", ("input_tensor",)),
    "reduce_scatter_": ("reduce_scatter", ("input_tensors",)),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", ("inputs",)),
    "all_reduce": ("all_reduce", ("input",)),
    "all_reduce_": ("all_reduce", ("input",)),
    "all_reduce_coalesced": ("all_reduce", ("inputs",)),
    "all_reduce_coalesced_": ("all_reduce", ("inputs",)),
    "allreduce_": ("all_reduce", ("tensors",)),
    "allreduce_coalesced_": ("all_reduce", ("tensors",)),
    "all_to_all_single": ("all_to_all", ("input",)),
    "alltoall_base_": ("all_to_all", ("input",)),
    "alltoall_": ("all_to_all_list", ("input_tensors",)),
    "broadcast": ("broadcast", ("input",)),
    "broadcast_": ("broadcast", ("input", "tensors")),  # functional: input; c10d: tensors
    "isend": ("send", ("tensor",)),
}


def tensor_bytes(value) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def bytes_sent(rule: str, payload: int, group_size: int, group_rank: int, *, splits=None, parts=None,
               source: int | None = None) -> int:
    """Bytes one rank sends for one collective (the table of the module doc). `payload`: B, the
    input's bytes; `splits`: an all-to-all's input split sizes (rows to each peer; None: equal);
    `parts`: a list all-to-all's per-peer input bytes; `source`: a broadcast's source group rank."""
    n = group_size
    if rule == "all_gather":
        return (n - 1) * payload
    if rule == "reduce_scatter":
        return int(Fraction(n - 1, n) * payload)
    if rule == "all_reduce":
        return int(Fraction(2 * (n - 1), n) * payload)
    if rule == "all_to_all":
        if not splits:
            return int(Fraction(n - 1, n) * payload)
        rows = sum(splits)
        return int(Fraction(rows - splits[group_rank], rows) * payload) if rows else 0
    if rule == "all_to_all_list":
        return sum(parts) - parts[group_rank]
    if rule == "broadcast":
        return (n - 1) * payload if group_rank == source else 0
    if rule == "send":
        return payload
    raise ValueError(f"no byte rule {rule!r}")


def _named_arguments(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def _process_group(named: dict):
    """(size, this rank's index) of the op's group: `group_name` (functional ops: a name or a group)
    or `process_group` (c10d ops: a boxed ScriptObject)."""
    group = named.get("group_name", named.get("process_group"))
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    elif not isinstance(group, dist.ProcessGroup):
        group = dist.ProcessGroup.unbox(group)
    return group.size(), group.rank()


def category(namespace: str, rule: str) -> str:
    if rule == "all_reduce":
        return "reductions"
    if rule == "send" or namespace in FUNCTIONAL_NAMESPACES:
        return "cp"
    return "fsdp"


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this rank sends while active (module doc): `total`, `by_category()`,
    `by_collective()`, and `unknown` (collective ops it has no rule for)."""

    def __init__(self):
        super().__init__()
        self.sent: collections.Counter = collections.Counter()  # (category, op name) -> bytes
        self.calls: collections.Counter = collections.Counter()
        self.unknown: collections.Counter = collections.Counter()
        self._plain_send = self._custom_op_excludes = None

    def __enter__(self):
        self._custom_op_excludes = _keys_a_custom_op_excludes()  # probed before the mode is on
        self._plain_send = dist.ProcessGroup.__dict__["send"]
        counter, plain_send = self, self._plain_send

        def send(group, tensors, *args, **kwargs):
            counter.add("cp", "send", tensor_bytes(list(tensors)))
            return plain_send(group, tensors, *args, **kwargs)

        setattr(dist.ProcessGroup, "send", send)
        return super().__enter__()

    def __exit__(self, *exc):
        setattr(dist.ProcessGroup, "send", self._plain_send)
        return super().__exit__(*exc)

    def add(self, kind: str, op: str, sent: int) -> None:
        self.sent[(kind, op)] += sent
        self.calls[(kind, op)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace in FUNCTIONAL_NAMESPACES or namespace == "c10d":
            self._count(func, namespace, args, kwargs)
        elif namespace not in SEEN_NAMESPACES:  # a custom op: functorch may run inside (module doc)
            with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                                 self._custom_op_excludes):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _count(self, func, namespace: str, args, kwargs) -> None:
        name = func._schema.name.split("::")[1]
        if name in NOT_SENDING:
            return
        if name not in RULES:
            self.unknown[f"{namespace}.{name}"] += 1
            return
        rule, payload_names = RULES[name]
        named = _named_arguments(func, args, kwargs)
        payload = next(named[n] for n in payload_names if n in named)
        if rule == "send":  # a functional isend: no group size needed
            self.add(category(namespace, rule), name, tensor_bytes(payload))
            return
        size, rank = _process_group(named)
        sent = bytes_sent(rule, tensor_bytes(payload), size, rank,
                          splits=list(named.get("input_split_sizes") or []),
                          parts=[tensor_bytes(t) for t in payload] if rule == "all_to_all_list" else None,
                          source=named.get("src", named.get("root_rank")))
        self.add(category(namespace, rule), name, sent)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def by_category(self) -> dict[str, int]:
        totals = {"cp": 0, "fsdp": 0, "reductions": 0}
        for (kind, _), sent in self.sent.items():
            totals[kind] += sent
        return totals

    def by_collective(self) -> dict[str, tuple[int, int]]:
        """'category/op' -> (calls, bytes sent)."""
        return {f"{kind}/{op}": (self.calls[(kind, op)], sent) for (kind, op), sent in sorted(self.sent.items())}


@torch.library.custom_op("collective_bytes::excluded_keys_probe", mutates_args=())
def _excluded_keys_probe(x: torch.Tensor) -> torch.Tensor:
    _PROBED.append(torch._C._dispatch_tls_local_exclude_set())
    return x.clone()


_excluded_keys_probe.register_autograd(lambda ctx, grad: grad)
_PROBED: list = []


def _keys_a_custom_op_excludes():
    """The dispatch keys excluded while a custom op's body runs outside any dispatch mode (the
    autograd keys, below which it runs, and the default exclusions), found once by running one
    (call it outside any dispatch mode)."""
    if not _PROBED:
        _excluded_keys_probe(torch.zeros(1, requires_grad=True))
    return _PROBED[0]
