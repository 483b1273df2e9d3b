"""Several candidates on Ray: one read of each row group scores all of them.

The distributed form of :mod:`raycompat.backfill.candidates` (docs/simulator.md, "Several
candidates").  Every candidate is a column of new vectors of one parquet dataset.  Each is
planned as :func:`~raycompat.backfill.distributed.simulate_backfill_dataset` plans a single run,
on the dataset as that candidate sees it (:meth:`ParquetGallery.candidate_view`: its column read
as ``new``); then one score step reads each row group once, with ``old`` and every candidate's
column, and runs the block pass over every candidate's sides, ``old-old`` shared.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from raycompat.backfill import distributed as dist
from raycompat.backfill.candidates import (
    CandidatePlan,
    _owner,
    _plain,
    _results,
    candidate_side,
    check_candidates,
    share_equal_orders,
)
from raycompat.backfill.dataset import ParquetGallery
from raycompat.backfill.embeddings_parquet import RowGroup
from raycompat.backfill.gallery import BackfillInputError, GalleryEmbeddings

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
        from raycompat.backfill.modes import SideBuilder, scores_raw

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
        from raycompat.backfill.modes import normalize_columns

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
    from raycompat.backfill.block_pass import block_pass_rows
    from raycompat.backfill.blocks import release_memory

    t0 = time.perf_counter()
    builders = ctx.builders(group, [_plain(x) for x in plan.used])
    read_s = time.perf_counter() - t0
    rows = {x: builders[_owner(x) or ctx.first].side(_plain(x)).gallery for x in plan.used}
    counts = block_pass_rows(plan, rows, group.g0, [s for s in seg_rows])
    del builders, rows
    release_memory()
    info = dist._task_info(t0, group)
    info.update(device="cpu", read_s=read_s)
    return counts, info


def simulate_candidates_dataset(
    dataset: ParquetGallery,
    columns: Mapping[str, str],
    policies: Sequence[str] | str = ("random", "sequential"),
    modes: Sequence[str] | str = ("compatible",),
    *,
    fractions: Sequence[float] | None = None,
    grid_step: float = 5.0,
    k: int = 100,
    seed: int = 0,
    cost=None,
    references=None,
    learned_sample_fraction: float = 0.02,
    rank_merge_distance: str = "sq_l2",
    block_bytes: int = dist.TASK_BLOCK_BYTES,
    progress: Callable[[str], None] | None = None,
    debug: bool = False,
    options: dist.DistributedOptions | None = None,
    bootstrap=None,
    policy_options=None,
    reference_cache=None,
) -> dict:
    """``{name: SimulationResult}`` for every candidate ``name -> column`` of ``dataset``, each
    equal to :func:`simulate_backfill_dataset` on ``dataset.candidate_view(column)``; the score
    step reads every row group once for all of them."""
    import ray

    t_all = time.perf_counter()
    say = progress or (lambda msg: None)
    names = check_candidates(columns)
    views = {n: dataset.candidate_view(columns[n]) for n in names}
    run = dist.DatasetRun(dataset, options or dist.DistributedOptions(), say)
    positives = _read_positives_once(run, dataset, views, columns, names)
    planned, summaries, key, cached = [], {}, None, None
    for n in names:
        run.dataset = views[n]
        cp, sums, key_n, cached_n = _plan_candidate(
            run, n, views[n], policies, modes, fractions, grid_step, k, seed,
            learned_sample_fraction, rank_merge_distance, policy_options, reference_cache,
            cached, key, say, positives[n],
        )  # fmt: skip
        key, cached = key or key_n, cached if cached is not None else cached_n
        planned.append(cp)
        summaries.update(sums)
    run.dataset = dataset
    share_equal_orders(planned)
    queries = {
        n: {"query_old": views[n].queries["old"], "query_new": views[n].queries["new"]}
        for n in names
    }
    ctx = _CandidatesContext(dataset.without_items(), dict(columns), queries, names[0])
    res = _score_all(run, ray.put(ctx), planned, summaries, block_bytes, debug)
    sizes = _Sizes(dataset.n_items, dataset.n_queries, dataset.gallery_costs)
    results = _results(
        planned, res, dict.fromkeys(names, sizes), cached, key, reference_cache, references,
        cost, bootstrap, t_all,
    )  # fmt: skip
    stats = dist._run_stats(run)
    for r in results.values():
        r.stats["distributed"] = stats
        r.config["engine"] = "ray"
    return results


@dataclass
class _Sizes:
    """What :func:`~raycompat.backfill.candidates._results` reads of a candidate's data."""

    n_items: int
    n_queries: int
    item_costs: np.ndarray | None


def _read_positives_once(run, dataset, views: dict, columns: Mapping[str, str], names) -> dict:
    """Per candidate, ``(items, ids, columns)`` of the positives' rows as its view names them
    (``new``: its column): ``old``, every candidate's column and the item columns, read in one
    pass over the row groups for all candidates."""
    import ray

    first = views[names[0]]
    items = dist._positive_items(first)
    physical = ["old", *dict.fromkeys(columns[n] for n in names), *first.item_columns]
    ctx = dist._Context(dataset.without_items(), {}, physical, None)
    run.say(
        f"reading the {items.size:,} gallery items that are positives of a query "
        f"(once for {len(names)} candidates)"
    )
    run.dataset = dataset
    ids, cols = dist.gather_columns(run, ray.put(ctx), items, physical, "positives")
    shared = {c: v for c, v in cols.items() if c == "old" or c in first.item_columns}
    return {n: (items, ids, {**shared, "new": cols[columns[n]]}) for n in names}


def _plan_candidate(
    run, name, view, policies, modes, fractions, grid_step, k, seed, learned_sample_fraction,
    rank_merge_distance, policy_options, cache, cached, key, say, positives,
):  # fmt: skip
    """One candidate as a single distributed run plans it: its positives, orders, curves and
    side summaries (keyed by the engine's side names)."""
    from raycompat.backfill import simulator as sim
    from raycompat.backfill.modes import SideBuilder
    from raycompat.backfill.policies import PolicyInputs, PolicyOptions

    columns = view.vector_columns + view.item_columns
    ctx = dist._Context(view.without_items(), view.query_arrays(), columns, None)
    items, small, ctx_ref = dist._read_positives(run, ctx, positives)
    builder = SideBuilder(small)
    inputs = PolicyInputs(
        n_items=view.n_items,
        data=small,
        head=None,
        seed=seed,
        learned_sample_fraction=learned_sample_fraction,
        rank_merge_distance=rank_merge_distance,
        block_bytes=None,
        sides=builder,
        options=policy_options or PolicyOptions(),
        reads=None,
    )
    plan = sim._check_inputs(small, policies, modes, k, fractions, grid_step, None, inputs)
    tagged = lambda msg: say(f"candidate {name}: {msg}")  # noqa: E731
    orders, seconds = dist._dataset_orders(run, ctx, ctx_ref, plan, inputs, items, tagged)
    want_oo = small.query_old is not None
    if cache is not None and want_oo and key is None:
        key = dist._reference_key(run, ctx_ref, small, plan.k)
        pairs = sim.n_positive_pairs(view.query_labels, view.gallery_labels)
        cached = cache.lookup(key, pairs)
    curves, static, derived = sim._curve_specs(plan, orders, view.n_items, want_oo,
                                               cached is not None)  # fmt: skip
    cp = CandidatePlan(name, plan, inputs, orders, seconds, curves, static, derived)
    scored = [c for c in curves if c.key not in derived]
    sums = dist._summaries(run, ctx_ref, scored, builder, items, rank_merge_distance)
    return cp, {candidate_side(name, s): v for s, v in sums.items()}, key, cached


def _score_all(run, ctx_ref, planned: list[CandidatePlan], summaries, block_bytes, debug):
    """One rank plan over every candidate's curves; one score task per row group."""
    from raycompat.backfill.rank_plan import plan_ranks

    ds = run.dataset
    rplan = plan_ranks(
        summaries,
        [c for cp in planned for c in cp.engine_curves()],
        ds.query_labels,
        ds.gallery_labels,
        device="cpu",
        block_bytes=block_bytes,
        debug=debug,
        workers=1,
    )
    return dist._rank_blocks(run, ctx_ref, rplan, run.say, task=_candidates_pass_task)
