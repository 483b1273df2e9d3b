"""The class-scaling run (``--class-scaling 100,200,400``): does BCT's criterion depend on the
number of training classes? At each count, extended-data is trained with ``bct`` and the
independent model (and its own old model), and measured on the same held-out queries and
gallery as the reproduction's extended-data scenario; per count, the paired difference
``M(bct,o) - M(o,o)`` with its interval and verdict, and the change of that difference from the
smallest to the largest count (paired too: every count shares the query set).

Training classes are nested. At a count ``N`` up to the scale's ``T`` (``--train-classes``) they
are the first ``N`` of the data seed's class permutation (a random subset of the ``T``); above
``T``, those ``T`` and the next ``N - T`` after the held-out evaluation and distractor classes. So
count ``T`` is the reproduction's own extended-data scenario (its models are reused) and no count
trains on a held-out class. docs/reproduce.md, "The class-scaling run".
"""

from __future__ import annotations

import dataclasses

import numpy as np

from raycompat.config import ConfigError
from raycompat.data.scenarios import Scenario, ScenarioSizes, Split
from raycompat.metrics.verdicts import HELD, INCONCLUSIVE, NOT_HELD, verdict
from raycompat.reproduce.claims import PRIMARY
from raycompat.reproduce.evidence import Evidence

__all__ = [
    "LABELS",
    "QUERY_SET",
    "SCENARIO",
    "scaling_results",
    "scaling_scenario",
    "test_set_name",
]

SCENARIO = "extended-data"
#: the query set of every count: the reproduction's extended-data queries
QUERY_SET = "extended-data"
#: the new models trained at every count
LABELS = ("independent", "bct")


def test_set_name(classes: int) -> str:
    """The evidence's test set of count ``classes``."""
    return f"class-scaling {classes}"


def _restricted(split: Split, classes: np.ndarray) -> Split:
    keep = np.isin(split.labels, classes)
    return Split(split.name, split.labels[keep], split.instances[keep])


def scaling_scenario(sizes: ScenarioSizes, classes: int, catalog=None) -> Scenario:
    """The extended-data scenario of ``sizes`` with ``classes`` training classes and the held-out
    query, gallery and distractor splits of ``sizes`` (see the module docstring). ``catalog``:
    as :func:`raycompat.data.scenarios.build_scenario` (default: the glyph catalog)."""
    total = sizes.train_classes
    held = sizes.eval_classes + sizes.distractor_classes

    def build(train: int, **kw) -> Scenario:
        return dataclasses.replace(sizes, train_classes=train, **kw).build(catalog, SCENARIO)

    try:
        base = build(total)
        if classes == total:
            return base
        # the held-out classes: the permutation's positions [T, T + eval + distractors)
        ahead = build(total + held, eval_classes=1, distractor_classes=0)
        held_out = np.setdiff1d(ahead.train_classes, base.train_classes)
        source = build(
            classes + (held if classes > total else 0), eval_classes=1, distractor_classes=0
        )
    except ValueError as exc:
        raise ConfigError(
            f"--class-scaling {classes}: the glyph catalog cannot hold {classes} training classes "
            f"beside the {held} held-out evaluation and distractor classes ({exc})"
        ) from None
    chosen = np.setdiff1d(source.train_classes, held_out)
    assert chosen.size == classes, (chosen.size, classes)
    splits = {k: _restricted(source[k], chosen) for k in ("old_train", "new_train")}
    splits.update({k: base[k] for k in ("query", "gallery", "distractors")})
    params = dict(base.params, num_train_classes=int(classes))
    return Scenario(base.name, base.seed, splits, params)


def _interval(evidence: Evidence, sample) -> dict:
    return evidence.interval(value=sample).to_dict()


def _point(evidence: Evidence, point: dict) -> dict:
    """One row of the table: every number of count ``point["classes"]`` with its interval."""
    row = {k: point[k] for k in ("classes", "old_train_images", "new_train_images")}
    if point.get("missing"):
        return dict(row, measured=False, reason=point["missing"])
    name = test_set_name(point["classes"])
    keys = {
        "m_oo": ("m_oo",),
        "m_nstar": ("m_nstar",),
        "m_bct_o": ("bct", "m_no"),
        "m_bct_bct": ("bct", "m_nn"),
        "m_nstar_o": ("independent", "m_no"),
    }
    s = {k: evidence.sample(("pair", name, *key), PRIMARY) for k, key in keys.items()}
    if any(v is None for v in s.values()):
        return dict(row, measured=False, reason="a model diverged (NaN embeddings)")
    d = evidence.interval(lambda a, b: a - b, a=s["m_bct_o"], b=s["m_oo"])
    row.update({k: _interval(evidence, v) for k, v in s.items()})
    return dict(row, measured=True, difference=d.to_dict(), verdict=verdict(d))


def _trend(evidence: Evidence, first: int, last: int) -> dict:
    """``d(last) - d(first)``, ``d = M(bct,o) - M(o,o)``, paired (the same queries)."""
    a, b = test_set_name(first), test_set_name(last)

    def sample(name, *key):
        return evidence.sample(("pair", name, *key), PRIMARY)

    iv = evidence.interval(
        lambda no2, oo2, no1, oo1: (no2 - oo2) - (no1 - oo1),
        no2=sample(b, "bct", "m_no"),
        oo2=sample(b, "m_oo"),
        no1=sample(a, "bct", "m_no"),
        oo1=sample(a, "m_oo"),
    )
    return dict(first=first, last=last, change=iv.to_dict(), verdict=verdict(iv))


def _summary(rows: list[dict], trend: dict | None) -> str:
    """What the run shows, in words, from the rows and the trend (no judgement beyond them)."""
    measured = [r for r in rows if r["measured"]]
    if not measured:
        return "No class count was measured."
    by = {
        v: [r["classes"] for r in measured if r["verdict"] == v]
        for v in (HELD, NOT_HELD, INCONCLUSIVE)
    }
    parts = [f"{v} at {', '.join(map(str, c))} classes" for v, c in by.items() if c]
    text = "BCT's criterion M(bct,o) > M(o,o) is " + "; ".join(parts) + "."
    if not by[HELD]:
        text += " The difference does not turn positive at any of these class counts."
    lo, hi = measured[0], measured[-1]
    if trend is not None:
        change = trend["change"]
        direction = {HELD: "rises", NOT_HELD: "falls"}.get(
            trend["verdict"], "shows no clear change"
        )
        text += (
            f" From {trend['first']} to {trend['last']} classes the difference {direction}: "
            f"{change['value']:+.4f} [{change['low']:+.4f}, {change['high']:+.4f}] (paired)."
        )
    text += (
        f" Over the same counts M(o,o) goes from {lo['m_oo']['value']:.4f} to "
        f"{hi['m_oo']['value']:.4f} and M(bct,o) from {lo['m_bct_o']['value']:.4f} to "
        f"{hi['m_bct_o']['value']:.4f}."
    )
    return text


def scaling_results(points: list[dict], evidence: Evidence) -> dict:
    """The class-scaling section of ``report.json`` from the measured ``points`` (``{classes,
    old_train_images, new_train_images, missing}``, ``missing``: why a count has no numbers):
    ``rows`` (per count every number with its interval, the difference and its verdict),
    ``trend`` (the difference's change, smallest to largest measured count) and ``summary``."""
    rows = [_point(evidence, p) for p in points]
    measured = [r["classes"] for r in rows if r["measured"]]
    trend = _trend(evidence, measured[0], measured[-1]) if len(measured) > 1 else None
    return dict(
        scenario=SCENARIO,
        query_set=QUERY_SET,
        metric=PRIMARY,
        rows=rows,
        trend=trend,
        summary=_summary(rows, trend),
    )
