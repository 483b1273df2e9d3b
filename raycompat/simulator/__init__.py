"""The backfill simulator: exact retrieval curves of a gallery while it is backfilled, for
every policy and query mode (docs/simulator.md).  It owns the engine only: reading a run's
rows, ranking every query's positives in blocks that add up (``score_sides`` ->
``thresholds`` -> ``side_pass`` / ``block_pass`` -> ``counting`` -> ``assembly``, planned by
``rank_plan``), one planner of a run (``run_plan``) shared by the in-memory engine
(``memory_engine``), the Ray engine over parquet row groups (``ray_engine``) and the
several-candidates paths (``candidates``, ``ray_candidates``), results and intervals
(``results``), the reference cache, reports and the ``simulate-backfill`` job.  What a backfill
*is* (policies, modes, grid, canary, cost, query logs) lives in :mod:`raycompat.upgrade`; the
embeddings files it reads in :mod:`raycompat.embeddings`.
"""

import importlib

_EXPORTS = {
    "BackfillCurve": "results",
    "SimulationResult": "results",
    "RankedCurves": "results",
    "SimulationSpec": "run_plan",
    "simulate_backfill": "memory_engine",
    "backfill_curve_rows": "memory_engine",
    "DistributedOptions": "ray_engine",
    "simulate_backfill_dataset": "ray_engine",
    "simulate_candidates": "candidates",
    "simulate_candidates_dataset": "ray_candidates",
    "write_reports": "report",
}


def __getattr__(name):
    """Lazy exports: importing the package stays light (no torch) until a name is used."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
