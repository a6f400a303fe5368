"""Matcher for the softmax-attention core: `find_sdpa_cores` returns one `SdpaMatch` per call."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from ...methods import MethodSpec
from ..graph_utils import CoreMatch

SDPA = torch.ops.aten.scaled_dot_product_attention.default
CORE = "sdpa"


@dataclass
class SdpaMatch(CoreMatch):
    """One `scaled_dot_product_attention` call (`node`), its arguments normalised to names.

    Layout is the SDPA one: q `[B, Hq, Sq, D]`, k/v `[B, Hkv, Skv, D]`; a mask, when
    present, broadcasts to `[B, Hq, Sq, Skv]`. A rewrite emits the new attention and then
    `replace_with(gm, output)`.
    """

    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: fx.Node | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool

    def unrepeated_kv(self) -> tuple[fx.Node, fx.Node, bool]:
        """K and V before Hugging Face's `repeat_kv`, and whether SDPA must then broadcast heads.

        HF repeats K/V to the query head count when it passes a mask and not otherwise, so
        two ranks of one batch can disagree; rewriting both to the KV-head tensors keeps
        every rank's collectives identical (and moves fewer bytes).
        """
        key, value = repeat_kv_source(self.key), repeat_kv_source(self.value)
        if key is not None and value is not None:
            return key, value, True
        return self.key, self.value, self.enable_gqa


def find_sdpa_cores(gm: fx.GraphModule) -> list[SdpaMatch]:
    matches = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        normalized = normalize_function(SDPA, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        kw = normalized.kwargs
        matches.append(
            SdpaMatch(
                node=node,
                query=kw["query"],
                key=kw["key"],
                value=kw["value"],
                attn_mask=kw.get("attn_mask"),
                dropout_p=kw.get("dropout_p", 0.0),
                is_causal=bool(kw.get("is_causal", False)),
                scale=kw.get("scale"),
                enable_gqa=bool(kw.get("enable_gqa", False)),
            )
        )
    return matches


def repeat_kv_source(node: fx.Node) -> fx.Node | None:
    """`x` if `node` is `reshape(expand(unsqueeze(x, 2)))` repeating heads of `[B, H, S, D]`."""
    aten = torch.ops.aten
    if node.op != "call_function" or node.target not in (aten.reshape.default, aten.view.default):
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target is not aten.unsqueeze.default or unsqueeze.args[1] != 2:
        return None
    source = unsqueeze.args[0]
    src_shape = source.meta["val"].shape
    out_shape = node.meta["val"].shape
    if len(src_shape) != 4 or out_shape[0] != src_shape[0] or tuple(out_shape[2:]) != tuple(src_shape[2:]):
        return None
    return source


def sdpa_method(name: str, rewrite, **spec) -> MethodSpec:
    """The spec of an SDPA method: its cores are SDPA calls, its regions traced by the SDPA adapter.
    Rewrites read K/V before HF's repeat_kv; the repeated copies would otherwise still be made, so
    the dead code goes after them."""
    return MethodSpec(core=CORE, name=name, find=find_sdpa_cores, rewrite=rewrite, adapter="sdpa",
                      drop_dead_code=True, **spec)
