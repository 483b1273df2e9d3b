"""The main job's report.md (docs/reproduce.md, "The main job"): its data, training,
retrieval table, compatibility verdicts, backfill curves, timings and verdict lines, rendered
from the report dict that :func:`raycompat.quickstart.run_quickstart` writes as report.json.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["difference_text", "render_markdown"]


def _iv(value, low=None, high=None):
    """``value [low, high]`` (4 digits), the value alone without an interval, ``value [no
    interval]`` when the bootstrap refused one (NaN bounds: too many undefined resamples)."""
    from raycompat.report import fmt

    if value is None or low is None or high is None:
        return value
    if _finite(value) and not (_finite(low) and _finite(high)):
        return f"{fmt(value)} [no interval]"
    return f"{fmt(value)} [{fmt(low)}, {fmt(high)}]"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and bool(np.isfinite(x))


def _with_interval(row: dict):
    """An evaluation row's value with its interval."""
    return _iv(row["value"], row.get("low"), row.get("high"))


def _verdict_number(v: dict, key: str):
    """A verdict's number (``m_old_old``, ``update_gain``, ...) with its paired interval."""
    d = v.get("intervals", {}).get(key)
    return v[key] if not d else _iv(v[key], d["low"], d["high"])


def difference_text(v: dict) -> str:
    """The BCT criterion's paired difference ``M(n,o) - M(o,o)`` with its interval, and the
    queries and classes behind it."""
    d = v.get("difference")
    if not d:
        return "n/a"
    dropped = d.get("dropped") or 0
    return (
        f"{_iv(d['value'], d['low'], d['high'])}, {d['queries']} queries in {d['classes']} classes"
        + f", {_seeds_text(d.get('seeds', 1))}"
        + (f", {dropped} of {d['resamples']} resamples undefined" if dropped else "")
    )


def _seeds_text(seeds: int) -> str:
    return "1 training seed" if seeds == 1 else f"{seeds} training seeds"


def _confidence(report: dict) -> str:
    return f"{100 * report['options'].get('confidence', 0.95):g} %"


def render_markdown(report: dict, allocation: str) -> str:
    """report.md: data, training, retrieval, compatibility, backfill curves, timings, verdicts."""
    from raycompat.report import fmt, markdown_table

    conf = _confidence(report)
    lines = [
        *_intro_lines(report, conf),
        "## Data allocation",
        "",
        allocation,
        "",
        *_training_lines(report),
        *_retrieval_lines(report),
        "## Compatibility (BCT criterion on mAP@100, new* = independent)",
        "",
        "The claim M(n,o) > M(o,o) is held when the paired interval of the difference is above "
        "0, not held when it is at or below 0, inconclusive when it contains 0.",
        "",
        _compatibility_table(report, conf),
        "",
        *_seed_lines(report),
        *_backfill_lines(report),
        "## Timings",
        "",
        markdown_table(
            ["phase", "seconds"], [(k, v) for k, v in report["timings"].items()], digits=1
        ),
        "",
    ]
    lines.append(
        "Verdicts: "
        + "; ".join(
            f"{v['model']}: M(n,o) > M(o,o) {v.get('verdict', 'n/a')} "
            f"(M(n,o)={fmt(v['m_new_old'])} vs M(o,o)={fmt(v['m_old_old'])}; "
            f"difference {difference_text(v)})"
            for v in report["verdicts"]
        )
    )
    return "\n".join(lines) + "\n"


def _seed_lines(report: dict) -> list[str]:
    """How many training seeds stand behind each number, and every seed's values."""
    from raycompat.report import markdown_table

    seeds = report.get("seeds") or {"count": 1, "rows": []}
    lines = ["## Training seeds", ""]
    if seeds["count"] == 1:
        return lines + [
            "One training seed stands behind every number: the intervals count the query "
            "sampling, not the training variation (`--seeds N` trains every model N times).",
            "",
        ]
    models = [v["model"] for v in report["verdicts"]]
    header = ["seed", "M(o,o)"]
    for m in models:
        header += [f"M({m},o)", f"M({m},o) - M(o,o)"]
    body = [
        [r["seed"], r["m_old_old"]]
        + [x for m in models for x in (r[f"m_{m}_old"], r[f"difference_{m}"])]
        for r in seeds["rows"]
    ]
    return lines + [
        f"{seeds['count']} training seeds ({', '.join(map(str, seeds['seeds']))}) stand behind "
        "every number: each value above is the mean over the seeds, and each interval resamples "
        "the seeds as well as the query classes. The backfill curves below use the first "
        "seed's models. Per seed (mAP@100):",
        "",
        markdown_table(header, body),
        "",
    ]


def _intro_lines(report: dict, conf: str) -> list[str]:
    """The title, the scenario and how intervals are read."""
    return [
        "# raycompat quickstart report",
        "",
        f"Scenario `{report['scenario']['name']}` (seed {report['scenario']['seed']}), "
        f"{report['catalog']['description']}.",
        "",
        f"Every retrieval number is `value [low, high]`: its {conf} bootstrap interval over the "
        f"query classes ({report['options'].get('resamples', 1000)} resamples, seed "
        f"{report['options'].get('bootstrap_seed', 0)}; every query of a drawn class comes with "
        "it; docs/methods.md, Uncertainty). Differences and ratios of two numbers are paired: "
        "the same queries in the same draws. A resample whose value is undefined is dropped; "
        "past 1 % dropped a number has no interval (`[no interval]`, its verdict inconclusive).",
        "",
    ]


def _training_lines(report: dict) -> list[str]:
    """Each model's method, split, epochs, final loss, throughput and wall time."""
    from raycompat.report import markdown_table

    return [
        "## Training",
        "",
        markdown_table(
            ["model", "method", "split", "epochs", "final loss", "images/s", "wall s"],
            [
                (
                    name,
                    m["method"],
                    m["split"],
                    m["epochs"],
                    m["history"][-1].get("loss/loss"),
                    m["history"][-1].get("images_per_s"),
                    m["wall_s"],
                )
                for name, m in report["models"].items()
            ],
            digits=3,
        ),
        "",
    ]


def _retrieval_lines(report: dict) -> list[str]:
    """Every (query embedder, gallery embedder) pair's metrics with their intervals."""
    from raycompat.report import markdown_table

    metrics = ["mAP@100", "mAP", "top1", "top5"]
    by_pair: dict[tuple, dict] = {}
    for row in report["evaluations"]:
        by_pair.setdefault((row["model"], row["query"], row["gallery"]), {})[row["metric"]] = (
            _with_interval(row)
        )
    return [
        "## Retrieval (query embedder -> gallery embedder)",
        "",
        "Ranked by the canonical score (the float64 inner product of the float32 vectors), "
        "ties by gallery index, as on the backfill curves: a value here and the same pair on a "
        "backfill curve are the same number (the simulation stores the gallery in a shuffled "
        "order, so only items with bit-identical canonical scores could rank differently).",
        "",
        markdown_table(
            ["model", "query", "gallery"] + metrics,
            [k + tuple(v.get(m) for m in metrics) for k, v in by_pair.items()],
        ),
        "",
    ]


def _backfill_lines(report: dict) -> list[str]:
    """The backfill table, what it shows, and the plots."""
    return [
        "## Backfill curves (a hot refresh, simulated)",
        "",
        "The gallery is backfilled item by item with the new model while the new model "
        "already answers queries. Values at 0 %, 50 % and 100 % backfilled, the area under "
        "the curve over the fraction backfilled, the AUC gain against the independent model "
        "(new*, RM Table 1), each with its interval; the paired AUC difference to the random "
        "order in the same mode (for NFR@1, random's minus the policy's: positive is better) "
        "with its verdict; regressions (RACT Eq.3: grid points worse than t=0, and steps "
        "between grid points that make the metric worse; for NFR@1 worse means higher) with the "
        "verdict on 'the curve regresses': held when one of those paired differences is "
        "worse beyond its interval, not held when every interval excludes a worsening. "
        "Full curves: `backfill/<model>/curves.md`, plots below (the shaded bands are the "
        "intervals).",
        "",
        _backfill_table(report),
        "",
        *[
            f"![{os.path.splitext(os.path.basename(p))[0]} ({model})]({p})\n"
            for model, plots in report["backfill_plots"].items()
            for p in plots
            if p.endswith("_vs_fraction.png") and os.path.basename(p) != "mAP_vs_fraction.png"
        ],
    ]


def _compatibility_table(report: dict, conf: str) -> str:
    from raycompat.report import markdown_table

    keys = ("m_old_old", "m_new_old", "m_new_new", "update_gain", "delta_up", "delta_down")
    return markdown_table(
        ["model", "M(o,o)", "M(n,o)", "M(n,n)", "update gain", "Delta_up", "Delta_down"]
        + [f"M(n,o) - M(o,o) [{conf} interval] (paired)", "verdict"],
        [
            (v["model"], *(_verdict_number(v, k) for k in keys))
            + (difference_text(v), v.get("verdict", "n/a"))
            for v in report["verdicts"]
        ],
    )


def _regression(s: dict) -> str:
    """Points worse than t=0 and worsening steps, and the verdict on 'the curve regresses'."""
    reg = s.get("regression")
    said = s.get("regression_verdict")
    tail = "" if said is None else f"; regression {said}"
    if not reg or not reg.get("has_regression"):
        return "none" + tail
    return (
        f"{len(reg['points_below_start'])} points worse than t=0, "
        f"{len(reg['drops'])} worsening steps" + tail
    )


def _vs_random(s: dict):
    vs = s.get("vs_random")
    return None if not vs else f"{_iv(vs['value'], vs['low'], vs['high'])} {vs['verdict']}"


def _backfill_table(report: dict) -> str:
    from raycompat.report import markdown_table
    from raycompat.simulator.report import auc_gain_notes

    points = {
        (r["model"], r["policy"], r["mode"], r["metric"], round(r["fraction"], 9)): r
        for r in report["curves"]
    }

    def value_at(s, fraction):
        r = points.get((s["model"], s["policy"], s["mode"], s["metric"], fraction))
        return None if r is None else _iv(r["value"], r.get("low"), r.get("high"))

    rows = []
    for s in report["backfill"]:
        if s["metric"] not in ("mAP@100", "NFR@1"):
            continue
        if s["mode"] == "cold" and s["policy"] != "random":
            continue  # the cold curve does not depend on the policy
        rows.append(
            (
                s["model"],
                "-" if s["mode"] == "cold" else s["policy"],
                s["mode"],
                s["metric"],
                *(value_at(s, f) for f in (0.0, 0.5, 1.0)),
                _iv(s.get("auc"), *(s.get("auc_interval") or (None, None))),
                _iv(s.get("auc_gain"), *(s.get("auc_gain_interval") or (None, None))),
                _vs_random(s),
                _regression(s),
            )
        )
    headers = ["model", "policy", "mode", "metric", "t=0", "t=50%", "t=100%", "AUC"]
    headers += ["AUC gain", "AUC vs random (paired)", "regression"]
    table = markdown_table(headers, rows)
    shown = [s for s in report["backfill"] if s["metric"] in ("mAP@100", "NFR@1")]
    return "\n".join([table, "", *(f"- {n}" for n in auc_gain_notes(shown))]).rstrip("\n")
