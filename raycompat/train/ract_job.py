"""Train RACT against an old model (trained first without --old-model); small, quick defaults.

``raycompat train-ract`` is ``raycompat train --method ract`` with other defaults (lcnet_050,
40 training classes, 3 epochs: a couple of minutes on 2 CPU cores, both models included).
Without ``--old-model`` it first trains the old model (independent, on the scenario's
``old_train`` split, with the same data and model options) to
``<storage>/models/ract-old-<time>``, so the bare command runs end to end. Every option of
``raycompat train`` is accepted. See docs/architecture.md, "Jobs".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

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
from raycompat.train.old_job import train_old

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


def old_model_path(opts: TrainOptions, stamp: int) -> str:
    """Where the old model trained by this job goes: ``<storage>/models/ract-old-<stamp>``."""
    return os.path.join(os.path.expanduser(opts.storage), "models", f"ract-old-{stamp}")


@console.job_main
def main(argv: list[str] | None = None) -> int:
    opts = parse_train_options(build_parser(), argv, RACT_DEFAULTS)
    scenario = load_scenario(opts)
    stamp = int(time.time())
    old_model = opts.old_model or old_model_path(opts, stamp)
    run_name = opts.run_name or f"{opts.method}-{stamp}"

    def new_config(check_paths: bool):
        return train_config(
            opts,
            scenario,
            method=opts.method,
            split=opts.split,
            run_name=run_name,
            method_options=parse_key_values(list(opts.method_options)),
            old_model=old_model,
            init_model=opts.init_model,
            check_paths=check_paths,
        )

    if not opts.old_model:
        new_config(check_paths=False)  # a bad option fails now, not after the old model
        console.phase("old model", f"no --old-model: training it first -> {old_model}")
        old_opts = dataclasses.replace(opts, split="old_train")
        train_old(old_opts, run_name=f"ract-old-{stamp}", out=old_model)
    run_training(opts, new_config(check_paths=True), export_path(opts, run_name))
    return 0
