"""The papers' headline claims (docs/methods.md, "Headline claims"), each decided by one stated
measurement on the results of ``runner`` and its per-query evidence -- whatever they say.

Every claim is a set of *checks*; each check is a difference ``d`` whose claim is ``d > 0`` (or
``d >= 0``) with its bootstrap interval over the queries (and seeds), paired where both sides
were measured on the same queries (docs/methods.md, "Uncertainty"). A check is ``held`` when
the interval excludes the opposite, ``not held`` when it excludes the claim, ``inconclusive``
otherwise; a claim over every test set is held when every check is held and not held as soon
as one is not held (:mod:`raycompat.metrics.verdicts`). ``not measured``: the run did not
train what the claim needs. The field methods' claims (docs/reproduce.md, "The field methods'
claims") also say ``not run``, with the reason, when the run never planned their method.
Nothing is tuned to make a claim pass: the measurements are the claims' own wording made exact,
fixed before the run.

Every function takes ``(results, evidence)`` and returns::

    {id, paper, claim, measurement, verdict, checks, numbers, explanation}

``checks``: ``[{check, difference: {value, low, high, queries, classes, seeds}, verdict}]``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from raycompat.metrics.bootstrap import Interval
from raycompat.metrics.verdicts import (
    HELD,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_MEASURED,
    combine_all,
    combine_any,
    verdict,
)
from raycompat.reproduce.evidence import Evidence
from raycompat.reproduce.intervals import trapezoid

__all__ = [
    "CLAIMS",
    "HELD",
    "INCONCLUSIVE",
    "NOT_HELD",
    "NOT_MEASURED",
    "NOT_RUN",
    "PREMISE_CLAIM",
    "PREMISE_NOT_MET",
    "evaluate_claims",
    "mark_premise",
    "shown_verdict",
]

#: a field method's claim whose method this run did not train (not planned: ``--methods``,
#: ``--scenarios`` or the default-scale plan); its explanation says why
NOT_RUN = "not run"

# "far below": the new* cross test at less than half the old system's score.
FAR_BELOW = 0.5
PRIMARY = "mAP@100"


class Checks:
    """The checks of one claim: each a difference with its interval and verdict."""

    def __init__(self, evidence: Evidence):
        self.evidence = evidence
        self.items: list[dict] = []

    def add(self, name: str, statistic: Callable, strict: bool = True, **samples) -> dict:
        """Check ``statistic(**samples) > 0`` (``>= 0`` unless ``strict``); *not measured*
        when a sample is missing (a model of some training seed not trained yet, as in a
        piece of a ``--train-budget-minutes`` run)."""
        if any(sample is None for sample in samples.values()):
            return self.add_interval(name, None, NOT_MEASURED)
        with np.errstate(divide="ignore", invalid="ignore"):
            iv = self.evidence.interval(statistic, **samples)
        return self.add_interval(name, iv, verdict(iv, strict))

    def add_interval(self, name: str, iv: Interval | None, outcome: str) -> dict:
        item = dict(check=name, difference=None if iv is None else iv.to_dict(), verdict=outcome)
        self.items.append(item)
        return item

    def verdicts(self) -> list[str]:
        return [c["verdict"] for c in self.items]


def _claim(cid, paper, claim, measurement, checks: Checks, numbers, outcome=None, note=""):
    """One claim's record: ``outcome`` (default: every check must hold) and its explanation."""
    v = checks.verdicts()
    outcome = outcome or combine_all(v)
    counts = ", ".join(
        f"{v.count(o)} {o}" for o in (HELD, NOT_HELD, INCONCLUSIVE, NOT_MEASURED) if v.count(o)
    )
    if outcome == NOT_MEASURED:
        explanation = "the run did not train the models this claim needs"
    else:
        explanation = f"{len(v)} check(s): {counts}" if v else "no check could be decided"
    explanation += note
    return dict(
        id=cid,
        paper=paper,
        claim=claim,
        measurement=measurement,
        verdict=outcome,
        checks=checks.items,
        numbers=numbers,
        explanation=explanation,
    )


def _sets_with(results: dict, *labels: str) -> list[dict]:
    """Test sets where every one of ``labels`` was trained and which have an old model."""
    return [
        ts
        for ts in results["test_sets"]
        if ts.get("m_oo") is not None and all(label in ts["methods"] for label in labels)
    ]


def _s(evidence: Evidence, *key, metric: str = PRIMARY):
    return evidence.sample(("pair", *key), metric)


def _value(evidence: Evidence, sample) -> dict | None:
    return None if sample is None else evidence.interval(value=sample).to_dict()


def _diff(a, b):
    return a - b


# -- BCT ---------------------------------------------------------------------------------
def bct_independent_incompatible(results: dict, evidence: Evidence) -> dict:
    checks, rows = Checks(evidence), []
    for ts in _sets_with(results, "independent"):
        oo, no = _s(evidence, ts["name"], "m_oo"), _s(evidence, ts["name"], "independent", "m_no")
        c = checks.add(ts["name"], lambda oo, no: FAR_BELOW * oo - no, oo=oo, no=no)
        rows.append(
            {
                "test set": ts["name"],
                "M(o,o)": _value(evidence, oo),
                "M(n*,o)": _value(evidence, no),
                f"{FAR_BELOW} M(o,o) - M(n*,o)": c["difference"],
                "verdict": c["verdict"],
            }
        )
    return _claim(
        "bct-independent-incompatible",
        "BCT",
        "an independently trained new model is incompatible: M(n*,o) far below M(o,o)",
        f"per test set, {PRIMARY}: {FAR_BELOW} x M(o,o) - M(n*,o) > 0 (paired)",
        checks,
        rows,
    )


def bct_compatible(results: dict, evidence: Evidence) -> dict:
    checks, rows = Checks(evidence), []
    for ts in _sets_with(results, "bct"):
        oo, no = _s(evidence, ts["name"], "m_oo"), _s(evidence, ts["name"], "bct", "m_no")
        c = checks.add(ts["name"], _diff, a=no, b=oo)
        rows.append(
            {
                "test set": ts["name"],
                "M(o,o)": _value(evidence, oo),
                "M(bct,o)": _value(evidence, no),
                "M(bct,o) - M(o,o)": c["difference"],
                "verdict": c["verdict"],
            }
        )
    return _claim(
        "bct-compatible",
        "BCT",
        "BCT satisfies the compatibility criterion M(n,o) > M(o,o)",
        f"per test set, {PRIMARY}: M(bct,o) - M(o,o) > 0 (BCT-sys, paired)",
        checks,
        rows,
    )


def bct_variant_order(results: dict, evidence: Evidence) -> dict:
    checks, rows = Checks(evidence), []
    for ts in _sets_with(results, "bct", "bct-kd", "bct-beta"):
        if not ts["unseen_classes"]:
            continue
        sys_, kd, beta = (
            _s(evidence, ts["name"], k, "m_no") for k in ("bct", "bct-kd", "bct-beta")
        )
        c1 = checks.add(f"{ts['name']}: sys >= kd", _diff, strict=False, a=sys_, b=kd)
        c2 = checks.add(f"{ts['name']}: kd >= beta", _diff, strict=False, a=kd, b=beta)
        rows.append(
            {
                "test set": ts["name"],
                "M(sys,o)": _value(evidence, sys_),
                "M(kd,o)": _value(evidence, kd),
                "M(beta,o)": _value(evidence, beta),
                "sys - kd": c1["difference"],
                "kd - beta": c2["difference"],
                "verdicts": [c1["verdict"], c2["verdict"]],
            }
        )
    return _claim(
        "bct-variants",
        "BCT",
        "on new classes, sys >= kd >= beta",
        f"per test set whose new training set has classes the old model never saw, {PRIMARY} "
        "cross test, paired: M(sys,o) - M(kd,o) >= 0 and M(kd,o) - M(beta,o) >= 0",
        checks,
        rows,
    )


def bct_l2_fails(results: dict, evidence: Evidence) -> dict:
    checks, rows, diverged = Checks(evidence), [], 0
    for ts in _sets_with(results, "l2"):
        oo = _s(evidence, ts["name"], "m_oo")
        if ts["methods"]["l2"].get("diverged"):
            # a model whose training diverged (NaN) produces no usable embedding: it fails too
            diverged += 1
            checks.add_interval(f"{ts['name']}: diverged", None, HELD)
            rows.append({"test set": ts["name"], "M(o,o)": _value(evidence, oo), "diverged": True})
            continue
        no = _s(evidence, ts["name"], "l2", "m_no")
        c = checks.add(ts["name"], _diff, strict=False, a=oo, b=no)
        rows.append(
            {
                "test set": ts["name"],
                "M(o,o)": _value(evidence, oo),
                "M(l2,o)": _value(evidence, no),
                "M(o,o) - M(l2,o)": c["difference"],
                "verdict": c["verdict"],
            }
        )
    note = (
        f"; on {diverged} test set(s) the l2 training diverged (NaN loss), which fails the "
        "criterion by producing no usable model -- unlike the paper, whose l2 model trained but "
        "was incompatible"
        if diverged
        else ""
    )
    return _claim(
        "bct-l2-fails",
        "BCT",
        "the l2 baseline fails the compatibility criterion",
        f"per test set, {PRIMARY}: M(o,o) - M(l2,o) >= 0 (paired), or the l2 training diverged",
        checks,
        rows,
        note=note,
    )


# -- RACT --------------------------------------------------------------------------------
def backfill_curve(results: dict, scenario: str, label: str, policy: str, mode: str) -> dict | None:
    """The backfill curve of model ``label`` in ``scenario`` for (policy, mode), or ``None``."""
    for c in results.get("backfill", {}).get(scenario, {}).get(label, {}).get("curves", []):
        if c["policy"] == policy and c["mode"] == mode:
            return c
    return None


def _curve(evidence: Evidence, scenario, label, policy, mode, metric=PRIMARY):
    return evidence.sample(("curve", scenario, label, policy, mode), metric)


def _auc_difference(grid):
    """``AUC(a) - AUC(b)`` over ``grid`` (trapezoids, t in [0, 1])."""
    return lambda a, b: trapezoid(grid, a) - trapezoid(grid, b)


def _largest_drop(curve):
    """``max_t (M(0) - M(t))`` over the later grid points: > 0 is a regression (RACT Eq.3)."""
    return np.max(curve[..., :1] - curve[..., 1:], axis=-1)


def ract_vanilla_regresses(results: dict, evidence: Evidence) -> dict:
    checks, rows = Checks(evidence), []
    for scenario in results.get("backfill", {}):
        samples = {
            m: _curve(evidence, scenario, "contrastive", "random", "compatible", m)
            for m in (PRIMARY, "top1")
        }
        if any(s is None for s in samples.values()):
            continue
        sub = Checks(evidence)
        for metric, s in samples.items():
            sub.add(f"{scenario} {metric}", _largest_drop, curve=s)
        outcome = combine_any(sub.verdicts())
        checks.items.append(
            dict(
                check=scenario,
                difference=sub.items[0]["difference"],
                verdict=outcome,
                parts=sub.items,
            )
        )
        rows.append(
            {
                "scenario": scenario,
                **{
                    f"largest drop below t=0, {c['check'].split()[-1]}": c["difference"]
                    for c in sub.items
                },
                "verdict": outcome,
            }
        )
    return _claim(
        "ract-vanilla-regresses",
        "RACT",
        "vanilla compatible training regresses (flips) early in a hot refresh",
        "per scenario, `contrastive` model, random backfill order, compatible queries: the "
        "largest drop of the mAP@100 or the top-1 curve below its t=0 value, max_t (M(0) - "
        "M(t)), is > 0 (RACT Eq.3; either metric)",
        checks,
        rows,
    )


def ract_lowers_nfr(results: dict, evidence: Evidence) -> dict:
    checks, rows = Checks(evidence), []
    for scenario in results.get("backfill", {}):
        van = _curve(evidence, scenario, "contrastive", "random", "compatible", "NFR@1")
        ract = _curve(evidence, scenario, "ract", "random", "compatible", "NFR@1")
        curve = backfill_curve(results, scenario, "ract", "random", "compatible")
        if van is None or ract is None or curve is None:
            continue
        grid = curve["fractions"]
        c = checks.add(f"{scenario}: mean NFR@1", _auc_difference(grid), a=van, b=ract)
        band = evidence.interval(_diff, a=van, b=ract)
        worse = [t for t, h in zip(grid, band["high"], strict=True) if h < 0]
        better = [t for t, lo in zip(grid, band["low"], strict=True) if lo > 0]
        checks.add_interval(
            f"{scenario}: no grid point where ract flips more", None, NOT_HELD if worse else HELD
        )
        rows.append(
            {
                "scenario": scenario,
                "mean NFR@1 contrastive - ract": c["difference"],
                "grid points ract lower (interval > 0)": f"{len(better)}/{len(grid)}",
                "grid points ract higher (interval < 0)": f"{len(worse)}/{len(grid)}",
                "old-old successes behind NFR": (curve.get("old_old_successes") or [None])[0],
                "verdict": c["verdict"],
            }
        )
    return _claim(
        "ract-lower-nfr",
        "RACT",
        "RACT lowers the negative flip rate along the whole curve",
        "per scenario, random order (same seed), compatible queries, paired: the mean NFR@1 "
        "over the curve (area, t in [0,1]) of contrastive minus ract > 0, and no grid point "
        "t = 0, 5%, ..., 100% where ract's NFR@1 is higher (difference interval below 0)",
        checks,
        rows,
    )


UNCERTAINTY_CHECKS = (
    ("uncertainty:margin", "random", True),
    ("uncertainty:least_confidence", "random", True),
    ("uncertainty:margin", "uncertainty:entropy", False),
    ("uncertainty:least_confidence", "uncertainty:entropy", False),
)


def ract_uncertainty_faster(results: dict, evidence: Evidence) -> dict:
    checks, rows = Checks(evidence), []
    for scenario in results.get("backfill", {}):
        policies = {p for a, b, _ in UNCERTAINTY_CHECKS for p in (a, b)}
        s = {p: _curve(evidence, scenario, "ract", p, "compatible") for p in policies}
        curve = backfill_curve(results, scenario, "ract", "random", "compatible")
        if any(v is None for v in s.values()) or curve is None:
            continue
        grid = curve["fractions"]
        row = {"scenario": scenario}
        for a, b, strict in UNCERTAINTY_CHECKS:
            name = f"AUC {a.split(':')[-1]} - {b.split(':')[-1]}"
            c = checks.add(
                f"{scenario}: {name}",
                _auc_difference(grid),
                strict=strict,
                a=s[a],
                b=s[b],
            )
            row[name] = c["difference"]
            row[f"{name} verdict"] = c["verdict"]
        rows.append(row)
    return _claim(
        "ract-uncertainty-order",
        "RACT",
        "uncertainty ordering (margin, least confidence > entropy) converges faster than random",
        "per scenario, `ract` model, compatible queries, paired: area under the mAP@100 "
        "backfill curve (t in [0,1]); AUC(margin) - AUC(random) > 0, AUC(least confidence) - "
        "AUC(random) > 0, AUC(margin) - AUC(entropy) >= 0, AUC(least confidence) - "
        "AUC(entropy) >= 0",
        checks,
        rows,
    )


# -- DMU ---------------------------------------------------------------------------------
#: DMU's BCT, best first: one trained with DMU's head (ArcFace, as the DMU paper's BCT), else
#: the shared ``bct`` (CosFace)
DMU_REFERENCES = ("bct-arcface", "bct")


def dmu_reference(ts: dict) -> str | None:
    """The BCT test set ``ts`` compares DMU with (:data:`DMU_REFERENCES`), None if none."""
    return next((label for label in DMU_REFERENCES if label in ts["methods"]), None)


def dmu_adapted_beats_bct(results: dict, evidence: Evidence) -> dict:
    checks, rows = Checks(evidence), []
    for ts in _sets_with(results, "dmu"):
        name, bct = ts["name"], dmu_reference(ts)
        if bct is None:
            continue
        na, no = _s(evidence, name, "dmu", "m_nadapted"), _s(evidence, name, bct, "m_no")
        nn_dmu, nn_bct = _s(evidence, name, "dmu", "m_nn"), _s(evidence, name, bct, "m_nn")
        nstar = _s(evidence, name, "m_nstar")
        if na is None or nstar is None:
            continue
        c1 = checks.add(f"{name}: adapted cross test", _diff, a=na, b=no)
        c2 = checks.add(
            f"{name}: Delta_down",
            lambda d, b, s: (d - b) / s,  # Delta_down(bct) - Delta_down(dmu), DMU Eq.7
            d=nn_dmu,
            b=nn_bct,
            s=nstar,
        )
        rows.append(
            {
                "test set": name,
                "BCT": bct,
                "M(dmu,psi(o))": _value(evidence, na),
                "M(bct,o)": _value(evidence, no),
                "M(dmu,psi(o)) - M(bct,o)": c1["difference"],
                "Delta_down(bct) - Delta_down(dmu)": c2["difference"],
                "verdicts": [c1["verdict"], c2["verdict"]],
            }
        )
    return _claim(
        "dmu-adapted",
        "DMU",
        "new-to-adapted-old beats BCT's new-to-old, with less new-new degradation",
        f"per test set, {PRIMARY}, paired: M(dmu, psi(old)) - M(bct, old) > 0 and "
        "Delta_down(bct) - Delta_down(dmu) > 0 (DMU Eq.7, new* = independent), bct the BCT of "
        "DMU's ArcFace head (bct-arcface) where it was trained, as the DMU paper's, else bct",
        checks,
        rows,
    )


# -- RM ----------------------------------------------------------------------------------
RM_CURVES = (
    ("rank_merge (mcl)", "mcl", "rank_merge"),
    ("naive_merge", "mcl", "naive_merge"),
    ("bct compatible", "bct", "compatible"),
)


def _gain(grid):
    """AUC gain (RM Table 1): ``(AUC - M(o,o)) / (M(n*,n*) - M(o,o))``."""
    return lambda c, oo, ns: (trapezoid(grid, c) - oo) / (ns - oo)


def _gain_above_one(gain):
    return lambda c, oo, ns: gain(c, oo, ns) - 1.0


def _gain_difference(gain):
    return lambda r, o, oo, ns: gain(r, oo, ns) - gain(o, oo, ns)


def rm_rank_merge(results: dict, evidence: Evidence) -> dict:
    checks, rows, reach, undefined = Checks(evidence), [], Checks(evidence), []
    for scenario in results.get("backfill", {}):
        s = {k: _curve(evidence, scenario, m, "random", mode) for k, m, mode in RM_CURVES}
        oo, ns = _s(evidence, scenario, "m_oo"), _s(evidence, scenario, "m_nstar")
        curve = backfill_curve(results, scenario, "mcl", "random", "rank_merge")
        if any(v is None for v in s.values()) or oo is None or ns is None or curve is None:
            continue
        if not ns.value().mean() > oo.value().mean():
            undefined.append(f"{scenario}: M(n*,n*) is not above M(o,o)")
            rows.append({"scenario": scenario, "AUC gain": "undefined: M(n*,n*) <= M(o,o)"})
            continue
        gain = _gain(curve["fractions"])
        row = {"scenario": scenario}
        for k in s:
            row[f"AUC gain {k}"] = evidence.interval(gain, c=s[k], oo=oo, ns=ns).to_dict()
        a = reach.add(
            f"{scenario}: gain >= 1",
            _gain_above_one(gain),
            strict=False,
            c=s["rank_merge (mcl)"],
            oo=oo,
            ns=ns,
        )
        row["gain - 1"] = a["difference"]
        for other in ("bct compatible", "naive_merge"):
            c = checks.add(
                f"{scenario}: beats {other}",
                _gain_difference(gain),
                r=s["rank_merge (mcl)"],
                o=s[other],
                oo=oo,
                ns=ns,
            )
            row[f"gain - gain({other})"] = c["difference"]
            row[f"beats {other}"] = c["verdict"]
        rows.append(row)
    if reach.items:
        checks.items.insert(
            0,
            dict(
                check="gain >= 1 in some scenario",
                difference=None,
                verdict=combine_any(reach.verdicts()),
                parts=reach.items,
            ),
        )
    outcome = INCONCLUSIVE if undefined and not checks.items else None
    return _claim(
        "rm-auc-gain",
        "RM",
        "rank merge reaches AUC gain >= 100% on some dataset and beats BCT / naive merge",
        "random backfill order, mAP@100 AUC gain (RM Table 1, new* = independent), paired: "
        "(a) mcl rank_merge gain - 1 >= 0 in at least one scenario; (b) in every scenario its "
        "gain minus bct's (compatible queries) > 0; (c) minus naive merge's > 0",
        checks,
        rows,
        outcome,
        note="".join(f"; AUC gain n/a in {u} (scenario not counted)" for u in undefined),
    )


# -- NDPP / ODPP -------------------------------------------------------------------------
P1_LABELS = ("ndpp", "odpp", "p2s", "bct")


def _p1(n_sets: int, label: str):
    """P_1 of ``label`` (NDPP tables): the mean over test sets of the harmonic mean of
    u = sigmoid((M(n,n) - M(n*,n*)) / M(n*,n*)) and v = sigmoid((M(n,o) - M(o,o)) /
    (M(n*,n*) - M(o,o)))."""

    def f(**m):
        total = 0.0
        for i in range(n_sets):
            nn, no, oo, ns = (
                m[f"{k}{i}_{label}"] if k in ("nn", "no") else m[f"{k}{i}"]
                for k in ("nn", "no", "oo", "ns")
            )
            u = 1.0 / (1.0 + np.exp(-(nn - ns) / ns))
            v = 1.0 / (1.0 + np.exp(-(no - oo) / (ns - oo)))
            total = total + 2.0 * u * v / (u + v)
        return 100.0 * total / n_sets

    return f


def ndpp_p1(results: dict, evidence: Evidence) -> dict:
    sets = _sets_with(results, *P1_LABELS)
    checks, rows = Checks(evidence), []
    if sets:
        samples = {}
        for i, ts in enumerate(sets):
            samples[f"oo{i}"] = _s(evidence, ts["name"], "m_oo")
            samples[f"ns{i}"] = _s(evidence, ts["name"], "m_nstar")
            for label in P1_LABELS:
                samples[f"nn{i}_{label}"] = _s(evidence, ts["name"], label, "m_nn")
                samples[f"no{i}_{label}"] = _s(evidence, ts["name"], label, "m_cross")
        p1 = {label: _p1(len(sets), label) for label in P1_LABELS}
        rows.append(
            {
                "test sets": ", ".join(ts["name"] for ts in sets),
                **{f"P_1 {k}": evidence.interval(p1[k], **samples).to_dict() for k in P1_LABELS},
            }
        )
        for new in ("ndpp", "odpp"):
            for base in ("p2s", "bct"):
                c = checks.add(
                    f"P_1 {new} - P_1 {base}",
                    lambda new=new, base=base, **m: p1[new](**m) - p1[base](**m),
                    **samples,
                )
                rows[0][f"P_1 {new} - {base}"] = c["difference"]
    return _claim(
        "ndpp-p1",
        "NDPP/ODPP",
        "perturbed prototypes (NDPP, ODPP) beat plain P2S and BCT on P_1",
        "P_1 (NDPP tables: harmonic mean of u and v per test set, averaged over the test sets "
        "where all four were trained), paired: P_1(ndpp) - P_1(p2s), P_1(ndpp) - P_1(bct), "
        "P_1(odpp) - P_1(p2s), P_1(odpp) - P_1(bct), each > 0",
        checks,
        rows,
    )


# -- field methods (docs/reproduce.md, "The field methods' claims") -------------------------
#: BT^2's "close to the independent model": Delta_down(bt2) = (M(n*,n*) - M(bt2,bt2)) / M(n*,n*)
#: below 5 %, i.e. the paired check 0.05 - Delta_down(bt2) > 0
BT2_CLOSE = 0.05
#: the scenarios whose new training set has classes the old model never saw
UNSEEN_SCENARIOS = ("open-class", "sequential")


def _model_label(model: str) -> str:
    """The method of a model name ``scenario/label[-genG][@seedS]``."""
    return model.partition("/")[2].split("@")[0].split("-gen")[0]


def _absent(results: dict, labels: tuple, scenarios: tuple | None) -> tuple[str, str]:
    """``(verdict, reason)`` of a claim with nothing to measure: ``not measured`` when a model it
    needs was planned but not trained (or not usable), else ``not run`` with why the run did not
    train it (``results["skipped"]``: the plan's reason per scenario and method)."""
    ran = results.get("scenarios") or sorted({ts["scenario"] for ts in results["test_sets"]})
    where = [s for s in ran if scenarios is None or s in scenarios]
    if not where:
        which = (
            "no scenario was run"
            if scenarios is None
            else f"the {' / '.join(scenarios)} scenario was not run"
        )
        return NOT_RUN, f"{which} (`--scenarios`)"
    for label in labels:
        for m in results.get("not_trained") or []:
            if m["model"].partition("/")[0] in where and _model_label(m["model"]) == label:
                return NOT_MEASURED, f"{m['model']} was not trained: {m['reason']}"
    skipped = results.get("skipped") or {}
    for label in labels:
        if any(label in ts["methods"] for ts in results["test_sets"] if ts["scenario"] in where):
            continue
        models = results.get("models") or {}
        if any(m.partition("/")[0] in where and _model_label(m) == label for m in models):
            return NOT_MEASURED, f"{label} was trained but could not be evaluated (diverged)"
        why = [f"{s}: {dict(skipped.get(s, ())).get(label, 'not trained')}" for s in where]
        return NOT_RUN, f"{label} was not trained ({'; '.join(why)})"
    return NOT_RUN, f"{' and '.join(labels)} were not trained together in {', '.join(where)}"


def _field_claim(cid, paper, claim, measurement, checks, rows, results, labels, scenarios=None):
    """:func:`_claim`, or ``not run`` / ``not measured`` with its reason when no check ran."""
    if checks.items:
        return _claim(cid, paper, claim, measurement, checks, rows)
    outcome, reason = _absent(results, labels, scenarios)
    record = _claim(cid, paper, claim, measurement, checks, rows, outcome=outcome)
    record["explanation"] = reason
    return record


def _diverged(ts: dict, label: str) -> bool:
    return bool(ts["methods"][label].get("diverged"))


def _versus_bct(results, evidence, label, kinds, unseen_only=False):
    """Per test set with ``label``, ``bct`` and an old model (and unseen classes if
    ``unseen_only``), one check per ``(kind of label, kind of bct, name of label's number, name of
    bct's number)``: M(label) - M(bct) > 0, paired. A diverged ``label`` fails its checks."""
    checks, rows = Checks(evidence), []
    for ts in _sets_with(results, label, "bct"):
        name = ts["name"]
        if unseen_only and not ts["unseen_classes"]:
            continue
        if _diverged(ts, label):
            checks.add_interval(f"{name}: {label} diverged", None, NOT_HELD)
            rows.append({"test set": name, "diverged": label})
            continue
        row = {"test set": name}
        for kind, bct_kind, text, bct_text in kinds:
            a, b = _s(evidence, name, label, kind), _s(evidence, name, "bct", bct_kind)
            if a is None or b is None:
                continue
            c = checks.add(name if len(kinds) == 1 else f"{name}: {text}", _diff, a=a, b=b)
            row.update({text: _value(evidence, a), bct_text: _value(evidence, b)})
            row[f"{text} - {bct_text}"] = c["difference"]
            row[f"verdict {text}" if len(kinds) > 1 else "verdict"] = c["verdict"]
        rows.append(row)
    return checks, rows


def lce_beats_bct(results: dict, evidence: Evidence) -> dict:
    checks, rows = _versus_bct(results, evidence, "lce", [("m_no", "m_no", "M(lce,o)", "M(bct,o)")])
    return _field_claim(
        "lce-beats-bct",
        "LCE",
        "LCE's aligned classifier and boundary loss give a better cross test than BCT",
        f"per test set, {PRIMARY}, paired: M(lce,o) - M(bct,o) > 0",
        checks,
        rows,
        results,
        ("lce", "bct"),
    )


def unibct_beats_bct(results: dict, evidence: Evidence) -> dict:
    kinds = [("m_no", "m_no", "M(unibct,o)", "M(bct,o)")]
    checks, rows = _versus_bct(results, evidence, "unibct", kinds, unseen_only=True)
    return _field_claim(
        "unibct-beats-bct",
        "UniBCT",
        "UniBCT's universal prototypes beat BCT on the cross test where the new model learns "
        "classes the old one never saw",
        f"per test set whose new training set has classes the old model never saw (open-class; "
        f"the sequential upgrades against phi_1, which extend the class set), {PRIMARY}, paired: "
        "M(unibct,o) - M(bct,o) > 0",
        checks,
        rows,
        results,
        ("unibct", "bct"),
        UNSEEN_SCENARIOS,
    )


def advbct_beats_bct(results: dict, evidence: Evidence) -> dict:
    kinds = [
        ("m_no", "m_no", "M(advbct,o)", "M(bct,o)"),
        ("m_nn", "m_nn", "M(advbct,advbct)", "M(bct,bct)"),
    ]
    checks, rows = _versus_bct(results, evidence, "advbct", kinds)
    return _field_claim(
        "advbct-beats-bct",
        "AdvBCT",
        "AdvBCT beats BCT on the cross test and on the new model's own retrieval",
        f"per test set, {PRIMARY}, paired: M(advbct,o) - M(bct,o) > 0 and M(advbct,advbct) - "
        "M(bct,bct) > 0",
        checks,
        rows,
        results,
        ("advbct", "bct"),
    )


def fct_beats_bct(results: dict, evidence: Evidence) -> dict:
    kinds = [("m_nadapted", "m_no", "M(fct,h(o))", "M(bct,o)")]
    checks, rows = _versus_bct(results, evidence, "fct", kinds)
    return _field_claim(
        "fct-beats-bct",
        "FCT",
        "FCT's transformed old gallery is searched better by the new model than BCT's old gallery",
        f"per test set, {PRIMARY}, paired: M(fct, h(o)) - M(bct, o) > 0 (h: FCT's transformation "
        "of the stored old vectors; the new model is the independent one)",
        checks,
        rows,
        results,
        ("fct", "bct"),
    )


def _bt2_row(evidence, name, samples, close, compatible, bct_no) -> dict:
    nn, ns, no, oo = (samples[k] for k in ("nn", "ns", "no", "oo"))
    row = {
        "test set": name,
        "M(n*,n*)": _value(evidence, ns),
        "M(bt2,bt2)": _value(evidence, nn),
        f"{BT2_CLOSE} - Delta_down(bt2)": close["difference"],
        "M(o,o)": _value(evidence, oo),
        "M(bt2,o)": _value(evidence, no),
        "M(bt2,o) - M(o,o)": compatible["difference"],
        "verdicts": [close["verdict"], compatible["verdict"]],
    }
    if bct_no is not None:
        row["M(bct,o) (context)"] = _value(evidence, bct_no)
    return row


def bt2_close_and_compatible(results: dict, evidence: Evidence) -> dict:
    checks, rows = Checks(evidence), []
    for ts in _sets_with(results, "bt2"):
        name = ts["name"]
        if _diverged(ts, "bt2"):
            checks.add_interval(f"{name}: bt2 diverged", None, NOT_HELD)
            continue
        samples = {
            "nn": _s(evidence, name, "bt2", "m_nn"),
            "no": _s(evidence, name, "bt2", "m_no"),
            "oo": _s(evidence, name, "m_oo"),
            "ns": _s(evidence, name, "m_nstar"),
        }
        if any(v is None for v in samples.values()):
            continue
        close = checks.add(
            f"{name}: M(bt2,bt2) within {BT2_CLOSE:.0%} of M(n*,n*)",
            lambda nn, ns: BT2_CLOSE - (ns - nn) / ns,
            nn=samples["nn"],
            ns=samples["ns"],
        )
        compatible = checks.add(
            f"{name}: M(bt2,o) > M(o,o)", _diff, a=samples["no"], b=samples["oo"]
        )
        bct_no = _s(evidence, name, "bct", "m_no") if "bct" in ts["methods"] else None
        rows.append(_bt2_row(evidence, name, samples, close, compatible, bct_no))
    return _field_claim(
        "bt2-close-and-compatible",
        "BT^2",
        "BT^2 keeps the new model's own retrieval close to the independent model's while "
        "meeting the compatibility criterion",
        f"per test set, {PRIMARY}, paired: (close) {BT2_CLOSE} - Delta_down(bt2) > 0, with "
        "Delta_down(bt2) = (M(n*,n*) - M(bt2,bt2)) / M(n*,n*) (DMU Eq.7, new* = the independent "
        "model bt2 was trained beside), i.e. M(bt2,bt2) above 95 % of M(n*,n*); (compatible, "
        "BT^2's sense: BCT's criterion) M(bt2,o) - M(o,o) > 0",
        checks,
        rows,
        results,
        ("bt2",),
    )


def dsimplex_compatible_chain(results: dict, evidence: Evidence) -> dict:
    checks, rows = Checks(evidence), []
    for ts in results["test_sets"]:
        if ts["scenario"] != "sequential" or "dsimplex" not in ts["methods"]:
            continue
        name = ts["name"]
        oo = _s(evidence, name, "dsimplex", "m_oo")
        no = _s(evidence, name, "dsimplex", "m_no")
        if oo is None or no is None:
            continue
        c = checks.add(f"{name} ({ts['pair']})", _diff, a=no, b=oo)
        row = {
            "pair": ts["pair"],
            "M(phi_i,phi_i)": _value(evidence, oo),
            "M(phi_j,phi_i)": _value(evidence, no),
            "M(phi_j,phi_i) - M(phi_i,phi_i)": c["difference"],
            "verdict": c["verdict"],
        }
        ind_oo = _s(evidence, name, "independent", "m_oo")
        ind_no = _s(evidence, name, "independent", "m_no")
        if ind_oo is not None and ind_no is not None:
            row["independent chain, same difference (context)"] = evidence.interval(
                _diff, a=ind_no, b=ind_oo
            ).to_dict()
        rows.append(row)
    return _field_claim(
        "dsimplex-chain",
        "d-Simplex (CoReS)",
        "a fixed d-Simplex classifier keeps every generation compatible with its predecessors "
        "without any old-model loss",
        f"sequential scenario, the dsimplex chain (its own phi_1; every generation trained with "
        f"the same fixed simplex head, loss=cores: no term involves the old model), {PRIMARY}, "
        "paired: M(phi_j, phi_i) - M(phi_i, phi_i) > 0 for each step (2->1, 3->2) and across "
        "both (3->1)",
        checks,
        rows,
        results,
        ("dsimplex",),
        ("sequential",),
    )


def _baseline_criterion(label: str, paper: str):
    """The compatibility criterion of a baseline without a headline claim of its own."""

    def claim(results: dict, evidence: Evidence) -> dict:
        checks, rows = Checks(evidence), []
        for ts in _sets_with(results, label):
            name = ts["name"]
            if _diverged(ts, label):
                checks.add_interval(f"{name}: {label} diverged", None, NOT_HELD)
                continue
            oo, no = _s(evidence, name, "m_oo"), _s(evidence, name, label, "m_no")
            if oo is None or no is None:
                continue
            c = checks.add(name, _diff, a=no, b=oo)
            rows.append(
                {
                    "test set": name,
                    "M(o,o)": _value(evidence, oo),
                    f"M({label},o)": _value(evidence, no),
                    f"M({label},o) - M(o,o)": c["difference"],
                    "verdict": c["verdict"],
                }
            )
        return _field_claim(
            f"{label}-criterion",
            f"{paper} (baseline)",
            f"{paper} as a compatibility baseline (no headline claim of its own): BCT's "
            "criterion M(n,o) > M(o,o)",
            f"per test set, {PRIMARY}: M({label},o) - M(o,o) > 0 (paired)",
            checks,
            rows,
            results,
            (label,),
        )

    claim.__name__ = f"{label}_criterion"
    return claim


lwf_criterion = _baseline_criterion("lwf", "LwF")
fd_criterion = _baseline_criterion("fd", "FD")


CLAIMS: tuple[Callable[[dict, Evidence], dict], ...] = (
    bct_independent_incompatible,
    bct_compatible,
    bct_variant_order,
    bct_l2_fails,
    ract_vanilla_regresses,
    ract_lowers_nfr,
    ract_uncertainty_faster,
    dmu_adapted_beats_bct,
    rm_rank_merge,
    ndpp_p1,
    lce_beats_bct,
    unibct_beats_bct,
    advbct_beats_bct,
    bt2_close_and_compatible,
    dsimplex_compatible_chain,
    fct_beats_bct,
    lwf_criterion,
    fd_criterion,
)


#: the premise of every claim that builds on a compatible new model: BCT's own criterion
PREMISE_CLAIM = "bct-compatible"
#: what such a claim shows where its run did not hold the premise (docs/reproduce.md, "The premise
#: scale")
PREMISE_NOT_MET = "premise not met at this scale (see the premise-scale run)"
#: the claims measured on a new model that is meant to be compatible with the old one: RACT's
#: flips and orders, DMU's adapted gallery, RM's rank merge, NDPP/ODPP's P_1 against BCT, and the
#: field's eight methods (each beats BCT or meets its criterion). BCT's own claims are the premise
#: and its context, and stand on their own.
NEEDS_PREMISE = (
    "ract-vanilla-regresses",
    "ract-lower-nfr",
    "ract-uncertainty-order",
    "dmu-adapted",
    "rm-auc-gain",
    "ndpp-p1",
    "lce-beats-bct",
    "unibct-beats-bct",
    "advbct-beats-bct",
    "bt2-close-and-compatible",
    "dsimplex-chain",
    "fct-beats-bct",
    "lwf-criterion",
    "fd-criterion",
)
MEASURED = (HELD, NOT_HELD, INCONCLUSIVE)


def mark_premise(claims: list[dict], results: dict, evidence: Evidence) -> list[dict]:
    """Where the run measured BCT's criterion (``PREMISE_CLAIM``) and did not hold it on every
    test set, every claim of ``NEEDS_PREMISE`` with a measured verdict gets ``premise``: the
    criterion's verdict, the test sets where it held (``met_on``) and those where it did not
    (``not_met_on``: not held, inconclusive or not measured), and the claim decided again
    without the latter (``verdict_where_met``; test sets the criterion does not check stay).
    ``met`` is whether that left the claim a measured verdict (:func:`shown_verdict`). A run
    that held it everywhere, or did not measure it, marks nothing."""
    premise = next((c for c in claims if c["id"] == PREMISE_CLAIM), None)
    if premise is None or premise["verdict"] not in MEASURED or premise["verdict"] == HELD:
        return claims
    met_on = [c["check"] for c in premise["checks"] if c["verdict"] == HELD]
    not_met_on = [c["check"] for c in premise["checks"] if c["verdict"] != HELD]
    where_met = _without_test_sets(results, set(not_met_on))
    for decide, c in zip(CLAIMS, claims, strict=True):
        if c["id"] not in NEEDS_PREMISE or c["verdict"] not in MEASURED:
            continue
        again = decide(where_met, evidence)
        met = again["verdict"] in MEASURED
        c["premise"] = dict(
            met=met,
            claim=PREMISE_CLAIM,
            verdict=premise["verdict"],
            met_on=met_on,
            not_met_on=not_met_on,
            verdict_where_met=again["verdict"] if met else None,
            explanation_where_met=again["explanation"] if met else None,
        )
    return claims


def _without_test_sets(results: dict, names: set[str]) -> dict:
    """``results`` without the test sets (and backfill curves) named in ``names``."""
    return dict(
        results,
        test_sets=[ts for ts in results["test_sets"] if ts["name"] not in names],
        backfill={k: v for k, v in (results.get("backfill") or {}).items() if k not in names},
    )


def shown_verdict(claim: dict) -> str:
    """The verdict as the report shows it (:func:`mark_premise`): ``PREMISE_NOT_MET; measured:
    v`` for a claim whose premise the run held on none of its test sets; ``v' where BCT's
    criterion held (...); on every test set: v`` for one decided where it held; else ``v``."""
    premise = claim.get("premise")
    if not premise:
        return claim["verdict"]
    if not premise["met"]:
        return f"{PREMISE_NOT_MET}; measured: {claim['verdict']}"
    return (
        f"{premise['verdict_where_met']} where BCT's criterion held "
        f"({', '.join(premise['met_on'])}; premise not met on "
        f"{', '.join(premise['not_met_on'])}); on every test set: {claim['verdict']}"
    )


def evaluate_claims(results: dict, evidence: Evidence) -> list[dict]:
    """Every claim of ``CLAIMS``, those whose premise the run did not hold marked
    (:func:`mark_premise`)."""
    return mark_premise([claim(results, evidence) for claim in CLAIMS], results, evidence)
