"""What `gdn_documents.py` times and checks: the document batches, and each family's call of the GDN
core or layer on one unpacked sequence or on packed documents, with its float64 each-document-alone
reference (see that script's docstring)."""
from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from cpcompile.kernels.gdn import CHUNK_SIZE

# A case: the leaves whose gradients a backward computes (inputs, a layer's parameters) by name, and the call.
Case = tuple[dict[str, Tensor], Callable[[], Tensor]]
CORE_NAMES = ("q", "k", "v", "g", "beta")


class Shape(NamedTuple):
    """The GDN layer's sizes: key / value heads, key / value head dims, hidden size, conv kernel."""
    hk: int
    hv: int
    dk: int
    dv: int
    hidden: int
    conv: int


def shape_of(model: dict) -> Shape:
    """From a trainer_gpu.py model config (`MODEL`, `SMALL`)."""
    return Shape(model["linear_num_key_heads"], model["linear_num_value_heads"], model["linear_key_head_dim"],
                 model["linear_value_head_dim"], model["hidden_size"], model["linear_conv_kernel_dim"])


# ----------------------------------------------------------------------------- batches


class Docs(NamedTuple):
    """A batch of one row: `lengths` None is one unpacked sequence (no document information handed
    to the layer at all); otherwise packed documents of these lengths."""
    name: str
    lengths: tuple[int, ...] | None

    @property
    def packed(self) -> bool:
        return self.lengths is not None

    def cu_seqlens(self, device) -> Tensor:
        return torch.tensor((0, *self.lengths), device=device).cumsum(0)

    def positions(self, device) -> Tensor:
        """`[1, T]` position ids restarting at 0 at every document (what a packed batch carries)."""
        return torch.cat([torch.arange(n, device=device) for n in self.lengths])[None]

    def spans(self) -> list[tuple[int, int]]:
        bounds = torch.tensor((0, *self.lengths)).cumsum(0).tolist()
        return list(zip(bounds[:-1], bounds[1:]))


def document_lengths(total: int, mean: int, seed: int = 0) -> tuple[int, ...]:
    """Seeded lengths uniform in [mean/2, 3·mean/2], the last one cut so that they sum to `total`."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(max(1, mean // 2), mean + mean // 2 + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - total
    return tuple(lengths)


def odd_lengths(total: int) -> tuple[int, ...]:
    """Documents shorter than the conv kernel, one chunk minus / exactly / plus one, and a long one."""
    pattern, lengths = (1, 3, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 2, 3 * CHUNK_SIZE + 5), []
    while sum(lengths) < total:
        lengths.append(pattern[len(lengths) % len(pattern)])
    lengths[-1] -= sum(lengths) - total
    return tuple(lengths)


def batches(T: int, means: list[int], check: bool = False) -> list[Docs]:
    """The unpacked reference, one document through the packed path (the trainer with data.packing
    hands every batch's position ids to its GDN layers, `parallelize.use_cpcompile_gdn`), then
    documents of each mean length. For a check (`check`, a short T) means are cut to T/4, so that a
    row holds several documents, and the odd lengths are added."""
    out = [Docs("one sequence (reference)", None), Docs("1 document, packed path", (T,))]
    for mean in means:
        used = min(mean, max(1, T // 4)) if check else mean
        label = f"docs ~{_tokens(mean)}" + (f" (as ~{used} at T={T})" if used != mean else "")
        out.append(Docs(label, document_lengths(T, used)))
    if check:
        lengths = odd_lengths(T)
        out.append(Docs(f"odd lengths {', '.join(map(str, lengths[:7]))}{', ...' if len(lengths) > 7 else ''}",
                        lengths))
    return out


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# ----------------------------------------------------------------------------- inputs


def _randn(shape, gen, device, dtype, scale=1.0) -> Tensor:
    """Seeded values drawn in fp32 and then cast: every dtype of a case sees the same numbers."""
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)


def core_inputs(shape: Shape, T: int, device, dtype, *, layer_dtypes: bool, seed: int = 0) -> list[Tensor]:
    """q, k, v, g, beta (leaves). `layer_dtypes`: as `gdn_core_inputs` hands them to the core (q/k
    L2-normalised fp32, v/beta in `dtype`, g fp32); else all in `dtype` with g fp32 (the API's)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qk_dtype = torch.promote_types(dtype, torch.float32) if layer_dtypes else dtype
    q, k = (_randn((1, T, shape.hk, shape.dk), gen, device, torch.float32) for _ in range(2))
    if layer_dtypes:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    v = _randn((1, T, shape.hv, shape.dv), gen, device, dtype)
    g = torch.nn.functional.logsigmoid(_randn((1, T, shape.hv), gen, device, torch.float32) + 2.0)
    beta = torch.sigmoid(_randn((1, T, shape.hv), gen, device, torch.float32)).to(dtype)
    g = g.to(torch.promote_types(dtype, torch.float32))
    return [x.detach().requires_grad_() for x in (q.to(qk_dtype), k.to(qk_dtype), v, g, beta)]


def grad_like(out: Tensor, seed: int = 1) -> Tensor:
    gen = torch.Generator(device=out.device).manual_seed(seed)
    return _randn(out.shape, gen, out.device, out.dtype)


def _per_document(run_one, xs: list[Tensor], docs: Docs) -> Tensor:
    """The core on each document alone (token-major inputs sliced), outputs concatenated."""
    spans = docs.spans() if docs.packed else [(0, xs[0].shape[1])]
    return torch.cat([run_one(*(x[:, a:b] for x in xs)) for a, b in spans], dim=1)


# ----------------------------------------------------------------------------- families


class CoreOp:
    """`cpcompile::gdn_chunk` on the triton backend as `adapters.qwen3_5.gdn_layer_forward` calls it;
    a packed batch's starts are `positions == 0`, as `gdn_core_inputs` makes them."""
    name = "core op (cpcompile::gdn_chunk)"

    def __init__(self, shape: Shape):
        from cpcompile.kernels.gdn import layer_ops  # noqa: F401  (registers the cpcompile:: ops)

        self.shape, self.scale = shape, shape.dk ** -0.5

    def case(self, T: int, docs: Docs, device, dtype=torch.bfloat16) -> Case:
        xs = core_inputs(self.shape, T, device, dtype, layer_dtypes=True)
        positions = docs.positions(device) if docs.packed else None

        def run():
            starts = positions == 0 if positions is not None else None
            return torch.ops.cpcompile.gdn_chunk(*xs, None, self.scale, CHUNK_SIZE, "triton", starts)
        return dict(zip(CORE_NAMES, xs)), run

    def reference(self, T: int, docs: Docs, device) -> Case:
        xs = core_inputs(self.shape, T, device, torch.float64, layer_dtypes=True)
        return dict(zip(CORE_NAMES, xs)), lambda: _per_document(
            lambda *d: torch.ops.cpcompile.gdn_chunk(*d, None, self.scale, CHUNK_SIZE, "eager"), xs, docs)


class CoreApi:
    """The public entry point, `cpcompile.kernels.chunk_gated_delta_rule(..., cu_seqlens=)` (triton,
    q/k L2-normalised in the op), on bf16 inputs as fla-core takes them."""
    name = "core API (chunk_gated_delta_rule, cu_seqlens)"

    def __init__(self, shape: Shape):
        self.shape = shape

    def case(self, T: int, docs: Docs, device, dtype=torch.bfloat16) -> Case:
        from cpcompile.kernels import chunk_gated_delta_rule

        xs = core_inputs(self.shape, T, device, dtype, layer_dtypes=False)
        cu = docs.cu_seqlens(device) if docs.packed else None
        return dict(zip(CORE_NAMES, xs)), lambda: chunk_gated_delta_rule(
            *xs, use_qk_l2norm_in_kernel=True, backend="triton", cu_seqlens=cu)[0]

    def reference(self, T: int, docs: Docs, device) -> Case:
        from cpcompile.kernels import chunk_gated_delta_rule

        xs = core_inputs(self.shape, T, device, torch.float64, layer_dtypes=False)
        return dict(zip(CORE_NAMES, xs)), lambda: _per_document(
            lambda *d: chunk_gated_delta_rule(*d, use_qk_l2norm_in_kernel=True, backend="eager")[0], xs, docs)


class FlaVarlen(CoreApi):
    """fla-core's `chunk_gated_delta_rule(..., cu_seqlens=)` on the API family's inputs (the peer)."""
    name = "fla-core (chunk_gated_delta_rule, cu_seqlens)"

    def __init__(self, shape: Shape, fla_fn):
        super().__init__(shape)
        self.fla_fn = fla_fn

    def case(self, T: int, docs: Docs, device, dtype=torch.bfloat16) -> Case:
        xs = core_inputs(self.shape, T, device, dtype, layer_dtypes=False)
        cu = docs.cu_seqlens(device) if docs.packed else None
        return dict(zip(CORE_NAMES, xs)), lambda: self.fla_fn(*xs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]


class Layer:
    """The whole GDN layer op the trainer runs (`gdn_layer_forward`: projections, causal conv whose
    halo stops at document starts, SiLU, q/k L2 norm, gates, triton core, gated norm, out_proj), on a
    transformers Qwen3.5 GDN layer of `config`'s sizes (seeded weights); eagerly, or under
    `torch.compile(dynamic=False, backend=compile_backend)` as the trainer compiles its decoder layers."""

    def __init__(self, shape: Shape, config: dict, compile_backend: str | None = None):
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        torch.manual_seed(0)
        self.shape, self.compile_backend = shape, compile_backend
        self.base = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**config), layer_idx=0)
        self.name = f"GDN layer op ({compile_backend or 'eager'})"
        self.modules: dict = {}  # (device, dtype) -> the layer in that dtype
        self.compiled: dict = {}  # (device, dtype) -> its compiled call

    def _module(self, device, dtype):
        key = (str(device), dtype)
        if key not in self.modules:
            self.modules[key] = copy.deepcopy(self.base).to(device=device, dtype=dtype)
        return self.modules[key]

    def _call(self, module, backend: str):
        from cpcompile.adapters.qwen3_5 import gdn_layer_forward

        def call(hidden, positions):
            return gdn_layer_forward(module, hidden, None, positions, chunk_size=CHUNK_SIZE, backend=backend)
        return call

    def case(self, T: int, docs: Docs, device, dtype=torch.bfloat16) -> Case:
        module = self._module(device, dtype)
        call = self._call(module, "triton")
        if self.compile_backend:  # one compiled call per module: Dynamo recompiles it per T and batch kind
            key = (str(device), dtype)
            if key not in self.compiled:
                self.compiled[key] = torch.compile(call, backend=self.compile_backend, dynamic=False)
            call = self.compiled[key]
        hidden = self._hidden(T, device, dtype)
        positions = docs.positions(device) if docs.packed else None
        return {"hidden": hidden, **dict(module.named_parameters())}, lambda: call(hidden, positions)

    def reference(self, T: int, docs: Docs, device) -> Case:
        """Each document alone through the eager backend in float64, no document information (so the
        conv is `F.conv1d` with zeros before the document: an oracle independent of `conv_taps`)."""
        module = self._module(device, torch.float64)
        call = self._call(module, "eager")
        hidden = self._hidden(T, device, torch.float64)
        return ({"hidden": hidden, **dict(module.named_parameters())},
                lambda: _per_document(lambda h: call(h, None), [hidden], docs))

    def _hidden(self, T: int, device, dtype) -> Tensor:
        gen = torch.Generator(device=device).manual_seed(2)
        return _randn((1, T, self.shape.hidden), gen, device, dtype).requires_grad_()
