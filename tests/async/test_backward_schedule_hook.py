"""The backward schedule as Inductor's post-grad hook (issue 19): which graphs it re-orders, and
how it is installed beside a user's own pass. Small hand-built graphs; no process group."""
from __future__ import annotations

import torch
import torch.fx as fx

from cpcompile import collectives as C
from cpcompile.passes import backward_schedule as B

funcol = torch.ops._c10d_functional
aten = torch.ops.aten


def _graph(first_input: str = "tangents_1", in_place: bool = False) -> fx.GraphModule:
    """grad -> all-gather -> wait -> add, and an independent mm traced after the wait."""
    graph = fx.Graph()
    grad, x = graph.placeholder(first_input), graph.placeholder("x")
    launch = graph.call_function(funcol.all_gather_into_tensor.default, (grad, 2, "cp-group"))
    done = graph.call_function(funcol.wait_tensor.default, (launch,))
    independent = graph.call_function(aten.mm.default, (x, x))
    if in_place:
        graph.call_function(aten.add_.Tensor, (x, 1.0))
    graph.output((graph.call_function(aten.add.Tensor, (done, independent)),))
    return fx.GraphModule(torch.nn.Module(), graph)


def _ops(gm: fx.GraphModule) -> list:
    return [B.unwrapped_target(n) for n in gm.graph.nodes if n.op == "call_function"]


def test_backward_graph_launches_early_and_waits_late():
    gm = _graph()
    assert B.schedule_backward(gm.graph, {"cp-group"})
    assert _ops(gm) == [funcol.all_gather_into_tensor.default, aten.mm.default, funcol.wait_tensor.default,
                        aten.add.Tensor]
    gm.recompile()


def test_graphs_left_alone():
    for gm, groups in ((_graph(), {"another-group"}), (_graph(in_place=True), {"cp-group"})):
        before = _ops(gm)
        assert not B.schedule_backward(gm.graph, groups)
        assert _ops(gm) == before
    forward = _graph(first_input="primals_1")
    B._ASYNC_GROUPS.add("cp-group")
    try:
        B.SCHEDULE(forward.graph)
    finally:
        B._ASYNC_GROUPS.discard("cp-group")
    assert C.is_wait(_ops(forward)[1]), "a forward graph was re-ordered"


def test_installed_once_after_a_users_pass(monkeypatch):
    import torch._inductor.config as inductor_config

    class UsersPass(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "users-pass"

    users = UsersPass()
    monkeypatch.setattr(B, "_ASYNC_GROUPS", set())
    # the config's own patch: pytest's monkeypatch deletes a config entry when it restores it
    with inductor_config.patch(post_grad_custom_post_pass=users):
        B.enable_for_groups({"cp-group"})
        B.enable_for_groups({"ring-group"})
        hook = inductor_config.post_grad_custom_post_pass
    assert hook.first is users and hook.then is B.SCHEDULE
    assert B._ASYNC_GROUPS == {"cp-group", "ring-group"}
    assert hook.uuid()[0] == "users-pass" and "cp-group,ring-group" in hook.uuid()[1]
