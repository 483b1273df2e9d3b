"""Train RACT against an old model (trained first without --old-model); small, quick defaults.

``raycompat train-ract`` is ``raycompat train --method ract`` with other defaults (lcnet_050,
40 training classes, 3 epochs: a couple of minutes on 2 CPU cores, both models included).
Without ``--old-model`` it first trains the old model (independent, on the scenario's
``old_train`` split, with the same data and model options) to
``<storage>/models/ract-old-<hash of its configuration>``, so the bare command runs end to end
(and a re-run resumes both runs). Every option of ``raycompat train`` is accepted. See
docs/architecture.md, "Jobs".
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from raycompat import console
from raycompat.config import parse_key_values
from raycompat.train.job import (
    TRAIN_DEFAULTS,
    TRAIN_SIZES,
    TrainOptions,
    export_path,
    load_scenario,
    options_parser,
    parse_train_options,
    run_training,
    train_config,
)
from raycompat.train.old_job import old_config, train_old

__all__ = ["RACT_DEFAULTS", "build_parser", "main"]

RACT_DEFAULTS = dataclasses.replace(
    TRAIN_DEFAULTS,
    method="ract",
    epochs=3,
    batch_size=64,
    sizes=dataclasses.replace(
        TRAIN_SIZES,
        backbone="lcnet_050",
        train_classes=40,
        images_per_class=16,
        eval_classes=20,
        gallery_per_class=5,
        distractor_classes=20,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    return options_parser("train-ract", __doc__, RACT_DEFAULTS)


def old_model_path(opts: TrainOptions, run_name: str) -> str:
    """Where the old model trained by this job goes: ``<storage>/models/<run_name>``."""
    return os.path.join(os.path.expanduser(opts.storage), "models", run_name)


@console.job_main
def main(argv: list[str] | None = None) -> int:
    opts = parse_train_options(build_parser(), argv, RACT_DEFAULTS)
    scenario = load_scenario(opts)
    old_opts = dataclasses.replace(opts, split="old_train", run_name=None, out=None)
    old_model = opts.old_model
    if not old_model:
        old_name = old_config(old_opts, scenario, name_prefix="ract-old").run_name
        old_model = old_model_path(opts, old_name)

    def new_config(check_paths: bool):
        return train_config(
            opts,
            scenario,
            method=opts.method,
            split=opts.split,
            run_name=opts.run_name,
            method_options=parse_key_values(list(opts.method_options)),
            old_model=old_model,
            init_model=opts.init_model,
            check_paths=check_paths,
        )

    if not opts.old_model:
        new_config(check_paths=False)  # a bad option fails now, not after the old model
        console.phase("old model", f"no --old-model: training it first -> {old_model}")
        train_old(old_opts, out=old_model, name_prefix="ract-old")
    cfg = new_config(check_paths=True)  # named once its old model exists (its fingerprint)
    run_training(opts, cfg, export_path(opts, cfg.run_name))
    return 0
