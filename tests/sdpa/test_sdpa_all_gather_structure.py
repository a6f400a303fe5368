"""Structure of the AllGather rewrite, checked under the fake process group (no real communication)."""
from __future__ import annotations


from cp_harness import random_batch, sdpa_plan, tiny_qwen3
from dist_utils import run_distributed

WORLD = 4


def _structure(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    import cpcompile
    from cpcompile import collectives as C

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    plan = cpcompile.load_plan(sdpa_plan(world))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(random_batch(rank, 2, 4 * world, padded=True), mesh, plan)
    model = cpcompile.compile(tiny_qwen3(0), mesh, plan, example_inputs=local)

    per_layer = []
    for layer in model.model.layers:
        (program,) = layer.self_attn.forward.__self__.programs.values()
        nodes = list(program.gm.graph.nodes)
        launches = [n for n in nodes if n.target is C.ALL_GATHER]
        per_layer.append([
            {
                "shape": tuple(n.args[0].meta["val"].shape),
                "waited_next": [u.target for u in n.users] == [C.WAIT] and nodes[nodes.index(n) + 1] in n.users,
                "group_size": n.args[1],
            }
            for n in launches
        ])

    class CollectiveLog(TorchDispatchMode):
        calls: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "c10d" in str(func):
                self.calls.append(str(func))
            return func(*args, **(kwargs or {}))

    out = model(**local)
    with CollectiveLog() as backward_log:
        out.loss.backward()
    dist.destroy_process_group()
    return {"per_layer": per_layer, "backward": backward_log.calls}


def test_all_gather_structure_identical_on_every_rank():
    results = run_distributed(_structure, WORLD, init_pg=False)
    local_len, batch, kv_heads, head_dim = 4, 2, 2, 8
    for rank, result in enumerate(results):
        for layer in result["per_layer"]:
            # the key-padding row first (the projections run under it), then K, V at the KV-head count
            assert [g["shape"] for g in layer] == [
                (local_len, batch, 1),
                (local_len, batch, kv_heads, head_dim),
                (local_len, batch, kv_heads, head_dim),
            ], f"rank {rank}: {layer}"
            assert all(g["waited_next"] for g in layer), "each launch must have exactly one wait, right after it"
            assert all(g["group_size"] == WORLD for g in layer)
        assert result["per_layer"] == results[0]["per_layer"], "collective order differs between ranks"
        reduce_scatters = [c for c in result["backward"] if "reduce_scatter_tensor" in c]
        assert len(reduce_scatters) == 2 * len(result["per_layer"]), "backward needs one reduce-scatter for K and V"
