"""Command line (also installed as `cpcompile`):

    python -m cpcompile inspect DUMP_DIR                          # print a graph dump's summary
    torchrun --nproc-per-node N -m cpcompile train CONFIG.yaml    # train with the config's CP plan
    torchrun --nproc-per-node N -m cpcompile bench CONFIG.yaml    # time its step, with and without CP
"""
from __future__ import annotations

import argparse
import sys

from .dump import inspect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpcompile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("inspect", help="print the summary of a debug dump directory")
    show.add_argument("dump_dir")
    run = commands.add_parser("train", help="train a causal LM built from a config with the plan's CP (under torchrun)")
    run.add_argument("config", help="YAML: model, train, accelerator, plan_overrides (see cpcompile/train.py)")
    run.add_argument("--steps", type=int, default=None, help="override train.steps")
    timing = commands.add_parser("bench", help="time a train config's step with its CP plan and without CP (under torchrun)")
    timing.add_argument("config", help="the same YAML as `train`")
    timing.add_argument("--warmup", type=int, default=3)
    timing.add_argument("--repeat", type=int, default=10)
    timing.add_argument("--full-sequence", action="store_true", help="also time the model without CP on the whole sequence")
    args = parser.parse_args(argv)
    if args.command in ("train", "bench"):
        return _run(args)
    if args.command == "inspect":
        try:
            print(inspect(args.dump_dir), end="")
        except FileNotFoundError as exc:
            print(f"cpcompile inspect: {exc}", file=sys.stderr)
            return 2
    return 0


def _run(args) -> int:
    import dataclasses

    import torch.distributed as dist

    from .errors import PlanError
    from .train import load_train_config, train

    try:
        config = load_train_config(args.config)
        if getattr(args, "steps", None) is not None:
            config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=args.steps).validate())
    except (PlanError, OSError) as exc:
        print(f"cpcompile {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "train":
            train(config)
        else:
            from .bench import bench, table

            rows = bench(config, args.warmup, args.repeat, args.full_sequence)
            if dist.get_rank() == 0:
                print(table(rows, config, args.warmup, args.repeat))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
