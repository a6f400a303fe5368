"""A plan suggested for a model, never guessed at run time (issue 52, item 1).

`compile` runs only an explicit plan (the Trainer CP RFC). This package helps write one: it finds
the model's attention cores by running it once (`sites.py`), chooses a method for each module kind
by documented rules (`choose.py`), and writes the plan as YAML with the reason of each choice and
each rank's expected work and memory (`render.py`, `expected.py`). `cpcompile plan` is its command.

    suggestion = cpcompile.suggest_plan(model, cp=4, seq_len=32768)
    print(suggestion.text)                         # the YAML, with its comments
    model = cpcompile.compile(model, mesh, suggestion.plan, example_inputs=local)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ..errors import CPInputError
from ..sequence_layout import required_multiple
from .choose import Choice, Decision, decide
from .expected import expected_memory_gib
from .render import group_choices, header_lines, override, plan_text
from .sites import find_core_sites

__all__ = ["Suggestion", "suggest_plan"]


@dataclass(frozen=True)
class Suggestion:
    plan: dict  # what `load_plan` / `compile` take
    text: str  # the same plan as YAML, with the reasons and expectations as comments
    decision: Decision
    uncovered: list[Choice]  # modules no method runs (named in `text` too)
    memory_gib: list[float] | str  # each rank's expected peak, or why there is no estimate


def suggest_plan(model: nn.Module, cp: Any, seq_len: int, *, example: Any = None, gdn_backend: str = "eager",
                 source: str | None = None) -> Suggestion:
    """The plan `choose.py`'s rules give `model` at `cp` ranks (an int, or a mesh: its cp size) and
    `seq_len` tokens a sequence (global). `example`: one short batch the model takes (default: a
    Hugging Face model's token ids); `gdn_backend`: eager | triton, for GDN layers."""
    cp_size = _cp_size(cp)
    _check_arguments(cp_size, seq_len, gdn_backend)
    sites = find_core_sites(model, example)
    if not sites:
        raise CPInputError(f"suggest_plan: {type(model).__name__} runs no attention core (no "
                           "scaled_dot_product_attention call, no GDN layer); build a Hugging Face model with "
                           'attn_implementation="sdpa"')
    decision = decide(sites, cp_size, seq_len, sum(p.numel() for p in model.parameters()))
    groups = group_choices(decision.choices, [name for name, _ in model.named_modules()])
    plan = {"accelerator": {"cp_size": cp_size},
            "plan_overrides": [override(g, gdn_backend) for g in groups if g.method is not None]}
    memory = expected_memory_gib(model, plan, seq_len)
    header = header_lines(source or type(model).__name__, decision, cp_size, seq_len,
                          required_multiple(decision.layout, cp_size), memory)
    uncovered = [c for c in decision.choices if c.method is None]
    return Suggestion(plan, plan_text(header, plan, groups), decision, uncovered, memory)


def _cp_size(cp: Any) -> int:
    size = getattr(cp, "cp_size", cp)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise CPInputError(f"suggest_plan: cp must be a positive int or a mesh with a cp dimension, got {size!r}")
    return size


def _check_arguments(cp: int, seq_len: int, gdn_backend: str) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2 * cp:
        raise CPInputError(f"suggest_plan: seq_len must be an int of at least 2 x cp = {2 * cp} tokens, got {seq_len!r}")
    if gdn_backend not in ("eager", "triton"):
        raise CPInputError(f"suggest_plan: gdn_backend must be 'eager' or 'triton', got {gdn_backend!r}")
