"""Command line (also installed as `cpcompile`):

    python -m cpcompile inspect DUMP_DIR                          # print a graph dump's summary
    torchrun --nproc-per-node N -m cpcompile train CONFIG.yaml    # train with the config's CP plan
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
    args = parser.parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "inspect":
        try:
            print(inspect(args.dump_dir), end="")
        except FileNotFoundError as exc:
            print(f"cpcompile inspect: {exc}", file=sys.stderr)
            return 2
    return 0


def _train(args) -> int:
    import dataclasses

    import torch.distributed as dist

    from .errors import PlanError
    from .train import load_train_config, train

    try:
        config = load_train_config(args.config)
    except (PlanError, OSError) as exc:
        print(f"cpcompile train: {exc}", file=sys.stderr)
        return 2
    if args.steps is not None:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=args.steps).validate())
    try:
        train(config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
