"""Reproduction report: every method on the papers' upgrade scenarios, a verdict per claim.

Extended-data, open-class, architecture change and sequential upgrades with every method;
paper-shaped tables and a verdict on each headline claim.
``raycompat reproduce --scale default|premise|cluster``: ``--scale`` picks a size preset
(:data:`raycompat.reproduce.plan.SCALES`); every size flag given overrides the preset. See
docs/methods.md, "Headline claims", and docs/architecture.md, "Jobs".
"""

from __future__ import annotations

import argparse

from raycompat import console
from raycompat.config import add_options, make_parser, options_from_args
from raycompat.reproduce.plan import ReproduceOptions

__all__ = ["build_parser", "main", "parse_reproduce_options"]

#: options that are not flags: ``scenario`` (the job picks its own, ``--scenarios``) and the
#: backfill-curve policies of the report
NOT_FLAGS = ("scenario", "backfill_policies")


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("reproduce", __doc__)
    add_options(parser, ReproduceOptions, exclude=NOT_FLAGS)
    return parser


def parse_reproduce_options(argv: list[str] | None = None) -> ReproduceOptions:
    """The flags in ``argv`` over their ``--scale`` preset, checked (``ConfigError`` otherwise)."""
    args = build_parser().parse_args(argv)
    base = ReproduceOptions.at_scale(getattr(args, "scale", "default"))
    return options_from_args(ReproduceOptions, args, base=base).validated()


@console.job_main
def main(argv: list[str] | None = None) -> int:
    from raycompat.reproduce import run_reproduce

    run_reproduce(parse_reproduce_options(argv))
    return 0
