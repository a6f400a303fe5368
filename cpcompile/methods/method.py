"""What a plan override asks for, as data: the rewrite passes read this, never the YAML.

A wrapper makes its `CPMethod` from the method's registered spec (`MethodSpec.cp_method`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# Sequence layouts a method expects `shard_batch` to produce.
CONTIGUOUS = "contiguous"  # rank r holds tokens [r*S/cp, (r+1)*S/cp)
HEAD_TAIL = "head_tail"    # rank r holds chunks r and 2*cp-1-r of 2*cp chunks


@dataclass(frozen=True)
class CPMethod:
    """One context-parallel method, fixed by the inner wrapper that returned it.

    `name` selects the rewrite pass (e.g. "all_gather"), `core` says which attention core
    it rewrites ("sdpa" or "gdn"), `layout` is the sequence layout it needs from the batch,
    and `params` holds the wrapper's own validated parameters (e.g. ulysses_degree).
    `fixed_chunks`: the method needs the layout's equal chunks for a packed batch too; a packed
    Head-Tail batch is otherwise cut per document (`documents.per_document_head_tail`), which
    gives a rank pieces whose number and places depend on the data (GDN's fragments cannot).
    """

    name: str
    core: str
    wrapper: str
    layout: str = CONTIGUOUS
    params: Mapping[str, Any] = field(default_factory=dict)
    asynchronous: bool = False  # launches at the producer, waits at the consumer (schedule pass)
    fixed_chunks: bool = False

    def describe(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in sorted(self.params.items()))
        mode = " async" if self.asynchronous else ""
        return f"{self.core}:{self.name}{mode}{extra} (via {self.wrapper})"
