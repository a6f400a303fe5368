"""Structure of the async schedule under the fake process group (issue 4).

For AllGather, Ulysses and Hybrid (u=2) at CP=4, every rank compiles a one-layer Qwen3 whose
global batch leaves a padding mask on some ranks only, and records, per collective of each
attention region: is the launch right after its last producer, the wait right before its
first consumer, and how much compute lies between. The collective order must be identical
on every rank. Rank 0 also checks the same property on the forward graph torch.compile
hands to its compiler (after AOT autograd, with Inductor's partitioner), and that an
attention region with nothing to overlap is refused. One child process per rank.

The backward (issue 19): ranks 0 (a padding mask) and 3 (none) compile the model through
`cp_harness.scheduled_backward_backend` (AOT autograd as Inductor runs it, then cpcompile's
post-grad backward schedule) and record, per collective of the backward graph: is it waited,
is the wait the very next node, is the launch right after its last producer and the wait right
before its first consumer, and what runs between. A collective with no compute under it must
be one for which nothing independent was left: every compute node after its wait depends on it
or on a later wait.
"""
from __future__ import annotations

import pytest

import torch

from cp_harness import (
    ASYNC_METHODS, QKVHolder, method_wrapper, random_batch, scalar_inductor_kernels, scheduled_backward_backend,
    sdpa_plan, tiny_qwen3,
)
from dist_utils import run_distributed

WORLD = 4
COMPILING_RANKS = (0, 3)  # rank 0's shard has padding (a mask), rank 3's none
_results: list = []


def _region_schedule(gm, roles: dict) -> list[dict]:
    """Per launch of a region graph: its signature and where it sits relative to its neighbours."""
    from cpcompile import collectives as C
    from cpcompile.dump import collective_report
    from cpcompile.passes.graph_utils import is_core
    from cpcompile.passes.schedule import group_of

    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    rows = []
    for report in collective_report(gm):
        launch = next(n for n in nodes if n.name == report["launch"])
        (wait,) = launch.users
        last_producer = max(launch.all_input_nodes, key=order.get)
        first_consumer = min(wait.users, key=order.get)
        rows.append({
            "signature": (report["collective"], roles[group_of(launch)], tuple(launch.args[0].meta["val"].shape)),
            # only other launches may sit between the handoff and the launch, only waits before the consumer
            "after_producer": all(C.is_launch(n.target) for n in nodes[order[last_producer] + 1: order[launch]]),
            "before_consumer": all(C.is_wait(n.target) for n in nodes[order[wait] + 1: order[first_consumer]]),
            "compute_between": len(report["compute_between"]),
            "model_compute_between": len(report["model_compute_between"]),
            "feeds_attention": not any(is_core(n) for n in nodes[: order[launch]]),
        })
    return rows


def _compiled_schedules(model, local, roles: dict) -> dict:
    """The launches of the compiled forward graph (post AOT autograd), as `_region_schedule` sees
    them, and those of the scheduled backward graph (`_backward_rows`)."""
    from cpcompile import collectives as C

    forwards, backwards = [], []
    torch._dynamo.reset()
    torch.compile(model, backend=scheduled_backward_backend(backwards, forwards))(**local).loss.backward()

    def with_collectives(graphs):
        return [gm for gm in graphs if any(C.is_launch(n.target) for n in gm.graph.nodes)]

    return {"forward": [_compiled_rows(gm) for gm in with_collectives(forwards)],
            "backward": [_backward_rows(gm, roles) for gm in with_collectives(backwards)]}


def _compiled_rows(gm) -> list[dict]:
    from cpcompile import collectives as C
    from cpcompile.dump import collective_report

    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    rows = []
    for report in collective_report(gm):
        launch = next(n for n in nodes if n.name == report["launch"])
        (wait,) = [u for u in launch.users if C.is_wait(u.target)]
        last_producer = max(launch.all_input_nodes, key=order.get)
        first_consumer = min(wait.users, key=order.get)
        rows.append({
            "collective": report["collective"],
            "after_producer": all(C.is_launch(n.target) for n in nodes[order[last_producer] + 1: order[launch]]),
            "before_consumer": all(C.is_wait(n.target) for n in nodes[order[wait] + 1: order[first_consumer]]),
            "compute_between": len(report["compute_between"]),
            "matmuls_between": sum(n.target is torch.ops.aten.mm.default for n in nodes[order[launch]: order[wait]]),
        })
    return rows


def _no_overlap_outcome(mesh, method: str) -> tuple[str, str] | None:
    """Compile a forward(q, k, v) → SDPA module with an async method: nothing to overlap."""
    import cpcompile

    q = torch.randn(1, 4, 4, 8)
    kv = torch.randn(1, 4, 4, 8)
    plan = sdpa_plan(WORLD, wrapper=method_wrapper(method, asynchronous=True), match="core")
    try:
        cpcompile.compile(QKVHolder(), mesh, plan, example_inputs=(q, kv, kv))
    except Exception as exc:  # asserted on in the parent
        return type(exc).__name__, str(exc)
    return None


def _structure(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    # batch 1 with left padding over the first ranks only: HF passes a mask on those ranks, none elsewhere
    batch = random_batch(0, 1, 4 * world, padded=True)
    out = {}
    for method in ASYNC_METHODS:
        plan = cpcompile.load_plan(sdpa_plan(world, method_wrapper(method, asynchronous=True)))
        mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
        local = cpcompile.shard_batch(batch, mesh, plan)
        model = cpcompile.compile(tiny_qwen3(0, layers=1), mesh, plan, example_inputs=local)
        roles = _group_roles(mesh, method)
        out[method] = {
            "has_mask": bool((local["attention_mask"] == 0).any()),  # HF drops an all-ones mask
            "layers": [_region_schedule(_program(layer).gm, roles) for layer in model.model.layers],
            "compiled": _compiled_schedules(model, local, roles) if rank in COMPILING_RANKS else None,
            "no_overlap": _no_overlap_outcome(mesh, method) if rank == 0 else None,
        }
    dist.destroy_process_group()
    return out


def _program(layer):
    (program,) = layer.self_attn.forward.__self__.programs.values()
    return program


def _group_roles(mesh, method: str) -> dict:
    roles = {mesh.cp_group_name: "cp"}
    if method == "hybrid":
        groups = mesh.cp_subgroups(2)
        roles.update({groups.ulysses.group_name: "cp_ulysses", groups.ring.group_name: "cp_ring"})
    return roles


def results() -> list:
    if not _results:
        _results.extend(run_distributed(_structure, WORLD, init_pg=False, timeout=600))
    return _results


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_launch_at_handoff_wait_at_consumer(method):
    """Every launch at its handoff, every wait at its consumer; every collective feeding the
    attention hides compute, except the last launched (nothing independent may be left then)."""
    for rank, result in enumerate(results()):
        for layer in result[method]["layers"]:
            for row in layer:
                assert row["after_producer"], f"rank {rank}: {row['signature']} is not launched at its handoff"
                assert row["before_consumer"], f"rank {rank}: {row['signature']} is not waited at its consumer"
            feeding = [row for row in layer if row["feeds_attention"]]
            for row in feeding[:-1]:
                assert row["compute_between"] >= 1, f"rank {rank}: {row['signature']} has nothing between"


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_attention_collectives_hide_model_compute(method):
    for result in results():
        for layer in result[method]["layers"]:
            assert sum(row["model_compute_between"] for row in layer if row["feeds_attention"]) >= 1


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_collective_order_identical_on_every_rank(method):
    per_rank = [[[row["signature"] for row in layer] for layer in r[method]["layers"]] for r in results()]
    masks = {r[method]["has_mask"] for r in results()}
    assert masks == {True, False}, "the scenario must give a mask to some ranks only"
    assert all(layers == per_rank[0] for layers in per_rank), "collective order differs between ranks"


def test_hybrid_chain_stays_async():
    """A2A → AllGather: each all-gather of K/V is launched right after its all-to-all's
    consumer chain and hides model compute (the Q path), not only other collectives."""
    for result in results():
        for layer in result["hybrid"]["layers"]:
            gathers = [row for row in layer if row["signature"][:2] == ("all_gather_into_tensor", "cp_ring")]
            assert len(gathers) == 2
            assert all(row["model_compute_between"] >= 1 for row in gathers), gathers


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_compiled_forward_keeps_the_schedule(method):
    compiled = results()[0][method]["compiled"]["forward"]
    assert len(compiled) == 1, "expected one compiled graph with collectives (one attention layer)"
    eager_kinds = [row["signature"][0] for row in results()[0][method]["layers"][0]]
    for rows in compiled:
        assert [row["collective"] for row in rows] == eager_kinds, "torch.compile changed the collective order"
        feeding = [row for row, eager in zip(rows, results()[0][method]["layers"][0]) if eager["feeds_attention"]]
        assert all(row["after_producer"] and row["before_consumer"] for row in rows), rows
        assert all(row["compute_between"] >= 1 for row in feeding[:-1]), rows
        assert sum(row["matmuls_between"] for row in feeding) >= 1, "no projection runs under the collectives"


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_region_without_overlappable_work_is_refused(method):
    outcome = results()[0][method]["no_overlap"]
    assert outcome is not None, "an attention with nothing to overlap was accepted as async"
    kind, message = outcome
    assert kind == "CPInputError", message
    for words in ("core", "asynchronous", "not async", "synchronous wrapper"):
        assert words in message, f"{words!r} not in {message!r}"


# --- the compiled backward (issue 19) ----------------------------------------------------------


def _is_wait(node) -> bool:
    from cpcompile import collectives as C
    from cpcompile.passes.backward_schedule import unwrapped_target

    return node.op == "call_function" and C.is_wait(unwrapped_target(node))


def _orders_only(user, launch) -> bool:
    """`user` names `launch` only as an ordering dependency (`control_deps`), not as data."""
    return getattr(user.target, "__name__", "") == "control_deps" and launch not in user.args[2:]


def _backward_rows(gm, roles: dict) -> list[dict]:
    """Per launch of a scheduled backward graph: where it and its wait sit, and what runs between."""
    from cpcompile import collectives as C
    from cpcompile.passes.backward_schedule import unwrapped_target
    from cpcompile.passes.graph_utils import ancestors
    from cpcompile.passes.schedule import group_of, is_compute

    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    waits = [n for n in nodes if _is_wait(n)]
    compute = {n for n in nodes if is_compute(n) or (unwrapped_target(n) is not n.target and not _is_wait(n))}
    rows = []
    for launch in (n for n in nodes if n.op == "call_function" and C.is_launch(n.target)):
        launch_waits = [u for u in launch.users if _is_wait(u)]
        readers = [u for u in launch.users if not _is_wait(u) and not _orders_only(u, launch)]
        row = {"signature": (C.collective_kind(launch.target), roles[group_of(launch)]),
               "waited": len(launch_waits) == 1 and not readers}
        if not row["waited"]:
            rows.append(row)
            continue
        (wait,) = launch_waits
        last_producer = max(launch.all_input_nodes, key=order.get)
        first_consumer = min(wait.users, key=order.get)
        between = nodes[order[launch] + 1: order[wait]]
        later_waits = {w for w in waits if order[w] >= order[wait]}
        row.update({
            "immediate": order[wait] == order[launch] + 1,
            "after_producer": all(C.is_launch(n.target) or n.op == "get_attr"
                                  for n in nodes[order[last_producer] + 1: order[launch]]),
            "before_consumer": all(_is_wait(n) or n.op == "get_attr" for n in nodes[order[wait] + 1: order[first_consumer]]),
            "compute_between": sum(n in compute for n in between),
            "matmuls_between": sum(unwrapped_target(n) is torch.ops.aten.mm.default for n in between),
            # nothing independent was left at the wait: all later compute needs this or a later wait
            "nothing_left": all(ancestors(n) & later_waits for n in compute if order[n] > order[wait]),
        })
        rows.append(row)
    return rows


def _graph(method: str, rank_index: int = 0) -> list[dict]:
    compiled = [r[method]["compiled"] for r in results() if r[method]["compiled"]]
    graphs = compiled[rank_index]["backward"]
    assert len(graphs) == 1, "expected one compiled backward graph with collectives (one attention layer)"
    return graphs[0]


EXPECTED = {  # the backward collectives autograd derives from the forward's
    "all_gather": [("reduce_scatter_tensor", "cp")] * 2,
    "ulysses": [("all_to_all_single", "cp")] * 4,
    "hybrid": [("all_to_all_single", "cp_ulysses")] + [("reduce_scatter_tensor", "cp_ring")] * 2
              + [("all_to_all_single", "cp_ulysses")] * 3,
}


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_every_backward_collective_waited_never_at_once(method):
    rows = _graph(method)
    assert sorted(row["signature"] for row in rows) == sorted(EXPECTED[method]), rows
    for row in rows:
        assert row["waited"], f"{row['signature']} is left unwaited (or read before its wait)"
        assert not row["immediate"], f"{row['signature']} is waited right after its launch"


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_backward_launch_at_handoff_wait_at_consumer(method):
    for row in _graph(method):
        assert row["after_producer"], f"{row['signature']} is not launched as soon as its input is ready"
        assert row["before_consumer"], f"{row['signature']} is not waited just before its first consumer"


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_backward_collectives_hide_compute(method):
    """Compute between launch and wait, except where nothing independent was left (Ulysses: dQ,
    dK, dV come out of one attention backward and everything after it needs one of them)."""
    rows = _graph(method)
    for row in rows:
        assert row["compute_between"] >= 1 or row["nothing_left"], f"{row['signature']} hides nothing: {rows}"
    assert sum(row["matmuls_between"] for row in rows) >= 2, f"no projection gradient runs under them: {rows}"


def test_all_gather_reduce_scatters_both_hide_a_matmul():
    assert all(row["matmuls_between"] >= 1 for row in _graph("all_gather")), _graph("all_gather")


@pytest.mark.parametrize("method", ASYNC_METHODS)
def test_backward_collective_order_identical_on_every_rank(method):
    compiling = [r[method] for r in results() if r[method]["compiled"]]
    assert {r["has_mask"] for r in compiling} == {True, False}, "the ranks compared must differ in mask"
    orders = [[row["signature"] for row in _graph(method, i)] for i in range(len(compiling))]
    assert all(order == orders[0] for order in orders), orders


def _inductor_code(rank: int, world: int) -> tuple[str, str]:
    """Inductor's generated forward and backward code of the async AllGather region."""
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile

    scalar_inductor_kernels()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    plan = cpcompile.load_plan(sdpa_plan(2, method_wrapper("all_gather", asynchronous=True)))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(random_batch(0, 2, 8, padded=True), mesh, plan)
    model = cpcompile.compile(tiny_qwen3(0, layers=1), mesh, plan, example_inputs=local)
    _, codes = run_and_get_code(lambda: torch.compile(model, backend="inductor")(**local).loss.backward())
    dist.destroy_process_group()
    return (next(code for code in codes if "all_gather_into_tensor.default(" in code),
            next(code for code in codes if "reduce_scatter_tensor.default(" in code))


def _code_lines(code: str, *markers: str) -> list[list[int]]:
    lines = code.splitlines()
    return [[i for i, line in enumerate(lines) if marker in line] for marker in markers]


_inductor_codes: list = []


def inductor_codes() -> tuple[str, str]:
    if not _inductor_codes:
        _inductor_codes.extend(run_distributed(_inductor_code, 1, init_pg=False, timeout=600))
    return _inductor_codes[0]


@pytest.mark.slow
def test_inductor_code_runs_the_q_projection_under_the_gathers():
    """Inductor's generated forward: all-gathers of K and V, then a matmul, then the waits."""
    launches, waits, matmuls = _code_lines(inductor_codes()[0], "all_gather_into_tensor.default(",
                                           "wait_tensor.default(", "extern_kernels.mm(")
    assert len(launches) == 3 and len(waits) == 3, (launches, waits)
    assert max(launches) < min(waits), "a gather is waited before the last one is launched"
    assert any(max(launches) < m < min(waits) for m in matmuls), "no matmul runs under the gathers"


@pytest.mark.slow
def test_inductor_backward_code_runs_gemms_under_the_reduce_scatters():
    """Inductor's generated backward (its peak-memory reordering included): both reduce-scatters
    launched before either is waited, and a matmul between each launch and its wait."""
    launches, waits, matmuls = _code_lines(inductor_codes()[1], "reduce_scatter_tensor.default(",
                                           "wait_tensor.default(", "extern_kernels.mm(")
    assert len(launches) == 2 and len(waits) == 2, (launches, waits)
    assert max(launches) < min(waits), "a reduce-scatter is waited before the other is launched"
    for launch, wait in zip(launches, waits):
        assert any(launch < m < wait for m in matmuls), "no matmul runs under a reduce-scatter"
