"""How Dynamo captures a compiled CP=2 step's decoder layers, in one CPU process (issue 48 item 2).

Rank `--rank` of PyTorch's fake process group of 2 (every collective returns at once, its values
garbage): a tiny Qwen3.5 of `--layers` layers (every 4th an attention layer), GDN State-P2P and SDPA
AllGather, each layer checkpointed and compiled as the trainer does (`compile_layers`, `--backend`),
run for an unpadded, a padded and a packed batch, three calls each: the first eager (the regions
trace their graphs), the second compiled, the third compiled again. Printed: each call's wall time
and the Dynamo graphs it made; then the graph breaks, the recompile reasons, and per graph which
local attention kernel and GDN core it calls. Wall times are this machine's, cold caches included.

    python benchmarks/compiled_layer_graphs.py --backend inductor --layers 8 2>/dev/null
"""
from __future__ import annotations

import argparse
import logging
import re
import time

import torch

TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4,
            linear_num_value_heads=8, linear_conv_kernel_dim=4)
GDN = {"_target_": "cpcompile.adapters.qwen3_5.qwen3_5_gdn_p2p_cp_wrapper", "chunk_size": 8}
PLAN = {"accelerator": {"cp_size": 2}, "plan_overrides": [
    {"match": "*.linear_attn", "when": "cp", "region_dispatch": False, "inner_target": "self", "inner_wrapper": GDN},
    {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_wrapper": "sdpa_hf"}]}
OPS = ("chunk_attention", "tiled_attention", "flex_attention", "gdn_chunk", "gdn_p2p_chunk")


def global_batches(length: int) -> dict:
    ids = torch.randint(0, TEXT["vocab_size"], (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, : length // 3] = 0
    packed = torch.cat([torch.arange(10), torch.arange(length - 10)])[None].expand(2, -1).clone()
    return {"unpadded": {"input_ids": ids, "labels": ids},
            "padded": {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask},
            "packed": {"input_ids": ids, "labels": ids, "position_ids": packed}}


def first_guard_failure(message: str) -> str:
    """The first failed guard of a recompile log message, object ids and entry numbers left out."""
    lines = [line.strip() for line in message.splitlines() if re.match(r"\s*- \d+/\d+:", line)]
    return re.sub(r"\d{6,}", "N", re.sub(r"^- \d+/\d+: ", "", lines[0]))[:160] if lines else message[:160]


def ops_called(gm: torch.fx.GraphModule) -> dict[str, int]:
    code = "\n".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
    return {op: n for op in OPS if (n := len(re.findall(rf"\b{op}\.default\(", code)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--length", type=int, default=32, help="global tokens a row")
    args = parser.parse_args()

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    import cpcompile
    from cpcompile.trainer.parallelize import apply_activation_checkpointing, compile_layers

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=2)
    recompiles = []
    handler = logging.Handler()
    handler.emit = lambda record: recompiles.append(first_guard_failure(record.getMessage()))
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(handler)
    plan = cpcompile.load_plan(PLAN)
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    batches = {name: cpcompile.shard_batch(b, mesh, plan) for name, b in global_batches(args.length).items()}
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT, num_hidden_layers=args.layers, attn_implementation="sdpa"))
    model = cpcompile.compile(model, mesh, plan, example_inputs=batches["unpadded"])
    apply_activation_checkpointing(model)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(args.backend)(gm, example_inputs)

    compile_layers(model, recording)
    for name, local in batches.items():
        for call in ("eager", "compiled", "again"):
            made, start = len(graphs), time.perf_counter()
            model(**local).loss.backward()
            print(f"{name:9s} {call:8s} {time.perf_counter() - start:7.1f} s  new graphs {len(graphs) - made}")
    counters = torch._dynamo.utils.counters
    print(f"graphs {len(graphs)}, graph breaks {dict(counters['graph_break'])}, recompiles {len(recompiles)}")
    for reason in sorted(set(recompiles)):
        print(f"  {recompiles.count(reason)} x first failed guard: {reason}")
    for i, gm in enumerate(graphs):
        print(f"graph {i}: {ops_called(gm)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
