"""Issue 52 items 2-3: a stock Hugging Face `Trainer` at cp 2 and cp 4 (`context_parallel`, gloo)
equals the same Trainer in one process, step by step: loss within 1e-5 relative over 5 steps,
gradient norm, eval loss, token count, and a checkpoint `from_pretrained` reads back; tiny Llama
and tiny Qwen3.5, padded and packed (DataCollatorWithFlattening) batches, gradient accumulation.
One launch per world size runs every case."""
from __future__ import annotations

import random

import pytest

from dist_utils import run_distributed
from hf_trainer_cases import fresh_out_dir, run_case

pytest.importorskip("accelerate")

# (model, packed, gradient accumulation steps)
CASES = [("llama", False, 1), ("llama", True, 2), ("qwen3_5", False, 2), ("qwen3_5", True, 1)]


def _reset_accelerate() -> None:
    # a forked rank must not inherit a parent's accelerate state (it would think it is alone)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _run_all(rank: int, world: int, seed: int, cp: int | None) -> dict:
    _reset_accelerate()
    return {case: run_case(*case[:2], seed, cp, fresh_out_dir(), grad_accum=case[2]) for case in CASES}


def _close(got: float, want: float, tol: float) -> bool:
    return abs(got - want) <= tol * abs(want)


def test_trainer_at_cp_2_and_4_equals_one_process():
    seed = random.randrange(1 << 20)
    reference = run_distributed(_run_all, 1, seed, None, timeout=300, init_pg=False)[0]
    for cp in (2, 4):
        results = run_distributed(_run_all, cp, seed, cp, timeout=300)
        for case, want in reference.items():
            for rank, got in enumerate(results):
                where = f"{case} at cp={cp} (rank {rank}, seed {seed})"
                assert len(got[case]["loss"]) == len(want["loss"]) == 5, where
                for step, (g, w) in enumerate(zip(got[case]["loss"], want["loss"])):
                    assert _close(g, w, 1e-5), f"{where}: step {step} loss {g} vs {w}"
                for step, (g, w) in enumerate(zip(got[case]["grad_norm"], want["grad_norm"])):
                    assert _close(g, w, 1e-4), f"{where}: step {step} grad norm {g} vs {w}"
                assert _close(got[case]["eval_loss"], want["eval_loss"], 1e-5), where
                assert got[case]["tokens"] == want["tokens"], where
            assert results[0][case]["saved"] == 0.0, f"{case} at cp={cp}: saved checkpoint differs"
