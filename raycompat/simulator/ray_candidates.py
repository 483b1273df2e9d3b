"""Several candidates on Ray: one read of each row group scores all of them.

The distributed form of :mod:`raycompat.simulator.candidates` (docs/simulator.md, "Several
candidates").  Every candidate is a column of new vectors of one parquet dataset.  Each is
planned as :func:`~raycompat.simulator.ray_engine.simulate_backfill_dataset` plans a single run,
on the dataset as that candidate sees it (:meth:`ParquetGallery.candidate_view`: its column read
as ``new``); then one score step reads each row group once, with ``old`` and every candidate's
column, and runs the block pass over every candidate's sides, ``old-old`` shared.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from raycompat.embeddings.dataset import ParquetGallery
from raycompat.embeddings.format import RowGroup
from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.simulator import ray_engine
from raycompat.simulator.candidates import (
    candidate_results,
    candidate_side,
    check_candidates,
    plain_side,
    plan_candidates,
    share_equal_orders,
    side_owner,
)

__all__ = ["simulate_candidates_dataset"]


@dataclass
class _CandidatesContext:
    """What every score task shares: the dataset, each candidate's column and queries."""

    dataset: ParquetGallery
    columns: dict[str, str]  # candidate -> its column
    queries: dict[str, dict[str, np.ndarray]]  # candidate -> query_old, query_new
    first: str

    def builders(self, group: RowGroup, sides: Sequence[str]) -> dict:
        """One :class:`SideBuilder` per candidate over the row group, read once.  Each vector
        column is L2-normalized once for all the builders, right after its read (its raw copy
        is freed before the next column is read), unless one of ``sides`` (the pass sides)
        scores raw vectors."""
        from raycompat.upgrade.modes import SideBuilder, scores_raw

        physical = ["old", *dict.fromkeys(self.columns.values())]
        if scores_raw(sides):
            ids, cols = self.dataset.read_block(group, physical)
            normalized: tuple[str, ...] = ()
        else:
            ids, cols = self._read_normalized(group, physical)
            normalized = ("gallery_old", "gallery_new")
        n = ids.size
        out = {}
        for name, col in self.columns.items():
            data = GalleryEmbeddings(
                gallery_labels=np.zeros(n, dtype=np.int64),
                gallery_old=cols["old"],
                gallery_new=cols[col],
                query_labels=self.dataset.query_labels,
                gallery_ids=ids,
                query_ids=self.dataset.query_ids,
                source=group.name,
                checked_finite=("gallery_old", "gallery_new"),  # by the reader, once
                **self.queries[name],
            )
            out[name] = SideBuilder(data, normalized=normalized)
        return out

    def _read_normalized(self, group: RowGroup, columns: list[str]):
        """``(ids, {column: L2-normalized vectors})``: one column read at a time."""
        from raycompat.upgrade.modes import normalize_columns

        ids, cols = None, {}
        for c in columns:
            got_ids, got = self.dataset.read_block(group, [c])
            if ids is not None and not np.array_equal(got_ids, ids):
                raise BackfillInputError(f"{group.name} changed while it was being read")
            normalize_columns(got, group.name)
            ids, cols[c] = got_ids, got[c]
        return ids, cols


def _candidates_pass_task(ctx: _CandidatesContext, group: RowGroup, plan, seg_rows: np.ndarray):
    """The block pass of one row group over every candidate's sides."""
    from raycompat.index.blocks import release_memory
    from raycompat.simulator.block_pass import block_pass_rows

    t0 = time.perf_counter()
    builders = ctx.builders(group, [plain_side(x) for x in plan.used])
    read_s = time.perf_counter() - t0
    rows = {x: builders[side_owner(x) or ctx.first].side(plain_side(x)).gallery for x in plan.used}
    counts = block_pass_rows(plan, rows, group.g0, [s for s in seg_rows])
    del builders, rows
    release_memory()
    info = ray_engine.task_info(t0, group)
    info.update(device="cpu", read_s=read_s)
    return counts, info


def simulate_candidates_dataset(
    dataset: ParquetGallery,
    columns: Mapping[str, str],
    policies: Sequence[str] | str = ("random", "sequential"),
    modes: Sequence[str] | str = ("compatible",),
    *,
    heads: Mapping[str, object] | None = None,
    block_bytes: int = ray_engine.TASK_BLOCK_BYTES,
    progress: Callable[[str], None] | None = None,
    debug: bool = False,
    options: ray_engine.DistributedOptions | None = None,
    **spec,
) -> dict:
    """``{name: SimulationResult}`` for every candidate ``name -> column`` of ``dataset``, each
    equal to :func:`simulate_backfill_dataset` on ``dataset.candidate_view(column)`` (``spec``
    as there); the score step reads every row group once for all of them."""
    import ray

    from raycompat.simulator.run_plan import SimulationSpec

    t_start = time.perf_counter()
    say = progress or (lambda msg: None)
    names = check_candidates(columns)
    base = SimulationSpec(policies=policies, modes=modes, **spec)
    views = {n: dataset.candidate_view(columns[n]) for n in names}
    run = ray_engine.DatasetRun(dataset, options or ray_engine.DistributedOptions(), say)
    positives = _read_positives_once(run, dataset, views, columns, names)
    engines = {
        n: ray_engine.DatasetEngine(
            run, views[n], None, block_bytes, debug, positives[n], base.rank_merge_distance
        )
        for n in names
    }
    planned = plan_candidates(base, engines, heads, say)
    share_equal_orders(planned)
    summaries = {}
    for cp in planned:
        sums = engines[cp.name].summaries(cp.run.scored_curves())
        summaries.update({candidate_side(cp.name, s): v for s, v in sums.items()})
    run.dataset = dataset
    queries = {
        n: {"query_old": views[n].queries["old"], "query_new": views[n].queries["new"]}
        for n in names
    }
    ctx = _CandidatesContext(dataset.without_items(), dict(columns), queries, names[0])
    curves = [c for cp in planned for c in cp.engine_curves()]
    res = ray_engine.rank_curves(
        run, ray.put(ctx), summaries, curves, block_bytes, debug, task=_candidates_pass_task
    )
    results = candidate_results(planned, res, engines, t_start)
    stats = ray_engine.run_stats(run)
    for r in results.values():
        r.stats["distributed"] = stats
        r.config["engine"] = "ray"
    return results


def _read_positives_once(run, dataset, views: dict, columns: Mapping[str, str], names) -> dict:
    """Per candidate, ``(items, ids, columns)`` of the positives' rows as its view names them
    (``new``: its column): ``old``, every candidate's column and the item columns, read in one
    pass over the row groups for all candidates."""
    import ray

    first = views[names[0]]
    items = ray_engine.positive_items(first)
    physical = ["old", *dict.fromkeys(columns[n] for n in names), *first.item_columns]
    ctx = ray_engine.TaskContext(dataset.without_items(), {}, physical, None)
    run.say(
        f"reading the {items.size:,} gallery items that are positives of a query "
        f"(once for {len(names)} candidates)"
    )
    run.dataset = dataset
    ids, cols = ray_engine.gather_columns(run, ray.put(ctx), items, physical, "positives")
    shared = {c: v for c, v in cols.items() if c == "old" or c in first.item_columns}
    return {n: (items, ids, {**shared, "new": cols[columns[n]]}) for n in names}
