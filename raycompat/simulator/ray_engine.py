"""The backfill simulator on Ray: the engine's block pass as tasks over parquet row groups.

The same engine as the in-memory simulator (:mod:`raycompat.simulator.assembly` and the modules
it assembles), run another way (docs/architecture.md, "Distributed backfill simulation"):

1. the driver opens the dataset (:class:`~raycompat.embeddings.dataset.ParquetGallery`): row
   groups, labels, ids and queries, from the metadata and the key columns;
2. tasks read the rows of the positive pairs (and the ``learned`` policy's sample), so the
   driver can plan the pass (:func:`raycompat.simulator.rank_plan.plan_ranks` with
   :class:`~raycompat.upgrade.score_sides.SideSummary`), with nothing gallery-sized but one number
   per item;
3. policies that need embeddings score every row group in tasks
   (:meth:`raycompat.upgrade.policies.Policy.block_scorer`); the global order sorts those
   scores, highest first and ties by lower gallery index -- on the driver, or with Ray Data's
   sort above ``sort_above`` items -- so it does not depend on the blocks or the workers;
   a query log's top-k (``demand``, ``upgrade-on-read``) is one task per row group too, the
   canonical top-k lists merged on the driver (:func:`raycompat.upgrade.query_log.block_topk`),
   and a policy built on a base order gets the base's global order first;
4. one task per row group reads its rows, builds the score sides with the in-memory code
   (:class:`~raycompat.upgrade.modes.SideBuilder`) and runs
   :func:`~raycompat.simulator.block_pass.block_pass_rows`; the driver adds the histograms as they
   arrive (:class:`~raycompat.simulator.assembly.CountsSum`) and turns them into ranks and metrics
   with the simulator's code.

A row group is counted once: results are keyed by row group, and a task whose worker dies is
retried by Ray (``max_retries``) and counted when it finishes.  Tasks ask for a GPU when the
cluster has GPUs and score on CUDA there.
"""

from __future__ import annotations

import functools
import hashlib
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raycompat.console import format_eta
from raycompat.embeddings.dataset import ParquetGallery
from raycompat.embeddings.format import BackfillInputError, RowGroup
from raycompat.embeddings.gallery import GalleryEmbeddings

__all__ = [
    "DatasetEngine",
    "DatasetRun",
    "DistributedOptions",
    "TASK_BLOCK_BYTES",
    "run_stats",
    "simulate_backfill_dataset",
]

#: score block budget of a block task: one task per core, so a block small enough to stay in
#: that core's cache while it is filtered (10 % faster than the in-process engine's 16 MiB on
#: this machine, bench/curve_eval_large.py)
TASK_BLOCK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class DistributedOptions:
    """How the block passes run on the cluster."""

    #: tasks in flight at once (default: twice the cluster's CPUs)
    max_in_flight: int | None = None
    #: GPUs per task (default: 1 when the cluster has GPUs, else 0)
    gpus_per_task: float | None = None
    #: global orders of more items than this are sorted by Ray Data, not on the driver
    sort_above: int = 50_000_000
    #: retries of a task whose worker died
    max_retries: int = 3
    #: seconds between progress lines of a step (and one when it ends)
    progress_every_s: float = 10.0


@dataclass
class _Modules:
    """The new bundle's gallery-side modules (psi, rho, psi_rev), as
    :func:`raycompat.upgrade.modes.apply_bundle_modules` reads them."""

    modules: dict


@dataclass
class TaskContext:
    """What every task of a run shares (one object-store copy): the dataset without its
    per-item arrays, the queries' arrays, the columns to read, the modules."""

    dataset: ParquetGallery
    queries: dict[str, np.ndarray]
    columns: list[str]
    modules: _Modules | None

    def block(self, group: RowGroup) -> GalleryEmbeddings:
        """The gallery rows of ``group`` with the queries, the modules applied."""
        from raycompat.upgrade.modes import apply_bundle_modules

        data = self.dataset.block_embeddings(group, self.queries, self.columns)
        return apply_bundle_modules(data, self.modules) if self.modules else data


def task_info(t0: float, group: RowGroup) -> dict[str, Any]:
    import ray

    return {
        "node": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds": time.perf_counter() - t0,
        "bytes": group.nbytes,
        "items": group.gallery_rows,
    }


def _device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# ----------------------------------------------------------------------------- tasks
def _gather_task(ctx: TaskContext, group: RowGroup, local: np.ndarray):
    """Some rows of one row group (``local``: indices among its gallery rows), as stored."""
    t0 = time.perf_counter()
    ids, cols = ctx.dataset.read_block(group, ctx.columns)
    return ({c: v[local] for c, v in cols.items()}, ids[local]), task_info(t0, group)


def _digest_task(ctx: TaskContext, group: RowGroup):
    """The digest of one row group's old gallery vectors (the reference cache's key)."""
    from raycompat.simulator.reference_cache import array_digest

    t0 = time.perf_counter()
    _, cols = ctx.dataset.read_block(group, ["old"])
    return array_digest([np.asarray(cols["old"], np.float32)]), task_info(t0, group)


def _policy_task(ctx: TaskContext, group: RowGroup, scorer):
    """One policy score per gallery row of one row group (float64)."""
    t0 = time.perf_counter()
    scores = np.asarray(scorer.scores(ctx.block(group), group.g0), dtype=np.float64)
    if scores.shape != (group.gallery_rows,):
        raise ValueError(f"a block scorer returned {scores.shape} for {group.gallery_rows} rows")
    return scores, task_info(t0, group)


def _norm_task(ctx: TaskContext, group: RowGroup, sides: list[str], rank_merge_distance: str):
    """An upper bound of the gallery row norms of each side (for sides that are not
    normalised)."""
    from raycompat.upgrade.modes import SideBuilder
    from raycompat.upgrade.score_sides import max_row_norm as _max_row_norm

    t0 = time.perf_counter()
    builder = SideBuilder(ctx.block(group))
    out = {s: _max_row_norm(builder.side(s).gallery) for s in sides}
    return out, task_info(t0, group)


def _log_topk_task(ctx: TaskContext, group: RowGroup, side: str, queries: np.ndarray, k: int):
    """The canonical top-k of the query log's queries among one row group's gallery rows on
    score side ``side`` (a mode's t=0 side)."""
    from raycompat.upgrade.modes import SideBuilder
    from raycompat.upgrade.query_log import block_topk

    t0 = time.perf_counter()
    gallery = SideBuilder(ctx.block(group)).side(side).gallery
    return block_topk(queries, gallery, group.g0, k), task_info(t0, group)


def _pass_task(ctx: TaskContext, group: RowGroup, plan, seg_rows: np.ndarray):
    """The engine's block pass over one row group (on CUDA when the task has a GPU)."""
    from raycompat.index.blocks import release_memory
    from raycompat.simulator.block_pass import block_pass_rows
    from raycompat.upgrade.modes import SideBuilder

    t0 = time.perf_counter()
    dev = _device()
    if dev.type != "cpu":
        plan = plan.for_blocks(dev)
    block = ctx.block(group)
    read_s = time.perf_counter() - t0
    vector_bytes = sum(v.nbytes for v in (block.gallery_old, block.gallery_new) if v is not None)
    builder = SideBuilder(block)
    rows = {x: builder.side(x).gallery for x in plan.used}
    counts = block_pass_rows(plan, rows, group.g0, [s for s in seg_rows])
    del builder, rows, block
    release_memory()  # the row group's arrays go back to the OS before the next task
    info = task_info(t0, group)
    info.update(device=str(dev), read_s=read_s, vector_bytes=vector_bytes)
    return counts, info


# ----------------------------------------------------------------------------- the runner
@dataclass
class DatasetRun:
    """Runs tasks over row groups and keeps what they report (for the report's stats)."""

    dataset: ParquetGallery
    options: DistributedOptions
    say: Callable[[str], None]
    tasks: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self):
        import ray

        from raycompat.cluster import connect
        from raycompat.console import is_verbose, quiet_ray

        quiet_ray(is_verbose())  # one progress line per step, not Ray Data's log lines
        connect()
        gpus = ray.cluster_resources().get("GPU", 0.0)
        per = self.options.gpus_per_task
        self.gpus_per_task = (1.0 if gpus >= 1 else 0.0) if per is None else float(per)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.max_in_flight = self.options.max_in_flight or max(2, 2 * cpus)

    def map(self, step: str, fn, ctx_ref, jobs: Sequence[tuple[RowGroup, tuple]]):
        """Yield ``(job index, result)`` of ``fn(ctx, group, *args)`` for every job, as tasks
        finish (any order), with one progress line per tenth of the work.  ``args`` may be a
        function that makes them, called when the task is submitted (block-sized arguments
        then exist only for the tasks in flight)."""
        import ray

        remote = ray.remote(_then_release(fn)).options(
            num_cpus=1,
            num_gpus=self.gpus_per_task,
            scheduling_strategy="SPREAD",
            max_retries=self.options.max_retries,
            retry_exceptions=False,
        )
        total_items = sum(g.gallery_rows for g, _ in jobs) or 1
        pending: dict[Any, int] = {}
        nxt, finished, done_items = 0, 0, 0
        t0 = last = time.perf_counter()
        while nxt < len(jobs) or pending:
            while nxt < len(jobs) and len(pending) < self.max_in_flight:
                group, args = jobs[nxt]
                args = args() if callable(args) else args
                pending[remote.remote(ctx_ref, group, *args)] = nxt
                nxt += 1
            ready, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ready[0])
            result, info = _get(ready[0])
            info["step"] = step
            self.tasks.append(info)
            finished += 1
            done_items += jobs[i][0].gallery_rows
            yield i, result
            now = time.perf_counter()
            if now - last >= self.options.progress_every_s or finished == len(jobs):
                last = now
                self._progress(step, finished, len(jobs), done_items, total_items, now - t0)
        took = time.perf_counter() - t0
        self.steps[step] = {"seconds": took, "tasks": len(jobs), "items": total_items}

    def _progress(self, step, done, total, items, total_items, elapsed) -> None:
        rate = items / elapsed if elapsed > 0 else float("nan")
        eta = (total_items - items) / rate if rate == rate and rate > 0 else float("nan")
        tail = f", ETA {format_eta(eta)}" if items < total_items and eta == eta else ""
        self.say(
            f"[{step}] {done}/{total} blocks, {items:,} items, {rate:,.0f} items/s | "
            f"{elapsed:.1f}s elapsed{tail}"
        )


def _then_release(fn):
    """``fn``, then the worker's freed memory back to the OS (:func:`release_memory`): the
    next task, of any step, starts from the worker's baseline, not from this row group's
    buffers."""

    @functools.wraps(fn)
    def task(*args):
        from raycompat.index.blocks import release_memory

        try:
            return fn(*args)
        finally:
            release_memory()

    return task


def _get(ref):
    """``ray.get`` with the task's own input error (it names the shard), not a wrapper."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BackfillInputError):
            raise BackfillInputError(str(cause)) from None
        raise


# ----------------------------------------------------------------------------- steps
def _jobs_by_group(dataset: ParquetGallery, items: np.ndarray) -> list[tuple[RowGroup, tuple]]:
    """One gather job per row group holding some of ``items`` (sorted gallery indices)."""
    starts = np.array([g.g0 for g in dataset.groups], dtype=np.int64)
    which = np.searchsorted(starts, items, side="right") - 1
    jobs = []
    for gi in np.unique(which):
        g = dataset.groups[int(gi)]
        jobs.append((g, (items[which == gi] - g.g0,)))
    return jobs


def _gather(run: DatasetRun, ctx: TaskContext, ctx_ref, items: np.ndarray, step: str):
    """The rows of ``items`` (sorted gallery indices) with the queries, as GalleryEmbeddings
    (the modules applied to these rows only, as the block passes apply them to theirs)."""
    ids, cols = gather_columns(run, ctx_ref, items, ctx.columns, step)
    return rows_as_embeddings(run.dataset, ctx, items, ids, cols)


def gather_columns(run: DatasetRun, ctx_ref, items: np.ndarray, columns, step: str):
    """``(ids, {column: values})`` of the gallery rows ``items`` (sorted gallery indices): one
    task per row group holding some, reading ``columns`` of the context's dataset."""
    jobs = _jobs_by_group(run.dataset, items)
    parts: list = [None] * len(jobs)
    for i, res in run.map(step, _gather_task, ctx_ref, jobs):
        parts[i] = res
    cols = {c: np.concatenate([p[0][c] for p in parts]) for c in columns}
    return np.concatenate([p[1] for p in parts]), cols


def rows_as_embeddings(ds, ctx: TaskContext, items: np.ndarray, ids: np.ndarray, cols: dict):
    """Gathered rows ``items`` of ``ds`` (``cols`` by logical column name) with the context's
    queries, as GalleryEmbeddings; the context's modules applied to these rows."""
    from raycompat.upgrade.modes import apply_bundle_modules

    names = {"old": "gallery_old", "new": "gallery_new", "adapted": "gallery_adapted"}
    cost = ds.cost_column
    stored = {c[len("unc_") :]: v for c, v in cols.items() if c.startswith("unc_") and c != cost}
    data = GalleryEmbeddings(
        gallery_labels=ds.gallery_labels[items],
        query_labels=ds.query_labels,
        gallery_ids=ids,
        query_ids=ds.query_ids,
        compatible_dim=ds.compatible_dim,
        source=ds.source,
        extra={"uncertainty": stored} if stored else {},
        item_costs=cols.get(cost) if cost else None,
        **{names[c]: v for c, v in cols.items() if c in names},
        **ctx.queries,
    )
    return apply_bundle_modules(data, ctx.modules) if ctx.modules else data


def _order(run: DatasetRun, ctx_ref, scorer, step: str) -> np.ndarray:
    """The global order of a block scorer: highest score first, ties by lower gallery index."""
    from raycompat.upgrade.policies import order_by_score

    ds = run.dataset
    jobs = [(g, (scorer,)) for g in ds.groups if g.gallery_rows]
    if ds.n_items > run.options.sort_above:
        return _sorted_by_ray_data(run, ctx_ref, jobs, step)
    scores = np.empty(ds.n_items, dtype=np.float64)
    for i, s in run.map(step, _policy_task, ctx_ref, jobs):
        g = jobs[i][0]
        scores[g.g0 : g.g1] = s
    return order_by_score(scores)


def _sorted_by_ray_data(run: DatasetRun, ctx_ref, jobs, step: str) -> np.ndarray:
    """The order from Ray Data's distributed sort of ``(-score, gallery index)``."""
    import pyarrow as pa
    import ray

    refs = []
    for i, s in run.map(step, _policy_task, ctx_ref, jobs):
        g = jobs[i][0]
        if np.isnan(s).any():
            raise ValueError("policy scores contain NaN")
        item = np.arange(g.g0, g.g1, dtype=np.int64)
        refs.append(ray.put(pa.table({"key": -s, "item": item})))
    t0 = time.perf_counter()
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.from_arrow_refs(refs).sort(["key", "item"])
    order = np.empty(run.dataset.n_items, dtype=np.int64)
    pos = 0
    for batch in ds.iter_batches(batch_format="numpy", batch_size=1 << 20):
        n = batch["item"].shape[0]
        order[pos : pos + n] = batch["item"]
        pos += n
    if pos != order.size:
        raise RuntimeError(f"the sort returned {pos} items of {order.size}")
    took = time.perf_counter() - t0
    run.steps[step + " sort"] = {"seconds": took, "tasks": 0, "items": pos}
    run.say(f"[{step}] {pos:,} scores sorted by Ray Data in {took:.1f}s")
    return order


# ----------------------------------------------------------------------------- the engine
class DatasetEngine:
    """The Ray engine (:class:`~raycompat.simulator.run_plan.Engine`) over a parquet dataset: the
    plan sees the queries' positives, read by tasks; orders, log searches and ranks run as tasks
    over the row groups. ``modules``: the new bundle's psi / rho / psi_rev, applied to each
    block; ``positives``: ``(items, ids, columns)`` already read (several candidates share one
    read)."""

    device = None
    #: the hinge-benefit blocks as in memory by default: the same float64 sums
    policy_block_bytes = None

    def __init__(
        self,
        run: DatasetRun,
        dataset: ParquetGallery,
        modules: dict | None = None,
        block_bytes: int = TASK_BLOCK_BYTES,
        debug: bool = False,
        positives=None,
        distance: str = "sq_l2",
    ):
        from raycompat.upgrade.modes import SideBuilder

        self.run, self.dataset, self.block_bytes, self.debug = run, dataset, block_bytes, debug
        self.distance = distance  # rank merge's distance (its sides' norm bounds)
        mods = _Modules(dict(modules)) if modules else None
        columns = dataset.vector_columns + dataset.item_columns
        self.ctx = TaskContext(dataset.without_items(), dataset.query_arrays(), columns, mods)
        run.dataset = dataset
        self.items, self.data, self.ctx_ref = _read_positives(run, self.ctx, positives)
        self.builder = SideBuilder(self.data)
        self.n_items, self.n_queries = dataset.n_items, dataset.n_queries
        self.query_labels, self.gallery_labels = dataset.query_labels, dataset.gallery_labels
        self.item_costs = dataset.gallery_costs

    @property
    def _run(self) -> DatasetRun:
        """The runner, on this engine's dataset (candidates' engines share one runner)."""
        self.run.dataset = self.dataset
        return self.run

    def log_searches(self, log, k: int, distance: str):
        return _log_searches(self._run, self.ctx_ref, self.data, log, k, distance)

    def orders(self, plan, inputs, say):
        return _dataset_orders(self._run, self.ctx, self.ctx_ref, plan, inputs, self.items, say)

    def reference_key(self, k: int) -> str:
        return _reference_key(self._run, self.ctx_ref, self.data, k)

    def summaries(self, curves) -> dict:
        """Per pass side of ``curves``: the queries, the positives' rows, a bound of the norms."""
        return _summaries(self._run, self.ctx_ref, curves, self.builder, self.items, self.distance)

    def rank(self, curves):
        """The ranks of every curve: planned on the driver, counted by the block tasks."""
        summaries = self.summaries(curves)
        return rank_curves(self._run, self.ctx_ref, summaries, curves, self.block_bytes, self.debug)

    def stats(self) -> dict:
        return {"distributed": run_stats(self.run)}


def simulate_backfill_dataset(
    dataset: ParquetGallery,
    policies: Sequence[str] | str = ("random", "sequential"),
    modes: Sequence[str] | str = ("compatible",),
    *,
    modules: dict | None = None,
    block_bytes: int = TASK_BLOCK_BYTES,
    progress: Callable[[str], None] | None = None,
    debug: bool = False,
    options: DistributedOptions | None = None,
    **spec,
):
    """:func:`~raycompat.simulator.memory_engine.simulate_backfill` on a streamed parquet
    dataset, on Ray: the same curves, value for value (``spec`` as there: the fields of
    :class:`~raycompat.simulator.run_plan.SimulationSpec`; ``modules``: the new bundle's psi /
    rho / psi_rev, applied to each block; ``block_bytes``: the engine's score blocks; the items'
    costs come from the dataset's cost column, ``ParquetGallery.open(cost_column=)``)."""
    from raycompat.simulator.run_plan import SimulationSpec, simulate

    say = progress or (lambda msg: None)
    spec = SimulationSpec(policies=policies, modes=modes, **spec)
    run = DatasetRun(dataset, options or DistributedOptions(), say)
    engine = DatasetEngine(
        run, dataset, modules, block_bytes, debug, None, spec.rank_merge_distance
    )
    result = simulate(spec, engine, say)
    result.config["engine"] = "ray"
    return result


def _reference_key(run: DatasetRun, ctx_ref, small, k: int) -> str:
    """The reference cache key (:func:`~raycompat.simulator.reference_cache.reference_key`):
    the old column of every row group digested by a task, in the dataset's order."""
    from raycompat.simulator.reference_cache import reference_key

    ds = run.dataset
    jobs = [(g, ()) for g in ds.groups if g.gallery_rows]
    digests = [""] * len(jobs)
    for i, digest in run.map("reference key", _digest_task, ctx_ref, jobs):
        digests[i] = digest
    combined = hashlib.sha256(" ".join(digests).encode()).hexdigest()
    return reference_key(combined, ds.gallery_labels, small.query_old, ds.query_labels, k)


def _read_positives(run: DatasetRun, ctx: TaskContext, gathered=None):
    """``(items, rows, context ref)``: the sorted gallery indices of the positives of the
    queries, their rows with the queries (the modules add the queries' rho / psi_rev): what
    the plan needs of the gallery; the context the tasks share then carries those queries.
    ``gathered``: ``(items, ids, columns)`` already read (several candidates share one read)."""
    import ray

    if gathered is None:
        items = positive_items(run.dataset)
        run.say(f"reading the {items.size:,} gallery items that are positives of a query")
        small = _gather(run, ctx, ray.put(ctx), items, "positives")
    else:
        items, ids, cols = gathered
        small = rows_as_embeddings(run.dataset, ctx, items, ids, cols)
    ctx.queries = {
        n: getattr(small, n)
        for n in ("query_old", "query_new", "query_rho", "query_rev")
        if getattr(small, n) is not None
    }
    return items, small, ray.put(ctx)


def _log_searches(run: DatasetRun, ctx_ref, small, log, k: int, distance: str):
    """``log`` matched with the streamed dataset: each mode's t=0 top-k from one task per row
    group, merged on the driver (the same lists as in memory: canonical scores)."""
    from raycompat.upgrade.modes import mode_spec
    from raycompat.upgrade.query_log import log_query_side, log_searches, merge_topk

    holder: dict = {}

    def search(mode: str) -> np.ndarray:
        side = mode_spec(mode, distance).old_side
        queries = log_query_side(log, small, holder["reads"].eval_rows, side)
        jobs = [(g, (side, queries, k)) for g in run.dataset.groups if g.gallery_rows]
        best = (np.full((queries.shape[0], k), -np.inf), np.full((queries.shape[0], k), -1))
        for _, part in run.map(f"query log top-{k} {mode}", _log_topk_task, ctx_ref, jobs):
            best = merge_topk([best, part], k)
        return best[1]

    holder["reads"] = log_searches(log, small, run.dataset.gallery_ids, k, search)
    return holder["reads"]


def rank_curves(
    run: DatasetRun, ctx_ref, summaries, curves, block_bytes: int, debug: bool, task=None
):
    """The ranks of every curve: planned on the driver (the side ``summaries``), counted by one
    block task per row group (``task``, default the single-run pass)."""
    from raycompat.simulator.rank_plan import plan_ranks

    ds = run.dataset
    rplan = plan_ranks(
        summaries,
        curves,
        ds.query_labels,
        ds.gallery_labels,
        device="cpu",
        block_bytes=block_bytes,
        debug=debug,
        workers=1,
    )
    return rank_blocks(run, ctx_ref, rplan, run.say, task=task)


def positive_items(dataset: ParquetGallery) -> np.ndarray:
    """The sorted gallery indices of every item that is a positive of some query."""
    from raycompat.metrics.rank_metrics import positive_pairs

    _, pi, _ = positive_pairs(dataset.query_labels, dataset.gallery_labels)
    items = np.unique(pi)
    if not items.size:
        raise BackfillInputError("no query has a positive in the gallery: nothing to evaluate")
    return items


def _dataset_orders(run, ctx, ctx_ref, plan, inputs, items: np.ndarray, say):
    """``{(policy, hot mode): order}``: from N on the driver, or from block scores."""
    from dataclasses import replace

    from raycompat.upgrade.policies import check_order, policy_class, policy_order
    from raycompat.upgrade.policies.base import DatasetAccess

    access = DatasetAccess(
        run.dataset.n_items, items, lambda ids: _gather(run, ctx, ctx_ref, ids, "sample")
    )
    orders: dict[tuple, np.ndarray] = {}
    seconds: dict[str, float] = {}
    hot = [m for m in plan.modes if plan.specs[m].schedule == "hot"]

    done: dict[tuple, np.ndarray] = {}  # base orders are computed once

    def order_of(p: str, m: str) -> np.ndarray:
        policy = policy_class(p)()
        key = (p, m if policy.per_mode else None)
        if key in done:
            return done[key]
        mine = replace(inputs, mode=m)
        base = policy.base_policy(mine)
        if base is not None:  # demand, upgrade-on-read: from the base's global order
            order = check_order(policy.order_with_base(mine, order_of(base, m)), inputs.n_items)
        elif (scorer := policy.block_scorer(mine, access)) is None:
            order = policy_order(p, replace(mine, data=None))
        else:
            step = f"policy {p}" + (f" {m}" if policy.per_mode else "")
            order = _order(run, ctx_ref, scorer, step)
        done[key] = order
        return order

    for p in plan.policies:
        t0 = time.perf_counter()
        per_mode = policy_class(p).per_mode
        for m in hot if per_mode else hot[:1]:
            order = order_of(p, m)
            for mm in [m] if per_mode else hot:
                orders[(p, mm)] = order
        seconds[p] = time.perf_counter() - t0
        say(f"policy {p}: order ready")
    return orders, seconds


def _summaries(run, ctx_ref, curves, builder, items: np.ndarray, distance: str):
    """Per pass side: its queries, the positive pairs' rows and a bound of its gallery norms
    (1 + a rounding margin for normalised sides; a pass over the gallery for the others)."""
    from raycompat.metrics.rank_metrics import positive_pairs
    from raycompat.upgrade.score_sides import SideSummary

    small = builder.data
    _, rows, _ = positive_pairs(small.query_labels, small.gallery_labels)
    names = []
    for c in curves:
        for s in c.sides():
            if s not in names:
                names.append(s)
    raw = [s for s in names if s.endswith(":l2raw")]
    norms = {s: 1.0 + 1e-3 for s in names if s not in raw}  # l2-normalised rows: |g| <= 1
    if raw:
        jobs = [(g, (raw, distance)) for g in run.dataset.groups if g.gallery_rows]
        for _, got in run.map("norms", _norm_task, ctx_ref, jobs):
            for s, v in got.items():
                norms[s] = max(norms.get(s, 0.0), v)
    out = {}
    for s in names:
        side = builder.side(s)
        out[s] = SideSummary(side.queries, side.gallery[rows], norms[s])
    return out


def rank_blocks(run: DatasetRun, ctx_ref, plan, say, task=None):
    """Every row group's block pass (``task``, default :func:`_pass_task`), added up as the
    tasks finish; then the ranks."""
    import ray

    from raycompat.simulator.assembly import CountsSum

    ds = run.dataset
    light = plan.for_blocks("cpu", workers=1)
    plan_ref = ray.put(light)
    total = CountsSum(plan)
    groups = [g for g in ds.groups if g.gallery_rows]
    jobs = [(g, functools.partial(_pass_args, plan, plan_ref, g)) for g in groups]
    say(
        f"scoring {len(plan.used)} side(s): {', '.join(plan.used)} "
        f"({ds.n_items:,} items x {ds.n_queries:,} queries, {len(jobs)} blocks)"
    )
    for _, counts in run.map("score", task or _pass_task, ctx_ref, jobs):
        total.add(counts)
    return total.ranks()


def _pass_args(plan, plan_ref, group: RowGroup) -> tuple:
    """A block pass task's arguments: the plan, and its rows' segment in each segmentation
    (int16 where the segments fit)."""
    segs = np.stack(plan.segs.rows(group.g0, group.g1))
    dtype = np.int16 if segs.max(initial=0) < np.iinfo(np.int16).max else np.int32
    return plan_ref, segs.astype(dtype)


def _per_read_second(score_tasks: list[dict]) -> float | None:
    secs = sum(t.get("read_s", 0.0) for t in score_tasks)
    return sum(t.get("vector_bytes", 0) for t in score_tasks) / secs if secs else None


def run_stats(run: DatasetRun) -> dict[str, Any]:
    """Tasks, nodes, peak memory per worker and of the driver, bytes read, per step."""
    workers: dict[str, int] = {}
    nodes: dict[str, int] = {}
    for t in run.tasks:
        key = f"{t['node'][:12]}/{t['pid']}"
        workers[key] = max(workers.get(key, 0), int(t["peak_rss"]))
        if t["step"] == "score":
            nodes[t["node"]] = nodes.get(t["node"], 0) + 1
    score = [t for t in run.tasks if t["step"] == "score"]
    secs = run.steps.get("score", {}).get("seconds", 0.0)
    read = sum(t["bytes"] for t in score)
    return {
        "steps": run.steps,
        "blocks": len(score),
        "blocks_per_node": nodes,
        "devices": sorted({t.get("device", "cpu") for t in score}),
        "peak_rss_per_worker": workers,
        "peak_rss_driver": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "bytes_read": read,
        "bytes_per_s": read / secs if secs else None,
        "items_per_s": run.steps.get("score", {}).get("items", 0) / secs if secs else None,
        "task_seconds": {
            "score_total": float(sum(t["seconds"] for t in score)),
            "score_read": float(sum(t.get("read_s", 0.0) for t in score)),
        },
        #: float32 old and new vectors the score tasks read per second of reading (one core)
        "read_float32_bytes_per_task_s": _per_read_second(score),
        "gpus_per_task": run.gpus_per_task,
    }
