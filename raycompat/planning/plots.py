"""The plan's PNGs (matplotlib, Agg backend):

* ``quality_over_hours.png``: every option's mAP@k on the wall clock up to the horizon; the
  baselines black (cold refresh, dashed) and gray (staying on the old model), the recommended
  option thick and with its band;
* ``quality_bands.png``: one panel per option, its mAP@k with its band against old-old's value;
* ``cost_vs_quality.png``: each option's total cost against its mAP@k at the deadline, with its
  interval (without a deadline: its mean mAP@k over the horizon, quality-hours / H).
"""

from __future__ import annotations

import os

import numpy as np

from raycompat.planning.inputs import Estimate
from raycompat.planning.plan import Plan
from raycompat.planning.timeline import COLD, STAY

__all__ = ["plot_plan"]


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
    for i, a in enumerate(plan.assessed):
        t = a.option.timeline
        hours = np.append(t.hours, horizon)
        style = _style(a, chosen, colors, i)
        label = a.option.label + (" (recommended)" if a is chosen else "")
        ax.plot(hours, 100 * np.append(t.quality, t.quality[-1]), label=label, **style)
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
    ax.set_title(f"{plan.metric} during the upgrade, every option (band: the recommended's)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
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
    """Write both PNGs into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    colors = list(plt.get_cmap("tab20").colors)
    names = ("quality_over_hours.png", "quality_bands.png", "cost_vs_quality.png")
    paths = [os.path.join(out_dir, n) for n in names]
    _quality_over_hours(plan, paths[0], colors)
    _quality_bands(plan, paths[1], colors)
    _cost_vs_quality(plan, paths[2], colors)
    return paths
