"""GDN in Head-Tail order beside SDPA Head-Tail on real devices, in bf16 (issue 49, item 6): run under
torchrun, one process per CP rank (`--device cuda` uses NCCL).

The scenarios of tests/gdn/test_gdn_head_tail.py — Qwen3.5 (GDN layers on triton State-P2P, eager
State-AllGather and triton State-P2P, all in Head-Tail order) and Qwen3-Next (triton State-P2P in
Head-Tail order): padding, packed documents with a start at a fragment edge, nearly parallel keys
without decay; fragments of 160 tokens (2.5 chunks of 64) — and the op itself at Qwen3.5's head
shape (K = V = 128) against the whole sequence. Judged as `cpcompile.parity` judges bf16: against the
unrewritten fp32 model (eager GDN core), CP's error in the loss, the logits, all gradients together
and the worst single parameter (the decay parameters reported beside, as benchmarks/cp_methods.py
does) at most 1.5x the single-device bf16 run's (triton core) + 1e-3. Prints a table, PASS or FAIL;
exits 1 on a failure.

    torchrun --standalone --nproc-per-node 2 tests/gdn/gdn_head_tail_check.py --device cuda
    torchrun --standalone --nproc-per-node 4 tests/gdn/gdn_head_tail_check.py --device cuda
    TRITON_INTERPRET=1 torchrun --standalone --nproc-per-node 2 tests/gdn/gdn_head_tail_check.py --device cpu \
        --small      # the script's own smoke run on CPU (gloo, Triton's interpreter, head dims 16): no verdict
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpcompile  # noqa: E402
from cp_harness import each_document_alone, random_batch  # noqa: E402
from cpcompile.parity import relative_error, within_precision  # noqa: E402
from gdn_harness import DECAY_PARAMS, correlate_keys  # noqa: E402
from model_zoo import build  # noqa: E402

CHUNK = 64
SIZE = dict(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4)
# (model fields, GDN head dim, fragment tokens, the op's head dim and fragment tokens)
SHAPES = {"gpu": (SIZE, 64, 160, 128, 4096),
          "small": (dict(SIZE, hidden_size=32, intermediate_size=64, head_dim=16, linear_key_head_dim=16,
                         linear_value_head_dim=16), 16, 24, 16, 32)}
FRAGMENT = 160  # set by main from SHAPES


def qwen3_5(seed: int, dtype, device, fields: dict):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields, attn_implementation="sdpa")).to(device, dtype)


def qwen3_next(seed: int, dtype, device, head_dim: int):
    return build("qwen3_next", seed, dtype, mlp_only_layers=[0, 1], linear_key_head_dim=head_dim,
                 linear_value_head_dim=head_dim, head_dim=head_dim).to(device)


def with_core(model, backend: str):
    """The unrewritten model with cpcompile's statement of its GDN layers on `backend` (CP=1)."""
    from cpcompile.adapters.qwen3_5 import gdn_layer_forward, is_gdn_layer

    def forward(self, hidden_states, attention_mask=None, **_):
        return gdn_layer_forward(self, hidden_states, attention_mask, chunk_size=CHUNK, backend=backend)

    for module in model.modules():
        if is_gdn_layer(module):
            module.forward = types.MethodType(forward, module)
    return model


def plan(world: int, methods) -> dict:
    def gdn(method, backend):
        return {"_target_": f"cpcompile.adapters.qwen3_5.qwen3_5_gdn_{method}_cp_wrapper", "backend": backend,
                "chunk_size": CHUNK}
    overrides = [{"match": f"model.layers.{i}.linear_attn", "when": "cp", "region_dispatch": False,
                  "inner_target": "self", "inner_wrapper": gdn(*m)} for i, m in enumerate(methods)]
    overrides.append({"match": "*.self_attn", "when": "cp", "region_dispatch": False,
                      "inner_wrapper": {"_target_": "cpcompile.wrappers.sdpa_hf_load_balance_cp_wrapper"}})
    return {"accelerator": {"cp_size": world}, "plan_overrides": overrides}


def packed(seed: int, world: int, device) -> tuple[dict, list]:
    """Documents of odd lengths; one starts at the fragment edge 2c, others cross fragment edges."""
    length, c = 2 * world * FRAGMENT, FRAGMENT
    bounds = sorted({0, c // 4 + 1, 2 * c - 5, 2 * c, 2 * c + 3, 3 * c + c // 3, length - c // 4 - 1, length})
    spans = list(zip(bounds[:-1], bounds[1:]))
    ids = torch.randint(0, 96, (1, length), generator=torch.Generator().manual_seed(seed)).to(device)
    positions = torch.cat([torch.arange(b - a) for a, b in spans])[None].to(device)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}, spans


def reference(make, batch: dict, spans) -> dict:
    model = make()
    if spans is not None:
        return each_document_alone(model, batch, spans)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def cp_run(make, batch: dict, raw_plan: dict, device: str) -> dict:
    plan_ = cpcompile.load_plan(raw_plan)
    mesh = cpcompile.build_mesh(plan_.accelerator, device_type=device)
    local = cpcompile.shard_batch(batch, mesh, plan_)
    model = cpcompile.compile(make(), mesh, plan_, example_inputs=local)
    out = model(**local)
    out.loss.backward()
    cpcompile.all_reduce_gradients(model, mesh)
    loss = out.loss.detach().float()
    dist.all_reduce(loss, group=mesh.cp_group)
    return {"loss": loss, "logits": cpcompile.unshard(out.logits.detach(), mesh, plan_, batch=local),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def errors(got: dict, want: dict) -> dict:
    names = [n for n in want["grads"] if n in got["grads"]]
    each = {n: relative_error(got["grads"][n], want["grads"][n]) for n in names}
    return {"loss": relative_error(got["loss"].reshape(1), want["loss"].reshape(1)),
            "logits": relative_error(got["logits"], want["logits"]),
            "grads": relative_error(torch.cat([got["grads"][n].flatten() for n in names]),
                                    torch.cat([want["grads"][n].flatten() for n in names])),
            "param": max(v for n, v in each.items() if not n.endswith(DECAY_PARAMS)),
            "decay": max((v for n, v in each.items() if n.endswith(DECAY_PARAMS)), default=float("nan")),
            "complete": len(names) == len(want["grads"]),
            "finite": bool(torch.isfinite(got["logits"]).all() and torch.isfinite(got["loss"]))}


def scenario(make, batch: dict, spans, methods, world: int, device: str) -> tuple[dict, dict, bool]:
    truth = reference(lambda: with_core(make(torch.float32), "eager"), batch, spans)
    single = errors(reference(lambda: with_core(make(torch.bfloat16), "triton"), batch, spans), truth)
    cp = errors(cp_run(lambda: make(torch.bfloat16), batch, plan(world, methods), device), truth)
    ok = cp["finite"] and cp["complete"] and all(within_precision(cp[k], single[k])
                                                 for k in ("loss", "logits", "grads", "param"))
    return cp, single, ok


def op_check(world: int, rank: int, device: str, dim: int, c: int) -> tuple[dict, dict, bool]:
    """`gdn_p2p_head_tail_chunk` at K = V = `dim` (bf16), `c`-token fragments, against the fp32 eager
    core on the whole sequence, beside the single-device triton core in bf16: this rank's rows."""
    ops = torch.ops.cpcompile
    T, scale = 2 * world * c, dim ** -0.5
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, 2, dim, generator=gen), dim=-1) for _ in range(2))
    v, d_o = torch.randn(1, T, 4, dim, generator=gen), torch.randn(1, T, 4, dim, generator=gen).to(device)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, 4, generator=gen) + 4.0)
    beta = torch.sigmoid(torch.randn(1, T, 4, generator=gen))
    chunks = [slice(i * c, (i + 1) * c) for i in (rank, 2 * world - 1 - rank)]
    fold = lambda x: torch.cat([x[:, s] for s in chunks])  # noqa: E731  this rank's fragments, folded

    def run(dtype, core, weight) -> dict:
        """q, k and g stay fp32 (as the layer hands them to the core), v and beta in `dtype`."""
        leaves = [x.to(device, dtype if i in (2, 4) else torch.float32).clone().requires_grad_()
                  for i, x in enumerate((q, k, v, g, beta))]
        o = core(*leaves)
        (o.float() * weight).sum().backward()
        return {"logits": o.detach().float(), "grads": {n: x.grad.float() for n, x in zip("qkvgb", leaves)}}

    def whole(backend):
        return lambda *xs: ops.gdn_chunk(*xs, None, scale, CHUNK, backend)

    def fragments(*xs):
        return ops.gdn_p2p_head_tail_chunk(*(fold(x) for x in xs), scale, CHUNK, dist.group.WORLD.group_name,
                                           rank, world)[0]

    def rows(run_: dict, folded: bool) -> dict:
        take = (lambda x: x) if folded else fold
        logits = take(run_["logits"])
        return {"logits": logits, "loss": logits.sum().reshape(1),
                "grads": {n: take(x) for n, x in run_["grads"].items()}}

    truth = rows(run(torch.float32, whole("eager"), d_o), folded=False)
    single = errors(rows(run(torch.bfloat16, whole("triton"), d_o), folded=False), truth)
    got = rows(run(torch.bfloat16, fragments, fold(d_o)), folded=True)
    got["grads"] = {n: fold(x) for n, x in got["grads"].items()}  # the leaves are the whole sequence's
    cp = errors(got, truth)
    ok = cp["finite"] and all(within_precision(cp[k], single[k]) for k in ("logits", "grads", "param"))
    return cp, single, ok


def main() -> int:
    global FRAGMENT
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="head dims 16, short fragments (the CPU smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    fields, head_dim, FRAGMENT, op_dim, op_fragment = SHAPES["small" if args.small else "gpu"]
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world, rank, device, seed = dist.get_world_size(), dist.get_rank(), args.device, args.seed
    length = 2 * world * FRAGMENT
    mixed = (("p2p_head_tail", "triton"), ("all_gather_head_tail", "eager"), ("p2p_head_tail", "triton"))
    relay = (("p2p_head_tail", "triton"),)
    q35 = lambda dtype: qwen3_5(seed, dtype, device, fields)  # noqa: E731
    nxt = lambda dtype: qwen3_next(seed, dtype, device, head_dim)  # noqa: E731
    correlated = lambda make: (lambda dtype: correlate_keys(make(dtype)))  # noqa: E731
    on = lambda batch: {k: v.to(device) for k, v in batch.items()}  # noqa: E731
    try:
        rows = {
            "qwen3_5 padded": scenario(q35, on(random_batch(seed + 1, 2, length, True)), None, mixed, world, device),
            "qwen3_5 packed": scenario(q35, *packed(seed + 2, world, device), mixed, world, device),
            "qwen3_5 correlated keys, no decay": scenario(correlated(q35), on(random_batch(seed + 3, 1, length, False)),
                                                          None, mixed, world, device),
            "qwen3_next padded": scenario(nxt, on(random_batch(seed + 4, 2, length, True)), None, relay, world,
                                          device),
            "qwen3_next packed, correlated keys": scenario(correlated(nxt), *packed(seed + 5, world, device), relay,
                                                           world, device),
            f"op at K = V = {op_dim}": op_check(world, rank, device, op_dim, op_fragment),
        }
        if rank == 0:
            print(f"GDN Head-Tail, {world} ranks on {device}, bf16 vs fp32 (CP error / single-device error):")
            print("| scenario | loss | logits | all grads | worst param | decay params | verdict |")
            print("|---|---|---|---|---|---|---|")
            for name, (cp, single, ok) in rows.items():
                cells = " | ".join(f"{cp[k]:.2e} / {single[k]:.2e}"
                                   for k in ("loss", "logits", "grads", "param", "decay"))
                print(f"| {name} | {cells} | {'PASS' if ok else 'FAIL'} |")
        passed = torch.tensor(float(all(ok for _, _, ok in rows.values())), device=device)
        dist.all_reduce(passed, op=dist.ReduceOp.MIN)
        if rank == 0:
            print("PASS" if passed.item() else "FAIL")
        return 0 if passed.item() else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
