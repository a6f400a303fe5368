"""Context parallelism for your own model: torchrun --nproc-per-node 2 examples/your_own_model.py"""
import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import cpcompile

plan = cpcompile.load_plan({"accelerator": {"cp_size": 2}, "plan_overrides": [
    {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
     "inner_wrapper": "sdpa_hf"}]})  # AllGather for every attention module; YAML works too
mesh = cpcompile.build_mesh(plan.accelerator)  # one process per rank: gloo on CPU, nccl on CUDA

torch.manual_seed(0)  # the same weights on every rank; or AutoModelForCausalLM.from_pretrained(path)
config = AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)
single = copy.deepcopy(model)  # to check against: one process, the whole sequence

tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
batch = {"input_ids": tokens, "labels": tokens}  # the global batch, the same on every rank
local = cpcompile.shard_batch(batch, mesh, plan)  # this rank's slice, global positions, shifted labels
model = cpcompile.compile(model, mesh, plan, example_inputs=local, dump_dir="cp_dump")  # cp_dump/rank<r>

model(**local).loss.backward()  # this rank's share of the global mean loss
cpcompile.all_reduce_gradients(model, mesh)  # sum over the cp group (or FSDP2 over mesh.dp_cp)

single(**batch).loss.backward()
worst = max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(), single.parameters()))
if mesh.cp_rank == 0:
    print(f"CP=2 against one process: largest relative gradient difference {worst:.1e}")
cpcompile.release_process_group()
