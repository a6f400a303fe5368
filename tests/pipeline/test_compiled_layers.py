"""`torch.compile` of checkpointed decoder layers holding CP regions: one graph per layer kind, no break.

A tiny Qwen3.5 (3 GDN layers under State-P2P, 1 attention layer under SDPA AllGather, sync and
async; and both in Head-Tail order) at CP=2 on gloo, fp32, every decoder layer under non-reentrant
activation checkpointing and compiled on its own (the trainer's `apply_activation_checkpointing` and
`compile_layers`, backend aot_eager): its logits, loss and every parameter gradient equal the eager
CP run's and the CP=1 reference's, Dynamo captured each layer, its checkpoint and its region's
collectives in one graph, with no graph break, the layers of one kind (the 3 GDN layers) sharing
it, and the async region's launches stay apart from their waits in that graph.
"""
from __future__ import annotations

import random

import torch

from cp_harness import random_batch, rel
from dist_utils import run_distributed
from gdn_harness import DECAY_PARAMS, decay_as_close_as_reference, gdn_plan, tiny_qwen3_5, use_reference_gdn

LOCAL_LEN = 12  # GDN chunk 8: a full chunk and a partial one per rank
# (GDN method, SDPA wrapper): State-P2P beside async SDPA AllGather (launches early, waits late: the
# schedule must survive), and both in Head-Tail order (one batch order; the sync case: no overlap).
# Sync AllGather beside contiguous State-P2P compiles in tests/train/test_trainer_compile.py.
PLANS = {"async": ("p2p", {"_target_": "cpcompile.wrappers.sdpa_hf_async_cp_wrapper"}),
         "head_tail": ("p2p_head_tail", {"_target_": "cpcompile.wrappers.sdpa_hf_load_balance_cp_wrapper"})}
LAYER_KINDS = 2  # tiny_qwen3_5: 3 GDN layers, then an attention layer; Dynamo shares a kind's compiled code
# The first call of a new signature runs eagerly (the regions trace their graphs), the second is
# compiled, the third must reuse the compiled graphs: no recompile, no break.
STEPS = 3


def _regions_under_plain_compile(rank: int, world: int) -> dict:
    """Rank 0 of a fake group of 2: a 9-layer Qwen3 (9 SDPA AllGather regions) under plain
    `torch.compile`, where each region is a graph of its own: the Dynamo warnings of one call (each
    region's `_run` is compiled at its first)."""
    import logging

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile
    from cp_harness import sdpa_plan, tiny_qwen3

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("torch._dynamo").addHandler(handler)
    batch = {"input_ids": torch.randint(0, 96, (1, 8)), "position_ids": torch.arange(8)[None], "use_cache": False}
    plan = cpcompile.load_plan(sdpa_plan(2))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    model = cpcompile.compile(tiny_qwen3(0, layers=9), mesh, plan, example_inputs=batch)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(**batch)
    dist.destroy_process_group()
    return {"warnings": warnings}


def _global_results(model, mesh, plan, local: dict) -> dict:
    """One forward and backward of the CP model, in global terms (logits gathered, loss and
    gradients summed over the cp group)."""
    import cpcompile

    model.zero_grad(set_to_none=True)
    out = model(**local)
    out.loss.backward()
    cpcompile.all_reduce_gradients(model, mesh)
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss, group=mesh.cp_group)
    return {"logits": cpcompile.unshard(out.logits.detach(), mesh, plan, batch=local), "loss": loss,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _reference(seed: int, batch: dict, dtype) -> dict:
    model = use_reference_gdn(tiny_qwen3_5(seed, dtype))
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return {"logits": out.logits.detach(), "loss": out.loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def _checkpointed_cp_model(seed: int, mesh, plan, example: dict):
    import cpcompile
    from cpcompile.trainer.parallelize import apply_activation_checkpointing

    model = cpcompile.compile(tiny_qwen3_5(seed), mesh, plan, example_inputs=example)
    apply_activation_checkpointing(model)
    return model


def _collectives(gm: torch.fx.GraphModule) -> int:
    """Functional-collective nodes in a Dynamo graph and the subgraphs it calls (a checkpoint's body)."""
    return sum(1 for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes
               if node.op == "call_function" and "_c10d_functional" in str(node.target))


def _overlapped_launches(gm: torch.fx.GraphModule) -> int:
    """Collectives in a Dynamo graph (and its subgraphs) whose wait is not the next op after their
    launch: the async schedule's launch/wait split, kept by the compiled graph."""
    count = 0
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            ops = [n for n in module.graph.nodes if n.op in ("call_function", "call_method")]
            position = {n: i for i, n in enumerate(ops)}
            count += sum(1 for n in ops if "wait_tensor" in str(n.target) and n.args[0] in position
                         and position[n] - position[n.args[0]] > 1)
    return count


def _errors(got: dict, want: dict) -> dict:
    grads = {n: rel(got["grads"][n], g) for n, g in want["grads"].items()}
    return {"logits": rel(got["logits"], want["logits"]), "loss": rel(got["loss"], want["loss"]), "grads": grads,
            "missing": sorted(set(want["grads"]) - set(got["grads"]))}


def _compiled_vs_eager_per_plan(rank: int, world: int, seed: int) -> dict:
    return {name: _compiled_vs_eager(world, seed, *methods) for name, methods in PLANS.items()}


def _compiled_vs_eager(world: int, seed: int, gdn: str, sdpa) -> dict:
    import torch._dynamo

    import cpcompile
    from cpcompile.trainer.parallelize import compile_layers

    plan = cpcompile.load_plan(gdn_plan(world, gdn, sdpa=sdpa))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    batch = random_batch(seed, 2, LOCAL_LEN * world, padded=True)
    local = cpcompile.shard_batch(batch, mesh, plan)
    # regions traced on a shorter batch: the step's length is a new signature, traced in the first call
    example = cpcompile.shard_batch(random_batch(seed, 2, LOCAL_LEN * world // 2, padded=True), mesh, plan)

    eager = _global_results(_checkpointed_cp_model(seed, mesh, plan, example), mesh, plan, local)
    graphs = []

    def recording_aot_eager(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _checkpointed_cp_model(seed, mesh, plan, example)
    compile_layers(model, recording_aot_eager)
    first, compiled, again = [_global_results(model, mesh, plan, local) for _ in range(STEPS)]
    counters = torch._dynamo.utils.counters
    reference, truth = _reference(seed, batch, torch.float32), _reference(seed, batch, torch.float64)
    return {
        "first_vs_eager": _errors(first, eager),
        "again_vs_compiled": _errors(again, compiled),
        "compiled_vs_eager": _errors(compiled, eager),
        "compiled_vs_reference": _errors(compiled, reference),
        "decay": {n: (rel(compiled["grads"][n], t), rel(reference["grads"][n], t))
                  for n, t in truth["grads"].items() if n.endswith(DECAY_PARAMS)},
        "graph_breaks": dict(counters["graph_break"]),
        "unsupported": sum(counters["unimplemented"].values()),
        "frames": counters["stats"]["unique_graphs"],
        "graphs": len(graphs),
        "collectives_per_graph": [_collectives(gm) for gm in graphs],
        "overlapped": _overlapped_launches(graphs[-1]),  # the attention layer's
        "checkpointed": all(any("checkpoint" in str(n.target) for n in gm.graph.nodes) for gm in graphs),
        "convolutions": sum(1 for gm in graphs for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
                            for n in module.graph.nodes if "conv" in str(n.target)),
    }


def test_checkpointed_layers_with_cp_regions_compile_whole_and_exact():
    """Compiled = eager CP and = the CP=1 reference within 1e-5 except the GDN decay parameters'
    gradients (fp32 sums of cancelling terms, moved by the compiled conv's other rounding), which
    must be as close to a float64 run as the reference is. Dynamo: no graph break, nothing unsupported, one graph per
    layer kind (the GDN layers share theirs), each a checkpoint holding its region's collectives, none compiled again in the third step,
    no convolution (the GDN conv inlined as its taps); the async attention layer's graph keeps compute
    between launches and their waits, the sync one's none."""
    for per_method in run_distributed(_compiled_vs_eager_per_plan, 2, random.randrange(1 << 30), timeout=300):
        for result in per_method.values():
            _check(result)
        assert per_method["head_tail"]["overlapped"] == 0 < per_method["async"]["overlapped"], per_method


def _check(result: dict) -> None:
    assert result["graph_breaks"] == {} and result["unsupported"] == 0, result
    assert result["graphs"] == result["frames"] == LAYER_KINDS, result
    assert result["checkpointed"] and min(result["collectives_per_graph"]) > 0, result
    assert result["convolutions"] == 0, result  # the GDN regions' conv inlined as its taps (kernels/gdn/conv.py)
    for name in ("compiled_vs_eager", "first_vs_eager", "again_vs_compiled"):
        same = result[name]
        # compiled, the GDN conv is its float32 taps, eagerly F.conv1d: the decay parameters' fp32
        # gradients (sums of cancelling terms) move by more than 1e-5 with that rounding; they are
        # judged against float64 below, as the CP=1 reference's are
        grads = {n: v for n, v in same["grads"].items()
                 if not (name == "compiled_vs_eager" and n.endswith(DECAY_PARAMS))}
        assert not same["missing"] and max(same["logits"], same["loss"], *grads.values()) <= 1e-5, (name, same)
    cp1 = result["compiled_vs_reference"]
    rest = [v for n, v in cp1["grads"].items() if not n.endswith(DECAY_PARAMS)]
    assert not cp1["missing"] and max(cp1["logits"], cp1["loss"], *rest) <= 1e-5, cp1
    assert decay_as_close_as_reference(result["decay"]), result["decay"]


class _PerLayerCallable:
    """An object in a submodule's `forward` (as `InstalledRegion` was; it is a bound method now): Dynamo
    guards on its identity, so each layer is a compiled entry of its own."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, x):
        return x * self.scale


class _Layer(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.mixer = torch.nn.Module()
        self.mixer.forward = _PerLayerCallable(scale)

    def forward(self, x):
        return torch.sin(self.mixer(x)) + 1


def test_every_layer_compiles_past_dynamos_recompile_limit():
    """20 layers of one code object, each guarded on its own object: Dynamo's default limit of 8
    entries a code object would run the 9th layer on eagerly with a warning (a 20-layer CP model
    compiled 8); `compile_around_regions` gives each compiled function its share."""
    import torch._dynamo

    from cpcompile.compiled import compile_around_regions

    graphs = []

    def counting_eager(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layers = [_Layer(1.0 + i) for i in range(20)]
    for layer in layers:
        layer.forward = compile_around_regions(layer.forward, counting_eager)
    x = torch.randn(3, 4)
    for _ in range(2):  # the first call of a signature is eager, the second compiled
        outputs = [layer(x) for layer in layers]
    assert len(graphs) == len(layers), len(graphs)
    for i, out in enumerate(outputs):
        torch.testing.assert_close(out, torch.sin(x * (1.0 + i)) + 1)


def test_every_region_compiles_past_dynamos_recompile_limit_under_plain_compile():
    """Under plain `torch.compile` each region's `_run` is an entry of one code object: with 9
    regions, the 9th would run uncompiled past Dynamo's limit of 8."""
    (result,) = run_distributed(_regions_under_plain_compile, 1, init_pg=False, timeout=300)
    ours = [w for w in result["warnings"] if "recompile_limit" in w and "cpcompile" in w]  # not transformers' frames
    assert not ours, ours
