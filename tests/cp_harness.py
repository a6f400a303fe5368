"""Equivalence harness: run a model at CP=1 and under cpcompile at CP>1, compare everything.

A scenario builds the same model twice from one seed, feeds the reference the global batch
and the CP copy this rank's local batch, and reports relative errors of logits (gathered
back to global order), loss (summed over the CP group) and every parameter gradient (summed
over the CP group), so the test can assert on them.
"""
from __future__ import annotations

import torch

import cpcompile

VOCAB = 96


def tiny_qwen3(seed: int, layers: int = 2, dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa",
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


def reference_run(make_model, batch: dict):
    model = make_model()
    out = model(**batch, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def compare_cp_run(make_model, batch: dict, plan: dict, *, compile_backend=None, dump_dir=None) -> dict:
    """Run CP on this rank and return relative errors against the CP=1 reference."""
    ref_logits, ref_loss, ref_grads = reference_run(make_model, batch)
    plan = cpcompile.load_plan(plan)
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    local = cpcompile.shard_batch(batch, mesh, plan)
    model = cpcompile.compile(make_model(), mesh, plan, dump_dir=dump_dir, example_inputs=local)
    runner = torch.compile(model, backend=compile_backend) if compile_backend else model
    out = runner(**local)
    out.loss.backward()
    cpcompile.all_reduce_gradients(model, mesh)
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss, group=mesh.cp_group)
    logits = cpcompile.unshard(out.logits.detach(), mesh, plan)
    grads = {n: p.grad for n, p in model.named_parameters()}
    missing = sorted(set(ref_grads) - {n for n, g in grads.items() if g is not None})
    return {
        "logits": rel(logits, ref_logits),
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grads": {n: rel(grads[n], ref_grads[n]) for n in ref_grads if grads.get(n) is not None},
        "missing_grads": missing,
        "compiled": hasattr(model.model.layers[0].self_attn, "_cpcompile_config"),
    }


def assert_equivalent(result: dict, tol: float = 1e-5) -> None:
    assert result["compiled"], "the attention modules were not rewritten"
    assert not result["missing_grads"], f"parameters without gradient: {result['missing_grads']}"
    assert result["logits"] <= tol, f"logits rel err {result['logits']:.3g}"
    assert result["loss"] <= tol, f"loss rel err {result['loss']:.3g}"
    worst = max(result["grads"], key=result["grads"].get)
    assert result["grads"][worst] <= tol, f"gradient of {worst}: rel err {result['grads'][worst]:.3g}"
