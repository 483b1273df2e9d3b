"""Train the old model (independent method) on the scenario's old split (Ray Train, DDP).

``raycompat train-old --scenario extended-class --out models/old``: the options of
``raycompat train`` (:class:`~raycompat.train.job.TrainOptions`) without the new-model ones
(``--method``, ``--opt``, ``--old-model``, ``--init-model``); ``--split`` defaults to
``old_train``. See docs/architecture.md, "Jobs".
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from raycompat import console
from raycompat.train.job import (
    TRAIN_DEFAULTS,
    TrainOptions,
    export_path,
    load_scenario,
    options_parser,
    parse_train_options,
    run_training,
    train_config,
)

__all__ = ["OLD_DEFAULTS", "NEW_MODEL_ONLY", "build_parser", "main", "train_old"]

OLD_DEFAULTS = dataclasses.replace(TRAIN_DEFAULTS, method="independent", split="old_train")
#: the options of a new model that the old model does not take
NEW_MODEL_ONLY = ("method", "method_options", "old_model", "init_model")


def train_old(opts: TrainOptions, *, run_name: str | None = None, out: str | None = None) -> str:
    """Train the old model of ``opts`` (independent, on ``opts.split``); returns its bundle path."""
    scenario = load_scenario(opts)
    name = run_name or opts.run_name or f"old-{int(time.time())}"
    cfg = train_config(opts, scenario, method="independent", split=opts.split, run_name=name)
    return run_training(opts, cfg, out or export_path(opts, cfg.run_name))


def build_parser() -> argparse.ArgumentParser:
    return options_parser("train-old", __doc__, OLD_DEFAULTS, exclude=NEW_MODEL_ONLY)


@console.job_main
def main(argv: list[str] | None = None) -> int:
    train_old(parse_train_options(build_parser(), argv, OLD_DEFAULTS))
    return 0
