"""The plan as files: ``plan.json`` (every number; schema in docs/planning.md, "plan.json"),
``plan.md`` (the recommendation first, a summary of every option, then a table per option) and
the PNGs of :mod:`raycompat.planning.plots`. Values are fractions in the JSON and percentages
in the markdown; hours are wall-clock hours from the start of the upgrade."""

from __future__ import annotations

import os

from raycompat.planning.plan import Plan
from raycompat.planning.plots import COST_PLOT, same_cost
from raycompat.planning.recommend import CONSTRAINT_FLAGS, Assessment
from raycompat.planning.timeline import CANDIDATE, COLD, STAY
from raycompat.report import markdown_table, with_version, write_json

__all__ = ["plan_dict", "plan_markdown", "write_plan"]


def _option_row(a: Assessment) -> dict:
    """One ``options`` row of plan.json."""
    o = a.option
    return {
        "model": o.model,
        "policy": o.policy,
        "mode": o.mode,
        "kind": o.kind,
        "deployable": o.deployable,
        "milestones": [
            {
                "fraction": m.fraction,
                "hours": m.hours,
                "cost": m.cost,
                "map": m.quality.value,
                "map_low": m.quality.low,
                "map_high": m.quality.high,
                "nfr": m.nfr.value,
                "nfr_low": _or_none(m.nfr.low),
                "nfr_high": _or_none(m.nfr.high),
                "top1": _or_none(m.top1.value),
                "top1_low": _or_none(m.top1.low),
                "top1_high": _or_none(m.top1.high),
                "interpolated": m.interpolated,
            }
            for m in o.milestones
        ],
        "end_hours": o.end_hours,
        "end_hours_range": None if o.end_range is None else list(o.end_range),
        "prep_hours": o.prep_hours,
        "devices_busy": o.devices_busy,
        "total_cost": o.total_cost,
        "total_cost_range": None if o.cost_range is None else list(o.cost_range),
        "fixed_costs": dict(o.fixed_costs),
        "quality_hours": a.quality_hours,
        "unweighted_quality_hours": a.plain_quality_hours,
        "mean_map": a.mean_quality,
        "map_at_deadline": {
            "map": a.quality_at_deadline.value,
            "map_low": a.quality_at_deadline.low,
            "map_high": a.quality_at_deadline.high,
        },
        "passes_old_at_hours": a.passes_old_at_hours,
        "paired": _paired_row(a),
        "meets_constraints": a.meets,
        "violations": dict(a.violations),
    }


def _paired_row(a: Assessment) -> dict | None:
    """Quality-hours' interval and the paired difference to the best option (None without)."""
    c = a.comparison
    if c is None:
        return None
    d = c.vs_best
    return {
        "quality_hours": c.quality_hours.to_dict(),
        "vs_best": None if d is None else d.to_dict(),
        "verdict": c.verdict,
    }


def plan_dict(plan: Plan, command: str | None = None) -> dict:
    """Everything in plan.json."""
    hw, rec = plan.hardware, plan.recommendation
    chosen = rec.chosen.option if rec.chosen is not None else None
    first = plan.simulations[0]
    return {
        "command": command,
        "metric": plan.metric,
        "items": hw.items,
        "simulated_items": first.n_items,
        "queries": first.n_queries,
        "hardware": {
            "devices": hw.devices,
            "device_kind": hw.device_kind,
            "price_per_device_hour": hw.price,
        },
        "rates": {
            "embedding": {
                m: {
                    "items_per_s_per_device": r.items_per_s,
                    "startup_s": r.startup_s,
                    "source": r.source,
                }
                for m, r in plan.rates.items()
            },
            "psi": None
            if plan.psi is None
            else {"vectors_per_s_per_device": plan.psi.vectors_per_s, "source": plan.psi.source},
            "search": None
            if hw.search is None
            else {
                "queries_per_s": hw.search.queries_per_s,
                "searches_per_s_per_device": hw.search.searches_per_s,
            },
        },
        "constraints": {c: getattr(plan.constraints, c) for c in CONSTRAINT_FLAGS},
        "horizon_hours": plan.horizon,
        "old_old": {
            "map": plan.old_old.value,
            "map_low": plan.old_old.low,
            "map_high": plan.old_old.high,
        },
        "inputs": [
            {
                "model": s.model,
                "path": s.path,
                "order_paths": list(s.order_paths),
                "n_items": s.n_items,
                "n_queries": s.n_queries,
                "k": s.k,
            }
            for s in plan.simulations
        ],
        "options": [_option_row(a) for a in plan.assessed],
        "recommended": None
        if chosen is None
        else {
            "model": chosen.model,
            "policy": chosen.policy,
            "mode": chosen.mode,
            "kind": chosen.kind,
            "paired": _paired_row(rec.chosen),
        },
        "reason": rec.reason,
        "binding": [
            {"constraint": b.constraint, "flag": CONSTRAINT_FLAGS[b.constraint], "advice": b.advice}
            for b in rec.binding
        ],
        "notes": list(plan.notes),
        "size_check": _size_check_dict(plan),
    }


def _or_none(x: float) -> float | None:
    """A JSON value: None for NaN (not measured, or no interval)."""
    return None if x != x else x


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.2f}"


def _pct_iv(e) -> str:
    if e.has_interval:
        return f"{_pct(e.value)} [{_pct(e.low)}, {_pct(e.high)}]"
    return _pct(e.value)


def _hours(h) -> str:
    return "never" if h is None else f"{h:.4g}"


def _verdict(a: Assessment) -> str:
    if a.meets:
        return "meets all" if a.option.deployable else "meets all (reference, not deployable)"
    return "; ".join(f"{CONSTRAINT_FLAGS[c]}: {why}" for c, why in a.violations.items())


def _qh(a: Assessment) -> str:
    c = a.comparison
    if c is None or not c.quality_hours.low == c.quality_hours.low:
        return f"{a.quality_hours:.4g}"
    return f"{a.quality_hours:.4g} [{c.quality_hours.low:.4g}, {c.quality_hours.high:.4g}]"


def _fixed(a: Assessment) -> str:
    parts = a.option.fixed_costs
    return ", ".join(f"{k} {v:,.2f}" for k, v in parts) if parts else "none"


def _vs_best(a: Assessment) -> str:
    c = a.comparison
    if c is None:
        return "n/a"
    if c.vs_best is None:
        return "the best"
    d = c.vs_best
    return f"{d.estimate:+.3g} [{d.low:+.3g}, {d.high:+.3g}] {c.verdict}"


def _switch_on(a: Assessment) -> str:
    """NFR@1 and top-1 at the switch-on point (0 %: the new model deployed, nothing moved)."""
    first = next((m for m in a.option.milestones if m.fraction == 0.0), None)
    return "n/a" if first is None else f"{_pct_iv(first.nfr)} / {_pct_iv(first.top1)}"


def _end_cell(o) -> str:
    """Hours to 100 %, with the range of the rate's timed windows when it has one."""
    if o.end_range is None:
        return _hours(o.end_hours)
    return f"{_hours(o.end_hours)} [{_hours(o.end_range[0])}, {_hours(o.end_range[1])}]"


def _cost_cell(o) -> str:
    if o.cost_range is None:
        return f"{o.total_cost:,.2f}"
    return f"{o.total_cost:,.2f} [{o.cost_range[0]:,.2f}, {o.cost_range[1]:,.2f}]"


def _summary_lines(plan: Plan) -> list[str]:
    """One row per option, recommended first, then by quality-hours."""
    chosen = plan.recommendation.chosen
    rows = sorted(plan.assessed, key=lambda a: (a is not chosen, -a.quality_hours))
    at = "deadline" if plan.constraints.deadline_hours is not None else "horizon"
    weighted = plan.simulations[0].weighted
    fixed = any(a.option.fixed_costs for a in plan.assessed)
    headers = [
        "option",
        "hours to 100 %",
        "cost",
        f"{plan.metric}-hours (fraction x h{', query log' if weighted else ''})",
        *([f"{plan.metric}-hours, every query once"] if weighted else []),
        "vs the best (paired)",
        *(["fixed costs (in cost)"] if fixed else []),
        f"mean {plan.metric} (%)",
        f"{plan.metric} at the {at} (%)",
        "passes old-old at (h)",
        "at switch-on (0 %): NFR@1 / top-1 (%)",
        "constraints",
    ]
    body = [
        [
            ("**" + a.option.label + "**") if a is chosen else a.option.label,
            _end_cell(a.option),
            _cost_cell(a.option),
            _qh(a),
            *([_hours(a.plain_quality_hours)] if weighted else []),
            _vs_best(a),
            *([_fixed(a)] if fixed else []),
            _pct(a.mean_quality),
            _pct_iv(a.quality_at_deadline),
            _hours(a.passes_old_at_hours),
            _switch_on(a),
            _verdict(a),
        ]
        for a in rows
    ]
    return ["## Every option", "", markdown_table(headers, body), ""]


def _option_table(plan: Plan, a: Assessment) -> list[str]:
    o = a.option
    rows = [
        [
            f"{100 * m.fraction:g} %",
            _hours(m.hours),
            f"{m.cost:,.2f}",
            _pct_iv(m.quality) + (" (interpolated)" if m.interpolated else ""),
            _pct_iv(m.nfr),
            _pct_iv(m.top1),
        ]
        for m in o.milestones
    ]
    prep = f"; psi refresh first: {o.prep_hours:.4g} h" if o.prep_hours else ""
    h = a.passes_old_at_hours
    passes = "never passes old-old" if h is None else f"passes old-old at {h:.4g} h"
    return [
        f"### {o.label}",
        "",
        f"Quality-hours {a.quality_hours:.4g}; {passes}; {_verdict(a)}{prep}.",
        "",
        markdown_table(
            ["re-embedded", "hours", "cost", f"{plan.metric} (%)", "NFR@1 (%)", "top-1 (%)"], rows
        ),
        "",
    ]


def _setup_lines(plan: Plan, command: str | None) -> list[str]:
    hw = plan.hardware
    lines = ["## What the plan assumes", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines.append(
        f"- Gallery: {hw.items:,} items; {hw.devices} {hw.device_kind} device(s) at "
        f"{hw.price:g} per device-hour; horizon H = {plan.horizon:.4g} h (the slowest "
        f"option's end); old-old {plan.metric}: {_pct_iv(plan.old_old)} %."
    )
    for model, r in plan.rates.items():
        lines.append(
            f"- Embedding rate for {model}: {r.items_per_s:,.1f} items/s per device"
            + (f" after {r.startup_s:.1f} s of start-up" if r.startup_s else "")
            + f" ({r.source})."
            + (
                f" The hours and costs in brackets are those at the fastest and at the slowest "
                f"of its {r.windows} timed windows ({r.window_range[1]:,.1f} and "
                f"{r.window_range[0]:,.1f} items/s); the quality-hours use the steady rate."
                if r.window_range
                else ""
            )
        )
    if hw.store_items_per_s is not None:
        lines.append(
            f"- The store takes {hw.store_items_per_s:,.1f} items/s: no backfill writes faster "
            "(given)."
        )
    f = hw.fixed
    given = [
        (f.training_hours, f"training {f.training_hours:g} device-hours"),
        (f.index_build_hours, f"index build {f.index_build_hours:g} device-hours"),
        (f.storage_price, f"storage of the second vector set {f.storage_gib:,.3g} GiB at "
         f"{f.storage_price:g} per GiB-hour until the end"),
        (f.new_items_per_hour, f"{f.new_items_per_hour:,.0f} new items per hour during the "
         "backfill, each embedded once more"),
    ]  # fmt: skip
    if any(v for v, _ in given):
        lines.append(
            "- Fixed costs of every upgrade (given; in each option's cost): "
            + "; ".join(text for v, text in given if v)
            + "."
        )
    for note in f.training_notes:
        lines.append(f"- Training cost of {note}.")
    active = plan.constraints.active()
    lines.append(
        "- Constraints: "
        + (
            ", ".join(
                f"{CONSTRAINT_FLAGS[c]}"
                + ("" if c == "never_below_old" else f" {getattr(plan.constraints, c):g}")
                for c in active
            )
            if active
            else "none"
        )
        + "."
    )
    return lines + [f"- {n}" for n in plan.notes] + [""]


def _size_check_dict(plan: Plan) -> dict | None:
    sc = plan.size_check
    if sc is None:
        return None
    return {
        "sizes": list(sc.sizes),
        "quality_hours": {k: list(v) for k, v in sc.quality_hours.items()},
        "quality_hours_intervals": {
            k: [None if b is None else list(b) for b in v] for k, v in sc.intervals.items()
        },
        "ranks": {k: list(v) for k, v in sc.ranks().items()},
        "recommended": list(sc.recommended),
        "recommendation_changes": sc.recommendation_changes,
        "skipped": list(sc.skipped),
    }


def _size_check_lines(plan: Plan) -> list[str]:
    sc = plan.size_check
    if sc is None:
        return []
    ranks = sc.ranks()
    headers = ["option", *(f"{n:,} items: {plan.metric}-hours (rank)" for n in sc.sizes)]

    def cell(q, band, rank) -> str:
        text = _hours(q) if band is None else f"{q:.4g} [{band[0]:.4g}, {band[1]:.4g}]"
        return text + ("" if rank is None else f" ({rank})")

    body = [
        [
            label,
            *(
                cell(q, b, r)
                for q, b, r in zip(
                    qh, sc.intervals.get(label) or (None,) * len(qh), ranks[label], strict=True
                )
            ),
        ]
        for label, qh in sc.quality_hours.items()
    ]
    said = (
        "**The recommendation changes with the gallery's size**: "
        + ", ".join(
            f"{n:,} items: {r or 'none'}" for n, r in zip(sc.sizes, sc.recommended, strict=True)
        )
        if sc.recommendation_changes
        else f"The recommendation is the same at every size: {sc.recommended[-1] or 'none'}."
    )
    lines = ["## The gallery-size check", "", markdown_table(headers, body), "", said, ""]
    if sc.skipped:
        lines += ["Not re-simulated: " + "; ".join(sc.skipped) + ".", ""]
    return lines


def plan_markdown(plan: Plan, plots: list[str] | None = None, command: str | None = None) -> str:
    """plan.md: the recommendation, every option, the assumptions, a table per option."""
    rec = plan.recommendation
    lines = [
        f"# Upgrade plan: {plan.hardware.items:,} items on {plan.hardware.devices} "
        f"{plan.hardware.device_kind} device(s)",
        "",
        "## Recommendation",
        "",
        ("Recommended: " if rec.chosen else "") + rec.reason,
        "",
    ]
    lines += _summary_lines(plan) + _size_check_lines(plan) + _setup_lines(plan, command)
    for s in plan.simulations:
        lines += [f"## {s.model}", "", f"Curves: `{s.path}`.", ""]
        for a in plan.assessed:
            if a.option.kind == CANDIDATE and a.option.model == s.model:
                lines += _option_table(plan, a)
    lines += ["## Baselines", ""]
    for a in plan.assessed:
        if a.option.kind in (COLD, STAY):
            lines += _option_table(plan, a)
    if plots:
        lines += ["## Plots", ""] + [
            f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots
        ]
        lines.append("")
        if not any(os.path.basename(p) == COST_PLOT for p in plots) and same_cost(plan):
            cost = max(a.option.total_cost for a in plan.assessed)
            lines += [
                f"Every upgrade costs the same ({cost:,.2f}; staying on the old model costs "
                "nothing), so no cost plot is drawn.",
                "",
            ]
    return "\n".join(lines)


def write_plan(plan: Plan, out_dir: str, *, plots: bool = True, command: str | None = None):
    """Write plan.json, plan.md and the PNGs into ``out_dir``; returns ``{"json", "markdown",
    "plots"}`` paths."""
    pngs = []
    if plots:
        from raycompat.planning.plots import plot_plan

        pngs = plot_plan(plan, out_dir)
    jpath = write_json(os.path.join(out_dir, "plan.json"), with_version(plan_dict(plan, command)))
    mpath = os.path.join(out_dir, "plan.md")
    with open(mpath + ".tmp", "w") as f:
        f.write(plan_markdown(plan, pngs, command))
    os.replace(mpath + ".tmp", mpath)
    return {"json": jpath, "markdown": mpath, "plots": pngs}
