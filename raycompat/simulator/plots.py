"""PNG plots of backfill curves (matplotlib, Agg backend: no display needed).

One line per policy and mode (colour = policy, line style = mode); the metric against the
fraction backfilled and, when a cost model is given, against simulated wall-clock time.  Reference
levels (old-old, new-new, new*-new*) are drawn as dashed horizontal lines. With bootstrap
intervals every curve carries its band, shaded in its colour (docs/methods.md, "Uncertainty").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["plot_curves", "PLOT_METRICS"]


def PLOT_METRICS(k: int):
    return (f"mAP@{k}", "mAP", "NFR@1")


_LABELS = {
    "NFR@1": "negative flip rate @1 (lower is better)",
    "mAP": "mAP (revisited, full ranking)",
    "top1": "top-1 accuracy",
}


def _time_unit(seconds_max: float):
    for unit, div in (("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0)):
        if seconds_max >= 2 * div:
            return unit, div
    return "seconds", 1.0


@dataclass(frozen=True)
class _Styles:
    """Colour = policy, line style and marker = mode; the cold curve is black and dashed."""

    policies: list[str]
    modes: list[str]
    colors: list[Any]
    line_styles: tuple = ("-", "--", "-.", ":", (0, (3, 1, 1, 1)))
    markers: tuple = ("o", "s", "^", "v", "D")

    def of(self, curve):
        """``(label, color, line style, marker)`` of a curve."""
        if curve.mode == "cold":
            return "cold (any policy)", "black", (0, (6, 2)), "x"
        m = self.modes.index(curve.mode)
        color = self.colors[self.policies.index(curve.policy) % len(self.colors)]
        return (
            f"{curve.policy} / {curve.mode}",
            color,
            self.line_styles[m % len(self.line_styles)],
            self.markers[m % len(self.markers)],
        )


def _x_axis(result, axis: str, xlabel: str | None):
    """``(xlabel, divisor)``: the fraction axis as given, the time axis in a readable unit."""
    if axis != "time":
        return xlabel, 1.0
    smax = max(float(np.max(c.seconds)) for c in result.curves if c.seconds is not None)
    unit, div = _time_unit(smax)
    return f"simulated backfill time ({unit}; {result.cost.describe()})", div


def _plot_one(
    result, metric: str, axis: str, xlabel: str | None, styles: _Styles, path: str
) -> None:
    """One PNG: ``metric`` of every curve against the fraction (or time), with the references."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.0), dpi=110)
    xlabel, div = _x_axis(result, axis, xlabel)
    for c in result.curves:
        x = 100.0 * c.fractions if axis == "fraction" else c.seconds / div
        label, color, ls, mk = styles.of(c)
        ax.plot(
            x,
            100.0 * c.metrics[metric],
            color=color,
            linestyle=ls,
            marker=mk,
            markersize=3,
            linewidth=1.3,
            label=label,
        )
        band = c.bands.get(metric)
        if band:  # the bootstrap interval at every grid point
            low, high = (100.0 * np.asarray(band[k], dtype=float) for k in ("low", "high"))
            ax.fill_between(x, low, high, color=color, alpha=0.2, linewidth=0)
    if not metric.startswith("NFR"):
        for ref, color in (("old-old", "gray"), ("new-new", "black"), ("new*-new*", "tab:red")):
            v = result.references.get(ref, {}).get(metric)
            if v is not None and np.isfinite(v):
                ax.axhline(
                    100.0 * v, color=color, linestyle=":", linewidth=1.0, label=f"{ref} reference"
                )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{_LABELS.get(metric, metric)} (%)")
    ax.set_title(
        f"{metric} during backfill ({result.n_items:,} items, {result.n_queries:,} queries)"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_curves(result, out_dir: str, *, metrics=None, prefix: str = "") -> list[str]:
    """Write ``<metric>_vs_fraction.png`` (and ``<metric>_vs_time.png`` with a cost model).

    Returns the list of written paths.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    styles = _Styles(
        policies=list(dict.fromkeys(c.policy for c in result.curves)),
        modes=list(dict.fromkeys(c.mode for c in result.curves)),
        colors=list(plt.get_cmap("tab10").colors),
    )
    axes = [("fraction", "fraction of the gallery backfilled (%)")]
    if result.cost is not None:
        axes.append(("time", None))
    paths = []
    for metric in metrics or PLOT_METRICS(result.k):
        for axis, xlabel in axes:
            safe = metric.replace("@", "at").replace("/", "_")
            path = os.path.join(out_dir, f"{prefix}{safe}_vs_{axis}.png")
            _plot_one(result, metric, axis, xlabel, styles, path)
            paths.append(path)
    return paths
