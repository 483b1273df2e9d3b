"""The ``raycompat`` console command: ``raycompat <job> [options]`` runs one job's ``main``.

Every job is a module with a docstring whose first line (or first paragraph) says what it does,
``build_parser()`` and ``main(argv)`` (see docs/architecture.md, "Jobs"); ``jobs/*.py`` are
thin wrappers over the same ``main``. Modules are imported only when needed, so
``raycompat --help`` is quick and lists a job even while its module cannot be imported.
"""

from __future__ import annotations

import importlib
import sys

from raycompat.console import fail

#: job name -> the module that runs it
JOBS: dict[str, str] = {
    "quickstart": "raycompat.quickstart",
    "reproduce": "raycompat.reproduce.job",
    "scenario": "raycompat.scenario_job",
    "train": "raycompat.train.job",
    "train-old": "raycompat.train.old_job",
    "train-ract": "raycompat.train.ract_job",
    "import-model": "raycompat.import_model",
    "embed-gallery": "raycompat.pipeline.job",
    "simulate-backfill": "raycompat.simulator.job",
    "plan-upgrade": "raycompat.planning.job",
    "hot-refresh": "raycompat.hot_refresh",
    "serve-index": "raycompat.serving.job",
    "backfill-store": "raycompat.backfill_store",
}


def summary(module_path: str) -> str:
    """The first line of a job module's docstring, continued up to its first blank line
    ("" when the module cannot be imported)."""
    try:
        module = importlib.import_module(module_path)
    except Exception:  # a job that cannot be imported here is still listed, without its line
        return ""
    paragraph = (module.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def usage() -> str:
    """``raycompat --help``: every job with its one-line description."""
    lines = [
        "usage: raycompat <job> [options]   (raycompat <job> --help: the job's options)",
        "",
        "jobs:",
    ]
    lines += [f"  {name:18s} {summary(path)}".rstrip() for name, path in JOBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in JOBS:
        print(usage(), file=sys.stderr)
        return fail(f"unknown job {argv[0]!r}" if argv else "no job given")
    module = importlib.import_module(JOBS[argv[0]])
    sys.argv[0] = "raycompat"  # so the job's usage line reads "raycompat <job>"
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
