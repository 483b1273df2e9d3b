"""Reports of a backfill simulation: JSON (every number), markdown tables, PNG plots.

``write_reports(result, out_dir)`` writes

* ``curves.json`` -- every curve value, flat rows ``{policy, mode, fraction,
  metric, value, items_backfilled, seconds}``, per-curve summaries (AUC, AUC
  gain, regression statistics), references, the cost model and the
  configuration; NaN is written as ``null``; an undefined AUC gain is ``null`` with its
  reason in ``auc_gain_note``;
* ``curves.md`` -- the same as tables a person can read; with bootstrap intervals (the job's
  default, docs/methods.md "Uncertainty") every value as ``value [low, high]`` and each policy's
  AUC against ``random``'s in the same mode as a paired difference with its verdict;
* ``<metric>_vs_fraction.png`` / ``<metric>_vs_time.png`` -- see
  :mod:`raycompat.backfill.plots`.

All values are fractions in [0, 1] in the JSON; the markdown shows percentages.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from raycompat.backfill.grid import backfill_counts
from raycompat.report import markdown_table, write_json

__all__ = ["write_reports", "markdown_report", "load_json", "auc_gain_notes"]


def _pct(v) -> float | None:
    if v is None:
        return None
    v = float(v)
    return 100.0 * v if np.isfinite(v) else None


def _pct_iv(value, low=None, high=None) -> str | float | None:
    """``12.34 [11.02, 13.60]`` in percent, or the plain percentage without an interval."""
    v, lo, hi = _pct(value), _pct(low), _pct(high)
    if v is None or lo is None or hi is None:
        return v
    return f"{v:.2f} [{lo:.2f}, {hi:.2f}]"


def _band(curve, metric: str, j: int) -> tuple:
    band = curve.bands.get(metric)
    return (None, None) if not band else (band["low"][j], band["high"][j])


def _vs_random(result, curve, metric: str) -> str | None:
    """``AUC(curve) - AUC(random)`` in the same mode, paired, with its verdict."""
    from raycompat.backfill.simulator import QUERIES
    from raycompat.metrics.bootstrap import Bootstrap
    from raycompat.metrics.verdicts import verdict

    if result.bootstrap is None or curve.policy == "random" or curve.mode == "cold":
        return None
    base = next((c for c in result.curves if c.policy == "random" and c.mode == curve.mode), None)
    a, b = curve.samples.get(metric), None if base is None else base.samples.get(metric)
    if a is None or b is None or not (result.fractions[0] == 0 and result.fractions[-1] == 1):
        return None
    boot = Bootstrap(result.bootstrap)
    boot.add_query_set(QUERIES, result.query_labels)
    f = np.asarray(result.fractions, dtype=np.float64)

    def area_difference(a, b):
        return (((a - b)[..., 1:] + (a - b)[..., :-1]) / 2.0 * np.diff(f)).sum(axis=-1)

    iv = boot.interval(area_difference, a=a, b=b)
    if metric.startswith("NFR"):  # lower is better: the claim is AUC(random) - AUC(policy) > 0
        iv = dataclasses.replace(iv, estimate=-iv.estimate, low=-iv.high, high=-iv.low, per_seed=())
    return f"{_pct_iv(iv.estimate, iv.low, iv.high)} {verdict(iv)}"


def _time_unit(seconds: float):
    for unit, div in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * div:
            return unit, div
    return "s", 1.0


def _regression_text(reg) -> str:
    if reg is None:
        return "n/a"
    if not reg["has_regression"]:
        return "none"
    parts = []
    if reg["points_below_start"]:
        parts.append(
            f"{len(reg['points_below_start'])} pt below start "
            f"(max {100 * reg['max_below_start']:.2f})"
        )
    if reg["drops"]:
        parts.append(f"{len(reg['drops'])} drop(s) (max {100 * reg['max_drop']:.2f})")
    return "; ".join(parts)


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
    if result.cost is not None:
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


def _summary_lines(result) -> list[str]:
    """Per policy, mode and metric: t=0, t=50%, t=100%, AUC, AUC gain, regression."""
    headers = [
        "policy",
        "mode",
        "metric",
        "t=0",
        "t=50%",
        "t=100%",
        "AUC",
        "AUC gain",
        "better than random (AUC, paired)",
        "regression",
    ]
    rows = []
    mid = int(np.argmin(np.abs(result.fractions - 0.5)))
    for c in result.curves:
        for n in result.metric_names:
            s = c.summary.get(n, {})
            v = c.metrics[n]
            rows.append(
                [
                    c.policy,
                    c.mode,
                    n,
                    _pct_iv(v[0], *_band(c, n, 0)),
                    _pct_iv(v[mid], *_band(c, n, mid)),
                    _pct_iv(v[-1], *_band(c, n, -1)),
                    _pct_iv(s.get("auc"), *(s.get("auc_interval") or (None, None))[:2]),
                    _pct(s.get("auc_gain")),
                    _vs_random(result, c, n),
                    _regression_text(s.get("regression")),
                ]
            )
    notes = [f"- {line}" for line in auc_gain_notes(result.summary_rows())]
    return [
        "## Summary per policy and mode",
        "",
        "AUC: trapezoid area over t in [0, 1] (RM); AUC gain: (AUC - AUC(old-old)) / "
        "(AUC(new*-new*) - AUC(old-old)) (RM Table 1, needs the new* reference and "
        "new*-new* better than old-old; n/a otherwise, with the reason under the table); "
        "regression: points below the t=0 value and drops between consecutive points (RACT Eq.3; "
        "for NFR, rises). `value [low, high]`: the bootstrap interval over the query classes "
        "(docs/methods.md, Uncertainty); better than random: the paired AUC difference to the "
        "random order in the same mode (for NFR, random's minus the policy's) and its verdict.",
        "",
        markdown_table(headers, rows, digits=2),
        "",
        *(notes + [""] if notes else []),
    ]


def _metric_table_lines(result, n: str) -> list[str]:
    """Metric ``n`` (%) of every curve at each backfill fraction (and the simulated time)."""
    unit, div = "s", 1.0
    if result.cost is not None:
        unit, div = _time_unit(float(result.cost.seconds([result.n_items])[0]))
    cols = (
        ["backfilled"]
        + ([f"time ({unit})"] if result.cost is not None else [])
        + [f"{c.policy} / {c.mode}" for c in result.curves]
    )
    counts = backfill_counts(result.fractions, result.n_items)  # the same for every mode
    rows = []
    for j, t in enumerate(result.fractions):
        row = [f"{100 * t:g}%"]
        if result.cost is not None:
            row.append(float(result.cost.seconds([counts[j]])[0]) / div)
        row += [_pct(c.metrics[n][j]) for c in result.curves]
        rows.append(row)
    return [f"## {n} (%) at each backfill fraction", "", markdown_table(cols, rows, digits=2), ""]


def markdown_report(
    result, *, title: str = "Backfill simulation", plots: list[str] | None = None
) -> str:
    """Markdown: setup, references, summary (AUC, AUC gain, regression) and per-metric curve
    tables."""
    lines = (
        [f"# {title}", ""]
        + _setup_lines(result)
        + _run_lines(result)
        + _references_lines(result)
        + _summary_lines(result)
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
) -> dict[str, object]:
    """Write ``curves.json``, ``curves.md`` and the PNGs; returns ``{"json", "markdown",
    "plots"}`` paths."""
    os.makedirs(out_dir, exist_ok=True)
    pngs: list[str] = []
    if plots:
        from raycompat.backfill.plots import plot_curves

        pngs = plot_curves(result, out_dir)
    payload = result.to_dict()
    if extra:
        payload["extra"] = extra
    jpath = write_json(os.path.join(out_dir, "curves.json"), payload)
    mpath = os.path.join(out_dir, "curves.md")
    tmp = mpath + ".tmp"
    with open(tmp, "w") as f:
        f.write(markdown_report(result, title=title, plots=pngs))
    os.replace(tmp, mpath)
    return {"json": jpath, "markdown": mpath, "plots": pngs}


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
