"""RoPE whose frequencies depend on the call: chosen from the step's global longest position under CP.

transformers' `dynamic` (NTK) and `longrope` rotary embeddings pick their frequencies from the
call's `max(position_ids) + 1` (`dynamic`: grown past the trained length, reset below it;
`longrope`: the long or the short factors around `original_max_position_embeddings`). Under CP a
rank's call holds its own slice, so ranks would pick different frequencies, none of them the
single process's: wrong by ~1e-1, no error. So `compile` wraps the forward of each such rotary
module outside the regions (`StepRope`): one scalar max all-reduce over the cp group gives the
step's longest position, transformers' own update picks the frequencies from it (a call at that
one position), and the rotation runs at the call's positions with them. Once per rotary call (a
model calls its rotary embedding once per forward), the same on every rank.

Rotary types whose frequencies are fixed at construction pass unchanged (`STATIC`); any other
type — or a call-dependent one inside a region, whose traced graph would freeze the local
choice — is refused at `compile` with `UnsupportedError` naming the module and the type.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .collectives import ALL_REDUCE, WAIT
from .errors import UnsupportedError

# frequencies fixed at construction (`axial`: vision towers' 2-D rotary; `ntk_alpha`: scaled once, at init)
STATIC = frozenset({"default", "linear", "yarn", "llama3", "proportional", "axial", "ntk_alpha"})
STEP_MAX = frozenset({"dynamic", "longrope"})  # chosen from max(position_ids) + 1 of the call


@dataclass(frozen=True)
class RotaryFinding:
    """A rotary embedding module whose frequencies depend on the call: `fqn`, its class, its RoPE types."""

    fqn: str
    module: nn.Module
    rope_types: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.fqn} ({type(self.module).__name__}, rope_type {'/'.join(self.rope_types)})"


def rope_types(module: nn.Module) -> tuple[str, ...]:
    """The RoPE types a transformers rotary module applies (one, or one per layer type), else ()."""
    declared = getattr(module, "rope_type", None)
    if isinstance(declared, str):
        return (declared,)
    if isinstance(declared, dict) and all(isinstance(v, str) for v in declared.values()):
        return tuple(sorted(set(declared.values())))
    return ()


def call_dependent(kind: str) -> bool:
    return kind not in STATIC


def find_call_dependent_rotaries(model: nn.Module, regions: list[str]) -> list[RotaryFinding]:
    """The rotary modules whose frequencies depend on the call, outside the regions; refuse those
    CP cannot make exact (`UnsupportedError`, naming them)."""
    found = []
    for fqn, module in model.named_modules():
        kinds = rope_types(module)
        if not any(call_dependent(kind) for kind in kinds):
            continue
        finding = RotaryFinding(fqn, module, kinds)
        unknown = [kind for kind in kinds if call_dependent(kind) and not any(k in kind for k in STEP_MAX)]
        if unknown:
            raise UnsupportedError(
                f"{finding.describe()}: RoPE type {unknown[0]!r} is not one CP knows; its frequencies may depend on "
                f"the call's positions, which under CP are one rank's slice. Known: {', '.join(sorted(STATIC))} (fixed "
                f"at construction) and {', '.join(sorted(STEP_MAX))} (chosen from the step's global longest position)")
        inside = [r for r in regions if fqn == r or fqn.startswith(r + ".")]
        if inside:
            raise UnsupportedError(
                f"{finding.describe()} lies inside the CP region {inside[0]!r}: its frequencies depend on the call's "
                "longest position, which a traced region would fix at the local slice's; CP makes such a rotary "
                "exact only outside the regions (a model-level rotary embedding, as transformers has)")
        if not hasattr(type(module).forward, "__wrapped__"):
            raise UnsupportedError(f"{finding.describe()}: its forward is not transformers' dynamic_rope_update "
                                   "wrapper, so CP cannot choose its frequencies from the step's longest position")
        found.append(finding)
    return found


class StepRope:
    """The forward of a call-dependent rotary module under CP: frequencies from the step's global
    longest position, the rotation at the call's own positions.

    transformers' decorated forward does both from one call; the choice is made by calling it at
    the single position `global max`, and the rotation by the undecorated forward
    (`inspect.unwrap`), which reads the frequencies the choice left on the module."""

    def __init__(self, module: nn.Module, mesh):
        self.module = module
        self.decorated = type(module).forward
        self.rotation = inspect.unwrap(type(module).forward)
        self.group_name = mesh.cp_group_name
        self.cp_size = mesh.cp_size

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        with torch.no_grad():
            longest = step_longest_position(position_ids, self.group_name)
            self.decorated(self.module, x, longest, *args, **kwargs)  # chooses; its one-position output is dropped
            return self.rotation(self.module, x, position_ids, *args, **kwargs)


def step_longest_position(position_ids: torch.Tensor, group_name: str) -> torch.Tensor:
    """`[1, 1]`: the largest position id of every rank's call (one scalar max all-reduce)."""
    local = position_ids.detach().amax().reshape(1, 1).contiguous()
    return WAIT(ALL_REDUCE(local, "max", group_name))


def install_step_rope(findings: list[RotaryFinding], mesh) -> None:
    for finding in findings:
        finding.module.forward = StepRope(finding.module, mesh)


@contextmanager
def state_kept(findings: list[RotaryFinding]):
    """Leave the rotary modules as they were after `compile`'s probe forward. transformers' update is
    stateful (`dynamic` keeps the frequencies of the longest call since its last reset, `longrope`
    writes its buffer in place), and the probe calls them with a rank's own slice, which the
    single-process run the CP run must equal never sees."""
    saved = [(f.module, dict(f.module.__dict__), {n: b.detach().clone() for n, b in f.module._buffers.items()})
             for f in findings]
    try:
        yield
    finally:
        for module, attributes, buffers in saved:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            module._buffers = buffers
