"""Command line (also installed as `cpcompile`):

    python -m cpcompile inspect DUMP_DIR                              # print a graph dump's summary
    python -m cpcompile train --nproc-per-node N CONFIG.yaml          # train: FSDP2 x CP, the config's plan
    python -m cpcompile compare A.yaml B.yaml --steps N               # two configs' runs, step by step
    python -m cpcompile bench --nproc-per-node N CONFIG.yaml          # time its step, with and without CP
    python -m cpcompile export CHECKPOINT_DIR OUT_DIR                 # a checkpoint as a Hugging Face folder
    python -m cpcompile plan MODEL_OR_CONFIG --cp N --seq-len S       # suggest an explicit plan, with reasons
    python -m cpcompile config-reference                              # every train config key, its default

`--nproc-per-node N` starts the N workers itself (launch.py, with torchrun's own launcher) after
checking the config; `torchrun --nproc-per-node N -m cpcompile train CONFIG.yaml` runs the same
workers under torchrun.

An error cpcompile raises for the user (a `CPCompileError`: a config field, a plan that does not
fit the job, a verify run that missed its tolerance, a checkpoint that could not be saved, a
collective that timed out) or a file it cannot read is one line on stderr from rank 0 —
`cpcompile train: error: <field>: <reason>`, or `FAIL: ...` for verify — and exit status 2 (1 for
FAIL); the other ranks stay quiet. A failed collective is said by the first rank whose collective
failed (a stuck rank 0 says nothing). `--debug` raises it with its traceback instead. With
`--nproc-per-node` the workers hand their line to the launcher, which prints the one of the
failure that ended the job and exits with that worker's status (launch.py); under torchrun,
torchrun adds its own report and exits 1. Ctrl-C is one line too (exit status 130).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from .dump import inspect
from .errors import CPCompileError, CPInputError, VerificationError
from .worker_lifetime import end_with_launcher

# What is reported in one line; anything else is a bug, and keeps its traceback.
REPORTED = (CPCompileError, OSError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    no_traceback_for_unraisable_interrupts()
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "memory_gib", None) is not None and not args.dry_run:
        parser.error("--memory-gib goes with --dry-run (it sizes the estimate's longest train.seq_len)")
    try:
        if getattr(args, "nproc_per_node", None) is not None:
            return _launch(args, argv)
        if args.command == "config-reference":
            from .trainer.config_reference import render_reference

            print(render_reference(), end="")
            return 0
        end_with_launcher()  # a worker whose launcher is killed outright must not train on
        if args.command == "inspect":
            print(inspect(args.dump_dir), end="")
            return 0
        if args.command == "export":
            return _export(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "compare":
            from .trainer.compare import compare_configs

            return 0 if compare_configs(args.config_a, args.config_b, args.steps, args.rtol, args.out).passed else 1
        return _run(args)
    except REPORTED as exc:
        if args.debug:
            raise
        return report(args.command, exc)
    except KeyboardInterrupt:
        if args.debug:
            raise
        return interrupted(args.command)


def no_traceback_for_unraisable_interrupts() -> None:
    """A SIGINT that lands while Python runs a weakref callback or a `__del__` cannot be raised
    there: Python prints "Exception ignored in ... KeyboardInterrupt" with a traceback, in the
    launcher or in a worker torchrun forwarded the signal to, beside the one line the interrupt
    is reported by. Those prints are dropped; any other unraisable error is printed as before."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)

    sys.unraisablehook = hook


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="raise errors with their traceback, on every rank")
    parser = argparse.ArgumentParser(prog="cpcompile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("inspect", parents=[common], help="print the summary of a debug dump directory")
    show.add_argument("dump_dir")
    run = commands.add_parser("train", parents=[common],
                              help="train a causal LM built from a config with the plan's CP (under torchrun)")
    run.add_argument("config", help="YAML: model, train, optimizer, data, checkpoint, accelerator, plan_overrides "
                                    "(docs/trainer.md)")
    run.add_argument("--steps", type=int, default=None, help="override train.steps")
    run.add_argument("--stop-after", type=int, default=None,
                     help="stop after this step, the LR schedule unchanged (as a preempted job would)")
    run.add_argument("--metrics", default=None, help="override train.metrics_file (JSONL, one line per step)")
    run.add_argument("--dry-run", action="store_true",
                     help="print the mesh, the plan's coverage and a memory estimate, then exit")
    run.add_argument("--memory-gib", type=float, default=None,
                     help="with --dry-run: also print the longest train.seq_len whose estimate fits this many GiB "
                          "a rank (default on CUDA: the device's memory)")
    run.add_argument("--nproc-per-node", type=int, default=None,
                     help="start this many workers here (the config's mesh size), instead of running under torchrun")
    pair = commands.add_parser("compare", parents=[common],
                               help="run two train configs (each under torchrun) and judge loss/grad-norm parity")
    pair.add_argument("config_a")
    pair.add_argument("config_b")
    pair.add_argument("--steps", type=int, required=True)
    pair.add_argument("--rtol", type=float, default=1e-6,
                      help="largest relative difference of any step's loss or grad-norm (default 1e-6)")
    pair.add_argument("--out", default="compare_out", help="folder for the JSONL files, the table and the plot")
    timing = commands.add_parser("bench", parents=[common],
                                 help="time a train config's step with its CP plan and without CP (under torchrun)")
    timing.add_argument("config", help="the same YAML as `train`")
    timing.add_argument("--warmup", type=int, default=3)
    timing.add_argument("--repeat", type=int, default=10)
    timing.add_argument("--full-sequence", action="store_true",
                        help="also time the model without CP on the whole sequence")
    timing.add_argument("--nproc-per-node", type=int, default=None,
                        help="start this many workers here (the config's mesh size), instead of running under torchrun")
    commands.add_parser("config-reference", parents=[common],
                        help="print every key of the train config's sections with its default, type and meaning")
    out = commands.add_parser("export", parents=[common],
                              help="write a train checkpoint as a Hugging Face folder (from_pretrained reads it)")
    out.add_argument("checkpoint", help="a checkpoint step folder (<checkpoint.folder>/step-<n>), or a "
                                        "checkpoint.folder (its latest complete step)")
    out.add_argument("out_dir", help="the folder to write (new, or empty)")
    out.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default=None,
                     help="the weights' dtype (default: as trained)")
    out.add_argument("--max-shard-mb", type=float, default=5000,
                     help="largest safetensors file, in MB (1e6 bytes; default 5000, transformers' 5GB); larger "
                          "weights are sharded, with an index")
    suggest = commands.add_parser("plan", parents=[common],
                                  help="suggest an explicit CP plan for a model, each choice with its reason")
    suggest.add_argument("model", help="a local Hugging Face folder or its config.json, or a train YAML (its "
                                       "model:, accelerator.cp_size and train.seq_len)")
    suggest.add_argument("--cp", type=int, default=None, help="CP ranks (default: the YAML's accelerator.cp_size)")
    suggest.add_argument("--seq-len", type=int, default=None,
                         help="tokens a sequence, global (default: the YAML's train.seq_len)")
    suggest.add_argument("--gdn-backend", choices=("eager", "triton"), default="triton",
                         help="GDN layers' kernels (default triton: a GPU's; eager runs on the CPU)")
    suggest.add_argument("--out", default=None, help="write the plan to this file (default: print it)")
    return parser


def _plan(args) -> int:
    from .suggest import suggest_plan
    from .suggest.source import meta_model, read_source

    section, defaults = read_source(args.model)
    cp, seq_len = args.cp or defaults.get("cp"), args.seq_len or defaults.get("seq_len")
    if cp is None or seq_len is None:
        raise CPInputError("cpcompile plan: give --cp and --seq-len (a train YAML may give them instead)")
    suggestion = suggest_plan(meta_model(section), cp, seq_len, gdn_backend=args.gdn_backend, source=args.model)
    if args.out is None:
        print(suggestion.text, end="")
        return 0
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(suggestion.text)
    print(f"cpcompile plan: wrote {args.out}" + (f"; {len(suggestion.uncovered)} module(s) no method runs, named "
                                                  "in it" if suggestion.uncovered else ""))
    return 0


def _export(args) -> int:
    from .errors import CPConfigError
    from .trainer.export import export

    if not args.max_shard_mb > 0:
        raise CPConfigError(f"--max-shard-mb must be positive, got {args.max_shard_mb}")
    step = export(args.checkpoint, args.out_dir, args.dtype, int(args.max_shard_mb * 1e6))
    print(f"exported {step} to {args.out_dir}")
    return 0


def report(command: str, exc: BaseException) -> int:
    """One line on stderr, the exit status. From rank 0 (torchrun's RANK; 0 without torchrun),
    except a failed collective, which the first rank to conclude prints (`CollectiveError.reports`:
    a stuck rank 0 prints nothing); under cpcompile's own launcher, into the worker's error file
    instead, and the launcher prints the line of the failure that ended the job (launch.py)."""
    from .launch import write_worker_report

    text = " ".join(str(exc).split()) or type(exc).__name__
    line = f"FAIL: {text}" if isinstance(exc, VerificationError) else f"cpcompile {command}: error: {text}"
    status = 1 if isinstance(exc, VerificationError) else 2
    reports = getattr(exc, "reports", None)  # a CollectiveError's: whether this rank is the one to print it
    if write_worker_report(line, status, consequence=reports is not None):
        return status
    if reports if reports is not None else int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)
    return status


def interrupted(command: str) -> int:
    """Ctrl-C (SIGINT): one line, from rank 0, exit status 130, no traceback. A worker of
    cpcompile's launcher hands its line to the launcher (which prints its own when the SIGINT
    was the launcher's, forwarded) and ends at once, quietly: the interpreter's teardown would
    print PyTorch's warning about the collective the worker was in (its `finally` blocks, the
    checkpoint folder's lock among them, have run by now)."""
    from .launch import write_worker_report

    status = 128 + int(signal.SIGINT)
    line = f"cpcompile {command}: error: rank {os.environ.get('RANK', '0')} was interrupted by SIGINT"
    if write_worker_report(line, status, consequence=False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"cpcompile {command}: interrupted by SIGINT", file=sys.stderr, flush=True)
    return status


def _config(args):
    """The train config of `train` / `bench`, with the command line's overrides."""
    import dataclasses

    from .trainer import load_train_config

    config = load_train_config(args.config)
    if getattr(args, "steps", None) is not None:
        config = config.with_steps(args.steps)
    if getattr(args, "metrics", None) is not None:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, metrics_file=args.metrics))
    return config


def _launch(args, argv: list[str]) -> int:
    """`--nproc-per-node`: check the config and what a run checks before building, here, then
    start the workers (launch.py); -> their exit status."""
    from .launch import check_launch, run_workers, worker_argv
    from .trainer.lock import check_free
    from .trainer.startup import check_before_building

    config = _config(args)
    check_launch(args.nproc_per_node, config.plan.accelerator.world_size)
    if args.command == "train":
        check_before_building(config)
        if config.checkpoint.folder is not None:
            check_free(config.checkpoint.folder)  # another job there: said before any worker starts
    after_stop = (lambda: _where_to_resume(config.checkpoint.folder)) if args.command == "train" else None
    return run_workers(args.nproc_per_node, worker_argv(argv), quiet=not args.debug, after_stop=after_stop)


def _where_to_resume(folder: str | None) -> str:
    """What a stopped run leaves: the checkpoint a resume starts from, if any."""
    from .trainer.checkpoint import latest_step, step_folder

    latest = latest_step(folder)
    if latest is None:
        return "no checkpoint to resume from" if folder else "nothing was saved (no checkpoint.folder)"
    return f"a resume starts from {step_folder(folder, latest)}"


def _run(args) -> int:
    import torch.distributed as dist

    from .mesh import release_process_group
    from .trainer import dry_run, train

    config = _config(args)
    try:
        if args.command == "train" and args.dry_run:
            dry_run(config, memory_gib=args.memory_gib)
        elif args.command == "train":
            train(config, stop_after=args.stop_after)
        else:
            from .bench import bench, table

            rows = bench(config, args.warmup, args.repeat, args.full_sequence)
            if dist.get_rank() == 0:
                print(table(rows, config, args.warmup, args.repeat))
        release_process_group()  # every rank past its last collective before the group goes
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
