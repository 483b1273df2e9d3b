"""Train the old model (independent method) on the scenario's old split (Ray Train, DDP).

``raycompat train-old --scenario extended-class --out models/old``: the options of
``raycompat train`` (:class:`~raycompat.train.job.TrainOptions`) without the new-model ones
(``--method``, ``--opt``, ``--old-model``, ``--init-model``); ``--split`` defaults to
``old_train``. See docs/architecture.md, "Jobs".
"""

from __future__ import annotations

import argparse
import dataclasses

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

__all__ = ["OLD_DEFAULTS", "NEW_MODEL_ONLY", "build_parser", "main", "old_config", "train_old"]

OLD_DEFAULTS = dataclasses.replace(TRAIN_DEFAULTS, method="independent", split="old_train")
#: the options of a new model that the old model does not take
NEW_MODEL_ONLY = ("method", "method_options", "old_model", "init_model")


def old_config(opts: TrainOptions, scenario, name_prefix: str = "old"):
    """The :class:`~raycompat.train.TrainConfig` of the old model of ``opts`` (independent, on
    ``opts.split``), named ``--run-name`` or ``<name_prefix>-<hash of its configuration>``."""
    return train_config(
        opts,
        scenario,
        method="independent",
        split=opts.split,
        run_name=opts.run_name,
        name_prefix=name_prefix,
    )


def train_old(opts: TrainOptions, *, out: str | None = None, name_prefix: str = "old") -> str:
    """Train the old model of ``opts`` (:func:`old_config`); returns its bundle path."""
    cfg = old_config(opts, load_scenario(opts), name_prefix)
    return run_training(opts, cfg, out or export_path(opts, cfg.run_name))


def build_parser() -> argparse.ArgumentParser:
    return options_parser("train-old", __doc__, OLD_DEFAULTS, exclude=NEW_MODEL_ONLY)


@console.job_main
def main(argv: list[str] | None = None) -> int:
    train_old(parse_train_options(build_parser(), argv, OLD_DEFAULTS))
    return 0
