"""Structure of the Ulysses, Hybrid and Head-Tail rewrites under the fake process group.

Per attention: which collectives, over which group, on what shapes, each waited right after
its launch, in the same order on every rank; and what the backward communicates. One child
process per rank checks all three methods at CP=4 (no real communication).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from cp_harness import HEAD_TAIL_WRAPPER, hybrid_wrapper, random_batch, sdpa_plan, tiny_qwen3
from dist_utils import run_distributed

WORLD = 4
METHODS = {"ulysses": "sdpa_hf_ulysses", "hybrid": hybrid_wrapper(2), "head_tail": HEAD_TAIL_WRAPPER}
# tiny Qwen3 at CP=4: batch 2, 16 tokens (4 per rank), 4 query / 2 KV heads of 8 dims
B, LOCAL, HQ, HKV, D = 2, 4, 4, 2, 8
_results: list = []


def _group_roles(mesh, method: str) -> dict:
    roles = {mesh.cp_group_name: "cp"}
    if method == "hybrid":
        groups = mesh.cp_subgroups(2)  # the cached groups compile built
        roles.update({groups.ulysses.group_name: "cp_ulysses", groups.ring.group_name: "cp_ring"})
    return roles


def _layer_collectives(layer, roles: dict) -> list:
    from cpcompile import collectives as C
    from cpcompile.passes.graph_utils import is_core

    (program,) = layer.self_attn.forward.__self__.programs.values()
    nodes = list(program.gm.graph.nodes)
    rows = [
        (
            C.collective_kind(n.target),
            tuple(n.args[0].meta["val"].shape),
            roles[n.args[-1]],
            n.args[1] if n.target is C.ALL_GATHER else len(n.args[1]),
            [u.target for u in n.users] == [C.WAIT] and nodes[nodes.index(n) + 1] in n.users,
        )
        for n in nodes if n.target in C.LAUNCH_OPS
    ]
    return {"collectives": rows, "attention_calls": sum(is_core(n) for n in nodes)}


def _backward_collectives(model, local) -> list:
    from torch.utils._python_dispatch import TorchDispatchMode

    from cpcompile import collectives as C

    class CollectiveLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if C.is_launch(func):
                self.calls.append(C.collective_kind(func))
            return func(*args, **(kwargs or {}))

    out = model(**local)
    with CollectiveLog() as log:
        out.loss.backward()
    return log.calls


def _structure(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    out = {}
    for name, wrapper in METHODS.items():
        plan = cpcompile.load_plan(sdpa_plan(world, wrapper=wrapper))
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
        local = cpcompile.shard_batch(random_batch(0, B, LOCAL * world, padded=True), mesh, plan)
        with tempfile.TemporaryDirectory() as dump_dir:
            model = cpcompile.compile(tiny_qwen3(0), mesh, plan, example_inputs=local, dump_dir=dump_dir)
            summary = json.loads((Path(dump_dir) / f"rank{rank}" / "summary.json").read_text())  # one per rank
        roles = _group_roles(mesh, name)
        out[name] = {
            "layers": [_layer_collectives(layer, roles) for layer in model.model.layers],
            "backward": _backward_collectives(model, local),
            "dump": summary["regions"][0],
        }
    dist.destroy_process_group()
    return out


def results() -> list:
    if not _results:
        _results.extend(run_distributed(_structure, WORLD, init_pg=False, timeout=300))
    return _results


def _a2a(parts, shape, group="cp"):
    return ("all_to_all_single", (parts, *shape), group, parts, True)


def _gather(shape, group="cp", size=WORLD):
    return ("all_gather_into_tensor", shape, group, size, True)


KEY_VALIDITY = _gather((LOCAL, B, 1))
EXPECTED = {
    # Key validity first (it needs no projection), Q, K, V sequence→head (KV heads 2 < cp 4:
    # replicated to 4, one per rank), output head→sequence; the parts exchanged are
    # [B, heads/cp, tokens, D] blocks. One local attention call.
    "ulysses": (
        [KEY_VALIDITY] + [_a2a(WORLD, (B, HQ // WORLD, LOCAL, D))] * 3 + [_a2a(WORLD, (B, 1, LOCAL, D))],
        1, ["all_to_all_single"] * 4,
    ),
    # A2A in Ulysses sub-groups of 2, then K/V gathered in ring sub-groups of 2 (8 tokens each).
    "hybrid": (
        [KEY_VALIDITY] + [_a2a(2, (B, HQ // 2, LOCAL, D), "cp_ulysses")]
        + [_a2a(2, (B, HKV // 2, LOCAL, D), "cp_ulysses")] * 2 + [_gather((2 * LOCAL, B, HKV // 2, D), "cp_ring", 2)] * 2
        + [_a2a(2, (B, HQ // 2, LOCAL, D), "cp_ulysses")],
        1, ["all_to_all_single"] * 4 + ["reduce_scatter_tensor"] * 2,
    ),
    # Key validity, K/V gathered at the KV-head count; one local attention call for both chunks.
    "head_tail": ([KEY_VALIDITY] + [_gather((LOCAL, B, HKV, D))] * 2, 1, ["reduce_scatter_tensor"] * 2),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_collectives_per_attention_identical_on_every_rank(method):
    collectives, attention_calls, backward_per_layer = EXPECTED[method]
    for rank, result in enumerate(results()):
        layers = result[method]["layers"]
        for layer in layers:
            assert layer["collectives"] == collectives, f"rank {rank}: {layer['collectives']}"
            assert layer["attention_calls"] == attention_calls
        assert layers == results()[0][method]["layers"], "collective order differs between ranks"
        assert sorted(result[method]["backward"]) == sorted(backward_per_layer * len(layers)), result[method]["backward"]


def test_dump_names_method_subgroups_and_collectives():
    for result in results():
        hybrid = result["hybrid"]["dump"]
        assert hybrid["method"] == "hybrid" and hybrid["params"] == {"ulysses_degree": 2}
        purposes = [c["purpose"] for c in hybrid["collectives_inserted"]]
        assert purposes == ["key padding and documents", "Q @cp_ulysses", "K @cp_ulysses", "V @cp_ulysses", "K @cp_ring",
                            "V @cp_ring", "attention output @cp_ulysses"]
        assert [c["group_size"] for c in hybrid["collectives_inserted"]] == [4, 2, 2, 2, 2, 2, 2]
        # which kernels serve the core
        assert any("local attention: cpu_flash blocks" in note for note in hybrid["notes"]), hybrid["notes"]
        assert any("cp_ulysses" in note and "cp_ring" in note for note in hybrid["notes"])
        ulysses = result["ulysses"]["dump"]
        assert ulysses["method"] == "ulysses"
        assert any("2 KV heads < 4 ranks" in note and "replicated 2x" in note for note in ulysses["notes"])
        assert result["head_tail"]["dump"]["method"] == "head_tail"
