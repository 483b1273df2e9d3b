"""Command-line entry points. ``jobs/*.py`` are thin wrappers over these, and the
``raycompat`` console command dispatches to them (``raycompat quickstart``, ``raycompat train``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from raycompat.config import ConfigError, describe_options, parse_key_values


# -- shared argument groups --------------------------------------------------------------
def add_scenario_args(parser: argparse.ArgumentParser, default: str = "extended-class") -> None:
    from raycompat.data import SCENARIOS

    g = parser.add_argument_group("data (built-in glyph scenario)")
    g.add_argument("--scenario", default=default, help=f"one of {list(SCENARIOS)}")
    g.add_argument("--scenario-file", help="a scenario JSON written by an earlier run (overrides --scenario)")
    g.add_argument("--train-classes", type=int, default=200)
    g.add_argument("--images-per-class", type=int, default=40)
    g.add_argument("--eval-classes", type=int, default=100)
    g.add_argument("--queries-per-class", type=int, default=2)
    g.add_argument("--gallery-per-class", type=int, default=10)
    g.add_argument("--distractor-classes", type=int, default=100)
    g.add_argument("--distractors-per-class", type=int, default=5)
    g.add_argument("--data-seed", type=int, default=0)
    g.add_argument("--resolution", type=int, default=32)


def scenario_from_args(args):
    from raycompat.data import Scenario, scenario_from_options

    if args.scenario_file:
        with open(args.scenario_file) as f:
            return Scenario.from_dict(json.load(f))
    return scenario_from_options(args.scenario, args, seed=args.data_seed)


def add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and optimisation")
    g.add_argument("--backbone", default="resnet10t", help="any timm model name")
    g.add_argument("--pretrained", dest="pretrained_path", help="local weights file for the backbone")
    g.add_argument("--embed-dim", type=int, default=128)
    g.add_argument("--head", default="cosface", choices=["softmax", "cosface", "arcface"])
    g.add_argument("--epochs", type=int, default=10)
    g.add_argument("--batch-size", type=int, default=128, help="global batch size")
    g.add_argument("--lr", type=float, default=0.1)
    g.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    g.add_argument("--seed", type=int, default=0)
    r = parser.add_argument_group("execution")
    r.add_argument("--workers", type=int, default=1, help="DDP workers (Ray Train)")
    r.add_argument("--gpus", type=float, default=0.0,
                   help="GPUs per worker (0: CPU with gloo; >0: NCCL)")
    r.add_argument("--cpus-per-worker", type=float, default=1.0)
    r.add_argument("--max-failures", type=int, default=2, help="worker-failure restarts (FailureConfig)")
    r.add_argument("--storage", default="~/raycompat_runs", help="where runs and checkpoints go")
    r.add_argument("--address", default=None, help="Ray address (default: embedded local Ray)")


def train_config(args, scenario, *, method: str, split: str, run_name: str,
                 method_options: dict | None = None, old_model: str | None = None, **overrides):
    from raycompat.train import TrainConfig

    values = dict(
        method=method, method_options=method_options or {}, backbone=args.backbone,
        pretrained_path=args.pretrained_path, embed_dim=args.embed_dim, head=args.head,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer,
        seed=args.seed, scenario=scenario.to_dict(), split=split, resolution=args.resolution,
        data_seed=args.data_seed, num_workers=args.workers, use_gpu=args.gpus > 0,
        gpus_per_worker=args.gpus if args.gpus > 0 else 1.0, cpus_per_worker=args.cpus_per_worker,
        max_failures=args.max_failures, storage_path=args.storage, run_name=run_name,
        old_model=old_model)
    values.update(overrides)
    return TrainConfig.from_dict(values)


def _methods_help() -> str:
    from raycompat.methods import available_methods

    lines = ["methods and their options (--opt key=value):"]
    for name, cls in available_methods().items():
        lines.append(f"  {name}: {cls.description}")
        lines.append("      " + ", ".join(describe_options(cls.Options)))
    return "\n".join(lines)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


# -- jobs --------------------------------------------------------------------------------
def train_main(argv: list[str] | None = None, *, default_method: str | None = None,
               prog: str = "train.py") -> int:
    """Train a new model with any registered method against an old model."""
    parser = argparse.ArgumentParser(prog=prog, description=train_main.__doc__, epilog=_methods_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default=default_method or "bct")
    parser.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                        help="a method option, repeatable")
    parser.add_argument("--old-model", help="bundle of the old model (from train_old.py)")
    parser.add_argument("--init-model", help="bundle to start from; the frozen new model for mcl/rqt/cl")
    parser.add_argument("--split", default=None, help="training split (default: new_train)")
    parser.add_argument("--out", default=None, help="where to export the model bundle")
    parser.add_argument("--run-name", default=None)
    add_scenario_args(parser)
    add_training_args(parser)
    args = parser.parse_args(argv)
    try:
        options = parse_key_values(args.opt)
    except ConfigError as err:
        return _fail(str(err))
    return _configure_and_train(args, method=args.method, split=args.split or "new_train",
                                method_options=options, old_model=args.old_model,
                                init_model=args.init_model, run_prefix=args.method)


def train_old_main(argv: list[str] | None = None) -> int:
    """Train the old model (independent method) on the scenario's old split."""
    parser = argparse.ArgumentParser(prog="train_old.py", description=train_old_main.__doc__)
    parser.add_argument("--split", default="old_train")
    parser.add_argument("--out", default=None, help="where to export the model bundle")
    parser.add_argument("--run-name", default=None)
    add_scenario_args(parser)
    add_training_args(parser)
    args = parser.parse_args(argv)
    return _configure_and_train(args, method="independent", split=args.split, run_prefix="old")


def _configure_and_train(args, *, run_prefix: str, **config) -> int:
    """Build the scenario and the run's config (a bad value exits 2 with its message, before
    Ray starts), then train and export."""
    try:
        scenario = scenario_from_args(args)
        cfg = train_config(args, scenario, run_name=args.run_name or f"{run_prefix}-{int(time.time())}",
                           **config)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        return _fail(str(err))
    return _run_training(args, cfg, args.out or os.path.join(args.storage, "models", cfg.run_name))


def _run_training(args, cfg, export_to: str) -> int:
    from raycompat.cluster import connect
    from raycompat.data import Scenario
    from raycompat.train import fit

    print(Scenario.from_dict(cfg.scenario).allocation_table())
    connect(args.address)
    started = time.time()
    run = fit(cfg, export_to=export_to)
    last = run.history[-1]
    print(f"[raycompat] {cfg.run_name}: {len(run.history)} epochs, final loss "
          f"{last.get('loss/loss', float('nan')):.4f}, {last['images_per_s']:.0f} images/s, "
          f"{time.time() - started:.0f} s")
    print(f"[raycompat] model bundle: {run.bundle_path}")
    return 0


def quickstart_main(argv: list[str] | None = None) -> int:
    """Main job: train old, BCT and independent new models on the built-in glyphs, evaluate
    them, and write report.md / report.json."""
    from raycompat.quickstart import QuickstartOptions, run_quickstart

    parser = argparse.ArgumentParser(prog="quickstart.py", description=quickstart_main.__doc__)
    QuickstartOptions.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        options = QuickstartOptions.from_args(args)
    except (ConfigError, ValueError) as err:
        return _fail(str(err))
    try:
        run_quickstart(options)
    except ConfigError as err:   # e.g. StorageError: an unusable --storage/--out, found before any work
        return _fail(str(err))
    return 0


def reproduce_main(argv: list[str] | None = None) -> int:
    """Reproduction report: extended-data, open-class, architecture change and sequential
    upgrades with every method; paper-shaped tables and a verdict on each headline claim."""
    from raycompat.reproduce import ReproduceOptions, run_reproduce

    parser = argparse.ArgumentParser(prog="reproduce.py", description=reproduce_main.__doc__)
    ReproduceOptions.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        options = ReproduceOptions.from_args(args)
    except (ConfigError, ValueError) as err:
        return _fail(str(err))
    try:
        run_reproduce(options)
    except ConfigError as err:   # e.g. StorageError: an unusable --storage/--out, found before any work
        return _fail(str(err))
    return 0


COMMANDS = {
    "quickstart": quickstart_main,
    "reproduce": reproduce_main,
    "train": train_main,
    "train-old": train_old_main,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: raycompat {" + ",".join(COMMANDS) + "} [options]")
        for name, fn in COMMANDS.items():
            print(f"  {name:12s} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
