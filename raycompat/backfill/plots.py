"""PNG plots of backfill curves (matplotlib, Agg backend: no display needed).

One line per policy and mode (colour = policy, line style = mode); the metric against the fraction backfilled and,
when a cost model is given, against simulated wall-clock time.  Reference
levels (old-old, new-new, new*-new*) are drawn as dashed horizontal lines.
"""
from __future__ import annotations

import os
from typing import List

import numpy as np

__all__ = ["plot_curves", "PLOT_METRICS"]


def PLOT_METRICS(k: int):
    return (f"mAP@{k}", "mAP", "NFR@1")


_LABELS = {"NFR@1": "negative flip rate @1 (lower is better)", "mAP": "mAP (revisited, full ranking)",
           "top1": "top-1 accuracy"}


def _time_unit(seconds_max: float):
    for unit, div in (("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0)):
        if seconds_max >= 2 * div:
            return unit, div
    return "seconds", 1.0


def plot_curves(result, out_dir: str, *, metrics=None, prefix: str = "") -> List[str]:
    """Write ``<metric>_vs_fraction.png`` (and ``<metric>_vs_time.png`` with a cost model).

    Returns the list of written paths.
    """
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    metrics = metrics or PLOT_METRICS(result.k)
    paths = []
    # colour = policy, line style and marker = mode
    colors = list(plt.get_cmap("tab10").colors)
    styles = ["-", "--", "-.", ":", (0, (3, 1, 1, 1))]
    markers = ["o", "s", "^", "v", "D"]
    policies = [p for p in dict.fromkeys(c.policy for c in result.curves)]
    modes = [m for m in dict.fromkeys(c.mode for c in result.curves)]
    axes = [("fraction", "fraction of the gallery backfilled (%)")]
    if result.cost is not None:
        axes.append(("time", None))
    for metric in metrics:
        for axis, xlabel in axes:
            fig, ax = plt.subplots(figsize=(8.5, 5.0), dpi=110)
            unit, div = "seconds", 1.0
            if axis == "time":
                smax = max(float(np.max(c.seconds)) for c in result.curves if c.seconds is not None)
                unit, div = _time_unit(smax)
                xlabel = (f"simulated backfill time ({unit}; {result.cost.items_per_s_per_gpu:g} items/s/GPU "
                          f"x {result.cost.num_gpus} GPU)")
            for c in result.curves:
                x = 100.0 * c.fractions if axis == "fraction" else c.seconds / div
                y = c.metrics[metric]
                if c.mode == "cold":
                    label, color, ls, mk = "cold (any policy)", "black", (0, (6, 2)), "x"
                else:
                    label = f"{c.policy} / {c.mode}"
                    color = colors[policies.index(c.policy) % len(colors)]
                    ls = styles[modes.index(c.mode) % len(styles)]
                    mk = markers[modes.index(c.mode) % len(markers)]
                ax.plot(x, 100.0 * y, color=color, linestyle=ls, marker=mk, markersize=3, linewidth=1.3,
                        label=label)
            if not metric.startswith("NFR"):
                for j, (ref, color) in enumerate((("old-old", "gray"), ("new-new", "black"),
                                                  ("new*-new*", "tab:red"))):
                    v = result.references.get(ref, {}).get(metric)
                    if v is not None and np.isfinite(v):
                        ax.axhline(100.0 * v, color=color, linestyle=":", linewidth=1.0,
                                   label=f"{ref} reference")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{_LABELS.get(metric, metric)} (%)")
            ax.set_title(f"{metric} during backfill ({result.n_items:,} items, {result.n_queries:,} queries)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
            fig.tight_layout()
            safe = metric.replace("@", "at").replace("/", "_")
            path = os.path.join(out_dir, f"{prefix}{safe}_vs_{axis}.png")
            fig.savefig(path)
            plt.close(fig)
            paths.append(path)
    return paths
