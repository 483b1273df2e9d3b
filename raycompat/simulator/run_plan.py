"""One planner of a simulation run, for every engine (docs/simulator.md, "How a run is planned").

A run is described by a :class:`SimulationSpec` (policies, modes, grid, cut-off, seed, the
references, the head, the query log, the reference cache, the bootstrap). :func:`plan_run`
turns it into what the engine must rank, the same way for the in-memory engine
(:mod:`raycompat.simulator.memory_engine`), the Ray engine (:mod:`raycompat.simulator.ray_engine`)
and several candidates in one pass (:mod:`raycompat.simulator.candidates`,
:mod:`raycompat.simulator.ray_candidates`):

1. the policies' inputs (:class:`~raycompat.upgrade.policies.PolicyInputs`) from the rows the
   engine shows the plan (all of them in memory; the queries' positives on Ray) and, with a
   query log, the engine's searches of it;
2. the names, the cut-off, the grid and every mode's sides checked (:func:`check_run`);
3. the orders, one per policy and hot mode (the engine's :meth:`Engine.orders`);
4. the reference cache looked up once (:class:`ReferenceLookup`);
5. the curve specifications (:func:`curve_specs`): one per policy x hot mode, one per cold mode,
   the static references.

The engines differ only in how they read rows, build the orders and rank the curves; the
result is assembled by :func:`finish_run` (:class:`~raycompat.simulator.results.RankedCurves`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.simulator.rank_plan import CurveSpec
from raycompat.simulator.results import RankedCurves, SimulationResult
from raycompat.upgrade.grid import backfill_counts, check_grid, cold_counts, default_grid
from raycompat.upgrade.modes import ModeSpec, SideBuilder, mode_spec, parse_modes
from raycompat.upgrade.policies import (
    PolicyInputs,
    PolicyOptions,
    check_policy_inputs,
    parse_policies,
    policy_class,
    policy_order,
)

if TYPE_CHECKING:
    from raycompat.metrics.bootstrap import BootstrapOptions
    from raycompat.simulator.assembly import EngineResult
    from raycompat.simulator.reference_cache import ReferenceCache
    from raycompat.upgrade.cost import CostModel
    from raycompat.upgrade.query_log import LogSearches, QueryLog

__all__ = [
    "COLD_POLICY",
    "Engine",
    "PlannedRun",
    "ReferenceLookup",
    "RunPlan",
    "SimulationSpec",
    "check_run",
    "curve_specs",
    "finish_run",
    "n_positive_pairs",
    "plan_run",
    "simulate",
]

COLD_POLICY = "any"  # the cold curve does not depend on the policy


@dataclass(frozen=True)
class SimulationSpec:
    """What one simulation computes, whatever engine runs it (docs/simulator.md).

    ``policies``, ``modes``: names or comma-separated strings (unknown names raise
    :class:`BackfillInputError` listing the allowed ones); ``fractions``: the grid, strictly
    increasing in [0, 1] (default ``default_grid(grid_step)``: 0, 5, ..., 100 %); ``k``: the
    cut-off of mAP@k; ``seed``: every policy's seed; ``head``: the new classifier (uncertainty
    policies); ``cost``: the wall-clock cost model (a ``seconds`` axis on every curve);
    ``references``: ``{"old-old": {...}, "new*-new*": {...}}`` metric values (AUC gains);
    ``reference_correct``: bool ``[Q]``, old-old top-1 correctness for NFR@1 (else computed);
    ``query_log``: the workload (``demand``, ``upgrade-on-read``, weighted metrics) and
    ``policy_options`` the policies' options; ``reference_cache``: where the old-old reference is
    kept between runs; ``bootstrap``: bands and intervals on every number."""

    policies: Sequence[str] | str = ("random", "sequential")
    modes: Sequence[str] | str = ("compatible",)
    fractions: Sequence[float] | None = None
    grid_step: float = 5.0
    k: int = 100
    seed: int = 0
    head: UncertaintyHead | None = None
    cost: CostModel | None = None
    references: Mapping[str, Mapping[str, float]] | None = None
    reference_correct: np.ndarray | None = field(default=None, compare=False)
    learned_sample_fraction: float = 0.02
    rank_merge_distance: str = "sq_l2"
    query_log: QueryLog | None = None
    policy_options: PolicyOptions | None = None
    reference_cache: ReferenceCache | None = None
    bootstrap: BootstrapOptions | None = None

    def options(self) -> PolicyOptions:
        return self.policy_options or PolicyOptions()


@dataclass(frozen=True)
class RunPlan:
    """The checked inputs of one simulation: names, cut-off, grid, and each mode's spec."""

    policies: list[str]
    modes: list[str]
    k: int
    grid: np.ndarray
    specs: dict[str, ModeSpec]

    @property
    def hot_modes(self) -> list[str]:
        return [m for m in self.modes if self.specs[m].schedule == "hot"]


class Engine(Protocol):
    """What an engine shows the planner. ``data``: the gallery rows the plan sees, with the
    queries (all of them in memory; the queries' positives on Ray) and ``builder`` their score
    sides; ``n_items``, ``n_queries``, ``query_labels``, ``gallery_labels`` and ``item_costs``
    are the whole gallery's."""

    data: GalleryEmbeddings
    builder: SideBuilder
    device: Any
    #: the score blocks the hinge-benefit policy sums over (None: the engine default)
    policy_block_bytes: int | None
    n_items: int
    n_queries: int
    query_labels: np.ndarray
    gallery_labels: np.ndarray
    item_costs: np.ndarray | None

    def log_searches(self, log: QueryLog, k: int, distance: str) -> LogSearches: ...

    def orders(
        self, plan: RunPlan, inputs: PolicyInputs, say: Callable[[str], None]
    ) -> tuple[dict[tuple, np.ndarray], dict[str, float]]: ...

    def reference_key(self, k: int) -> str: ...

    def rank(self, curves: list[CurveSpec]) -> EngineResult: ...

    def stats(self) -> dict[str, Any]: ...


def check_run(spec: SimulationSpec, data: GalleryEmbeddings, inputs: PolicyInputs) -> RunPlan:
    """Validate names, k, the grid, every policy's needs and every mode's sides (errors name the
    problem before any scoring pass)."""
    policies = list(parse_policies(spec.policies))
    modes = list(parse_modes(spec.modes))
    k = spec.k
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k <= 0:
        raise BackfillInputError(f"k must be a positive integer, got {k!r}")
    try:
        grid = (
            default_grid(spec.grid_step) if spec.fractions is None else check_grid(spec.fractions)
        )
    except ValueError as exc:
        raise BackfillInputError(str(exc)) from exc
    check_policy_inputs(policies, inputs)
    specs = {m: mode_spec(m, inputs.rank_merge_distance) for m in modes}
    for mode in specs.values():  # build (and check) every side up front
        inputs.sides.side(mode.old_side)
        inputs.sides.side(mode.new_side)
    correct = spec.reference_correct
    if correct is not None and np.shape(correct) != (data.n_queries,):
        raise BackfillInputError(
            f"reference_correct must have one entry per query ({data.n_queries}), "
            f"got {np.shape(correct)}"
        )
    return RunPlan(policies, modes, int(k), grid, specs)


def memory_orders(plan: RunPlan, inputs: PolicyInputs, say: Callable[[str], None]):
    """``{(policy, hot mode): order}`` through :func:`policy_order` on rows held in memory
    (per-mode policies once per hot mode, the others once), and the seconds each policy took."""
    orders: dict[tuple, np.ndarray] = {}
    seconds: dict[str, float] = {}
    for p in plan.policies:
        t0 = time.perf_counter()
        if policy_class(p).per_mode:
            for m in plan.hot_modes:
                say(f"policy {p}: scoring {m}")
                orders[(p, m)] = policy_order(p, replace(inputs, mode=m))
            seconds[p] = time.perf_counter() - t0
            continue
        o = policy_order(p, inputs)
        for m in plan.hot_modes:
            orders[(p, m)] = o
        seconds[p] = time.perf_counter() - t0
        say(f"policy {p}: order ready")
    return orders, seconds


def curve_specs(plan: RunPlan, orders, n: int, want_old_old: bool, old_old_cached: bool = False):
    """The engine's curves: one per policy x hot mode (states at every grid point from the
    order), one per cold mode, and the static references; returns ``(curves, references,
    derived)``. ``old_old_cached``: the old-old ranks come from the reference cache, so the
    cold curve (old-old, then new-new) is ``derived`` from the references, not scored."""
    counts, ccounts = backfill_counts(plan.grid, n), cold_counts(plan.grid, n)
    curves: list[CurveSpec] = []
    for m in plan.modes:
        mode = plan.specs[m]
        if mode.schedule == "cold":
            curves.append(CurveSpec((COLD_POLICY, m), mode.old_side, mode.new_side, ccounts, None))
            continue
        for p in plan.policies:
            curves.append(CurveSpec((p, m), mode.old_side, mode.new_side, counts, orders[(p, m)]))
    derived = {
        c.key
        for c in curves
        if old_old_cached and c.key[0] == COLD_POLICY and c.sides() == ["old-old", "new-new"]
    }
    used = {s for c in curves if c.key not in derived for s in c.sides()}
    used |= {"new-new"} if derived else set()
    static = {}
    for name, side in (("old-old", "old-old"), ("new-new", "new-new"), ("new-old", "new-old")):
        if (name == "old-old" and want_old_old and not old_old_cached) or side in used:
            static[name] = side
    for name, side in static.items():
        curves.append(CurveSpec(("reference", name), side, None, np.array([0])))
    return curves, static, derived


def n_positive_pairs(query_labels, gallery_labels) -> int:
    """How many (query, gallery item) pairs share a label: the ranks' second dimension."""
    from raycompat.metrics.rank_metrics import positive_pairs

    return int(positive_pairs(query_labels, gallery_labels)[0].size)


@dataclass
class ReferenceLookup:
    """The old-old reference in the cache (docs/simulator.md, "The reference cache"): looked up
    once per run (or once for every candidate of a pass, which share the old gallery).
    ``want_old_old``: the run needs old-old's top-1 correctness (NFR@1) and has old queries."""

    cache: ReferenceCache | None
    want_old_old: bool
    key: str | None = None
    cached: Any = None

    @classmethod
    def open(cls, spec: SimulationSpec, engine: Engine, k: int) -> ReferenceLookup:
        want = spec.reference_correct is None and engine.data.query_old is not None
        lookup = cls(spec.reference_cache, want)
        if lookup.used:
            lookup.key = engine.reference_key(k)
            pairs = n_positive_pairs(engine.query_labels, engine.gallery_labels)
            lookup.cached = spec.reference_cache.lookup(lookup.key, pairs)
        return lookup

    @property
    def used(self) -> bool:
        return self.cache is not None and self.want_old_old

    @property
    def hit(self) -> bool:
        return self.cached is not None

    def complete(self, ranks, static: dict, derived_curves: list, info: dict) -> dict:
        """The static references with old-old from the cache (a hit) or stored in it (a miss);
        ``static`` unchanged without a cache."""
        from raycompat.simulator.reference_cache import with_reference

        if not self.used:
            return static
        return with_reference(
            self.cache, self.key, self.cached, ranks, static, derived_curves, info
        )

    def report(self) -> dict | None:
        return self.cache.report(self.key) if self.used else None


@dataclass
class PlannedRun:
    """One run as :func:`plan_run` planned it: ready for the engine's ranks."""

    spec: SimulationSpec
    plan: RunPlan
    inputs: PolicyInputs
    orders: dict
    policy_seconds: dict
    curves: list[CurveSpec]
    static: dict
    derived: set
    lookup: ReferenceLookup

    def scored_curves(self) -> list[CurveSpec]:
        """The curves the engine ranks (a cold curve derived from a cache hit is not)."""
        return [c for c in self.curves if c.key not in self.derived]


def policy_inputs(spec: SimulationSpec, engine: Engine) -> PolicyInputs:
    """What the policies are given: the engine's rows and sides, the head, the seed, the
    query log's searches (the engine's) with their options."""
    options = spec.options()
    reads = None
    if spec.query_log is not None:
        reads = engine.log_searches(spec.query_log, options.demand_k, spec.rank_merge_distance)
    return PolicyInputs(
        n_items=engine.n_items,
        data=engine.data,
        head=spec.head,
        seed=spec.seed,
        learned_sample_fraction=spec.learned_sample_fraction,
        rank_merge_distance=spec.rank_merge_distance,
        device=engine.device,
        block_bytes=engine.policy_block_bytes,
        sides=engine.builder,
        options=options,
        reads=reads,
    )


def plan_run(
    spec: SimulationSpec,
    engine: Engine,
    say: Callable[[str], None],
    lookup: ReferenceLookup | None = None,
) -> PlannedRun:
    """Steps 1-5 of the module docstring; ``lookup``: a reference lookup already made (the
    candidates of one pass share the first one's)."""
    inputs = policy_inputs(spec, engine)
    plan = check_run(spec, engine.data, inputs)
    orders, seconds = engine.orders(plan, inputs, say)
    lookup = lookup or ReferenceLookup.open(spec, engine, plan.k)
    curves, static, derived = curve_specs(
        plan, orders, engine.n_items, lookup.want_old_old, lookup.hit
    )
    return PlannedRun(spec, plan, inputs, orders, seconds, curves, static, derived, lookup)


def finish_run(
    run: PlannedRun,
    ranks: EngineResult,
    engine: Engine,
    stats: dict,
    store: bool = True,
    extra_stats: dict | None = None,
) -> SimulationResult:
    """The :class:`SimulationResult` of a planned run from the engine's ranks: the references
    (old-old from the cache, or stored in it unless ``store`` is false), the metric curves, and
    with ``spec.bootstrap`` every band and interval. ``stats`` holds ``t_start``;
    ``extra_stats`` follow the reference cache's report."""
    spec, stats = run.spec, dict(stats)
    static = run.static
    if run.lookup.used and (store or run.lookup.hit):
        info = {"n_items": engine.n_items, "n_queries": engine.n_queries, "k": run.plan.k}
        derived = [c for c in run.curves if c.key in run.derived]
        static = run.lookup.complete(ranks, static, derived, info)
    if run.lookup.used:
        stats["reference_cache"] = run.lookup.report()
    stats.update(extra_stats or {})
    ranked = RankedCurves(
        run.plan, run.curves, static, ranks, run.inputs, run.orders, engine.item_costs
    )
    result = ranked.result(
        engine.n_queries, spec.reference_correct, spec.references, spec.cost, stats
    )
    if spec.bootstrap is not None:
        result.add_intervals(spec.bootstrap)
    return result


def simulate(spec: SimulationSpec, engine: Engine, say: Callable[[str], None]) -> SimulationResult:
    """One run: planned, ranked by the engine, assembled."""
    t_start = time.perf_counter()
    run = plan_run(spec, engine, say)
    ranks = engine.rank(run.scored_curves())
    stats = {"policy_seconds": run.policy_seconds, "t_start": t_start}
    return finish_run(run, ranks, engine, stats, extra_stats=engine.stats())
