"""The trainer's `compile_backend` where CP is on: at cp 2 (GDN State-P2P + SDPA AllGather), every
layer checkpointed and compiled with aot_eager, float64, the run follows the eager run step by step,
and Dynamo compiled each decoder layer as one graph, one per layer kind, without a graph break (and the chunked loss's
chunk work, which the backend compiles too)."""
from __future__ import annotations

import random

from dist_utils import run_distributed
from test_trainer import _close, _curves, _run, qwen3_5_config

LAYER_KINDS = 2  # gdn_harness.TEXT: 3 GDN layers and an attention layer; the GDN layers share their graph


def _eager_and_compiled(rank: int, world: int, seed: int) -> dict:
    import torch._dynamo

    eager = _curves(_run(qwen3_5_config(seed, activation_checkpointing="every_layer")))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = _curves(_run(qwen3_5_config(seed, activation_checkpointing="every_layer", compile_backend="aot_eager")))
    return {"eager": eager, "compiled": compiled, "graph_breaks": dict(counters["graph_break"]),
            "unsupported": sum(counters["unimplemented"].values()), "graphs": counters["stats"]["unique_graphs"],
            "loss_graphs": _loss_graphs()}


def _loss_graphs() -> int:
    """The graphs Dynamo holds for the chunked loss's compiled chunk work (its forward's and its
    backward's function; one per chunk shape)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from cpcompile.linear_cross_entropy import _fused_logit_gradient, _fused_loss_terms

    return sum(len(_debug_get_cache_entry_list(fn.__code__)) for fn in (_fused_loss_terms, _fused_logit_gradient))


def test_compiled_checkpointed_layers_follow_the_eager_run():
    """Each step's loss, gradient norm and learning rate within 1e-12 of the eager run's (the first
    step runs eagerly: each layer's first call of a signature traces its regions, `cpcompile.compiled`);
    no graph break, nothing Dynamo could not trace, one graph per decoder layer kind, and the chunked
    loss's chunk work compiled too (its forward's and its backward's)."""
    for result in run_distributed(_eager_and_compiled, 2, random.randrange(1 << 30), timeout=300):
        assert _close(result["compiled"], result["eager"], 1e-12), (result["compiled"], result["eager"])
        assert result["graph_breaks"] == {} and result["unsupported"] == 0, result
        assert result["loss_graphs"] >= 2 and result["graphs"] == LAYER_KINDS + result["loss_graphs"], result


def test_compile_backend_null_is_the_device_default_with_and_without_cp():
    """`compile_backend: null` takes the device's default (inductor on CUDA, eager on CPU), under CP
    too; `eager` stays eager; any other name is the layers' backend."""
    from cpcompile.trainer import config

    def layers(backend, device="cpu"):
        return config.TrainSettings(compile_backend=backend, device=device).layer_compile_backend()

    assert layers(None) is None and layers("eager") is None and layers("aot_eager") == "aot_eager"
    assert layers(None, "cuda") == "inductor" and layers("eager", "cuda") is None


def _packed_eager_and_compiled(rank: int, world: int, seed: int) -> dict:
    import torch._dynamo

    from test_trainer import without_cp
    from test_trainer_packing import _packed

    def packed(**train) -> dict:
        config = without_cp(_packed(seed, 2))
        config["train"].update(steps=3, activation_checkpointing="every_layer", **train)
        return config

    eager = _curves(_run(packed()))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = _curves(_run(packed(compile_backend="aot_eager")))
    return {"eager": eager, "compiled": compiled, "graph_breaks": dict(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"]}


def test_compiled_layers_on_packed_documents_follow_the_eager_run():
    """cp 1 with packed documents (GDN on cpcompile's core, each batch its own document boundaries):
    what a fine-tune runs on CUDA by default now that null means inductor there. Compiled with
    aot_eager, every step equals the eager run: no batch's documents are baked into a graph."""
    (result,) = run_distributed(_packed_eager_and_compiled, 1, random.randrange(1 << 30), timeout=300)
    assert _close(result["compiled"], result["eager"], 1e-12), (result["compiled"], result["eager"])
    assert result["graph_breaks"] == {} and result["graphs"] >= 2, result  # a GDN and an attention layer
