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


@dataclass(frozen=True)
class DeclaredAttention:
    """What a region's modules say about their softmax attention, read from the modules (their
    configuration), not from a traced call: whether it is causal (None: no module says, or they
    disagree) and the narrowest sliding window any of them declares (None: none), with the FQN
    of the module declaring it; likewise the narrowest attention chunk.

    The traced call cannot tell either reliably: transformers passes `is_causal = q_len > 1`
    (so one local token looks non-causal), and a window at least as long as the local shard
    looks fully causal on that shard, while it cuts the global sequence.
    """

    causal: bool | None = None
    window: int | None = None
    window_module: str = ""
    # chunked attention (Llama-4's `attention_chunk_size`): a query sees the keys of its own chunk
    # of that many tokens only; the narrowest any module declares, and which module
    chunk: int | None = None
    chunk_module: str = ""


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
    declared: DeclaredAttention = DeclaredAttention()  # the region adapter reads it off the modules
    tp_size: int = 1  # tensor-parallel ranks the region's heads are split over (tp.py); 1 without TP
    example_inputs: list[Any] = field(default_factory=list)
    # ops of the model that read the local sequence length (audit/local_length.py), for local_length_pass
    length_reads: list[Any] = field(default_factory=list)
    # whether the batch's keys are all real and of one document a row (`documents.unmasked_keys`); None: unknown
    unmasked: bool | None = None
    collectives: list[CollectiveRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cores: list[Any] = field(default_factory=list)  # the method's matches (`find_cores_pass`)
    cores_rewritten: int = 0  # counted by `rewrite_cores_pass` only

    def record(self, kind: str, purpose: str, launch: torch.fx.Node, wait: torch.fx.Node,
               group_name: str | None = None, group_size: int | None = None) -> None:
        """Record one inserted collective; the group defaults to the whole cp group."""
        self.collectives.append(CollectiveRecord(
            kind, purpose, group_name or self.group_name, group_size or self.cp_size, launch.name, wait.name
        ))
