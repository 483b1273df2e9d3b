"""Seeds merged, and every number of the reproduction given its interval (docs/methods.md,
"Uncertainty").

:func:`merge_seeds` averages the per-seed results (every number: the mean over seeds);
:func:`attach_intervals` adds, from the :class:`~raycompat.reproduce.evidence.Evidence`:

* per test set, ``intervals[m_oo | m_nstar][metric] = [low, high]`` (``[low, high, sd]`` with
  several seeds: sd is the standard deviation of the per-seed values) and ``queries``/``classes``;
* per method, ``intervals[m_oo | m_nn | m_no | m_nadapted | m_cross][metric]`` and the
  intervals of ``update_gain`` (BCT Eq.9), ``delta_up`` (DMU Eq.6), ``delta_down`` (DMU Eq.7),
  each against the method's own old model (a sequential chain with a phi_1 of its own, such as
  d-Simplex's, is not measured against the shared phi_1);
* per backfill curve, ``bands[metric] = {low, high}`` at every grid point, ``auc_interval`` in
  each metric's summary, and ``old_old_successes`` (the queries behind its NFR@1, per seed).
"""

from __future__ import annotations

import numpy as np

from raycompat.reproduce.evidence import Evidence

__all__ = ["attach_intervals", "merge_seeds", "trapezoid"]

PAIR_KEYS = ("m_oo", "m_nn", "m_no", "m_nadapted", "m_cross")


def _mean(values: list):
    if any(v is None for v in values):
        return None
    if all(isinstance(v, bool) for v in values):
        return values[0] if len(set(values)) == 1 else None
    if all(isinstance(v, (int, float)) for v in values):
        return float(np.mean(values))
    return values[0]


def average_tree(trees: list):
    """The elementwise mean of same-shaped JSON trees (dicts, lists, numbers); other leaves
    come from the first tree; a bool that differs between seeds becomes None."""
    first = trees[0]
    if len(trees) == 1:
        return first
    if isinstance(first, dict):
        return {
            k: average_tree([t.get(k) if isinstance(t, dict) else None for t in trees])
            if all(isinstance(t, dict) and k in t for t in trees)
            else first[k]
            for k in first
        }
    if isinstance(first, list) and all(isinstance(t, list) and len(t) == len(first) for t in trees):
        return [average_tree([t[i] for t in trees]) for i in range(len(first))]
    return _mean(trees)


def merge_seeds(per_seed: list[tuple]) -> tuple[list, dict, dict | None]:
    """``[(test_sets, backfill, sequential), ...]`` per seed -> one, every number the mean over
    seeds. A test set or curve missing in one seed is left out."""
    names = [{ts["name"] for ts in seed[0]} for seed in per_seed]
    common = set.intersection(*names) if names else set()
    test_sets = []
    for ts in per_seed[0][0]:
        if ts["name"] in common:
            same = [next(t for t in seed[0] if t["name"] == ts["name"]) for seed in per_seed]
            test_sets.append(average_tree(same))
    backfill = average_tree([seed[1] for seed in per_seed])
    sequentials = [seed[2] for seed in per_seed]
    sequential = None if any(s is None for s in sequentials) else sequentials[0]
    return test_sets, backfill, sequential


def trapezoid(fractions, values: np.ndarray) -> np.ndarray:
    """Area under ``values`` (grid on the last axis) over ``fractions``."""
    f = np.asarray(fractions, dtype=np.float64)
    return ((values[..., 1:] + values[..., :-1]) / 2.0 * np.diff(f)).sum(axis=-1)


def _bounds(iv) -> list:
    """``[low, high]``, and the standard deviation across seeds when there are several."""
    return [iv.low, iv.high] + ([iv.spread] if iv.seeds > 1 else [])


def _pair(evidence: Evidence, key: tuple) -> dict:
    got = evidence.get(key) or {}
    return {metric: _bounds(evidence.interval(value=s)) for metric, s in got.items()}


def _score_intervals(evidence: Evidence, ts: str, label: str, metric: str) -> dict:
    """Intervals of update gain, Delta_up and Delta_down (paired: one query set), with the
    method's own M(o,o) (the test set's when the method has none of its own)."""
    own_oo = evidence.sample(("pair", ts, label, "m_oo"), metric)
    s = {
        k: evidence.sample(("pair", ts, *k2), metric)
        for k, k2 in (
            ("nstar", ("m_nstar",)),
            ("nn", (label, "m_nn")),
            ("cross", (label, "m_cross")),
        )
    }
    s["oo"] = own_oo if own_oo is not None else evidence.sample(("pair", ts, "m_oo"), metric)
    if any(v is None for v in s.values()):
        return {}
    stats = {
        "update_gain": lambda oo, nstar, nn, cross: (cross - oo) / (nstar - oo),
        "delta_up": lambda oo, nstar, nn, cross: (cross - oo) / oo,
        "delta_down": lambda oo, nstar, nn, cross: (nstar - nn) / nstar,
    }
    out = {}
    with np.errstate(divide="ignore", invalid="ignore"):
        for name, f in stats.items():
            out[name] = _bounds(evidence.interval(f, **s))
    return out


def _test_set_intervals(ts: dict, evidence: Evidence) -> None:
    name, metric = ts["name"], ts["metric"]
    ts["intervals"] = {k: _pair(evidence, ("pair", name, k)) for k in ("m_oo", "m_nstar")}
    labels = evidence.query_labels.get(ts.get("query_set", ts["scenario"]))
    if labels is not None:
        ts["queries"], ts["classes"] = int(labels.size), int(np.unique(labels).size)
    for label, entry in ts["methods"].items():
        if entry.get("diverged"):
            continue
        entry["intervals"] = {k: _pair(evidence, ("pair", name, label, k)) for k in PAIR_KEYS}
        entry["intervals"].update(_score_intervals(evidence, name, label, metric))


def _curve_intervals(scenario: str, label: str, curve: dict, evidence: Evidence) -> None:
    got = evidence.get(("curve", scenario, label, curve["policy"], curve["mode"])) or {}
    fractions = curve["fractions"]
    curve["bands"] = {}
    for metric, sample in got.items():
        band = evidence.interval(curve=sample)
        curve["bands"][metric] = {
            "low": [float(x) for x in band["low"]],
            "high": [float(x) for x in band["high"]],
        }
        summary = curve.get("summary", {}).get(metric)
        if summary is not None and summary.get("auc") is not None:
            iv = evidence.interval(lambda curve: trapezoid(fractions, curve), curve=sample)
            summary["auc_interval"] = _bounds(iv)
        if metric == "NFR@1":
            curve["old_old_successes"] = [int(x) for x in sample.den.sum(axis=1)]


def attach_intervals(test_sets: list, backfill: dict, evidence: Evidence) -> None:
    """Add the intervals of the module docstring to merged results, in place."""
    for ts in test_sets:
        _test_set_intervals(ts, evidence)
    for scenario, models in backfill.items():
        for label, entry in models.items():
            for curve in entry.get("curves", []):
                _curve_intervals(scenario, label, curve, evidence)
