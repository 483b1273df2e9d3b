"""The claims' verdict logic on per-query fixtures whose truth is known: a clear win is held, a
clear loss is not held, a tie is inconclusive; every claim says not measured on empty results;
the claims decided again from the saved samples are the same."""

from __future__ import annotations

import numpy as np
import pytest

from raycompat.metrics.bootstrap import BootstrapOptions, Sample
from raycompat.reproduce.claims import (
    HELD,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_MEASURED,
    NOT_RUN,
    advbct_beats_bct,
    bct_compatible,
    bct_independent_incompatible,
    bct_l2_fails,
    bct_variant_order,
    bt2_close_and_compatible,
    dmu_adapted_beats_bct,
    dsimplex_compatible_chain,
    evaluate_claims,
    fct_beats_bct,
    fd_criterion,
    lce_beats_bct,
    lwf_criterion,
    ndpp_p1,
    ract_lowers_nfr,
    ract_uncertainty_faster,
    ract_vanilla_regresses,
    rm_rank_merge,
    unibct_beats_bct,
)
from raycompat.reproduce.evidence import Evidence

M = "mAP@100"
CLASSES, PER_CLASS = 120, 3
LABELS = np.repeat(np.arange(CLASSES), PER_CLASS)
GRID = [i / 10 for i in range(11)]


def base(seed: int = 0, level: float = 0.4) -> np.ndarray:
    """Per-query AP-like values in [0, 1] around ``level``."""
    return np.clip(np.random.default_rng(seed).normal(level, 0.2, LABELS.size), 0, 1)


def shifted(values: np.ndarray, outcome: str, seed: int = 1) -> np.ndarray:
    """``values`` plus a clear gain, a clear loss, or per-class noise of mean zero (a tie)."""
    if outcome == "win":
        return values + 0.15
    if outcome == "loss":
        return values - 0.15
    noise = np.random.default_rng(seed).normal(0, 0.1, CLASSES)
    return values + np.repeat(noise - noise.mean(), PER_CLASS)


class Fixture:
    """``results`` (test sets, backfill) and their :class:`Evidence` built from arrays."""

    def __init__(self):
        self.evidence = Evidence(BootstrapOptions(resamples=400))
        self.results = {"test_sets": [], "backfill": {}}

    def test_set(
        self, name: str, oo, nstar, methods: dict, unseen: bool = True, scenario: str = ""
    ) -> None:
        """``methods[label] = {"m_nn": array, "m_no": array, ...}`` (``m_cross`` defaults to
        ``m_nadapted`` when given, else ``m_no``; ``m_oo`` to ``oo``). ``scenario`` (default
        ``name``) is also the query set."""
        ev, scenario = self.evidence, scenario or name
        ev.add_query_set(scenario, LABELS)
        ev.put(("pair", name, "m_oo"), {M: Sample.mean(scenario, oo)}, 0)
        ev.put(("pair", name, "m_nstar"), {M: Sample.mean(scenario, nstar)}, 0)
        entries = {}
        for label, parts in methods.items():
            parts = {"m_oo": oo, **parts}
            parts.setdefault("m_cross", parts.get("m_nadapted", parts.get("m_no")))
            for kind, values in parts.items():
                ev.put(("pair", name, label, kind), {M: Sample.mean(scenario, values)}, 0)
            entries[label] = {"diverged": False}
        self.results["test_sets"].append(
            dict(
                name=name,
                scenario=scenario,
                query_set=scenario,
                unseen_classes=unseen,
                metric=M,
                m_oo={M: float(oo.mean())},
                m_nstar={M: float(nstar.mean())},
                methods=entries,
            )
        )

    def curve(self, scenario: str, label: str, policy: str, mode: str, values, nfr=None) -> None:
        """``values``: per-query ``[Q, J]`` mAP@100 (also used as top1); ``nfr``: ``(flips
        [Q, J], old-old correct [Q])``."""
        ev = self.evidence
        ev.add_query_set(scenario, LABELS)
        samples = {M: Sample.mean(scenario, values), "top1": Sample.mean(scenario, values)}
        if nfr is not None:
            samples["NFR@1"] = Sample.rate(scenario, *nfr)
        ev.put(("curve", scenario, label, policy, mode), samples, 0)
        model = self.results["backfill"].setdefault(scenario, {}).setdefault(label, {"curves": []})
        model["curves"].append(dict(policy=policy, mode=mode, fractions=GRID))


def rising(start, end) -> np.ndarray:
    """Per-query curves rising linearly from ``start`` to ``end`` over the grid."""
    t = np.asarray(GRID)[None, :]
    return start[:, None] * (1 - t) + end[:, None] * t


@pytest.mark.parametrize(
    "outcome,expected", [("win", HELD), ("loss", NOT_HELD), ("tie", INCONCLUSIVE)]
)
def test_bct_compatibility_clear_win_loss_and_tie(outcome, expected):
    f = Fixture()
    oo = base()
    f.test_set("ext", oo, base(5, 0.7), {"bct": {"m_nn": base(2), "m_no": shifted(oo, outcome)}})
    claim = bct_compatible(f.results, f.evidence)
    assert claim["verdict"] == expected, claim["checks"]
    d = claim["checks"][0]["difference"]
    assert d["queries"] == LABELS.size and d["classes"] == CLASSES
    assert d["low"] <= d["value"] <= d["high"]
    assert abs(d["value"] - {"win": 0.15, "loss": -0.15, "tie": 0.0}[outcome]) < 0.02


def test_a_claim_over_test_sets_needs_every_check():
    f = Fixture()
    oo = base()
    f.test_set("a", oo, base(5, 0.7), {"bct": {"m_nn": oo, "m_no": shifted(oo, "win")}})
    f.test_set("b", oo, base(5, 0.7), {"bct": {"m_nn": oo, "m_no": shifted(oo, "tie")}})
    assert bct_compatible(f.results, f.evidence)["verdict"] == INCONCLUSIVE
    f.test_set("c", oo, base(5, 0.7), {"bct": {"m_nn": oo, "m_no": shifted(oo, "loss")}})
    claim = bct_compatible(f.results, f.evidence)
    assert claim["verdict"] == NOT_HELD
    assert [c["verdict"] for c in claim["checks"]] == [HELD, INCONCLUSIVE, NOT_HELD]
    assert "1 held, 1 not held, 1 inconclusive" in claim["explanation"]


def test_independent_incompatibility_and_l2():
    f = Fixture()
    oo = base(0, 0.6)
    f.test_set(
        "ext",
        oo,
        base(5, 0.8),
        {
            "independent": {"m_nn": base(5, 0.8), "m_no": oo * 0.2},
            "l2": {"m_nn": oo, "m_no": shifted(oo, "loss")},
        },
    )
    assert bct_independent_incompatible(f.results, f.evidence)["verdict"] == HELD
    assert bct_l2_fails(f.results, f.evidence)["verdict"] == HELD
    f.results["test_sets"][0]["methods"]["l2"]["diverged"] = True
    claim = bct_l2_fails(f.results, f.evidence)
    assert claim["verdict"] == HELD and "diverged" in claim["explanation"]


def test_bct_variant_order_uses_non_strict_checks():
    f = Fixture()
    oo = base()
    kd = shifted(oo, "win")
    f.test_set(
        "open",
        oo,
        base(5, 0.7),
        {
            "bct": {"m_nn": oo, "m_no": kd},
            "bct-kd": {"m_nn": oo, "m_no": kd},
            "bct-beta": {"m_nn": oo, "m_no": oo},
        },
    )
    claim = bct_variant_order(f.results, f.evidence)
    # sys == kd exactly: the interval [0, 0] does not exclude sys >= kd; kd > beta clearly
    assert [c["verdict"] for c in claim["checks"]] == [HELD, HELD] and claim["verdict"] == HELD
    f.results["test_sets"][0]["unseen_classes"] = False
    assert bct_variant_order(f.results, f.evidence)["verdict"] == NOT_MEASURED


@pytest.mark.parametrize(
    "outcome,expected", [("win", HELD), ("loss", NOT_HELD), ("tie", INCONCLUSIVE)]
)
def test_dmu_claim(outcome, expected):
    f = Fixture()
    oo, nstar = base(), base(5, 0.8)
    bct_no = base(3, 0.45)
    f.test_set(
        "ext",
        oo,
        nstar,
        {
            "bct": {"m_nn": nstar - 0.2, "m_no": bct_no},
            "dmu": {"m_nn": nstar - 0.05, "m_no": bct_no, "m_nadapted": shifted(bct_no, outcome)},
        },
    )
    claim = dmu_adapted_beats_bct(f.results, f.evidence)
    assert claim["checks"][1]["verdict"] == HELD  # less new-new degradation: a clear win
    assert claim["verdict"] == expected


def test_ract_claims_on_curves():
    f = Fixture()
    start = base()
    dip = rising(start, start + 0.3)
    dip[:, 1:4] -= 0.2  # vanilla falls below its t=0 value early
    f.curve(
        "ext",
        "contrastive",
        "random",
        "compatible",
        dip,
        nfr=(np.tile(np.arange(LABELS.size)[:, None] % 3 == 0, (1, 11)), np.ones(LABELS.size)),
    )
    f.curve(
        "ext",
        "ract",
        "random",
        "compatible",
        rising(start, start + 0.3),
        nfr=(np.zeros((LABELS.size, 11)), np.ones(LABELS.size)),
    )
    assert ract_vanilla_regresses(f.results, f.evidence)["verdict"] == HELD
    claim = ract_lowers_nfr(f.results, f.evidence)
    assert claim["verdict"] == HELD and claim["checks"][0]["difference"]["value"] > 0.3
    for policy, gain in (
        ("uncertainty:margin", 0.1),
        ("uncertainty:least_confidence", 0.1),
        ("uncertainty:entropy", -0.05),
    ):
        values = rising(start, start + 0.3)
        values[:, 1:-1] += gain
        f.curve("ext", "ract", policy, "compatible", values)
    assert ract_uncertainty_faster(f.results, f.evidence)["verdict"] == HELD


def test_rm_and_ndpp_claims():
    f = Fixture()
    oo, nstar = base(0, 0.3), base(5, 0.7)
    f.test_set("ext", oo, nstar, {})
    rm = rising(oo, nstar)
    rm[:, 1:-1] += 0.3  # above the straight line: AUC gain above 1
    f.curve("ext", "mcl", "random", "rank_merge", rm)
    f.curve("ext", "mcl", "random", "naive_merge", rising(oo, nstar))
    f.curve("ext", "bct", "random", "compatible", rising(oo, nstar) - 0.05)
    claim = rm_rank_merge(f.results, f.evidence)
    assert claim["verdict"] == HELD, claim["checks"]
    g = Fixture()
    methods = {
        label: {"m_nn": nstar - d, "m_no": oo + e}
        for label, d, e in (
            ("ndpp", 0.02, 0.2),
            ("odpp", 0.02, 0.2),
            ("p2s", 0.1, 0.0),
            ("bct", 0.1, 0.05),
        )
    }
    g.test_set("ext", oo, nstar, methods)
    claim = ndpp_p1(g.results, g.evidence)
    assert claim["verdict"] == HELD and len(claim["checks"]) == 4


def test_every_claim_reports_not_measured_on_empty_results():
    claims = evaluate_claims({"test_sets": [], "backfill": {}}, Evidence())
    assert len(claims) == 18 and all(c["verdict"] == NOT_MEASURED for c in claims[:10])
    # the field methods' claims say why: nothing was run
    field = claims[10:]
    assert all(c["verdict"] == NOT_RUN and "(`--scenarios`)" in c["explanation"] for c in field)


def test_claims_from_saved_samples_are_the_same(tmp_path):
    f = Fixture()
    oo = base()
    f.test_set("ext", oo, base(5, 0.7), {"bct": {"m_nn": base(2), "m_no": shifted(oo, "tie")}})
    before = bct_compatible(f.results, f.evidence)
    f.evidence.save(str(tmp_path / "samples.npz"))
    again = bct_compatible(f.results, Evidence.load(str(tmp_path / "samples.npz")))
    assert again == before


def test_rm_claim_with_an_undefined_gain_is_inconclusive_and_says_why():
    f = Fixture()
    oo = base(0, 0.6)
    f.test_set("ext", oo, oo - 0.1, {})  # new* below old-old: the AUC gain is undefined
    for label, mode in (("mcl", "rank_merge"), ("mcl", "naive_merge"), ("bct", "compatible")):
        f.curve("ext", label, "random", mode, rising(oo, oo))
    claim = rm_rank_merge(f.results, f.evidence)
    assert claim["verdict"] == INCONCLUSIVE and not claim["checks"]
    assert "M(n*,n*) is not above M(o,o)" in claim["explanation"]


# -- the field methods' claims -------------------------------------------------------------
OUTCOMES = [("win", HELD), ("loss", NOT_HELD), ("tie", INCONCLUSIVE)]


@pytest.mark.parametrize("outcome,expected", OUTCOMES)
@pytest.mark.parametrize(
    "claim,label,kind",
    [
        (lce_beats_bct, "lce", "m_no"),
        (unibct_beats_bct, "unibct", "m_no"),
        (advbct_beats_bct, "advbct", "m_no"),
        (advbct_beats_bct, "advbct", "m_nn"),
        (fct_beats_bct, "fct", "m_nadapted"),
    ],
)
def test_field_method_beats_bct(claim, label, kind, outcome, expected):
    """The method's number (cross test, own retrieval, or FCT's transformed gallery) against
    BCT's, paired; AdvBCT's other check is a clear win, so the outcome decides the claim."""
    f = Fixture()
    oo, bct_no, bct_nn = base(), base(3, 0.45), base(4, 0.6)
    parts = {"m_no": bct_no + 0.15, "m_nn": bct_nn + 0.15, "m_nadapted": bct_no}
    parts[kind] = shifted({"m_nadapted": bct_no, "m_nn": bct_nn}.get(kind, bct_no), outcome)
    methods = {"bct": {"m_nn": bct_nn, "m_no": bct_no}, label: parts}
    f.test_set("open-class", oo, base(5, 0.7), methods)
    got = claim(f.results, f.evidence)
    assert got["verdict"] == expected, got["checks"]
    d = got["checks"][0 if kind != "m_nn" else 1]["difference"]
    assert abs(d["value"] - {"win": 0.15, "loss": -0.15, "tie": 0.0}[outcome]) < 0.02
    assert d["queries"] == LABELS.size and got["numbers"][0]["test set"] == "open-class"


def test_unibct_claim_counts_only_test_sets_with_unseen_classes():
    f = Fixture()
    oo, bct_no = base(), base(3, 0.45)
    methods = {"bct": {"m_nn": oo, "m_no": bct_no}, "unibct": {"m_nn": oo, "m_no": bct_no - 0.15}}
    f.test_set("extended-data", oo, base(5, 0.7), methods, unseen=False)
    f.results["scenarios"] = ["extended-data"]
    got = unibct_beats_bct(f.results, f.evidence)
    assert got["verdict"] == NOT_RUN and not got["checks"]
    assert "open-class / sequential scenario was not run" in got["explanation"]


@pytest.mark.parametrize("outcome,expected", OUTCOMES)
def test_bt2_close_to_new_star_and_compatible(outcome, expected):
    """close: 0.05 - (M(n*,n*) - M(bt2,bt2)) / M(n*,n*) > 0; compatible: M(bt2,o) > M(o,o)."""
    f = Fixture()
    oo, nstar = base(), base(5, 0.7)
    nn = {
        "win": nstar - 0.01,
        "loss": nstar - 0.3,
        "tie": 0.95 * nstar + shifted(np.zeros_like(nstar), "tie"),
    }[outcome]
    f.test_set("ext", oo, nstar, {"bt2": {"m_nn": nn, "m_no": shifted(oo, outcome)}})
    got = bt2_close_and_compatible(f.results, f.evidence)
    assert got["verdict"] == expected
    assert [c["verdict"] for c in got["checks"]] == [expected, expected]
    close = got["checks"][0]["difference"]["value"]
    assert close == pytest.approx(0.05 - (nstar.mean() - nn.mean()) / nstar.mean())


@pytest.mark.parametrize("outcome,expected", OUTCOMES)
def test_dsimplex_chain_every_step_and_across_both(outcome, expected):
    """Each sequential pair of the dsimplex chain against its own phi_i; one step decides."""
    f = Fixture()
    phi = {1: base(1, 0.3), 2: base(2, 0.4), 3: base(3, 0.5)}
    for j, i in ((2, 1), (3, 1), (3, 2)):
        no = shifted(phi[i], outcome if (j, i) == (3, 2) else "win")
        methods = {"dsimplex": {"m_oo": phi[i], "m_nn": phi[j], "m_no": no}}
        f.test_set(f"sequential {j}->{i}", phi[1], phi[j], methods, scenario="sequential")
        f.results["test_sets"][-1]["pair"] = f"phi_{j} -> phi_{i}"
    got = dsimplex_compatible_chain(f.results, f.evidence)
    assert got["verdict"] == expected
    assert [c["verdict"] for c in got["checks"]] == [HELD, HELD, expected]
    assert got["checks"][2]["check"] == "sequential 3->2 (phi_3 -> phi_2)"


@pytest.mark.parametrize("outcome,expected", OUTCOMES)
@pytest.mark.parametrize("claim,label", [(lwf_criterion, "lwf"), (fd_criterion, "fd")])
def test_baselines_compatibility_criterion(claim, label, outcome, expected):
    f = Fixture()
    oo = base()
    f.test_set("ext", oo, base(5, 0.7), {label: {"m_nn": oo, "m_no": shifted(oo, outcome)}})
    got = claim(f.results, f.evidence)
    assert got["verdict"] == expected and got["id"] == f"{label}-criterion"
    assert "no headline claim of its own" in got["claim"]


def test_field_claims_not_run_or_not_measured_say_why():
    """A claim whose method the run did not train is listed, never dropped: not run with the
    plan's reason, not measured when the model was planned but not trained."""
    f = Fixture()
    oo = base()
    f.test_set("extended-data", oo, base(5, 0.7), {"bct": {"m_nn": oo, "m_no": oo}})
    f.results.update(
        scenarios=["extended-data"],
        skipped={"extended-data": [["lce", "not requested (`--methods`)"]]},
        not_trained=[{"model": "extended-data/advbct", "reason": "the budget ran out"}],
    )
    claims = {c["id"]: c for c in evaluate_claims(f.results, f.evidence)}
    lce = claims["lce-beats-bct"]
    assert lce["verdict"] == NOT_RUN and not lce["checks"]
    assert lce["explanation"] == "lce was not trained (extended-data: not requested (`--methods`))"
    advbct = claims["advbct-beats-bct"]
    assert advbct["verdict"] == NOT_MEASURED
    assert advbct["explanation"] == "extended-data/advbct was not trained: the budget ran out"
    assert "sequential scenario was not run" in claims["dsimplex-chain"]["explanation"]
    assert claims["bt2-close-and-compatible"]["verdict"] == NOT_RUN


def test_a_model_with_a_nan_module_counts_as_diverged():
    """FCT's h (or DMU's psi) can diverge while the embedder it rides on is fine: the model is
    then diverged, not a crash of the evaluation on a NaN gallery."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from raycompat.reproduce.runner import diverged

    embedded = SimpleNamespace(query=np.ones((2, 4)), gallery=np.ones((3, 4)))
    h = torch.nn.Linear(4, 4)
    bundle = SimpleNamespace(modules={"fct": h})
    assert not diverged(embedded, bundle)
    with torch.no_grad():
        h.weight[0, 0] = float("nan")
    assert diverged(embedded, bundle) and not diverged(embedded)
    embedded.gallery[1, 2] = np.inf
    assert diverged(embedded)


def test_fct_trains_with_its_released_optimizer():
    """The reproduction trains FCT's h with Adam(W) at 5e-4 (its released configuration); the
    overrides are training options."""
    import dataclasses

    from raycompat.reproduce.plan import VARIANTS
    from raycompat.train import TrainConfig

    overrides = dict(VARIANTS["fct"].training)
    assert overrides == {"optimizer": "adamw", "lr": 5e-4}
    assert all(not VARIANTS[label].training for label in VARIANTS if label != "fct")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(overrides) <= fields  # training options, passed as they are


@pytest.mark.parametrize(
    "bct_outcome, marked",
    [("loss", True), ("tie", True), ("win", False)],
)
def test_claims_on_a_compatible_model_say_when_bcts_criterion_is_not_held(bct_outcome, marked):
    """BCT's criterion is the premise of the claims on a compatible new model: where the run
    does not hold it (not held, inconclusive) those claims keep their measured verdict and are
    shown as 'premise not met at this scale'; BCT's own claims are never marked."""
    from raycompat.reproduce.claims import PREMISE_NOT_MET, shown_verdict
    from raycompat.reproduce.report import _claims_lines

    f = Fixture()
    oo = base()
    bct_no = shifted(oo, bct_outcome)
    methods = {
        "independent": {"m_nn": base(5, 0.7), "m_no": oo - 0.3},
        "bct": {"m_nn": base(5, 0.7), "m_no": bct_no},
        "lce": {"m_nn": base(5, 0.7), "m_no": bct_no + 0.15},
    }
    f.test_set("extended-data", oo, base(5, 0.7), methods)
    claims = {c["id"]: c for c in evaluate_claims(f.results, f.evidence)}
    expected_bct = {"loss": NOT_HELD, "tie": INCONCLUSIVE, "win": HELD}[bct_outcome]
    assert claims["bct-compatible"]["verdict"] == expected_bct
    lce = claims["lce-beats-bct"]
    assert lce["verdict"] == HELD  # the measurement is kept either way
    assert ("premise" in lce) is marked
    assert (shown_verdict(lce) == f"{PREMISE_NOT_MET}; measured: held") is marked
    for own in ("bct-compatible", "bct-independent-incompatible"):
        assert "premise" not in claims[own] and shown_verdict(claims[own]) == claims[own]["verdict"]
    assert claims["ract-lower-nfr"]["verdict"] == NOT_MEASURED  # nothing measured: not marked
    assert "premise" not in claims["ract-lower-nfr"]
    report = {"claims": list(claims.values()), "results": {"seeds": [0]}}
    text = "\n".join(_claims_lines(report))
    assert (PREMISE_NOT_MET in text) is marked
    assert (f"BCT's criterion M(bct,o) > M(o,o) is **{expected_bct}**" in text) is marked


def test_claims_are_decided_again_on_the_test_sets_where_bcts_criterion_held():
    """BCT's criterion held on extended-data and tied on open-class: a claim on a compatible
    model keeps its verdict on every test set (here not held: LCE loses on open-class) and is
    shown decided again without open-class (held); one whose only test set is open-class says
    'premise not met'."""
    from raycompat.reproduce.claims import PREMISE_NOT_MET, shown_verdict
    from raycompat.reproduce.report import _claims_lines

    f = Fixture()
    for name, bct_outcome, lce_gain, bt2 in (
        ("extended-data", "win", 0.15, False),
        ("open-class", "tie", -0.15, True),
    ):
        oo = base()
        bct_no = shifted(oo, bct_outcome)
        methods = {
            "independent": {"m_nn": base(5, 0.7), "m_no": oo - 0.3},
            "bct": {"m_nn": base(5, 0.7), "m_no": bct_no},
            "lce": {"m_nn": base(5, 0.7), "m_no": bct_no + lce_gain},
        }
        if bt2:
            methods["bt2"] = {"m_nn": base(5, 0.7), "m_no": oo + 0.15}
        f.test_set(name, oo, base(5, 0.7), methods)
    claims = {c["id"]: c for c in evaluate_claims(f.results, f.evidence)}
    assert claims["bct-compatible"]["verdict"] == INCONCLUSIVE
    lce = claims["lce-beats-bct"]
    assert lce["verdict"] == NOT_HELD
    assert lce["premise"] == dict(
        met=True,
        claim="bct-compatible",
        verdict=INCONCLUSIVE,
        met_on=["extended-data"],
        not_met_on=["open-class"],
        verdict_where_met=HELD,
        explanation_where_met="1 check(s): 1 held",
    )
    assert shown_verdict(lce) == (
        "held where BCT's criterion held (extended-data; premise not met on open-class); "
        "on every test set: not held"
    )
    bt2 = claims["bt2-close-and-compatible"]
    assert bt2["verdict"] in (HELD, NOT_HELD, INCONCLUSIVE) and not bt2["premise"]["met"]
    assert shown_verdict(bt2) == f"{PREMISE_NOT_MET}; measured: {bt2['verdict']}"
    report = {"claims": list(claims.values()), "results": {"seeds": [0]}}
    text = "\n".join(_claims_lines(report))
    assert "(held on extended-data; not held or not decided on open-class)" in text
    assert "are decided again on the test sets where it held" in text


def test_a_model_missing_under_one_seed_leaves_its_checks_not_measured():
    """A piece of a two-seed ``--train-budget-minutes`` run: BCT trained under seed 0 only.
    Its check is *not measured* (not a crash, not a verdict on one seed); with a second test
    set measured under both seeds and held, the claim is inconclusive, never held."""
    f = Fixture()
    f.evidence = Evidence(BootstrapOptions(resamples=400), 2)
    oo = base()
    f.test_set("ext", oo, base(5, 0.7), {"bct": {"m_nn": base(2), "m_no": shifted(oo, "win")}})
    claim = bct_compatible(f.results, f.evidence)
    assert claim["verdict"] == NOT_MEASURED and claim["checks"][0]["difference"] is None
    assert claim["checks"][0]["verdict"] == NOT_MEASURED
    f.test_set("open", oo, base(5, 0.7), {"bct": {"m_nn": base(2), "m_no": shifted(oo, "win")}})
    for key in list(f.evidence._per_seed):
        if key[1] == "open" or key[-1] == "m_oo":
            f.evidence.put(key, f.evidence.latest(key, 0), 1)
    claim = bct_compatible(f.results, f.evidence)
    assert [c["verdict"] for c in claim["checks"]] == [NOT_MEASURED, HELD]
    assert claim["verdict"] == INCONCLUSIVE
    assert "1 held, 1 not measured" in claim["explanation"]


def test_dmu_claim_compares_with_the_bct_of_its_own_head_where_trained():
    """bct-arcface (DMU's ArcFace head, as the DMU paper's BCT) wins over the shared bct."""
    f = Fixture()
    oo, nstar = base(), base(5, 0.8)
    bct_no = base(3, 0.45)
    f.test_set(
        "ext",
        oo,
        nstar,
        {
            "bct": {"m_nn": nstar - 0.2, "m_no": shifted(bct_no, "loss")},
            "bct-arcface": {"m_nn": nstar - 0.01, "m_no": shifted(bct_no, "win")},
            "dmu": {"m_nn": nstar - 0.05, "m_no": bct_no, "m_nadapted": bct_no},
        },
    )
    claim = dmu_adapted_beats_bct(f.results, f.evidence)
    assert [c["verdict"] for c in claim["checks"]] == [NOT_HELD, NOT_HELD]
    assert claim["numbers"][0]["BCT"] == "bct-arcface"
    del f.results["test_sets"][0]["methods"]["bct-arcface"]
    claim = dmu_adapted_beats_bct(f.results, f.evidence)
    assert [c["verdict"] for c in claim["checks"]] == [HELD, HELD]
    assert claim["numbers"][0]["BCT"] == "bct"
