"""Train a new model with any registered method against an old model (Ray Train, DDP).

``raycompat train --method bct --opt variant=sys --old-model models/old --out models/bct``.
The options are :class:`TrainOptions`; ``train-old`` and ``train-ract`` take the same class
with other defaults. Every value is checked, and the run's :class:`TrainConfig` built, before
Ray starts (a bad option exits 2 naming it). See docs/architecture.md, "Jobs".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass

from raycompat import console
from raycompat.config import (
    add_options,
    choices,
    describe_options,
    fraction,
    make_parser,
    nonnegative,
    option,
    options_from_args,
    parse_key_values,
    positive,
)
from raycompat.data.scenarios import ScenarioSizes
from raycompat.data.source import DataSourceOptions

__all__ = [
    "TrainOptions",
    "TRAIN_DEFAULTS",
    "build_parser",
    "main",
    "parse_train_options",
    "load_scenario",
    "train_config",
    "run_training",
]

#: the train job's data: ScenarioSizes' own defaults (extended-class, 200 training classes of
#: 40 images, 100 held-out classes, resnet10t at 32 px)
TRAIN_SIZES = ScenarioSizes()


@dataclass(frozen=True)
class TrainOptions:
    """Options of the training jobs (``train``, ``train-old``, ``train-ract``)."""

    method: str = option("bct", help="training method (the list below)")
    method_options: tuple = option((), flag="--opt", help="a method option KEY=VALUE, repeatable")
    old_model: str | None = option(None, help="bundle of the old model (from train-old)")
    init_model: str | None = option(
        None, help="bundle to start from; the frozen new model for mcl/rqt/cl"
    )
    split: str = option("new_train", help="training split of the scenario")
    out: str | None = option(
        None, help="where to export the model bundle; none: <storage>/models/<run name>"
    )
    run_name: str | None = option(
        None,
        help="run name; none: <method>-<hash of the options that decide the model>, so an "
        "identical configuration resumes its run",
    )
    data: DataSourceOptions = option(
        DataSourceOptions(), help="data: the built-in glyphs or your images"
    )
    sizes: ScenarioSizes = option(
        TRAIN_SIZES,
        help="data: the scenario (your images: only --scenario, --queries-per-class, "
        "--resolution, --backbone and --data-seed apply)",
    )
    pretrained_path: str | None = option(
        None, flag="--pretrained", help="local weights file for the backbone"
    )
    embed_dim: int = positive(128, help="embedding dimension")
    head: str = choices(
        "softmax",
        "cosface",
        "arcface",
        "dsimplex",
        default="cosface",
        help="classifier head (dsimplex: the fixed d-Simplex of K = embed-dim + 1 classes)",
    )
    epochs: int = positive(10, help="training epochs")
    batch_size: int = positive(128, help="global batch size")
    batch_images_per_class: int | None = option(
        None,
        help="class-balanced P x K batches: K images of each of batch-size / K classes; 0: "
        "uniformly random batches; none: the method's own (mcl, cl: 4; the others: 0)",
    )
    batch_old_fraction: float | None = fraction(
        None,
        help="the share of each batch drawn from the old model's classes, the rest from the "
        "others; 0: not balanced; none: the method's own (dsimplex: 0.5; the others: 0)",
    )
    lr: float = positive(0.1, help="peak learning rate")
    optimizer: str = choices("sgd", "adamw", default="sgd", help="optimizer")
    seed: int = nonnegative(0, help="seed of the initialisation and the batch order")
    workers: int = nonnegative(
        1,
        help="DDP workers (Ray Train; 0: "
        "Ray Train's local mode, the loop in this process, one run at a time)",
    )
    gpus: float = nonnegative(0.0, help="GPUs per worker (0: CPU with gloo; >0: NCCL)")
    cpus_per_worker: float = positive(1.0, help="CPUs per worker")
    placement: str = choices(
        "pack",
        "spread",
        "strict-spread",
        default="pack",
        help="where Ray places the workers (Ray Train's placement strategy; strict-spread: "
        "one worker per node)",
    )
    max_failures: int = option(2, help="worker-failure restarts (FailureConfig; -1: unlimited)")
    storage: str = option("~/raycompat_runs", help="where runs and checkpoints go")
    address: str | None = option(None, help="Ray address; none: an embedded local Ray")
    verbose: bool = option(False, help="keep Ray's own INFO lines")
    overwrite: bool = option(False, help="replace an existing bundle at --out")


TRAIN_DEFAULTS = TrainOptions()


def methods_help() -> str:
    """Every registered method with its options, for the epilog of ``--help``."""
    from raycompat.methods import available_methods

    lines = ["methods and their options (--opt key=value):"]
    for name, cls in available_methods().items():
        lines.append(f"  {name}: {cls.description}")
        lines.append("      " + ", ".join(describe_options(cls.Options)))
    return "\n".join(lines)


def options_parser(
    job: str, description: str, base: TrainOptions, exclude: tuple[str, ...] = ()
) -> argparse.ArgumentParser:
    """The flags of :class:`TrainOptions` with ``base``'s defaults (``exclude``: left out)."""
    parser = make_parser(job, description)
    add_options(parser, TrainOptions, base=base, exclude=exclude + ("method_options",))
    if "method_options" not in exclude:  # repeatable: the one flag that appends, not stores
        parser.add_argument(
            "--opt",
            dest="method_options",
            action="append",
            default=argparse.SUPPRESS,
            metavar="KEY=VALUE",
            help="a method option, repeatable (the list below)",
        )
    return parser


def parse_train_options(
    parser: argparse.ArgumentParser, argv: list[str] | None, base: TrainOptions
) -> TrainOptions:
    """The flags in ``argv`` applied to ``base``; a bad value raises ``ConfigError``. Only
    ``--help`` lists the methods and their options (that imports torch)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    has_opt = parser.get_default("method_options") is not None  # --opt's default: SUPPRESS
    if has_opt and {"-h", "--help"} & set(argv):
        parser.epilog = methods_help()
    return options_from_args(TrainOptions, parser.parse_args(argv), base=base)


def load_scenario(opts: TrainOptions):
    """The scenario of ``--scenario FILE``, else the one ``--source`` and the sizes describe."""
    from raycompat.data.user_scenarios import resolve_scenario

    return resolve_scenario(opts.sizes, opts.data)


def train_config(
    opts: TrainOptions,
    scenario,
    *,
    method: str,
    split: str,
    run_name: str | None,
    method_options: dict | None = None,
    old_model: str | None = None,
    init_model: str | None = None,
    check_paths: bool = True,
    name_prefix: str | None = None,
):
    """The :class:`TrainConfig` of one run of a training job (checked on the driver). Without
    ``run_name`` the run is named ``<name_prefix or method>-<tag>`` by a hash of the options
    that decide the model (:func:`raycompat.train.runs.default_run_name`): re-running an
    identical configuration resumes its run."""
    from raycompat.train import TrainConfig
    from raycompat.train.runs import default_run_name

    values = dict(
        method=method,
        method_options=method_options or {},
        backbone=opts.sizes.backbone,
        pretrained_path=opts.pretrained_path,
        embed_dim=opts.embed_dim,
        head=opts.head,
        epochs=opts.epochs,
        batch_size=opts.batch_size,
        batch_images_per_class=opts.batch_images_per_class,
        batch_old_fraction=opts.batch_old_fraction,
        lr=opts.lr,
        optimizer=opts.optimizer,
        seed=opts.seed,
        split=split,
        **opts.sizes.training_data(scenario),
        num_workers=opts.workers,
        use_gpu=opts.gpus > 0,
        gpus_per_worker=opts.gpus if opts.gpus > 0 else 1.0,
        cpus_per_worker=opts.cpus_per_worker,
        placement=opts.placement,
        max_failures=opts.max_failures,
        storage_path=opts.storage,
        run_name=run_name or "unnamed",
        old_model=_absolute(old_model),
        init_model=_absolute(init_model),
    )
    values["pretrained_path"] = _absolute(opts.pretrained_path)
    cfg = TrainConfig.from_dict(values, check_paths=check_paths)
    if run_name:
        return cfg
    return dataclasses.replace(cfg, run_name=default_run_name(name_prefix or method, cfg))


def _absolute(path: str | None) -> str | None:
    """A local path made absolute on the driver (Ray workers run in other folders); URIs and
    ``None`` unchanged."""
    from raycompat.storage import is_uri

    if path is None or is_uri(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def export_path(opts: TrainOptions, run_name: str) -> str:
    """``--out``, else ``<storage>/models/<run name>``."""
    return opts.out or os.path.join(os.path.expanduser(opts.storage), "models", run_name)


def run_training(opts: TrainOptions, cfg, export_to: str) -> str:
    """Connect to Ray, train ``cfg``, export its bundle to ``export_to``; one summary line.
    Returns the bundle path."""
    from raycompat.cluster import connect
    from raycompat.data import Scenario
    from raycompat.train import fit
    from raycompat.train.data import check_training_images
    from raycompat.train.export import check_bundle_target

    check_bundle_target(export_to, cfg.to_dict(), opts.overwrite)  # before Ray starts
    check_training_images(cfg)  # a bad image is one error line, not a worker traceback
    print(Scenario.from_dict(cfg.scenario).allocation_table(), flush=True)
    console.quiet_ray(opts.verbose)
    connect(opts.address)
    started = time.time()
    run = fit(cfg, export_to=export_to, overwrite=opts.overwrite)
    last = run.history[-1]
    console.phase(
        cfg.run_name,
        f"{len(run.history)} epochs, final loss "
        f"{last.get('loss/loss', float('nan')):.4f}, {last['images_per_s']:.0f} images/s; "
        f"bundle {run.bundle_path}",
        time.time() - started,
    )
    return run.bundle_path


def build_parser() -> argparse.ArgumentParser:
    return options_parser("train", __doc__, TRAIN_DEFAULTS)


@console.job_main
def main(argv: list[str] | None = None) -> int:
    opts = parse_train_options(build_parser(), argv, TRAIN_DEFAULTS)
    scenario = load_scenario(opts)
    cfg = train_config(
        opts,
        scenario,
        method=opts.method,
        split=opts.split,
        run_name=opts.run_name,
        method_options=parse_key_values(list(opts.method_options)),
        old_model=opts.old_model,
        init_model=opts.init_model,
    )
    run_training(opts, cfg, export_path(opts, cfg.run_name))
    return 0
