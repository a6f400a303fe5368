"""Equivalence harness: run a model at CP=1 and under cpcompile at CP>1, compare everything.

A scenario builds the same model twice from one seed, feeds the reference the global batch
and the CP copy this rank's local batch, and reports relative errors of logits (gathered
back to global order), loss (summed over the CP group) and every parameter gradient (summed
over the CP group), so the test can assert on them.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cpcompile

VOCAB = 96


def scalar_inductor_kernels() -> None:
    """Inductor's CPU kernels without SIMD, in this process (a rank: it ends with the test). On a
    cold cache g++ builds them in about 60% of the time (the async AllGather region's ~30 kernels:
    18 s instead of 29 s on the 2-core CI box), and the vector ISA probe that compiles a program
    per ISA is skipped. What the tests look at does not depend on how Inductor vectorises its own
    loops: the wrapper code's order of collectives, waits and matmuls (Inductor's scheduler, not
    its C++ codegen), and CP's numbers against CP=1 within fp32 reduction-order tolerance."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.vec_isa_ok = False


def tiny_qwen3(seed: int, layers: int = 2, dtype=torch.float32, **extra_config):
    """A tiny Qwen3; `extra_config` sets more Qwen3Config fields (e.g. a sliding window)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa", **extra_config,
    )
    return Qwen3ForCausalLM(config).to(dtype)


def tiny_llama(seed: int, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def sdpa_plan(cp_size: int, wrapper="sdpa_hf", match="*.self_attn") -> dict:
    return {
        "accelerator": {"cp_size": cp_size},
        "plan_overrides": [
            {"match": match, "when": "cp", "region_dispatch": False, "inner_target": "self", "inner_wrapper": wrapper}
        ],
    }


def random_batch(seed: int, batch: int, length: int, padded: bool) -> dict:
    """Token ids and labels; with `padded`, left padding on one row and right on another."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
    out = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, : length // 3 + 1] = 0           # left padding crossing a rank boundary
        if batch > 1:
            mask[1, length - length // 4 :] = 0  # right padding
        out["attention_mask"] = mask
        out["labels"] = ids.masked_fill(mask == 0, -100)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def each_document_alone(model, batch: dict, spans) -> dict:
    """The packed-batch reference: the unrewritten `model` on every document `[a, b)` of the row by
    itself, with one global mean loss over all documents' targets."""
    targets = sum(b - a - 1 for a, b in spans)
    logits, loss = [], 0.0
    for a, b in spans:
        out = model(input_ids=batch["input_ids"][:, a:b], labels=batch["labels"][:, a:b],
                    num_items_in_batch=torch.tensor(targets), use_cache=False)
        logits.append(out.logits.detach())
        loss = loss + out.loss
    loss.backward()
    return {"logits": torch.cat(logits, dim=1), "loss": loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def reference_run(make_model, batch: dict):
    model = make_model()
    out = model(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def compare_cp_run(make_model, batch: dict, plan: dict, *, compile_backend=None, traced_with: dict | None = None) -> dict:
    """Run CP on this rank and return relative errors against the CP=1 reference.

    `traced_with`: a global batch of another shape to compile with, so `batch` runs a re-trace."""
    ref_logits, ref_loss, ref_grads = reference_run(make_model, batch)
    got = cp_outputs(make_model, batch, plan, compile_backend=compile_backend, traced_with=traced_with)
    return {
        "logits": rel(got["logits"], ref_logits),
        "loss": abs(got["loss"].item() - ref_loss.item()) / abs(ref_loss.item()),
        "grads": {n: rel(got["grads"][n], g) for n, g in ref_grads.items() if n in got["grads"]},
        "missing_grads": sorted(set(ref_grads) - set(got["grads"])),
        "compiled": got["compiled"],
    }


def assert_equivalent(result: dict, tol: float = 1e-5) -> None:
    assert result["compiled"], "the attention modules were not rewritten"
    assert not result["missing_grads"], f"parameters without gradient: {result['missing_grads']}"
    assert result["logits"] <= tol, f"logits rel err {result['logits']:.3g}"
    assert result["loss"] <= tol, f"loss rel err {result['loss']:.3g}"
    worst = max(result["grads"], key=result["grads"].get)
    assert result["grads"][worst] <= tol, f"gradient of {worst}: rel err {result['grads'][worst]:.3g}"


# ----------------------------------------------------------------------------- other SDPA methods

HEAD_TAIL_WRAPPER = {"_target_": "cpcompile.wrappers.sdpa_hf_load_balance_cp_wrapper"}


def hybrid_wrapper(ulysses_degree: int) -> dict:
    return {"_target_": "cpcompile.wrappers.sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": ulysses_degree}


def qwen3_with_heads(seed: int, q_heads: int, kv_heads: int, layers: int = 1):
    """A tiny Qwen3 with chosen head counts (head_dim 8), for head-divisibility rules."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=8, attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config)


def method_scenarios(seed: int, world: int, wrapper) -> dict:
    """The equivalence runs every SDPA method passes, keyed by scenario name.

    qwen3: GQA (4 query / 2 KV heads), batch 1, no padding: HF calls SDPA without a mask.
    qwen3_padded: batch 2 with left and right padding: HF passes a mask on some ranks only.
    llama_mqa_padded: one KV head (Ulysses and Hybrid must replicate it), padded.
    """
    plan = sdpa_plan(world, wrapper=wrapper)
    length = 4 * world  # a multiple of 2·cp, so Head-Tail chunks have 2 tokens
    return {
        "qwen3": compare_cp_run(lambda: tiny_qwen3(seed), random_batch(seed + 1, 1, length, padded=False), plan),
        "qwen3_padded": compare_cp_run(lambda: tiny_qwen3(seed), random_batch(seed + 2, 2, length, padded=True), plan),
        "llama_mqa_padded": compare_cp_run(lambda: tiny_llama(seed), random_batch(seed + 3, 2, length, padded=True), plan),
    }


# ----------------------------------------------------------------------------- async methods (schedule pass)

ASYNC_METHODS = ("all_gather", "ulysses", "hybrid")


def method_wrapper(method: str, asynchronous: bool, ulysses_degree: int = 2) -> dict:
    """The `inner_wrapper` of an SDPA method, sync or async (Hybrid with `ulysses_degree`)."""
    mode = "_async" if asynchronous else ""
    name = {"all_gather": "", "ulysses": "_ulysses", "hybrid": "_hybrid"}[method]
    wrapper = {"_target_": f"cpcompile.wrappers.sdpa_hf{mode}{name}_cp_wrapper"}
    if method == "hybrid":
        wrapper["ulysses_degree"] = ulysses_degree
    return wrapper


def cp_outputs(make_model, batch: dict, plan: dict, *, compile_backend=None, traced_with: dict | None = None) -> dict:
    """This rank's CP run in global terms: logits gathered, loss and gradients summed over cp.
    The model is compiled with `traced_with` (sharded) when given, else with `batch`."""
    plan = cpcompile.load_plan(plan)
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(batch, mesh, plan)
    example = local if traced_with is None else cpcompile.shard_batch(traced_with, mesh, plan)
    model = cpcompile.compile(make_model(), mesh, plan, example_inputs=example)
    runner = torch.compile(model, backend=compile_backend) if compile_backend else model
    out = runner(**local)
    out.loss.backward()
    cpcompile.all_reduce_gradients(model, mesh)
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss, group=mesh.cp_group)
    return {
        "logits": cpcompile.unshard(out.logits.detach(), mesh, plan, batch=local),
        "loss": loss,
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "compiled": any(hasattr(m, "_cpcompile_config") for m in model.modules()),
    }


def two_forwards_one_backward(model, mesh, locals_: list[dict], reference, want: list[dict]) -> dict:
    """Both local batches' forwards, then one backward of the summed losses (what a checkpointed
    layer's recompute must survive), against `reference`, whose gradients accumulated both
    batches' (`want`: each batch's reference result)."""
    losses = [model(**local).loss for local in locals_]
    (losses[0] + losses[1]).backward()
    cpcompile.all_reduce_gradients(model, mesh)
    loss = torch.stack([x.detach() for x in losses])
    torch.distributed.all_reduce(loss, group=mesh.cp_group)
    return {"logits": 0.0, "loss": rel(loss, torch.stack([w["loss"] for w in want])),
            "grads": {n: rel(p.grad, reference.get_parameter(n).grad) for n, p in model.named_parameters()},
            "missing_grads": [], "compiled": True}


def output_errors(got: dict, want: dict) -> dict:
    """Relative errors of `cp_outputs`-shaped results (logits, loss, worst gradient)."""
    missing = sorted(set(want["grads"]) - set(got["grads"]))
    grads = {n: rel(got["grads"][n], g) for n, g in want["grads"].items() if n in got["grads"]}
    return {"logits": rel(got["logits"], want["logits"]), "loss": rel(got["loss"], want["loss"]),
            "grads": max(grads.values()), "missing_grads": missing}


class RunningSum(torch.nn.Module):
    """An MLP followed by a cumulative sum over the sequence: a mixer no rule knows by name, which
    the audit for sequence mixing must find by behaviour (audit/mixers.py)."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden_states):
        return self.mlp(hidden_states).cumsum(dim=1) / hidden_states.shape[1]


class QKVAttention(torch.nn.Module):
    """A core-attention module in the `sdpa_qkv` style: forward(q, k, v) → causal SDPA."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class QKVHolder(torch.nn.Module):
    """A model whose only module is `core`, a `QKVAttention` unless another is given."""

    def __init__(self, core: torch.nn.Module | None = None):
        super().__init__()
        self.core = core if core is not None else QKVAttention()

    def forward(self, q, k, v):
        return self.core(q, k, v)


def assert_fails_with(name: str, outcome, error: str, words) -> None:
    """`outcome` is (exception class name, message) or None; it must be `error` naming `words`."""
    assert outcome is not None, f"{name}: no error was raised"
    kind, message = outcome
    assert kind == error, f"{name}: {kind}: {message}"
    for word in words:
        assert word in message, f"{name}: {word!r} not in {message!r}"


def outcome_of(fn):
    """Run `fn`; return None, or (exception class name, message) for the parent to assert on."""
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces while active (for the nothing-quadratic checks)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [x.numel() for x in tree_leaves(out) if isinstance(x, torch.Tensor)])
        return out


def scheduled_backward_backend(backward_graphs: list | None = None, forward_graphs: list | None = None):
    """A `torch.compile` backend that runs what Inductor would schedule, without compiling kernels:
    AOT autograd with Inductor's decompositions and min-cut partitioner, cpcompile's backward
    schedule applied to each backward graph (as Inductor's post-grad hook applies it), and the
    graphs run as FX code. The graphs are appended to `forward_graphs` / `backward_graphs`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from cpcompile.passes.backward_schedule import SCHEDULE

    def compiler(kept: list | None, backward: bool):
        def compile_graph(gm, _inputs):
            if backward:
                SCHEDULE(gm.graph)
                gm.recompile()
            if kept is not None:
                kept.append(gm)
            return make_boxed_func(gm.forward)
        return compile_graph

    return aot_autograd(fw_compiler=compiler(forward_graphs, False), bw_compiler=compiler(backward_graphs, True),
                        partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
