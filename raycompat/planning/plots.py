"""The plan's PNGs (matplotlib, Agg backend):

* ``quality_over_hours.png``: every option's mAP@k on the wall clock up to the horizon; in
  colour and in the legend only those :func:`highlighted` picks (the recommended option, thick
  and with its band; the best option of each query mode; the baselines, black dashed for a cold
  refresh and gray dotted for staying on the old model), every other option thin light gray
  without a legend entry;
* ``quality_bands.png``: one panel per option, its mAP@k with its band against old-old's value;
* ``cost_vs_quality.png``: each option's total cost against its mAP@k at the deadline, with its
  interval (without a deadline: its mean mAP@k over the horizon, quality-hours / H); not
  written when every upgrade costs the same (:func:`same_cost`).
"""

from __future__ import annotations

import os

import numpy as np

from raycompat.planning.inputs import Estimate
from raycompat.planning.plan import Plan
from raycompat.planning.recommend import (
    Assessment,
    ranked,  # the recommendation's order
)
from raycompat.planning.timeline import CANDIDATE, COLD, STAY

__all__ = ["COST_PLOT", "highlighted", "plot_plan", "same_cost"]

#: the cost plot's file name (left out when every upgrade costs the same)
COST_PLOT = "cost_vs_quality.png"
#: relative tolerance under which two total costs are the same
COST_RTOL = 1e-9


def same_cost(plan: Plan) -> bool:
    """Whether every upgrade (every option but staying on the old model, which pays nothing)
    has the same total cost, to ``COST_RTOL`` of the largest: a cost plot would then stack every
    option in one column."""
    costs = [a.option.total_cost for a in plan.assessed if a.option.kind != STAY]
    if len(costs) < 2:
        return True
    scale = max(abs(c) for c in costs)
    return max(costs) - min(costs) <= COST_RTOL * scale


def _mode_bests(plan: Plan) -> list[Assessment]:
    """The best deployable candidate of each query mode, in the order the modes first appear:
    those that meet every constraint first, then by the planner's ranking (most
    quality-hours; :func:`raycompat.planning.recommend.ranked`)."""
    modes: dict[str, list[Assessment]] = {}
    for a in plan.assessed:
        if a.option.kind == CANDIDATE and a.option.deployable:
            modes.setdefault(a.option.mode, []).append(a)
    out = []
    for pool in modes.values():
        meeting = [a for a in pool if a.meets]
        out.append(ranked(meeting or pool)[0])
    return out


def highlighted(plan: Plan) -> list[tuple[Assessment, str]]:
    """The options ``quality_over_hours.png`` draws in colour, each with its legend label: the
    recommended option (if any), the best of each query mode, then the baselines (each model's
    cold refresh, staying on the old model). Every other option is drawn faded, unlabelled."""
    chosen = plan.recommendation.chosen
    picks: list[tuple[Assessment, str]] = []
    if chosen is not None:
        picks.append((chosen, f"{chosen.option.label} (recommended)"))
    for a in _mode_bests(plan):
        if a is not chosen:
            picks.append((a, f"{a.option.label} (best {a.option.mode})"))
    for a in plan.assessed:
        if a.option.kind in (COLD, STAY) and a is not chosen:
            picks.append((a, a.option.label))
    return picks


def _style(a, chosen, colors, index: int) -> dict:
    kind = a.option.kind
    if kind == STAY:
        return dict(color="gray", linestyle=":", linewidth=1.5)
    if kind == COLD:
        return dict(color="black", linestyle=(0, (6, 2)), linewidth=1.2)
    return dict(
        color=colors[index % len(colors)],
        linestyle="-" if a.option.deployable else "-.",
        linewidth=2.6 if a is chosen else 1.0,
    )


def _quality_over_hours(plan: Plan, path: str, colors) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 5.5), dpi=110)
    chosen = plan.recommendation.chosen
    horizon = plan.horizon if plan.horizon > 0 else 1.0
    picks = highlighted(plan)
    shown = {id(a) for a, _ in picks}

    def curve(a):
        t = a.option.timeline
        return np.append(t.hours, horizon), 100 * np.append(t.quality, t.quality[-1])

    for a in plan.assessed:  # the others first, underneath
        if id(a) not in shown:
            ax.plot(*curve(a), color="0.82", linewidth=0.7, zorder=1)
    n_colored = n_cold = 0
    for a, label in picks:
        kind = a.option.kind
        if kind == STAY:
            style = dict(color="gray", linestyle=":", linewidth=1.5)
        elif kind == COLD:
            dashes = ((6, 2), (2, 2), (6, 2, 2, 2))[n_cold % 3]
            style = dict(color="black", linestyle=(0, dashes), linewidth=1.2)
            n_cold += 1
        else:
            style = dict(
                color=colors[n_colored % len(colors)],
                linestyle="-" if a.option.deployable else "-.",
                linewidth=1.4,
            )
            n_colored += 1
        if a is chosen:
            style["linewidth"] = 2.8
        hours, quality = curve(a)
        ax.plot(hours, quality, label=label, zorder=3 if a is chosen else 2, **style)
        t = a.option.timeline
        if a is chosen and np.isfinite(t.low).all():
            low, high = (100 * np.append(v, v[-1]) for v in (t.low, t.high))
            ax.fill_between(hours, low, high, color=style["color"], alpha=0.15, linewidth=0)
    if plan.constraints.deadline_hours is not None:
        ax.axvline(
            plan.constraints.deadline_hours, color="tab:red", linewidth=1.0, label="deadline"
        )
    ax.set_xlabel(
        f"wall-clock hours ({plan.hardware.items:,} items on {plan.hardware.devices} "
        f"{plan.hardware.device_kind} device(s))"
    )
    ax.set_ylabel(f"{plan.metric} (%)")
    others = len(plan.assessed) - len(picks)
    faded = ""
    if others:
        faded = f"; light gray: the {others} other option{'s' if others > 1 else ''}"
    ax.set_title(f"{plan.metric} during the upgrade (band: the recommended's{faded})", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _quality_bands(plan: Plan, path: str, colors) -> None:
    import matplotlib.pyplot as plt

    n = len(plan.assessed)
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.2 * cols, 2.4 * rows),
        dpi=100,
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    horizon = plan.horizon if plan.horizon > 0 else 1.0
    for i, (a, ax) in enumerate(zip(plan.assessed, axes.flat, strict=False)):
        t = a.option.timeline
        hours = np.append(t.hours, horizon)
        color = _style(a, None, colors, i)["color"]
        ax.plot(hours, 100 * np.append(t.quality, t.quality[-1]), color=color, linewidth=1.2)
        if np.isfinite(t.low).all():
            low, high = (100 * np.append(v, v[-1]) for v in (t.low, t.high))
            ax.fill_between(hours, low, high, color=color, alpha=0.25, linewidth=0)
        ax.axhline(100 * plan.old_old.value, color="gray", linestyle=":", linewidth=1.0)
        ax.set_title(a.option.label, fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.supxlabel("wall-clock hours", fontsize=9)
    fig.supylabel(f"{plan.metric} (%); dotted: old-old", fontsize=9)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.06, top=0.96, hspace=0.35, wspace=0.1)
    fig.savefig(path)
    plt.close(fig)


def _cost_vs_quality(plan: Plan, path: str, colors) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 5.5), dpi=110)
    chosen = plan.recommendation.chosen
    deadline = plan.constraints.deadline_hours is not None
    for i, a in enumerate(plan.assessed):
        q = a.quality_at_deadline if deadline else Estimate(a.mean_quality)
        style = _style(a, chosen, colors, i)
        err = None
        if q.has_interval:
            err = [[100 * max(q.value - q.low, 0.0)], [100 * max(q.high - q.value, 0.0)]]
        ax.errorbar(
            [a.option.total_cost],
            [100 * q.value],
            yerr=err,
            fmt="*" if a is chosen else "o",
            markersize=11 if a is chosen else 5,
            color=style["color"],
            capsize=2,
            label=a.option.label,
        )
    if plan.constraints.budget is not None:
        ax.axvline(plan.constraints.budget, color="tab:red", linewidth=1.0, label="budget")
    ax.set_xlabel(f"total cost (at {plan.hardware.price:g} per device-hour)")
    what = (
        f"{plan.metric} at the deadline ({plan.constraints.deadline_hours:g} h)"
        if deadline
        else f"mean {plan.metric} over the {plan.horizon:.3g} h horizon"
    )
    ax.set_ylabel(f"{what} (%)")
    ax.set_title(f"cost against {what}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_plan(plan: Plan, out_dir: str) -> list[str]:
    """Write the PNGs into ``out_dir`` (the cost plot only when the upgrades' costs differ,
    :func:`same_cost`); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    colors = list(plt.get_cmap("tab20").colors)
    paths = [os.path.join(out_dir, n) for n in ("quality_over_hours.png", "quality_bands.png")]
    _quality_over_hours(plan, paths[0], list(plt.get_cmap("tab10").colors))
    _quality_bands(plan, paths[1], colors)
    if not same_cost(plan):
        paths.append(os.path.join(out_dir, COST_PLOT))
        _cost_vs_quality(plan, paths[-1], colors)
    else:
        stale = os.path.join(out_dir, COST_PLOT)  # from an earlier plan in this folder
        if os.path.exists(stale):
            os.remove(stale)
    return paths
