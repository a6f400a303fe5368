"""The GDN cores where an unstable chunk inverse fails: correlated keys and weak decay.

Every regime of ``gdn_stress`` (beside this file) (key cosine 0 / 0.5 / 0.75 / 0.95 x gate scale
0 / 0.01 / 0.1 / 1) in the layouts where a chunk inverse fails (one chunk; a partial chunk with
grouped heads, batch 2 and an initial state), and the hardest regimes and one easy one in the
longer layouts (1000 tokens; packed documents through ``cu_seqlens``; they add the state carried
across chunks and documents, and cost 3x a short case in the interpreter), q/k L2-normalised in
the op as Qwen3.5 does. Judged against the float64 token-by-token recurrence: the output, the
final state and every gradient (q, k, v, g, beta and the initial state).

The bound is the eager fp32 core's own error on the same inputs: the Triton core may be at most
twice as far from float64, plus ``ROUNDING``. Before the blocked inverse, the power-series inverse
failed 18 of the 32 one-chunk and partial-chunk cases (a relative output error of 24 in one
chunk of uniform keys with no decay).

CPU: the Triton interpreter, fp32. GPU (``-m gpu``): the same regimes at 4K tokens in fp32 (the
same bound) and in bf16 (never NaN; at most 1.5x fla-core's error on the same inputs when
fla-core is installed).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from gdn_stress import (  # noqa: E402
    KEY_COSINES, REGIMES, Layout, Regime, cpcompile_core, mean_key_cosine, relative_errors, run_core, stress_case,
    stress_inputs)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# fp32 rounding of a relative L2 error: both cores land within a few 1e-7 of float64, and the Triton
# documents path reads gate sums shifted by its reset gate (-30), whose fp32 spacing is ~2e-6
ROUNDING = 2e-6

LAYOUTS = {
    "one-chunk": Layout(1, 64, 1, 2, 32, 32),
    "partial-grouped-h0": Layout(2, 100, 1, 2, 32, 32, initial_state=True),
    "T1000-h0": Layout(1, 1000, 1, 1, 16, 16, initial_state=True),
    "cu_seqlens": Layout(1, 230, 1, 2, 32, 32, documents=(37, 129, 64)),
}
REGIME_IDS = [str(r) for r in REGIMES]
# the hardest regimes (correlated keys, no or weak decay) and one easy one
HARDEST_REGIMES = (Regime(0.75, 0.0), Regime(0.95, 0.0), Regime(0.95, 0.1), Regime(0.0, 1.0))
CHUNK_INVERSE_LAYOUTS = ("one-chunk", "partial-grouped-h0")  # every regime
CASES = [(regime, layout) for layout in LAYOUTS for regime in REGIMES
         if layout in CHUNK_INVERSE_LAYOUTS or regime in HARDEST_REGIMES]


def _assert_within(errors, bound, what):
    for name, err in errors.items():
        assert err == err and err <= bound[name], (what, name, f"{err:.2e} > {bound[name]:.2e}")


def _as_accurate_as_eager(case, device, what):
    eager = relative_errors(run_core(cpcompile_core("eager", case.layout), case, torch.float32, device), case)
    triton = relative_errors(run_core(cpcompile_core("triton", case.layout), case, torch.float32, device), case)
    _assert_within(triton, {n: 2 * e + ROUNDING for n, e in eager.items()}, what)


@pytest.mark.skipif(not INTERPRET, reason="CPU interpreter set (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("regime, layout", CASES, ids=[f"{regime}-{layout}" for regime, layout in CASES])
def test_triton_core_as_accurate_as_eager(regime, layout):
    seed = 1000 * KEY_COSINES.index(regime.key_cosine) + 10 * list(LAYOUTS).index(layout) + int(100 * regime.gate_scale)
    _as_accurate_as_eager(stress_case(regime, LAYOUTS[layout], seed), "cpu", f"{regime} {layout}")


@pytest.mark.skipif(not INTERPRET, reason="CPU interpreter set (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("regime", HARDEST_REGIMES, ids=[str(r) for r in HARDEST_REGIMES])
def test_substitution_inverse_as_accurate_as_eager(monkeypatch, regime):
    """The blocked forward-substitution inverse (``prepare.INVERSE_BLOCK = 16``), the alternative to
    the default recursive doubling."""
    from cpcompile.kernels.gdn.triton import prepare

    monkeypatch.setattr(prepare, "INVERSE_BLOCK", 16)
    seed = 7 + HARDEST_REGIMES.index(regime)
    layout = LAYOUTS["partial-grouped-h0"]
    _as_accurate_as_eager(stress_case(regime, layout, seed), "cpu", f"{regime} substitution")


def test_key_cosine_of_the_generator():
    """The regimes are what their names say: mean key cosine within 0.05 of the target."""
    for cosine in KEY_COSINES:
        k = stress_inputs(Regime(cosine, 0.0), 1, 256, 2, 2, 128, 16, seed=5)[1]
        assert abs(mean_key_cosine(k) - cosine) < 0.05, (cosine, mean_key_cosine(k))


# ----------------------------------------------------------------------------- GPU set

GPU_LAYOUT = Layout(1, 4096, 2, 4, 128, 128, initial_state=True)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("regime", REGIMES, ids=REGIME_IDS)
def test_triton_core_stress_on_gpu(regime):
    case = stress_case(regime, GPU_LAYOUT, seed=7, reference_device="cuda", reference="chunked")
    _as_accurate_as_eager(case, "cuda", f"{regime} fp32")
    bf16 = relative_errors(run_core(cpcompile_core("triton", GPU_LAYOUT), case, torch.bfloat16, "cuda"), case)
    assert all(e == e for e in bf16.values()), bf16  # NaN never passes
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from gdn_accuracy import fla_stress_core
    try:
        fla = relative_errors(run_core(fla_stress_core(GPU_LAYOUT), case, torch.bfloat16, "cuda"), case)
    except ImportError:
        pytest.skip("fla-core is not installed: the bf16 comparison needs it")
    _assert_within(bf16, {n: 1.5 * e for n, e in fla.items()}, f"{regime} bf16 against fla-core")
