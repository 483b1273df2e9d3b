"""Backfill simulator: policies x query modes -> exact retrieval curves during a hot refresh.

Modules (one concept each):

* :mod:`~raycompat.backfill.gallery`   -- :class:`GalleryEmbeddings`, parquet loading, input errors
* :mod:`~raycompat.backfill.grid`      -- backfill fractions, the rounding rule, segments
* :mod:`~raycompat.backfill.policies`  -- backfill orders, one module per policy behind one registry
  (random, sequential, uncertainty, hinge-benefit, learned, cost-aware, demand,
  upgrade-on-read); :func:`policy_order` is the one dispatch, shared by the simulator and the
  live backfill controller
* :mod:`~raycompat.backfill.query_log` -- a query log read and matched with a gallery: its
  queries' top-k, the items' popularity, the searches in time order (demand, upgrade-on-read,
  frequency-weighted metrics)
* :mod:`~raycompat.backfill.modes`     -- query modes (one registered ModeSpec each) as score sides
  (compatible, adapted, rank_merge, ...)
* :mod:`~raycompat.backfill.blocks`    -- blockwise float32 scoring with torch (CPU/GPU),
  exact top-k
* the exact-ranks engine, one scoring pass per side in blocks that add up, one module per step:
  :mod:`~raycompat.backfill.score_sides` (score sides), :mod:`~raycompat.backfill.rank_metrics`
  (positive pairs, metrics from ranks), :mod:`~raycompat.backfill.thresholds` (the positives'
  thresholds), :mod:`~raycompat.backfill.rank_plan` (``plan_ranks``),
  :mod:`~raycompat.backfill.side_pass` and :mod:`~raycompat.backfill.block_pass` (the block
  pass), :mod:`~raycompat.backfill.counting` (counts to ranks),
  :mod:`~raycompat.backfill.assembly` (blocks added up; ``compute_ranks``)
* :mod:`~raycompat.backfill.dataset`   -- :class:`ParquetGallery`: a parquet dataset streamed
  by row group
* :mod:`~raycompat.backfill.distributed` -- :func:`simulate_backfill_dataset`: the engine as Ray
  tasks over row groups (docs/architecture.md, "Distributed backfill simulation")
* :mod:`~raycompat.backfill.cost`      -- wall-clock cost model
* :mod:`~raycompat.backfill.simulator` -- orchestration: curves, AUCs, regression, references
* :mod:`~raycompat.backfill.plots`, :mod:`~raycompat.backfill.report` -- PNG / JSON / markdown
* :mod:`~raycompat.backfill.job`       -- ``jobs/simulate_backfill.py`` (parquet + model
  bundles -> reports)

Main entry points: :func:`simulate_backfill` (in-memory :class:`GalleryEmbeddings` ->
:class:`SimulationResult`), :func:`backfill_curve_rows` (the same as flat rows for a
report), :func:`raycompat.backfill.report.write_reports` (JSON / markdown / PNG).
"""

import importlib

_EXPORTS = {
    "CostModel": "cost",
    "measure_items_per_s": "cost",
    "BackfillInputError": "gallery",
    "GalleryEmbeddings": "gallery",
    "load_parquet": "gallery",
    "ParquetGallery": "dataset",
    "DistributedOptions": "distributed",
    "simulate_backfill_dataset": "distributed",
    "backfill_counts": "grid",
    "cold_counts": "grid",
    "default_grid": "grid",
    "MODES": "modes",
    "SERVED_MODES": "modes",
    "ModeSpec": "modes",
    "SideBuilder": "modes",
    "apply_bundle_modules": "modes",
    "available_modes": "modes",
    "mode_spec": "modes",
    "POLICIES": "policies",
    "PolicyInputs": "policies",
    "UncertaintyHead": "policies",
    "policy_order": "policies",
    "QueryLog": "query_log",
    "read_query_log": "query_log",
    "BackfillCurve": "results",
    "SimulationResult": "results",
    "SimulationSpec": "run_plan",
    "backfill_curve_rows": "simulator",
    "simulate_backfill": "simulator",
}


def __getattr__(name):
    """Lazy exports: ``import raycompat.backfill`` stays light (no torch) until needed."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"raycompat.backfill.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'raycompat.backfill' has no attribute {name!r}")


__all__ = [
    "BackfillInputError",
    "BackfillCurve",
    "CostModel",
    "DistributedOptions",
    "GalleryEmbeddings",
    "MODES",
    "ModeSpec",
    "POLICIES",
    "ParquetGallery",
    "PolicyInputs",
    "QueryLog",
    "SERVED_MODES",
    "SideBuilder",
    "SimulationResult",
    "SimulationSpec",
    "UncertaintyHead",
    "apply_bundle_modules",
    "available_modes",
    "backfill_counts",
    "backfill_curve_rows",
    "cold_counts",
    "default_grid",
    "load_parquet",
    "measure_items_per_s",
    "mode_spec",
    "policy_order",
    "read_query_log",
    "simulate_backfill",
    "simulate_backfill_dataset",
]
