"""Build an upgrade scenario of your own labelled images and write it as scenario.json.

``raycompat scenario --source image_folder --path photos/ --allocation extended-class --out
scenario.json`` splits the classes and images by a standard allocation, seeded;
``--manifest items.csv`` (columns item, class, split) or ``--layout root/`` (a
``root/<split>/<class>/<image>`` folder) gives the splits explicitly. The file lists every
item's key, split and class name; every other job takes ``--scenario scenario.json``, so
splits and classes are the same everywhere (docs/methods.md, "Upgrade scenarios").
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from raycompat import console
from raycompat.config import (
    ConfigError,
    add_options,
    choices,
    make_parser,
    nonnegative,
    option,
    options_from_args,
    positive,
)
from raycompat.data.scenarios import SCENARIOS
from raycompat.data.source import DataSourceOptions

__all__ = ["ScenarioJobOptions", "build_parser", "build", "main"]


@dataclass(frozen=True)
class ScenarioJobOptions:
    """Every flag of the scenario job."""

    data: DataSourceOptions = option(DataSourceOptions(), help="where your images are")
    allocation: str = choices(
        *SCENARIOS, default="extended-class", help="the standard allocation of classes/images"
    )
    data_seed: int = nonnegative(0, help="seed of the allocation")
    queries_per_class: int = positive(2, help="queries per held-out class (the rest: gallery)")
    manifest: str | None = option(
        None, help="explicit splits: a CSV or parquet with columns item, class, split"
    )
    layout: str | None = option(None, help="explicit splits: a folder root/<split>/<class>/<image>")
    out: str = option("scenario.json", help="the scenario file to write")
    overwrite: bool = option(False, help="replace an existing --out")


def build(opts: ScenarioJobOptions):
    """The scenario the options describe (``ConfigError`` for a bad input)."""
    from raycompat.data import user_scenarios as us
    from raycompat.data.source import list_items

    if opts.layout:
        if opts.manifest or opts.data.user:
            raise ConfigError("--layout gives the images and the splits: no --manifest or --source")
        return us.from_layout(opts.layout)
    if not opts.data.user:
        raise ConfigError(
            "give your images: --source image_folder|parquet|gldv2 --path ..., or --layout ROOT"
        )
    items = list_items(opts.data.spec())
    if opts.manifest:
        return us.from_manifest(items, opts.manifest)
    return us.allocate(
        items,
        opts.allocation,
        seed=opts.data_seed,
        eval_fraction=opts.data.eval_fraction,
        distractor_fraction=opts.data.distractor_fraction,
        queries_per_class=opts.queries_per_class,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("scenario", __doc__)
    add_options(parser, ScenarioJobOptions)
    return parser


@console.job_main
def main(argv: list[str] | None = None) -> int:
    from raycompat.data.user_scenarios import write_scenario_file

    opts = options_from_args(ScenarioJobOptions, build_parser().parse_args(argv))
    if os.path.exists(opts.out) and not opts.overwrite:
        raise ConfigError(f"{opts.out} exists: pass --overwrite to replace it, or another --out")
    if os.path.isdir(opts.out):
        raise ConfigError(f"--out {opts.out} is a folder; give a file name such as scenario.json")
    scenario = build(opts)
    print(scenario.allocation_table())
    write_scenario_file(scenario, opts.out)
    console.phase(
        "scenario",
        f"{scenario.name}: "
        f"{len({k for s in scenario.splits.values() for k in s.items or ()})} items of "
        f"{len(scenario.class_names)} classes of {scenario.source['kind']} "
        f"{scenario.source['path']} -> {opts.out}",
    )
    return 0
