"""`train.verify`: unrewritten copies of the model trained on the whole batch beside the CP run
(`build_references`: one in the run's dtype and, in bfloat16, one more in float32), and each step's CP loss
judged against them (`step_failure`: within `train.verify_rtol`, or in bfloat16 as `parity.py`
judges), with every rank raising the same `VerificationError` when it misses (`verify_step`)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..errors import VerificationError
from ..parity import FACTOR, FLOOR, within_precision
from .config import TrainConfig, TrainSettings
from .metrics import relative
from .optimizer import build_optimizer
from .lm_loss import use_loss
from .parallelize import build_model, use_cpcompile_gdn
from .weights import load_pretrained


def build_references(config: TrainConfig, pretrained: str | None) -> dict[str, tuple]:
    """The unrewritten copies `verify` trains on the whole batch: one in the run's dtype, and in
    bfloat16 one more in float32 to judge both against (same seed, or the same `pretrained`
    weights, so the same initial weights)."""
    settings = config.train
    if not settings.verify:
        return {}
    variants = {"reference": settings}
    if settings.dtype == "bfloat16":
        variants["fp32_reference"] = dataclasses.replace(settings, dtype="float32")
    references = {}
    for name, variant in variants.items():
        model = build_model(config.model, variant)
        use_loss(model, variant)
        if pretrained is not None:
            load_pretrained(model, pretrained)
        use_cpcompile_gdn(model, settings.gdn_backend, config.data.packing, settings.gdn_checkpoint_around_core)
        references[name] = (model, *build_optimizer(model, config))
    return references


def tolerance(settings: TrainSettings) -> str:
    if settings.dtype == "bfloat16":
        return (f"the bfloat16 CP loss within {FACTOR:g}x the bfloat16 copy's difference from the float32 copy "
                f"+ {FLOOR:g}")
    return f"the CP loss within {settings.verify_rtol:.0e} (train.verify_rtol) of the unrewritten copy's"


def verify_step(record: dict, settings: TrainSettings, mesh) -> None:
    """Raise `VerificationError` on every rank when this step's CP loss is off its reference.
    The ranks hold the same numbers; they still agree by one all-reduce over every rank (verify
    runs one replica: cp x tp ranks), so none waits alone at the next step's collectives."""
    failure = step_failure(record, settings, mesh.cp_size)
    failed = torch.tensor([float(failure is not None)], device=settings.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise VerificationError(failure or f"train.verify: step {record['step']}: another rank's reference "
                                           "disagreed with the CP loss beyond the tolerance")


def step_failure(record: dict, settings: TrainSettings, cp_size: int) -> str | None:
    """None when the step passes, else one line saying by how much it missed (NaN misses)."""
    loss, reference = record["loss"], record["reference_loss"]
    where = f"train.verify: step {record['step']}:"
    if "fp32_reference_loss" in record:
        exact = record["fp32_reference_loss"]
        cp_error, single_error = relative(loss, exact), relative(reference, exact)
        if within_precision(cp_error, single_error):
            return None
        return (f"{where} the bfloat16 CP={cp_size} loss {loss:.6f} is {cp_error:.1e} off the float32 copy's "
                f"{exact:.6f}, more than {FACTOR:g} x the bfloat16 copy's {single_error:.1e} + {FLOOR:g}")
    error = relative(loss, reference)
    if error <= settings.verify_rtol:
        return None
    return (f"{where} CP={cp_size} loss {loss:.6f} vs CP=1 loss {reference:.6f}, rel. diff {error:.1e} > "
            f"train.verify_rtol {settings.verify_rtol:.0e}")
