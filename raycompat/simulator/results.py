"""What a simulation gives back (docs/simulator.md, "Reports"): every curve with its metrics at
every grid point, its per-query terms, bands and summaries (:class:`BackfillCurve`), and the
whole run's result (:class:`SimulationResult`), assembled from the engine's ranks by
:class:`RankedCurves` -- the same for the in-memory and the Ray engines and for several
candidates in one pass.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from raycompat.metrics import auc, auc_gain, regression_stats
from raycompat.metrics.bootstrap import Bootstrap, BootstrapOptions, Sample
from raycompat.metrics.curves import auc_gain_note
from raycompat.metrics.rank_metrics import METRIC_NAMES, metrics_from_ranks
from raycompat.upgrade.grid import backfill_counts

if TYPE_CHECKING:
    from raycompat.embeddings.gallery import GalleryEmbeddings
    from raycompat.simulator.run_plan import RunPlan
    from raycompat.upgrade.cost import CostModel
    from raycompat.upgrade.policies import PolicyInputs
    from raycompat.upgrade.query_log import LogSearches

__all__ = [
    "BackfillCurve",
    "RankedCurves",
    "SimulationResult",
    "per_query_samples",
    "QUERIES",
    "LOG_QUERIES",
]

#: the query set name of a simulation's per-query samples
QUERIES = "queries"
#: the query set of the frequency-weighted samples: the query log's distinct evaluation queries
LOG_QUERIES = "log queries"
#: the metrics weighted by query frequency (index into ``METRIC_NAMES(k)``: mAP@k, NFR@1)
WEIGHTED = (0, 3)


@dataclass
class BackfillCurve:
    """One backfill curve (policy x mode): metric values at every grid point.

    ``counts``: items whose new vector is served at each point (``cold``: 0 until t = 1).
    ``backfilled``: items the backfill job has re-embedded by then, ``n(t)`` for every mode
    (defaults to ``counts``); ``seconds`` is its cost.  ``backfilled_cost``: with items' costs,
    their sum over the items re-embedded by then.  ``weighted``: per weighted metric, its value
    at every grid point over the query log's queries (``weighted_samples``, ``weighted_bands``).
    """

    policy: str
    mode: str
    fractions: np.ndarray
    counts: np.ndarray
    metrics: dict[str, np.ndarray]
    seconds: np.ndarray | None = None
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)
    backfilled: np.ndarray | None = None
    #: per metric, the per-query terms at every grid point (``[1, Q, J]``)
    samples: dict[str, Sample] = field(default_factory=dict, repr=False)
    #: per metric, the bootstrap band ``{"low": [J], "high": [J]}`` (with ``bootstrap``)
    bands: dict[str, dict[str, list]] = field(default_factory=dict)
    backfilled_cost: np.ndarray | None = None
    weighted: dict[str, np.ndarray] = field(default_factory=dict)
    weighted_samples: dict[str, Sample] = field(default_factory=dict, repr=False)
    weighted_bands: dict[str, dict[str, list]] = field(default_factory=dict)
    #: per weighted metric: its AUC and, with ``bootstrap``, the AUC's interval
    weighted_auc: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self):
        if self.backfilled is None:
            self.backfilled = np.asarray(self.counts).copy()

    @property
    def label(self) -> str:
        return f"{self.policy} / {self.mode}"


@dataclass
class SimulationResult:
    k: int
    fractions: np.ndarray
    n_items: int
    n_queries: int
    n_valid_queries: int
    policies: list[str]
    modes: list[str]
    curves: list[BackfillCurve]
    references: dict[str, dict[str, float]]
    cost: CostModel | None
    stats: dict[str, Any]
    config: dict[str, Any]
    #: the policy orders, ``{(policy, mode): permutation}`` (not written to JSON)
    orders: dict[tuple, np.ndarray] = field(default_factory=dict, repr=False)
    #: the query labels (the classes the bootstrap resamples) and, per static reference,
    #: its per-query samples ``{name: {metric: Sample}}``
    query_labels: np.ndarray | None = field(default=None, repr=False)
    reference_samples: dict[str, dict[str, Sample]] = field(default_factory=dict, repr=False)
    #: the bootstrap behind the bands, or None
    bootstrap: BootstrapOptions | None = None
    #: per static reference and metric, its interval ``{low, high}``
    reference_intervals: dict[str, dict[str, dict]] = field(default_factory=dict)
    #: the query log behind ``demand`` / ``upgrade-on-read`` and the weighted metrics, or None
    query_log: dict | None = None
    #: per static reference, its frequency-weighted metrics ``{metric: {value[, low, high]}}``
    weighted_references: dict[str, dict[str, dict]] = field(default_factory=dict)
    reference_weighted_samples: dict[str, dict[str, Sample]] = field(
        default_factory=dict, repr=False
    )

    def add_intervals(self, options: BootstrapOptions) -> None:
        """Bands on every curve, and intervals on every AUC and static reference."""
        boot = Bootstrap(options)
        boot.add_query_set(QUERIES, self.query_labels)
        grid = np.asarray(self.fractions, dtype=np.float64)
        full = bool(grid[0] == 0.0 and grid[-1] == 1.0)
        self._weighted_intervals(boot, grid, full)
        for c in self.curves:
            for name, sample in c.samples.items():
                band = boot.interval(curve=sample)
                c.bands[name] = {
                    "low": [float(x) for x in band["low"]],
                    "high": [float(x) for x in band["high"]],
                    "dropped": [int(x) for x in band["dropped"]],  # undefined resamples
                }
                summary = c.summary.get(name)
                if summary is not None and summary.get("auc") is not None:
                    iv = boot.interval(lambda curve: _trapezoid(grid, curve), curve=sample)
                    summary["auc_interval"] = [iv.low, iv.high]
                    if not full:
                        summary["auc_interval"] = None
        for ref, samples in self.reference_samples.items():
            self.reference_intervals[ref] = {
                name: {"low": iv.low, "high": iv.high, "dropped": iv.dropped}
                for name, iv in ((n, boot.interval(m=s)) for n, s in samples.items())
            }
        self.bootstrap = options

    def _weighted_intervals(self, boot: Bootstrap, grid: np.ndarray, full: bool) -> None:
        """Bands and AUC intervals of the frequency-weighted curves, and intervals of the
        weighted references: the log's distinct evaluation queries resampled."""
        samples = [s for c in self.curves for s in c.weighted_samples.values()]
        if not samples:
            return
        boot.add_query_set(LOG_QUERIES, np.arange(samples[0].num.shape[1]))
        for c in self.curves:
            for name, sample in c.weighted_samples.items():
                band = boot.interval(curve=sample)
                c.weighted_bands[name] = {
                    "low": [float(x) for x in band["low"]],
                    "high": [float(x) for x in band["high"]],
                    "dropped": [int(x) for x in band["dropped"]],
                }
                if full and name in c.weighted_auc:
                    iv = boot.interval(lambda curve: _trapezoid(grid, curve), curve=sample)
                    c.weighted_auc[name]["interval"] = [iv.low, iv.high]
        for ref, samples_of in self.reference_weighted_samples.items():
            for name, sample in samples_of.items():
                iv = boot.interval(m=sample)
                self.weighted_references[ref][name].update(low=iv.low, high=iv.high)

    def states(self, policy: str, mode: str, j: int) -> np.ndarray:
        """int8 ``[N]`` at grid point ``j``: 1 = the item holds its new vector, 0 = its old one."""
        c = self.curve(policy, mode)
        st = np.zeros(self.n_items, dtype=np.int8)
        order = self.orders.get((policy, mode), np.arange(self.n_items))
        st[order[: int(c.counts[j])]] = 1
        return st

    @property
    def metric_names(self) -> tuple:
        return METRIC_NAMES(self.k)

    def curve(self, policy: str, mode: str) -> BackfillCurve:
        for c in self.curves:
            if c.mode == mode and (c.policy == policy or (mode == "cold")):
                return c
        raise KeyError((policy, mode))

    def rows(self) -> list[dict[str, Any]]:
        """Flat rows ``{policy, mode, fraction, metric, value, items_backfilled, seconds}``.

        Every requested (policy, mode) pair has rows; the cold curve (policy
        independent) is repeated under each policy.
        """
        out = []
        for c in self.curves:
            pols = self.policies if c.mode == "cold" else [c.policy]
            for pol in pols:
                for name in self.metric_names:
                    for j, t in enumerate(c.fractions):
                        v = float(c.metrics[name][j])
                        out.append(
                            {
                                "policy": pol,
                                "mode": c.mode,
                                "fraction": float(t),
                                "metric": name,
                                "value": v if np.isfinite(v) else None,
                                "items_backfilled": int(c.backfilled[j]),
                                "seconds": None if c.seconds is None else float(c.seconds[j]),
                                "cost_backfilled": None
                                if c.backfilled_cost is None
                                else float(c.backfilled_cost[j]),
                            }
                        )
        return out

    def summary_rows(self) -> list[dict[str, Any]]:
        """``{policy, mode, metric, start, end, min, max, auc, auc_gain, full_range, regression}``
        per curve and metric (the cold curve repeated under each policy, as in :meth:`rows`)."""
        out = []
        for c in self.curves:
            for pol in self.policies if c.mode == "cold" else [c.policy]:
                for name in self.metric_names:
                    s = dict(c.summary.get(name, {}))
                    s.update(policy=pol, mode=c.mode, metric=name)
                    out.append(s)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (lists and python floats; NaN kept as float('nan'))."""
        return {
            "k": self.k,
            "fractions": [float(x) for x in self.fractions],
            "n_items": self.n_items,
            "n_queries": self.n_queries,
            "n_valid_queries": self.n_valid_queries,
            "policies": list(self.policies),
            "modes": list(self.modes),
            "metrics": list(self.metric_names),
            "references": self.references,
            "cost_model": None if self.cost is None else self.cost.to_dict(),
            "curves": [
                {
                    "policy": c.policy,
                    "mode": c.mode,
                    "fractions": [float(x) for x in c.fractions],
                    "items_backfilled": [int(x) for x in c.backfilled],
                    "items_served_new": [int(x) for x in c.counts],
                    "seconds": None if c.seconds is None else [float(x) for x in c.seconds],
                    "metrics": {k: [float(x) for x in v] for k, v in c.metrics.items()},
                    "bands": c.bands,
                    "summary": c.summary,
                    "cost_backfilled": None
                    if c.backfilled_cost is None
                    else [float(x) for x in c.backfilled_cost],
                    "weighted": {
                        "metrics": {k: [float(x) for x in v] for k, v in c.weighted.items()},
                        "bands": c.weighted_bands,
                        "auc": c.weighted_auc,
                    }
                    if c.weighted
                    else None,
                }
                for c in self.curves
            ],
            "query_log": self.query_log,
            "weighted_references": self.weighted_references,
            "bootstrap": None if self.bootstrap is None else asdict(self.bootstrap),
            "reference_intervals": self.reference_intervals,
            "rows": self.rows(),
            "summary": self.summary_rows(),
            "stats": self.stats,
            "config": self.config,
        }


def _references(res, static, k: int, reference_correct, references):
    """Metrics of the static references, and the per-query old-old top-1 correctness NFR@1
    compares against (``reference_correct`` when given); returns ``(refs, ref_correct)``."""
    refs: dict[str, dict[str, float]] = {}
    samples: dict[str, dict[str, Sample]] = {}
    ref_correct = None if reference_correct is None else np.asarray(reference_correct, dtype=bool)
    if "old-old" in static and ref_correct is None:
        cr = res.curve(("reference", "old-old"))
        _, per = metrics_from_ranks(cr.ranks, res.pairs_q, res.npos, k, None, return_per_query=True)
        ref_correct = per["correct1"][0]
    for name in static:
        cr = res.curve(("reference", name))
        mv, per = metrics_from_ranks(
            cr.ranks, res.pairs_q, res.npos, k, ref_correct, return_per_query=True
        )
        refs[name] = {mk: float(v[0]) for mk, v in mv.items()}
        samples[name] = {
            m: Sample(QUERIES, s.num[:, :, 0], s.den)
            for m, s in per_query_samples(per, res.npos, k, ref_correct).items()
        }
    for name, vals in (references or {}).items():
        refs[name] = {**refs.get(name, {}), **{str(a): float(b) for a, b in vals.items()}}
    return refs, ref_correct, samples


def _weighted_references(samples: dict, weights, k: int):
    """Per static reference, its frequency-weighted metrics and their samples."""
    values: dict[str, dict[str, dict]] = {}
    out: dict[str, dict[str, Sample]] = {}
    if weights is None:
        return values, out
    names = METRIC_NAMES(k)
    for ref, by_metric in samples.items():
        for i in WEIGHTED:
            if names[i] in by_metric:
                ws = _weighted_sample(by_metric[names[i]], weights)
                out.setdefault(ref, {})[names[i]] = ws
                values.setdefault(ref, {})[names[i]] = {"value": float(ws.value()[0])}
    return values, out


def per_query_samples(per: dict, npos: np.ndarray, k: int, ref_correct) -> dict[str, Sample]:
    """The per-query terms of every curve metric (``[1, Q, J]``) from
    :func:`~raycompat.metrics.rank_metrics.metrics_from_ranks`'s per-query arrays (``[J, Q]``):
    means over the queries with positives; NFR@1 over the old-old successes."""
    names = METRIC_NAMES(k)
    valid = (npos > 0)[None, :]  # [1, Q] against [J, Q]
    out = {
        names[0]: Sample.mean(QUERIES, np.where(valid, per["ap@k"], np.nan).T),
        names[1]: Sample.mean(QUERIES, np.where(valid, per["ap"], np.nan).T),
        names[2]: Sample.mean(QUERIES, np.where(valid, per["correct1"], np.nan).T),
    }
    if ref_correct is not None:
        flips = ref_correct[None, :] & ~per["correct1"]
        out[names[3]] = Sample.rate(QUERIES, flips.T, ref_correct)
    return out


def _trapezoid(fractions: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Trapezoid area over the last axis (the grid), any leading axes."""
    widths = np.diff(fractions)
    return ((values[..., 1:] + values[..., :-1]) / 2.0 * widths).sum(axis=-1)


def _metric_curves(
    plan: RunPlan, curves, res, ref_correct, refs, cost, n: int, costs=None, weights=None
) -> list[BackfillCurve]:
    """Per policy x mode: the metrics at every grid point, the simulated seconds (the cost of
    re-embedding ``n(t)`` items, the same for every mode; with ``costs``, their summed cost
    along the curve's order), the summaries, and with ``weights`` (:func:`_log_weights`) the
    frequency-weighted metrics."""
    out: list[BackfillCurve] = []
    work = backfill_counts(plan.grid, n)
    for c in curves:
        if c.key[0] == "reference":
            continue
        cr = res.curve(c.key)
        mv, per = metrics_from_ranks(
            cr.ranks, res.pairs_q, res.npos, plan.k, ref_correct, return_per_query=True
        )
        spent = None if costs is None else _summed_costs(costs, c.order, work)
        cv = BackfillCurve(
            policy=c.key[0],
            mode=c.key[1],
            fractions=plan.grid.copy(),
            counts=cr.counts.copy(),
            metrics=mv,
            seconds=None if cost is None else cost.seconds(work if spent is None else spent),
            backfilled=work.copy(),
            samples=per_query_samples(per, res.npos, plan.k, ref_correct),
            backfilled_cost=spent,
        )
        cv.summary = {
            name: _summaries(name, plan.grid, mv[name], refs) for name in METRIC_NAMES(plan.k)
        }
        if weights is not None:
            _add_weighted(cv, weights, plan)
        out.append(cv)
    return out


def _summed_costs(costs: np.ndarray, order, counts: np.ndarray) -> np.ndarray:
    """The summed cost of the first ``counts[j]`` items of ``order`` (``None``: gallery order),
    float64, accumulated in order."""
    c = np.asarray(costs, dtype=np.float64)
    along = c if order is None else c[np.asarray(order)]
    return np.concatenate([[0.0], np.cumsum(along)])[np.asarray(counts, dtype=np.int64)]


def _log_weights(reads: LogSearches | None):
    """``(evaluation query rows, counts)`` of the query log's queries, or None."""
    if reads is None:
        return None
    rows, counts = reads.weights()
    return (rows, counts) if rows.size else None


def _weighted_sample(sample: Sample, weights) -> Sample:
    """``sample`` over the log's queries, each counted ``f_q`` times: ``M_w = sum_q f_q num_q /
    sum_q f_q den_q``."""
    rows, f = weights
    shape = (1, rows.size) + (1,) * (sample.num.ndim - 2)
    return Sample(
        LOG_QUERIES, sample.num[:, rows] * f.reshape(shape), sample.den[:, rows] * f[None, :]
    )


def _add_weighted(cv: BackfillCurve, weights, plan: RunPlan) -> None:
    names = METRIC_NAMES(plan.k)
    for i in WEIGHTED:
        sample = cv.samples.get(names[i])
        if sample is None:
            continue
        ws = _weighted_sample(sample, weights)
        cv.weighted_samples[names[i]] = ws
        values = ws.value()[0]
        cv.weighted[names[i]] = values
        full = bool(plan.grid[0] == 0.0 and plan.grid[-1] == 1.0)
        if full and np.isfinite(values).all():
            cv.weighted_auc[names[i]] = {"auc": float(_trapezoid(plan.grid, values))}


def _config(plan: RunPlan, data: GalleryEmbeddings, inputs: PolicyInputs) -> dict[str, Any]:
    return {
        "policies": plan.policies,
        "modes": plan.modes,
        "k": plan.k,
        "seed": inputs.seed,
        "grid": [float(x) for x in plan.grid],
        "rounding": "n(t) = floor(t*N + 1/2)",
        "tie_rule": "descending score, ties by ascending gallery index",
        "learned_sample_fraction": inputs.learned_sample_fraction,
        "rank_merge_distance": inputs.rank_merge_distance,
        "policy_options": asdict(inputs.options),
        "source": data.source,
        "compatible_dim": data.compat_dim,
        "old_dim": data.old_dim,
        "new_dim": data.new_dim,
    }


def _summaries(
    name: str,
    fractions: np.ndarray,
    values: np.ndarray,
    refs: Mapping[str, Mapping[str, float]],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "start": float(values[0]),
        "end": float(values[-1]),
        "min": float(np.nanmin(values)) if np.isfinite(values).any() else float("nan"),
        "max": float(np.nanmax(values)) if np.isfinite(values).any() else float("nan"),
        "auc": None,
        "auc_gain": None,
        "auc_gain_note": None,
        "full_range": bool(fractions[0] == 0.0 and fractions[-1] == 1.0),
    }
    if np.isnan(values).any():
        out["regression"] = None
        out["auc_gain_note"] = "the curve has undefined (NaN) values"
        return out
    out["auc"] = auc(fractions, values, require_full_range=False)
    higher = not name.startswith("NFR")
    out["regression"] = regression_stats(fractions, values, higher_is_better=higher)
    out["auc_gain"], out["auc_gain_note"] = _gain(name, out["auc"], out["full_range"], refs)
    return out


def _gain(name: str, area: float, full_range: bool, refs) -> tuple[float | None, str | None]:
    """``(AUC gain, None)`` (RM Table 1), or ``(None, why it is undefined)``."""
    if name.startswith("NFR"):
        return None, "lower is better; the AUC gain is defined for higher-is-better metrics only"
    if not full_range:
        return None, "the grid does not cover t in [0, 1]"
    oo = refs.get("old-old", {}).get(name)
    ns = refs.get("new*-new*", {}).get(name)
    if oo is None or ns is None:
        missing = "new*-new*" if ns is None else "old-old"
        return None, f"no {missing} reference for {name}"
    note = auc_gain_note(oo, ns)  # AUC of a flat reference curve over [0, 1] is its value
    if note is not None:
        return None, note
    return float(auc_gain(area, oo, ns)), None


@dataclass(frozen=True)
class RankedCurves:
    """What a simulator has once the engine has ranked every curve (in memory or on Ray); its
    :meth:`result` adds the references, the metric curves and their summaries."""

    plan: RunPlan
    curves: list
    static: dict
    ranks: Any  # raycompat.simulator.assembly.EngineResult
    inputs: PolicyInputs  # n_items, and data whose source and dims the config records
    orders: dict
    #: every item's cost (the time axis sums them), or None
    costs: np.ndarray | None = None

    def result(
        self, n_queries: int, reference_correct, references, cost, stats: dict
    ) -> SimulationResult:
        """The :class:`SimulationResult`; ``stats`` holds ``t_start`` (perf_counter) and any
        other entries to report."""
        plan, res, n = self.plan, self.ranks, self.inputs.n_items
        refs, ref_correct, ref_samples = _references(
            res, self.static, plan.k, reference_correct, references
        )
        weights = _log_weights(self.inputs.reads)
        out_curves = _metric_curves(
            plan, self.curves, res, ref_correct, refs, cost, n, self.costs, weights
        )
        weighted_refs, weighted_ref_samples = _weighted_references(ref_samples, weights, plan.k)
        stats = dict(stats)
        t_start = stats.pop("t_start")
        return SimulationResult(
            k=plan.k,
            fractions=plan.grid,
            n_items=n,
            n_queries=n_queries,
            n_valid_queries=int((res.npos > 0).sum()),
            policies=plan.policies,
            modes=plan.modes,
            curves=out_curves,
            references=refs,
            cost=cost,
            stats={**stats, "engine": res.stats, "seconds": time.perf_counter() - t_start},
            config=_config(plan, self.inputs.data, self.inputs),
            orders=self.orders,
            query_labels=np.asarray(self.inputs.data.query_labels),
            reference_samples=ref_samples,
            query_log=None if self.inputs.reads is None else self.inputs.reads.summary(),
            weighted_references=weighted_refs,
            reference_weighted_samples=weighted_ref_samples,
        )
