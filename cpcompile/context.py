"""State shared by the passes that rewrite one captured region."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .methods import CPMethod


@dataclass
class CollectiveRecord:
    """One collective a pass inserted: what it moves, over which group, and its nodes."""

    kind: str
    purpose: str
    group_name: str
    group_size: int
    launch: str
    wait: str


@dataclass
class PassContext:
    """What a rewrite pass may read (the method, the group, the example inputs) and record.

    `example_inputs` are the real flat inputs the region was traced with (parameters first,
    in placeholder order); passes use them only to check assumptions about values, such as
    the pattern of an attention mask, before anything runs.
    """

    fqn: str
    method: CPMethod
    cp_size: int
    cp_rank: int
    group_name: str
    mesh: Any = None  # the CPMesh, for methods that need sub-groups (built before any trace)
    example_inputs: list[Any] = field(default_factory=list)
    collectives: list[CollectiveRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cores_rewritten: int = 0

    def record(self, kind: str, purpose: str, launch: torch.fx.Node, wait: torch.fx.Node,
               group_name: str | None = None, group_size: int | None = None) -> None:
        """Record one inserted collective; the group defaults to the whole cp group."""
        self.collectives.append(CollectiveRecord(
            kind, purpose, group_name or self.group_name, group_size or self.cp_size, launch.name, wait.name
        ))
