"""Each headline-claim function on hand-made numbers: held, not held, partly held, not measured."""

from __future__ import annotations

import pytest

from raycompat.reproduce.claims import (
    HELD,
    NOT_HELD,
    NOT_MEASURED,
    PARTLY,
    bct_compatible,
    bct_independent_incompatible,
    bct_l2_fails,
    bct_variant_order,
    dmu_adapted_beats_bct,
    evaluate_claims,
    ndpp_p1,
    ract_lowers_nfr,
    ract_uncertainty_faster,
    ract_vanilla_regresses,
    rm_rank_merge,
)
from raycompat.reproduce.plan import VARIANTS
from raycompat.reproduce.runner import compat_entry

M = "mAP@100"


def metrics(value):
    return {M: value, "top1": value}


def make_set(name, oo, nstar, methods, unseen=True):
    """methods: label -> (m_nn, m_no, m_nadapted or None)."""
    entries = {
        label: compat_entry(
            VARIANTS[label],
            m_oo=metrics(oo),
            m_nn=metrics(nn),
            m_no=metrics(no),
            m_nadapted=None if na is None else metrics(na),
            m_nstar=metrics(nstar),
        )
        for label, (nn, no, na) in methods.items()
    }
    return dict(
        name=name,
        scenario=name,
        pair="new -> old",
        unseen_classes=unseen,
        metric=M,
        m_oo=metrics(oo),
        m_nstar=metrics(nstar),
        methods=entries,
    )


def curve(policy, mode, mAP, nfr=None, top1=None, auc=None, gain=None, regression=False):
    n = len(mAP)
    fr = [i / (n - 1) for i in range(n)]
    top1 = top1 or mAP
    nfr = nfr or [0.0] * n
    reg = {
        "has_regression": regression,
        "points_below_start": [0.5] if regression else [],
        "drops": [],
    }
    return dict(
        policy=policy,
        mode=mode,
        fractions=fr,
        **{M: mAP, "top1": top1, "NFR@1": nfr},
        summary={
            M: {"auc": auc, "auc_gain": gain, "regression": reg},
            "top1": {"auc": auc, "auc_gain": gain, "regression": reg},
            "NFR@1": {"auc": None, "auc_gain": None, "regression": None},
        },
    )


def test_bct_claims_hold_and_fail():
    good = make_set(
        "a",
        0.30,
        0.60,
        {
            "independent": (0.60, 0.05, None),
            "bct": (0.55, 0.35, None),
            "bct-kd": (0.55, 0.33, None),
            "bct-beta": (0.55, 0.31, None),
            "l2": (0.40, 0.20, None),
        },
    )
    bad = make_set(
        "b",
        0.30,
        0.60,
        {
            "independent": (0.60, 0.20, None),
            "bct": (0.55, 0.25, None),
            "bct-kd": (0.55, 0.28, None),
            "bct-beta": (0.55, 0.31, None),
            "l2": (0.40, 0.35, None),
        },
    )
    assert bct_independent_incompatible({"test_sets": [good]})["verdict"] == HELD
    assert bct_compatible({"test_sets": [good]})["verdict"] == HELD
    assert bct_variant_order({"test_sets": [good]})["verdict"] == HELD
    assert bct_l2_fails({"test_sets": [good]})["verdict"] == HELD
    # 0.20 is below M(o,o)=0.30 but not "far below" (< 0.15): not held
    for fn in (bct_independent_incompatible, bct_compatible, bct_variant_order, bct_l2_fails):
        assert fn({"test_sets": [bad]})["verdict"] == NOT_HELD, fn.__name__
        assert fn({"test_sets": [good, bad]})["verdict"] == PARTLY, fn.__name__
    numbers = bct_compatible({"test_sets": [good, bad]})["numbers"]
    assert [row["M(bct,o)"] for row in numbers] == [0.35, 0.25]
    assert numbers[0]["update gain"] == pytest.approx((0.35 - 0.30) / (0.60 - 0.30))


def test_bct_variants_need_unseen_classes_and_the_variants():
    known_only = make_set(
        "a",
        0.3,
        0.6,
        {
            "independent": (0.6, 0.0, None),
            "bct": (0.5, 0.35, None),
            "bct-kd": (0.5, 0.35, None),
            "bct-beta": (0.5, 0.35, None),
        },
        unseen=False,
    )
    assert bct_variant_order({"test_sets": [known_only]})["verdict"] == NOT_MEASURED
    no_l2 = make_set("a", 0.3, 0.6, {"independent": (0.6, 0.0, None)})
    assert bct_l2_fails({"test_sets": [no_l2]})["verdict"] == NOT_MEASURED


def test_dmu_claim_needs_both_parts():
    ok = make_set(
        "a",
        0.3,
        0.6,
        {"independent": (0.6, 0.0, None), "bct": (0.50, 0.35, None), "dmu": (0.58, 0.32, 0.40)},
    )
    worse_down = make_set(
        "b",
        0.3,
        0.6,
        {"independent": (0.6, 0.0, None), "bct": (0.55, 0.35, None), "dmu": (0.50, 0.32, 0.40)},
    )
    assert dmu_adapted_beats_bct({"test_sets": [ok]})["verdict"] == HELD
    assert dmu_adapted_beats_bct({"test_sets": [worse_down]})["verdict"] == NOT_HELD
    entry = ok["methods"]["dmu"]
    assert (
        entry["m_cross"][M] == 0.40 and entry["cross_mode"] == "adapted"
    )  # DMU's cross test is adapted


def test_ndpp_p1_mean_over_test_sets():
    sets = [
        make_set(
            n,
            0.3,
            0.6,
            {
                "independent": (0.6, 0.0, None),
                "bct": (0.50, 0.33, None),
                "p2s": (0.52, 0.34, None),
                "ndpp": (0.55, 0.36, None),
                "odpp": (0.51, 0.33, None),
            },
        )
        for n in ("a", "b")
    ]
    claim = ndpp_p1({"test_sets": sets})
    # ndpp beats both, odpp beats neither (lower u and v than p2s; same v and higher u than bct...)
    p1 = {k.split()[1]: v for k, v in claim["numbers"][-1].items() if k.startswith("P_1")}
    assert p1["ndpp"] > p1["p2s"] > p1["odpp"]
    assert claim["verdict"] == (
        HELD if p1["odpp"] > p1["bct"] and p1["odpp"] > p1["p2s"] else PARTLY
    )
    assert claim["verdict"] == PARTLY


def _backfill(**models):
    return {
        "backfill": {
            "extended-data": {
                label: {"curves": curves, "references": {}} for label, curves in models.items()
            }
        }
    }


def test_ract_claims():
    results = _backfill(
        contrastive=[
            curve("random", "compatible", [0.30, 0.28, 0.40], nfr=[0.2, 0.25, 0.1], regression=True)
        ],
        ract=[
            curve("random", "compatible", [0.30, 0.35, 0.45], nfr=[0.1, 0.1, 0.05], auc=0.36),
            curve("uncertainty:margin", "compatible", [0.30, 0.40, 0.45], auc=0.39),
            curve("uncertainty:least_confidence", "compatible", [0.30, 0.40, 0.45], auc=0.39),
            curve("uncertainty:entropy", "compatible", [0.30, 0.38, 0.45], auc=0.38),
        ],
    )
    assert ract_vanilla_regresses(results)["verdict"] == HELD
    assert ract_lowers_nfr(results)["verdict"] == HELD
    assert ract_uncertainty_faster(results)["verdict"] == HELD
    # one grid point where RACT flips more: the whole-curve claim fails
    results["backfill"]["extended-data"]["ract"]["curves"][0]["NFR@1"] = [0.1, 0.3, 0.05]
    assert ract_lowers_nfr(results)["verdict"] == NOT_HELD
    # entropy best: two of four checks fail -> partly
    results["backfill"]["extended-data"]["ract"]["curves"][3]["summary"][M]["auc"] = 0.45
    assert ract_uncertainty_faster(results)["verdict"] == PARTLY
    results["backfill"]["extended-data"]["contrastive"]["curves"][0]["summary"][M]["regression"][
        "has_regression"
    ] = False
    results["backfill"]["extended-data"]["contrastive"]["curves"][0]["summary"]["top1"][
        "regression"
    ]["has_regression"] = False
    assert ract_vanilla_regresses(results)["verdict"] == NOT_HELD


def test_rm_claim():
    results = _backfill(
        mcl=[
            curve("random", "rank_merge", [0.3, 0.6], gain=1.05),
            curve("random", "naive_merge", [0.3, 0.5], gain=0.6),
        ],
        bct=[curve("random", "compatible", [0.3, 0.5], gain=0.7)],
    )
    assert rm_rank_merge(results)["verdict"] == HELD
    results["backfill"]["extended-data"]["mcl"]["curves"][0]["summary"][M]["auc_gain"] = 0.65
    assert rm_rank_merge(results)["verdict"] == PARTLY  # beats naive, but < 100% and < bct
    results["backfill"]["extended-data"]["mcl"]["curves"][0]["summary"][M]["auc_gain"] = 0.5
    claim = rm_rank_merge(results)
    assert claim["verdict"] == NOT_HELD and claim["numbers"][0]["AUC gain rank_merge (mcl)"] == 0.5


def test_every_claim_reports_not_measured_on_empty_results():
    claims = evaluate_claims({"test_sets": [], "backfill": {}})
    assert len(claims) == 10 and {c["verdict"] for c in claims} == {NOT_MEASURED}
    assert len({c["id"] for c in claims}) == 10
