"""Reports of a backfill simulation: JSON (every number), markdown tables, PNG plots.

``write_reports(result, out_dir)`` writes

* ``curves.json`` -- every curve value, flat rows ``{policy, mode, fraction,
  metric, value, items_backfilled, seconds}``, per-curve summaries (AUC, AUC
  gain, regression statistics), references, the cost model and the
  configuration; NaN is written as ``null``; an undefined AUC gain is ``null`` with its
  reason in ``auc_gain_note``. With bootstrap intervals (docs/methods.md, "Uncertainty"):
  every curve's ``bands``, every row's ``low``/``high``, every summary's ``auc_interval``,
  ``auc_gain_interval``, ``vs_random`` (the paired AUC difference to ``random`` in the same
  mode, with its ``verdict``) and ``regression_verdict`` (:func:`curve_intervals`), and
  ``compatibility``: BCT's criterion ``M(n,o) > M(o,o)`` on mAP@k as the main job gives it,
  the paired interval of ``M(n,o) - M(o,o)`` and its verdict (:func:`compatibility_verdict`);
* with a query log, every curve's ``weighted`` metrics (mAP@k and NFR@1 counting each of the
  log's evaluation queries by its frequency, bands, AUCs) and ``weighted_summary`` (per curve:
  t=0, 50 %, 100 %, AUC, the paired weighted-AUC difference to ``random``);
* ``curves.md`` -- the same as tables a person can read, every value as
  ``value [low, high]`` when there are intervals;
* with intervals, ``samples.npz`` -- the per-query terms behind them (:func:`write_samples`),
  for the planner's paired intervals;
* ``<metric>_vs_fraction.png`` / ``<metric>_vs_time.png`` -- see
  :mod:`raycompat.simulator.plots`.

All values are fractions in [0, 1] in the JSON; the markdown shows percentages.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from raycompat.report import markdown_table, with_version, write_json
from raycompat.upgrade.grid import backfill_counts

__all__ = [
    "auc_difference",
    "compatibility_verdict",
    "auc_gain_interval",
    "auc_gain_notes",
    "curve_bootstrap",
    "curve_intervals",
    "curve_rows",
    "load_json",
    "markdown_report",
    "regression_text",
    "regression_verdict",
    "summary_rows",
    "weighted_summary",
    "write_samples",
    "write_reports",
]


def _pct(v) -> float | None:
    if v is None:
        return None
    v = float(v)
    return 100.0 * v if np.isfinite(v) else None


def _pct_iv(value, low=None, high=None) -> str | float | None:
    """``12.34 [11.02, 13.60]`` in percent, the plain percentage without an interval, ``12.34
    [no interval]`` when the bootstrap refused one (NaN bounds)."""
    v, lo, hi = _pct(value), _pct(low), _pct(high)
    if v is None or low is None or high is None:
        return v
    if lo is None or hi is None:
        return f"{v:.2f} [no interval]"
    return f"{v:.2f} [{lo:.2f}, {hi:.2f}]"


def _band(curve, metric: str, j: int) -> tuple:
    band = curve.bands.get(metric)
    return (None, None) if not band else (band["low"][j], band["high"][j])


def _area(fractions: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Trapezoid area over the last axis (the grid), any leading axes."""
    return ((values[..., 1:] + values[..., :-1]) / 2.0 * np.diff(fractions)).sum(axis=-1)


def _full_range(result) -> bool:
    return bool(result.fractions[0] == 0 and result.fractions[-1] == 1)


def curve_bootstrap(result):
    """The :class:`~raycompat.metrics.bootstrap.Bootstrap` behind ``result``'s bands (its query
    labels registered), or None when the simulation had no ``bootstrap``."""
    from raycompat.metrics.bootstrap import Bootstrap
    from raycompat.simulator.results import QUERIES

    if result.bootstrap is None or result.query_labels is None:
        return None
    boot = Bootstrap(result.bootstrap)
    boot.add_query_set(QUERIES, result.query_labels)
    return boot


def _better(metric: str, iv):
    """The interval of a difference read as "better": for NFR (lower is better) negated."""
    if not metric.startswith("NFR"):
        return iv
    return dataclasses.replace(
        iv,
        estimate=0.0 - iv.estimate,  # 0.0 - x: no -0.0 in a report
        low=0.0 - iv.high,
        high=0.0 - iv.low,
        per_seed=tuple(0.0 - x for x in iv.per_seed),
    )


def auc_difference(result, boot, curve, base, metric: str):
    """Paired ``AUC(curve) - AUC(base)`` over the same query resamples (for NFR ``AUC(base) -
    AUC(curve)``: positive is better), or None."""
    a, b = curve.samples.get(metric), base.samples.get(metric)
    if boot is None or a is None or b is None or not _full_range(result):
        return None
    f = np.asarray(result.fractions, dtype=np.float64)
    return _better(metric, boot.interval(lambda a, b: _area(f, a - b), a=a, b=b))


def auc_gain_interval(result, boot, curve, metric: str, newstar=None):
    """The interval of the AUC gain (RM Table 1): the curve and old-old resampled together,
    new*-new* too when its per-query ``newstar`` sample is given (else held at its value)."""
    from raycompat.metrics.curves import auc_gain

    c = curve.samples.get(metric)
    oo = result.reference_samples.get("old-old", {}).get(metric)
    if (
        boot is None
        or c is None
        or oo is None
        or curve.summary.get(metric, {}).get("auc_gain") is None
    ):
        return None
    f = np.asarray(result.fractions, dtype=np.float64)
    if newstar is not None:
        return boot.interval(
            lambda c, oo, ns: auc_gain(_area(f, c), oo, ns), c=c, oo=oo, ns=newstar
        )
    ns = result.references["new*-new*"][metric]
    return boot.interval(lambda c, oo: auc_gain(_area(f, c), oo, ns), c=c, oo=oo)


def regression_verdict(boot, curve, metric: str) -> tuple[str, int] | None:
    """``(verdict, checks held)`` on "the curve regresses" (RACT Eq.3): every grid point
    against t=0 and every step against the point before, each a paired difference (worse
    positive) with its verdict, combined with :func:`~raycompat.metrics.verdicts.combine_any`."""
    from raycompat.metrics.bootstrap import Interval
    from raycompat.metrics.verdicts import HELD, combine_any, verdict

    sample = curve.samples.get(metric)
    if boot is None or sample is None or not np.isfinite(curve.metrics[metric]).all():
        return None
    sign = -1.0 if metric.startswith("NFR") else 1.0  # worse: lower (NFR: higher)

    def worsening(c):
        c = sign * c
        return np.concatenate([c[..., :1] - c[..., 1:], c[..., :-1] - c[..., 1:]], axis=-1)

    band = boot.interval(worsening, c=sample)
    conf = boot.options.confidence
    checks = [
        verdict(Interval(float("nan"), float(lo), float(hi), conf, 0, 0))
        for lo, hi in zip(band["low"], band["high"], strict=True)
    ]
    return combine_any(checks), checks.count(HELD)


def curve_intervals(result, newstar: dict | None = None) -> dict:
    """Per ``(policy, mode, metric)`` of every curve: ``auc_gain_interval`` (``[low, high]``),
    ``vs_random`` (:func:`auc_difference` to ``random`` in the same mode, with its
    ``verdict``) and ``regression_verdict`` / ``regression_held`` (:func:`regression_verdict`);
    empty without a bootstrap. ``newstar``: ``{metric: Sample}`` of new*-new*, when known."""
    from raycompat.metrics.verdicts import verdict

    boot = curve_bootstrap(result)
    if boot is None:
        return {}
    out = {}
    for c in result.curves:
        base = next((b for b in result.curves if (b.policy, b.mode) == ("random", c.mode)), None)
        if c.mode == "cold" or base is c:
            base = None
        for n in result.metric_names:
            gain = auc_gain_interval(result, boot, c, n, (newstar or {}).get(n))
            vs = None if base is None else auc_difference(result, boot, c, base, n)
            reg = regression_verdict(boot, c, n)
            out[(c.policy, c.mode, n)] = dict(
                auc_gain_interval=None if gain is None else [gain.low, gain.high],
                vs_random=None if vs is None else dict(vs.to_dict(), verdict=verdict(vs)),
                regression_verdict=None if reg is None else reg[0],
                regression_held=None if reg is None else reg[1],
            )
    return out


def compatibility_verdict(result) -> dict | None:
    """BCT's criterion ``M(n,o) > M(o,o)`` on mAP@k (the static new-old and old-old
    references), as the main job gives it: ``difference``, the paired interval of ``M(n,o) -
    M(o,o)`` (same queries, same draws), and its ``verdict`` (held / not held / inconclusive;
    ``compatible``: held). None without a bootstrap or without both references."""
    from raycompat.metrics.verdicts import HELD, verdict

    boot = curve_bootstrap(result)
    metric = result.metric_names[0]
    no, oo = (result.reference_samples.get(r, {}).get(metric) for r in ("new-old", "old-old"))
    if boot is None or no is None or oo is None:
        return None
    diff = boot.interval(lambda a, b: a - b, a=no, b=oo)
    held = verdict(diff)
    return dict(
        metric=metric,
        criterion="M(new, old) > M(old, old)",
        compatible=held == HELD,
        verdict=held,
        difference=diff.to_dict(),
        m_old_old=result.references["old-old"][metric],
        m_new_old=result.references["new-old"][metric],
    )


def _compatibility_lines(compatibility: dict | None, confidence: float) -> list[str]:
    """The compatibility verdict as a table (percent; the difference in points)."""
    if compatibility is None:
        return []
    d = compatibility["difference"]
    dropped = f", {d['dropped']} of {d['resamples']} resamples undefined" if d["dropped"] else ""
    row = [
        compatibility["m_old_old"],
        compatibility["m_new_old"],
        f"{_pct_iv(d['value'], d['low'], d['high'])}, {d['queries']} queries in "
        f"{d['classes']} classes{dropped}",
        compatibility["verdict"],
    ]
    headers = ["M(o,o)", "M(n,o)", f"M(n,o) - M(o,o) [{100 * confidence:g} % interval] (paired)"]
    return [
        f"## Compatibility (BCT criterion on {compatibility['metric']})",
        "",
        "The claim M(n,o) > M(o,o) (new queries against the old gallery beat the old system) is "
        "held when the paired interval of the difference is above 0, not held when it is at or "
        "below 0, inconclusive when it contains 0 (or when it has no interval).",
        "",
        markdown_table(headers + ["verdict"], [[_pct(row[0]), _pct(row[1]), *row[2:]]], digits=2),
        "",
    ]


def summary_rows(result, intervals: dict) -> list[dict]:
    """``result.summary_rows()`` with :func:`curve_intervals`'s entries."""
    rows = result.summary_rows()
    for r in rows:
        c = result.curve(r["policy"], r["mode"])
        r.update(intervals.get((c.policy, c.mode, r["metric"]), {}))
    return rows


def curve_rows(result) -> list[dict]:
    """``result.rows()`` with each value's band, ``low``/``high`` (None without one)."""
    rows = result.rows()
    for r in rows:
        c = result.curve(r["policy"], r["mode"])
        j = int(np.argmin(np.abs(c.fractions - r["fraction"])))
        low, high = _band(c, r["metric"], j)
        ok = r["value"] is not None and low is not None
        r.update(low=low if ok else None, high=high if ok else None)
    return rows


def _time_unit(seconds: float):
    for unit, div in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * div:
            return unit, div
    return "s", 1.0


def regression_text(reg, extra: dict | None = None) -> str:
    """RACT Eq.3's points below start and drops, and with intervals the verdict on "the curve
    regresses" (:func:`regression_verdict`)."""
    said = (extra or {}).get("regression_verdict")
    tail = "" if said is None else f"; regression {said}"
    if reg is None:
        return "n/a"
    if not reg["has_regression"]:
        return "none" + tail
    parts = []
    if reg["points_below_start"]:
        parts.append(
            f"{len(reg['points_below_start'])} pt below start "
            f"(max {100 * reg['max_below_start']:.2f})"
        )
    if reg["drops"]:
        parts.append(f"{len(reg['drops'])} drop(s) (max {100 * reg['max_drop']:.2f})")
    return "; ".join(parts) + tail


def _setup_lines(result) -> list[str]:
    """The gallery, metrics, grid and cost model, in words."""
    lines = [
        f"Gallery: {result.n_items:,} items; queries: {result.n_queries:,} "
        f"({result.n_valid_queries:,} with at least one positive). Metrics in %; "
        f"mAP@{result.k} (GLDv2 AP@k), mAP (revisited protocol, full ranking), top-1 (CMC), "
        "NFR@1 (RACT Eq.12, against old-old). Grid: "
        f"{len(result.fractions)} points from {100 * result.fractions[0]:g}% "
        f"to {100 * result.fractions[-1]:g}%; "
        "at fraction t the first floor(t*N + 1/2) items of the policy's order "
        "hold their new vector; "
        "ties ranked by lower gallery index.",
        "",
    ]
    if result.cost is not None and result.cost.by_cost:
        lines.append(_cost_axis_line(result))
    elif result.cost is not None:
        c = result.cost
        total = c.seconds([result.n_items])[0]
        unit, div = _time_unit(total)
        lines.append(
            f"Cost model ({c.source}): {c.describe()} "
            f"= {c.items_per_s:g} items/s; the full backfill of {result.n_items:,} items takes "
            f"{total / div:,.2f} {unit}; time(t) = n(t) / ({c.items_per_s:g} items/s) for every "
            "mode (cold re-embeds in the background and switches at t = 100%)."
        )
    else:
        lines.append(
            "Cost model: none (pass items per second per GPU, or a new model to measure it, "
            "to get a simulated time axis)."
        )
    return lines + [""]


def _cost_axis_line(result) -> str:
    """The cost model when items have costs: the time axis sums them along each order."""
    c = result.cost
    total = max(float(cv.backfilled_cost[-1]) for cv in result.curves)
    unit, div = _time_unit(c.seconds([total])[0])
    return (
        f"Cost model ({c.source}): {c.describe()} = {c.items_per_s:g} {c.unit}/s; items cost "
        f"their {c.unit!r} column, {total:,.6g} {c.unit} in all, so the full backfill takes "
        f"{c.seconds([total])[0] / div:,.2f} {unit}; time(t) = (sum of {c.unit} of the first "
        f"n(t) items of the curve's order) / ({c.items_per_s:g} {c.unit}/s), cold in gallery "
        "order."
    )


def _query_log_lines(result) -> list[str]:
    """What the query log is (demand, upgrade-on-read, weighted metrics)."""
    q = result.query_log
    if not q:
        return []
    opts = result.config.get("policy_options", {})
    return [
        f"Query log `{q['source']}` ({q['form']}): {q['searches']:,} searches of "
        f"{q['distinct']:,} distinct {'queries' if q['form'] == 'queries' else 'returned items'}"
        f"{', in time order' if q['time_order'] else ''}; {q['evaluation_queries']:,} of them "
        f"are evaluation queries (the weighted metrics); top-{q['k']} per search in the mode's "
        f"t=0 state; demand's ties and upgrade-on-read's queue: {opts.get('order_base')}; "
        f"upgrade-on-read: {opts.get('queries_per_item'):g} searches per backfilled item, the "
        f"last {opts.get('read_window')} searches' results to the front.",
        "",
    ]


def weighted_summary(result) -> list[dict]:
    """Per curve and weighted metric (query log): t=0, t=50 %, t=100 %, AUC with intervals,
    and with a bootstrap the paired AUC difference to ``random`` in the same mode over the
    log's queries (for NFR, random's minus the policy's) and its verdict."""
    from raycompat.metrics.bootstrap import Bootstrap
    from raycompat.metrics.verdicts import verdict
    from raycompat.simulator.results import LOG_QUERIES

    curves = [c for c in result.curves if c.weighted]
    if not curves:
        return []
    boot = None
    if result.bootstrap is not None:
        boot = Bootstrap(result.bootstrap)
        n = next(iter(curves[0].weighted_samples.values())).num.shape[1]
        boot.add_query_set(LOG_QUERIES, np.arange(n))
    f = np.asarray(result.fractions, dtype=np.float64)
    mid = int(np.argmin(np.abs(f - 0.5)))
    rows = []
    for c in curves:
        base = next((b for b in curves if (b.policy, b.mode) == ("random", c.mode)), None)
        for name, values in c.weighted.items():
            band = c.weighted_bands.get(name, {})
            row = {"policy": c.policy, "mode": c.mode, "metric": name}
            for key, j in (("start", 0), ("mid", mid), ("end", -1)):
                row[key] = [float(values[j])] + [band[b][j] for b in ("low", "high") if band]
            row["auc"] = c.weighted_auc.get(name)
            vs = None
            if boot is not None and base is not None and base is not c and c.mode != "cold":
                a, b = c.weighted_samples[name], base.weighted_samples[name]
                iv = _better(name, boot.interval(lambda a, b: _area(f, a - b), a=a, b=b))
                vs = dict(iv.to_dict(), verdict=verdict(iv))
            row["vs_random"] = vs
            rows.append(row)
    return rows


def _weighted_lines(rows: list[dict]) -> list[str]:
    """The frequency-weighted metrics as a table (percent)."""
    if not rows:
        return []
    table = []
    for r in rows:
        auc = r["auc"] or {}
        vs = r["vs_random"]
        table.append(
            [r["policy"], r["mode"], r["metric"]]
            + [_pct_iv(*r[k]) if len(r[k]) == 3 else _pct(r[k][0]) for k in ("start", "mid", "end")]
            + [_pct_iv(auc.get("auc"), *(auc.get("interval") or (None, None)))]
            + [None if vs is None else _vs_random_text({"vs_random": vs})]
        )
    return [
        "## Frequency-weighted metrics (query log)",
        "",
        "Each of the log's evaluation queries counted as often as it was searched, M_w = sum_q "
        "f_q M_q / sum_q f_q; intervals resample the log's distinct queries; better than random: "
        "the paired difference of the weighted AUCs (for NFR, random's minus the policy's).",
        "",
        markdown_table(
            ["policy", "mode", "metric", "t=0", "t=50%", "t=100%", "AUC", "better than random"],
            table,
            digits=2,
        ),
        "",
    ]


def _run_lines(result) -> list[str]:
    """Where the passes ran: the engine, and for a distributed run the blocks per node, the
    read rate and the peak memory of the driver and of every worker."""
    d = result.stats.get("distributed")
    if not d:
        return []
    gib = 2.0**30
    per_worker = d["peak_rss_per_worker"]
    lines = [
        "## Where it ran",
        "",
        f"Distributed engine (Ray): {d['blocks']} blocks (parquet row groups) on "
        f"{len(d['blocks_per_node'])} node(s) "
        f"({', '.join(f'{n[:8]}: {c}' for n, c in d['blocks_per_node'].items())}), "
        f"devices {', '.join(d['devices'])}; "
        f"scoring pass {d['steps']['score']['seconds']:.1f} s, "
        f"{d['items_per_s'] or 0:,.0f} items/s, {(d['bytes_per_s'] or 0) / 2**20:,.1f} MiB/s read.",
        "",
        f"Peak resident memory: driver {d['peak_rss_driver'] / gib:.2f} GiB; "
        f"{len(per_worker)} worker process(es), largest "
        f"{max(per_worker.values(), default=0) / gib:.2f} GiB "
        "(resident set, shared libraries counted in each).",
        "",
    ]
    return lines


def _references_lines(result) -> list[str]:
    if not result.references:
        return []
    ivs = result.reference_intervals
    rows = [
        [ref]
        + [
            _pct_iv(v.get(n), *((ivs.get(ref, {}).get(n) or {}).get(k) for k in ("low", "high")))
            for n in result.metric_names
        ]
        for ref, v in result.references.items()
    ]
    return [
        "## References (static searches)",
        "",
        markdown_table(["retrieval"] + list(result.metric_names), rows, digits=2),
        "",
    ]


def auc_gain_notes(summaries) -> list[str]:
    """One line per distinct reason an AUC gain is ``n/a``: ``"AUC gain n/a for <metric>:
    <auc_gain_note>"``, in first-seen order (printed once under a table)."""
    seen = dict.fromkeys(
        (s.get("metric"), s["auc_gain_note"]) for s in summaries if s.get("auc_gain_note")
    )
    return [f"AUC gain n/a for {m}: {note}." if m else f"AUC gain n/a: {note}." for m, note in seen]


def _vs_random_text(extra: dict) -> str | None:
    vs = extra.get("vs_random")
    return None if vs is None else f"{_pct_iv(vs['value'], vs['low'], vs['high'])} {vs['verdict']}"


def _summary_lines(result, intervals: dict) -> list[str]:
    """Per policy, mode and metric: t=0, t=50%, t=100%, AUC, AUC gain, regression; with
    intervals each as ``value [low, high]`` and the paired AUC difference to random."""
    vs_random = any(e.get("vs_random") for e in intervals.values())
    headers = ["policy", "mode", "metric", "t=0", "t=50%", "t=100%", "AUC", "AUC gain"]
    headers += ["better than random (AUC, paired)"] if vs_random else []
    rows = []
    mid = int(np.argmin(np.abs(result.fractions - 0.5)))
    for c in result.curves:
        for n in result.metric_names:
            s, v = c.summary.get(n, {}), c.metrics[n]
            extra = intervals.get((c.policy, c.mode, n), {})
            gain = extra.get("auc_gain_interval") or (None, None)
            rows.append(
                [c.policy, c.mode, n]
                + [_pct_iv(v[j], *_band(c, n, j)) for j in (0, mid, -1)]
                + [_pct_iv(s.get("auc"), *(s.get("auc_interval") or (None, None))[:2])]
                + [_pct_iv(s.get("auc_gain"), *gain)]
                + ([_vs_random_text(extra)] if vs_random else [])
                + [regression_text(s.get("regression"), extra)]
            )
    notes = [f"- {line}" for line in auc_gain_notes(result.summary_rows())]
    said = (
        " `value [low, high]`: the bootstrap interval over the query classes (docs/methods.md, "
        "Uncertainty); better than random: the paired AUC difference to the random order in "
        "the same mode (for NFR, random's minus the policy's) and its verdict; regression "
        "verdict: held when a grid point's (or a step's) paired interval shows it worse than "
        "t=0 (than the point before), not held when every interval excludes a worsening."
        if intervals
        else ""
    )
    return [
        "## Summary per policy and mode",
        "",
        "AUC: trapezoid area over t in [0, 1] (RM); AUC gain: (AUC - AUC(old-old)) / "
        "(AUC(new*-new*) - AUC(old-old)) (RM Table 1, needs the new* reference and "
        "new*-new* better than old-old; n/a otherwise, with the reason under the table); "
        "regression: points below the t=0 value and drops between consecutive points (RACT Eq.3; "
        "for NFR, rises)." + said,
        "",
        markdown_table(headers + ["regression"], rows, digits=2),
        "",
        *(notes + [""] if notes else []),
    ]


def _metric_table_lines(result, n: str) -> list[str]:
    """Metric ``n`` (%) of every curve at each backfill fraction (and the simulated time)."""
    unit, div = "s", 1.0
    timed = result.cost is not None and not result.cost.by_cost  # by cost: per curve, in JSON
    if timed:
        unit, div = _time_unit(float(result.cost.seconds([result.n_items])[0]))
    cols = (
        ["backfilled"]
        + ([f"time ({unit})"] if timed else [])
        + [f"{c.policy} / {c.mode}" for c in result.curves]
    )
    counts = backfill_counts(result.fractions, result.n_items)  # the same for every mode
    rows = []
    for j, t in enumerate(result.fractions):
        row = [f"{100 * t:g}%"]
        if timed:
            row.append(float(result.cost.seconds([counts[j]])[0]) / div)
        row += [_pct_iv(c.metrics[n][j], *_band(c, n, j)) for c in result.curves]
        rows.append(row)
    return [f"## {n} (%) at each backfill fraction", "", markdown_table(cols, rows, digits=2), ""]


def markdown_report(
    result,
    *,
    title: str = "Backfill simulation",
    plots: list[str] | None = None,
    intervals: dict | None = None,
    compatibility: dict | None = None,
) -> str:
    """Markdown: setup, references, the compatibility verdict, summary (AUC, AUC gain,
    regression) and per-metric curve tables; ``intervals``: :func:`curve_intervals`,
    ``compatibility``: :func:`compatibility_verdict` (each computed when not given)."""
    intervals = curve_intervals(result) if intervals is None else intervals
    compatibility = compatibility_verdict(result) if compatibility is None else compatibility
    confidence = None if result.bootstrap is None else result.bootstrap.confidence
    lines = (
        [f"# {title}", ""]
        + _setup_lines(result)
        + _query_log_lines(result)
        + _run_lines(result)
        + _references_lines(result)
        + _compatibility_lines(compatibility, confidence)
        + _summary_lines(result, intervals)
        + _weighted_lines(weighted_summary(result))
    )
    for n in result.metric_names:
        lines += _metric_table_lines(result, n)
    if plots:
        lines += (
            ["## Plots", ""]
            + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
            + [""]
        )
    return "\n".join(lines)


def write_reports(
    result,
    out_dir: str,
    *,
    plots: bool = True,
    title: str = "Backfill simulation",
    extra: dict | None = None,
    intervals: dict | None = None,
) -> dict[str, object]:
    """Write ``curves.json``, ``curves.md`` and the PNGs; returns ``{"json", "markdown",
    "plots"}`` paths. ``intervals``: :func:`curve_intervals` (computed when not given)."""
    os.makedirs(out_dir, exist_ok=True)
    pngs: list[str] = []
    if plots:
        from raycompat.simulator.plots import plot_curves

        pngs = plot_curves(result, out_dir)
    intervals = curve_intervals(result) if intervals is None else intervals
    compatibility = compatibility_verdict(result)
    payload = result.to_dict()
    if result.bootstrap is not None:
        payload.update(rows=curve_rows(result), summary=summary_rows(result, intervals))
    if compatibility is not None:
        payload["compatibility"] = compatibility
    weighted = weighted_summary(result)
    if weighted:
        payload["weighted_summary"] = weighted
    if extra:
        payload["extra"] = extra
    jpath = write_json(os.path.join(out_dir, "curves.json"), with_version(payload))
    samples = write_samples(result, out_dir)
    mpath = os.path.join(out_dir, "curves.md")
    tmp = mpath + ".tmp"
    with open(tmp, "w") as f:
        f.write(
            markdown_report(
                result, title=title, plots=pngs, intervals=intervals, compatibility=compatibility
            )
        )
    os.replace(tmp, mpath)
    return {"json": jpath, "markdown": mpath, "plots": pngs, "samples": samples}


#: the per-query terms behind every interval of ``curves.json`` (read by the planner)
SAMPLES_FILE = "samples.npz"


def write_samples(result, out_dir: str) -> str | None:
    """``samples.npz``: the query labels and, per curve (its index in ``curves.json``) and per
    static reference, every metric's per-query terms (:class:`~raycompat.metrics.bootstrap.Sample`
    ``num`` [seeds, queries, points] and ``den`` [seeds, queries]), with a query log their
    frequency-weighted terms too (keys prefixed ``weighted:``), so that a reader can draw the
    same paired resamples (docs/simulator.md, "Outputs"). None without a bootstrap."""
    if result.bootstrap is None or result.query_labels is None:
        return None
    arrays = {"query_labels": np.asarray(result.query_labels)}
    parts = [(f"curve{i}", c.samples) for i, c in enumerate(result.curves)]
    parts += [(f"ref:{name}", s) for name, s in result.reference_samples.items()]
    # with a query log, the frequency-weighted terms too (its distinct queries resampled)
    parts += [(f"weighted:curve{i}", c.weighted_samples) for i, c in enumerate(result.curves)]
    parts += [(f"weighted:ref:{n}", s) for n, s in result.reference_weighted_samples.items()]
    for key, samples in parts:
        for metric, sample in samples.items():
            arrays[f"{key}|{metric}|num"] = sample.num
            arrays[f"{key}|{metric}|den"] = sample.den
    path = os.path.join(out_dir, SAMPLES_FILE)
    with open(path + ".tmp", "wb") as fh:
        np.savez_compressed(fh, **arrays)
    os.replace(path + ".tmp", path)
    return path


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def write_candidates_summary(results: dict, columns: dict, written: dict, out_dir: str) -> dict:
    """``candidates.json`` and ``candidates.md``: every candidate's column, report, static
    references and the AUC of every curve with its interval, side by side."""
    names = list(results)
    first = results[names[0]]
    payload = {"candidates": {}}
    for n, r in results.items():
        payload["candidates"][n] = {
            "column": columns[n],
            "report": written[n]["json"],
            "references": r.references,
            "reference_intervals": r.reference_intervals,
            "auc": [
                {
                    "policy": c.policy,
                    "mode": c.mode,
                    "metric": m,
                    "auc": c.summary.get(m, {}).get("auc"),
                    "auc_interval": c.summary.get(m, {}).get("auc_interval"),
                }
                for c in r.curves
                for m in r.metric_names
            ],  # fmt: skip
        }
    jpath = write_json(os.path.join(out_dir, "candidates.json"), with_version(payload))
    lines = [f"# Candidates: {', '.join(names)}", ""]
    for m in (first.metric_names[0], "NFR@1"):
        lines += [f"## AUC of {m} along the backfill", ""]
        rows = []
        for c in first.curves:
            row = [c.policy, c.mode]
            for n in names:
                s = results[n].curve(c.policy, c.mode).summary.get(m, {})
                row.append(_auc_text(s.get("auc"), s.get("auc_interval")))
            rows.append(row)
        lines += [markdown_table(["policy", "mode", *names], rows), ""]
    lines += ["Reports: " + ", ".join(f"[{n}]({n}/curves.md)" for n in names), ""]
    mpath = os.path.join(out_dir, "candidates.md")
    with open(mpath, "w") as fh:
        fh.write("\n".join(lines))
    return {"json": jpath, "markdown": mpath}


def _auc_text(auc, interval) -> str:
    if auc is None:
        return "n/a"
    if not interval:
        return f"{auc:.4f}"
    return f"{auc:.4f} [{interval[0]:.4f}, {interval[1]:.4f}]"
