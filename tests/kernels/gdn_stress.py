"""Adversarial GDN inputs: keys of a chosen mutual cosine, gates of a chosen strength.

The chunk form inverts ``I + A`` with ``A_ij = beta_i exp(gc_i - gc_j) k_i.k_j``. With random
(``randn``) keys ``A`` is small and almost any inverse works; real Qwen3.5 keys are SiLU outputs,
all positive after the L2 norm, so they correlate (mutual cosine ~0.75), and slow-decay heads have
gates near 0. That is where an unstable inverse fails. The kernel tests and
``benchmarks/gdn_accuracy.py --stress`` draw their inputs here, so both judge the same regimes.
Test-only: it lives beside the tests, not in the shipped package (the benchmark puts this folder
on ``sys.path``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from cpcompile.kernels.gdn.api import chunk_gated_delta_rule
from cpcompile.kernels.gdn.naive import naive_recurrent_gated_delta_rule

# 0: randn; 0.75: uniform [0, 1) entries, like post-SiLU keys; 0.95: nearly repeated keys
KEY_COSINES = (0.0, 0.5, 0.75, 0.95)
# g = scale * logsigmoid(randn): 0 is no decay at all, 1 a few tens of % per token
GATE_SCALES = (0.0, 0.01, 0.1, 1.0)


@dataclass(frozen=True)
class Regime:
    key_cosine: float
    gate_scale: float

    def __str__(self) -> str:
        return f"cos{self.key_cosine:g}-gate{self.gate_scale:g}"


REGIMES = tuple(Regime(c, s) for c in KEY_COSINES for s in GATE_SCALES)


def correlated_rows(shape: tuple[int, ...], cosine: float, gen: torch.Generator) -> Tensor:
    """fp32 rows ``[..., T, H, D]`` whose L2-normalised versions have a mutual cosine of about
    ``cosine`` within each head (not normalised: the kernels normalise q and k themselves)."""
    if cosine == 0.75:  # the measured regime: uniform entries have mean cosine E[x]^2 / E[x^2] = 3/4
        return torch.rand(shape, generator=gen)
    *lead, T, H, D = shape
    noise = torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1)
    if cosine == 0.0:
        return noise
    shared = torch.nn.functional.normalize(torch.randn(*lead, 1, H, D, generator=gen), dim=-1)
    return math.sqrt(cosine) * shared + math.sqrt(1.0 - cosine) * noise


def stress_inputs(regime: Regime, B: int, T: int, Hk: int, Hv: int, K: int, V: int, *, seed: int,
                  initial_state: bool = False):
    """-> (q, k, v, g, beta, h0 or None), fp32 on the CPU; q and k raw (normalise them in the op)."""
    gen = torch.Generator().manual_seed(seed)
    q = correlated_rows((B, T, Hk, K), regime.key_cosine, gen)
    k = correlated_rows((B, T, Hk, K), regime.key_cosine, gen)
    v = torch.randn(B, T, Hv, V, generator=gen)
    g = regime.gate_scale * torch.nn.functional.logsigmoid(torch.randn(B, T, Hv, generator=gen))
    beta = torch.sigmoid(2.0 * torch.randn(B, T, Hv, generator=gen))  # from ~0 to ~1
    h0 = torch.randn(B, Hv, K, V, generator=gen) * 0.5 if initial_state else None
    return q, k, v, g, beta, h0


def mean_key_cosine(k: Tensor) -> float:
    """Mean cosine between distinct rows of each head of ``k [B, T, H, D]`` (checks the generator)."""
    kn = torch.nn.functional.normalize(k.double(), dim=-1).transpose(1, 2)
    gram = kn @ kn.transpose(-1, -2)
    T = gram.shape[-1]
    return ((gram.sum() - gram.diagonal(dim1=-2, dim2=-1).sum()) / (gram.numel() / T * (T - 1))).item()


# ----------------------------------------------------------------------------- judging a core

# what a core is judged on, in this order (None where a layout has no such quantity)
QUANTITIES = ("o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
# core(q, k, v, g, beta, h0) -> (o, final state or None), differentiable
Core = Callable[..., tuple[Tensor, Optional[Tensor]]]


@dataclass(frozen=True)
class Layout:
    B: int
    T: int
    Hk: int
    Hv: int
    K: int
    V: int
    initial_state: bool = False
    documents: Optional[tuple[int, ...]] = None  # packed document lengths (B = 1), through cu_seqlens


@dataclass
class StressCase:
    """Inputs of one regime and layout, the output cotangents, and the float64 recurrence's answer."""

    layout: Layout
    inputs: tuple[Tensor, ...]  # q, k, v, g, beta (fp32, CPU)
    h0: Optional[Tensor]
    do: Tensor
    dht: Tensor
    reference: list


def stress_case(regime: Regime, layout: Layout, seed: int, reference_device="cpu",
                reference: str = "recurrence") -> StressCase:
    """The inputs are drawn on the CPU (the same numbers on every machine); the float64 reference
    runs on ``reference_device``. ``reference="chunked"``: the eager chunk form in float64 (a
    triangular solve per chunk, equal to the recurrence to float64 rounding, tests/kernels/
    test_gdn_eager.py) instead of the token-by-token recurrence, whose thousands of tiny steps took
    ~50 s a case at 4K tokens on an H200."""
    L = layout
    *inputs, h0 = stress_inputs(regime, L.B, L.T, L.Hk, L.Hv, L.K, L.V, seed=seed, initial_state=L.initial_state)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(L.B, L.T, L.Hv, L.V, generator=gen, dtype=torch.float64)
    dht = torch.randn(L.B, L.Hv, L.K, L.V, generator=gen, dtype=torch.float64)
    case = StressCase(L, tuple(inputs), h0, do, dht, [])
    oracle = recurrence_core(L) if reference == "recurrence" else cpcompile_core("eager", L)
    case.reference = [None if x is None else x.cpu() for x in run_core(oracle, case, torch.float64, reference_device)]
    return case


def run_core(core: Core, case: StressCase, dtype: torch.dtype, device) -> list:
    """Forward + backward of ``core`` on copies of the case's inputs in ``dtype`` (g and the states
    stay fp32, as Qwen3.5 keeps them) -> the ``QUANTITIES``."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(device=device, dtype=wide if name == "g" else dtype).requires_grad_()
              for name, x in zip(("q", "k", "v", "g", "beta"), case.inputs)]
    h0 = case.h0.detach().to(device=device, dtype=wide).requires_grad_() if case.h0 is not None else None
    o, ht = core(*leaves, h0)
    loss = (o.double() * case.do.to(device)).sum()
    if ht is not None:
        loss = loss + (ht.double() * case.dht.to(device)).sum()
    loss.backward()
    grads = [x.grad for x in leaves] + [None if h0 is None else h0.grad]
    return [o.detach(), None if ht is None else ht.detach()] + grads


def relative_errors(got: list, case: StressCase) -> dict[str, float]:
    """Relative L2 error of every quantity the case has against its float64 reference (NaN stays NaN)."""
    out = {}
    for name, a, b in zip(QUANTITIES, got, case.reference):
        if b is not None:
            a, b = a.detach().cpu().double(), b.double()
            out[name] = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    return out


def _starts(lengths: tuple[int, ...], T: int) -> Tensor:
    starts = torch.zeros(1, T, dtype=torch.bool)
    starts[0, torch.tensor((0, *lengths[:-1])).cumsum(0)] = True
    return starts


def cu_seqlens(lengths: tuple[int, ...], device) -> Tensor:
    return torch.tensor((0, *lengths), device=device).cumsum(0)


def recurrence_core(layout: Layout) -> Core:
    """The token-by-token oracle (q/k normalised in it, packed documents as state resets)."""
    starts = None if layout.documents is None else _starts(layout.documents, layout.T)

    def core(q, k, v, g, beta, h0):
        return naive_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=layout.documents is None,
            use_qk_l2norm_in_kernel=True, starts=None if starts is None else starts.to(q.device))
    return core


def cpcompile_core(backend: str, layout: Layout) -> Core:
    """``chunk_gated_delta_rule`` on ``backend`` as a layer calls it (q/k normalised in the op)."""
    def core(q, k, v, g, beta, h0):
        cu = None if layout.documents is None else cu_seqlens(layout.documents, q.device)
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=layout.documents is None,
                                      use_qk_l2norm_in_kernel=True, backend=backend, cu_seqlens=cu)
    return core
