"""A compiled CP step's decoder layers under Dynamo (issue 48 item 2), for an unpadded, a padded and a
packed batch: no graph break, the layers of one kind share one compiled graph (a layer holding regions
used to be guarded on its own region objects: every layer compiled apart, 24 graphs for a 20-layer
model), and the attention path is a fact of the batch, not read off the device: the unmasked kernel
for the unpadded batch, the masked one for the others, and no flag read back in the eager call.

Rank 0 of a fake process group of 2 (the collectives return at once), a tiny Qwen3.5 of two GDN
layers (State-P2P) and two attention layers (SDPA AllGather), each checkpointed and compiled as the
trainer does (`compile_layers`) with Dynamo's eager backend: only what Dynamo captures is checked
here; tests/pipeline/test_compiled_layers.py checks compiled CP against eager and CP=1.
"""
from __future__ import annotations

from dist_utils import run_distributed

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
LAYER_KINDS = 2
LENGTH = 32  # global tokens a row; GDN chunk 8
# each batch's first call runs eagerly (its regions trace), the second compiles, the third reuses
CALLS = 3


def _batches(cpcompile, mesh, plan) -> dict:
    from cp_harness import random_batch

    packed = random_batch(1, 2, LENGTH, padded=False)
    packed["position_ids"] = torch_cat_positions([10, LENGTH - 10], rows=2)
    return {name: cpcompile.shard_batch(batch, mesh, plan) for name, batch in
            (("unpadded", random_batch(0, 2, LENGTH, padded=False)),
             ("padded", random_batch(2, 2, LENGTH, padded=True)), ("packed", packed))}


def torch_cat_positions(lengths: list[int], rows: int):
    import torch

    return torch.cat([torch.arange(n) for n in lengths])[None].expand(rows, -1).clone()


def _attention_ops(gm) -> set[str]:
    """The local attention custom ops in a Dynamo graph and its subgraphs (a checkpoint's body)."""
    import torch

    names = ("chunk_attention", "tiled_attention", "flex_attention")
    return {name for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes for name in names if name in str(node.target)}


def _gdn_cores_take_contiguous_qkv(gm) -> list[bool]:
    """For each GDN core op in a Dynamo graph (and its subgraphs): whether its q, k and v are made
    contiguous in the graph, as the compiled cp 1 layer makes them (`kernels/gdn/layout.py`)."""
    import torch

    return [all(arg.op == "call_method" and arg.target == "contiguous" for arg in node.args[:3])
            for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes if str(node.target).startswith("cpcompile.gdn_chunk")]


def _traced_layers(rank: int, world: int) -> dict:
    import torch
    import torch._dynamo
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    import cpcompile
    import cpcompile.kernels.attention.local as local_attention
    from cpcompile.trainer.parallelize import apply_activation_checkpointing, compile_layers
    from gdn_harness import TEXT, gdn_plan

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**{**TEXT, "num_hidden_layers": len(LAYER_TYPES), "layer_types": LAYER_TYPES},
                               attn_implementation="sdpa")
    plan = cpcompile.load_plan(gdn_plan(2, "p2p", sdpa="sdpa_hf"))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    batches = _batches(cpcompile, mesh, plan)
    model = cpcompile.compile(Qwen3_5ForCausalLM(config), mesh, plan, example_inputs=batches["unpadded"])
    apply_activation_checkpointing(model)
    graphs = []

    def recording_eager(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    flags_read = []
    read_flag = local_attention.single_unpadded_document
    local_attention.single_unpadded_document = lambda tags: flags_read.append(1) or read_flag(tags)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compile_layers(model, recording_eager)
    out = {}
    for name, local in batches.items():
        made = []
        for _ in range(CALLS):
            before = len(graphs)
            model(**local).loss.backward()
            made.append(graphs[before:])
        out[name] = {"graphs": [len(g) for g in made], "attention": sorted(set().union(*map(_attention_ops, made[1]))),
                     "contiguous_qkv": [c for gm in made[1] for c in _gdn_cores_take_contiguous_qkv(gm)]}
    dist.destroy_process_group()
    return {"batches": out, "graph_breaks": dict(counters["graph_break"]),
            "unsupported": sum(counters["unimplemented"].values()), "flags_read": len(flags_read)}


def test_compiled_cp_layers_share_one_graph_per_kind_without_breaks_or_flag_reads():
    """Per batch: the eager call makes no graph, the second call at most one graph per layer kind (not one
    per layer), the third none; no graph break, nothing unsupported; the unpadded batch's attention
    runs the unmasked kernel, the padded and packed ones the masked kernel, and no call reads the keys'
    flag back from the device; the GDN cores take contiguous q, k and v, as at cp 1."""
    (result,) = run_distributed(_traced_layers, 1, init_pg=False, timeout=300)
    assert result["graph_breaks"] == {} and result["unsupported"] == 0, result
    assert result["flags_read"] == 0, result
    for name, batch in result["batches"].items():
        eager, compiled, again = batch["graphs"]
        assert eager == again == 0 and 1 <= compiled <= LAYER_KINDS, (name, result)
        assert batch["contiguous_qkv"] and all(batch["contiguous_qkv"]), (name, result)
    kernels = {name: batch["attention"] for name, batch in result["batches"].items()}
    assert kernels == {"unpadded": ["chunk_attention"], "padded": ["tiled_attention"], "packed": ["tiled_attention"]}, kernels
