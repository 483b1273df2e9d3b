"""Tests for raycompat.metrics.compatibility and raycompat.metrics.curves."""

import math

import numpy as np
import pytest

from raycompat.metrics import (
    auc,
    auc_gain,
    compatibility_report,
    delta_down,
    delta_up,
    is_compatible,
    p_scores,
    regression_stats,
    update_gain,
)


# ================================================================= compatibility, hand-worked
def test_update_gain_and_criterion_hand_worked():
    # M(o,o)=0.50, M(n,o)=0.60, M(n*,n*)=0.90: (0.60-0.50)/(0.90-0.50) = 0.10/0.40 = 0.25
    assert update_gain(0.60, 0.50, 0.90) == pytest.approx(0.25)
    assert isinstance(update_gain(0.60, 0.50, 0.90), float)
    # incompatible: (0.30-0.50)/0.40 = -0.5
    assert update_gain(0.30, 0.50, 0.90) == pytest.approx(-0.5)
    # M(n*,n*) == M(o,o): undefined -> nan, no exception, no warning
    with np.errstate(all="raise"):
        assert math.isnan(update_gain(0.6, 0.5, 0.5))
    assert is_compatible(0.60, 0.50) is True
    assert is_compatible(0.50, 0.50) is False  # strict
    assert is_compatible(float("nan"), 0.5) is False
    np.testing.assert_array_equal(is_compatible([0.6, 0.4], [0.5, 0.5]), [True, False])
    # arrays broadcast
    np.testing.assert_allclose(update_gain(np.array([0.6, 0.7]), 0.5, 0.9), [0.25, 0.5])


def test_delta_up_down_hand_worked():
    # Delta_up = (M(n,o)-M(o,o))/M(o,o) = (0.55-0.50)/0.50 = 0.1
    assert delta_up(0.55, 0.50) == pytest.approx(0.1)
    # Delta_down = (M(n*,n*)-M(n,n))/M(n*,n*) = (0.80-0.72)/0.80 = 0.1
    assert delta_down(0.72, 0.80) == pytest.approx(0.1)
    assert math.isnan(delta_up(0.3, 0.0))
    assert math.isnan(delta_down(0.3, 0.0))
    np.testing.assert_allclose(delta_up([0.55, 0.45], [0.5, 0.5]), [0.1, -0.1])


def test_p_scores_reproduce_ndpp_table():
    # NDPP Table II, data-extension (9% -> 30%), test sets RParis / ROxford / GLDv2-test.
    # old = R18(old) self-test, new* = R18(new) self-test.
    m_oo = [67.31, 41.82, 7.30]
    m_nstar = [75.08, 55.77, 12.08]
    # BCT row: self-test 71.52/51.16/10.38, cross-test 68.37/44.75/8.72 -> 47.75 55.34 51.23
    p = p_scores([71.52, 51.16, 10.38], m_nstar, [68.37, 44.75, 8.72], m_oo)
    assert p["P_up"] == pytest.approx(47.75, abs=0.006)
    assert p["P_comp"] == pytest.approx(55.34, abs=0.006)
    assert p["P_1"] == pytest.approx(51.23, abs=0.006)
    # NDPP row: 76.21/58.02/12.67 and 71.10/46.42/8.88 -> 50.87 59.44 54.80
    p = p_scores([76.21, 58.02, 12.67], m_nstar, [71.10, 46.42, 8.88], m_oo)
    assert (p["P_up"], p["P_comp"], p["P_1"]) == pytest.approx((50.87, 59.44, 54.80), abs=0.006)
    # scale invariance: fractions instead of percentages give the same scores
    q = p_scores(
        np.array([76.21, 58.02, 12.67]) / 100,
        np.array(m_nstar) / 100,
        np.array([71.10, 46.42, 8.88]) / 100,
        np.array(m_oo) / 100,
    )
    assert q == pytest.approx(p)


def test_p_scores_hand_worked_single_set():
    # M(n,n)=M(n*,n*) -> u = sigmoid(0) = 0.5 ; M(n,o)=M(o,o) -> v = sigmoid(0) = 0.5
    # P_up = P_comp = 50, P_1 = 100 * 2*0.25/1 = 50
    assert p_scores(0.8, 0.8, 0.5, 0.5) == pytest.approx(
        {"P_up": 50.0, "P_comp": 50.0, "P_1": 50.0}
    )
    # M(n*,n*) == M(o,o): v undefined -> P_comp and P_1 nan, P_up defined
    p = p_scores(0.8, 0.5, 0.6, 0.5)
    assert not math.isnan(p["P_up"]) and math.isnan(p["P_comp"]) and math.isnan(p["P_1"])
    with pytest.raises(ValueError, match="one value per test set"):
        p_scores([0.1, 0.2], [0.3], [0.1, 0.2], [0.1, 0.2])


def test_p_scores_vs_brute_force_random():
    rng = np.random.default_rng(0)
    for _ in range(20):
        d = rng.integers(1, 5)
        oo, ns, nn, no = (np.round(rng.uniform(0.1, 0.9, size=d), 2) for _ in range(4))
        ns = np.where(ns == oo, ns + 0.01, ns)
        u = [1 / (1 + math.exp(-((nn[i] - ns[i]) / ns[i]))) for i in range(d)]
        v = [1 / (1 + math.exp(-((no[i] - oo[i]) / (ns[i] - oo[i])))) for i in range(d)]
        ref = {
            "P_up": 100 * sum(u) / d,
            "P_comp": 100 * sum(v) / d,
            "P_1": 100 * sum(2 * a * b / (a + b) for a, b in zip(u, v, strict=False)) / d,
        }
        assert p_scores(nn, ns, no, oo) == pytest.approx(ref, abs=1e-12)


def test_compatibility_report():
    rep = compatibility_report(m_oo=0.5, m_no=0.6, m_nn=0.72, m_nstar=0.8)
    assert rep["compatible"] == 1.0
    assert rep["update_gain"] == pytest.approx(0.1 / 0.3)
    assert rep["delta_up"] == pytest.approx(0.2)
    assert rep["delta_down"] == pytest.approx(0.1)
    assert set(rep) >= {"P_up", "P_comp", "P_1"}
    assert all(isinstance(v, float) for v in rep.values())


# ================================================================= curves
def bf_auc(t, v):
    total = 0.0
    for i in range(1, len(t)):
        total += (t[i] - t[i - 1]) * (v[i] + v[i - 1]) / 2
    return total


def bf_regression(t, v, higher):
    below, drops = [], []
    for i in range(1, len(t)):
        worse_start = v[i] < v[0] if higher else v[i] > v[0]
        if worse_start:
            below.append(t[i])
        d = (v[i - 1] - v[i]) if higher else (v[i] - v[i - 1])
        if d > 0:
            drops.append((t[i - 1], t[i], d))
    return below, drops


def test_auc_hand_worked():
    # t = 0, 0.5, 1 ; v = 0.2, 0.4, 1.0 -> 0.5*(0.2+0.4)/2 + 0.5*(0.4+1.0)/2 = 0.15 + 0.35 = 0.5
    assert auc([0, 0.5, 1], [0.2, 0.4, 1.0]) == pytest.approx(0.5)
    assert auc([0, 1], [0.3, 0.3]) == pytest.approx(0.3)
    # uneven grid: t = 0, 0.1, 1 ; v = 0, 1, 1 -> 0.1*0.5 + 0.9*1 = 0.95
    assert auc([0, 0.1, 1], [0, 1, 1]) == pytest.approx(0.95)
    with pytest.raises(ValueError, match="t=0 to t=1"):
        auc([0, 0.5], [1, 1])
    assert auc([0, 0.5], [1, 1], require_full_range=False) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="increasing"):
        auc([0, 0.5, 0.5, 1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="equal length"):
        auc([0, 1], [1])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        auc([0, 1.5], [1, 1], require_full_range=False)
    with pytest.raises(ValueError, match="NaN"):
        auc([0, 1], [1, float("nan")])


def test_auc_gain_hand_worked():
    # AUC(method)=0.6, AUC(old)=0.5, AUC(new*)=0.7 -> 0.1/0.2 = 0.5 (50%)
    assert auc_gain(0.6, 0.5, 0.7) == pytest.approx(0.5)
    assert auc_gain(0.75, 0.5, 0.7) == pytest.approx(1.25)  # > 100% possible (RM)
    assert math.isnan(auc_gain(0.6, 0.5, 0.5))
    np.testing.assert_allclose(auc_gain([0.6, 0.7], 0.5, 0.7), [0.5, 1.0])


def test_regression_stats_hand_worked():
    # mAP curve: t=0: 0.50, 0.25: 0.45 (below start, drop 0.05), 0.5: 0.48 (below start),
    #            0.75: 0.60, 1.0: 0.58 (drop 0.02, not below start)
    t = [0, 0.25, 0.5, 0.75, 1.0]
    v = [0.50, 0.45, 0.48, 0.60, 0.58]
    st = regression_stats(t, v)
    assert st["points_below_start"] == [0.25, 0.5]
    assert [(a, b) for a, b, _ in st["drops"]] == [(0, 0.25), (0.75, 1.0)]
    assert [d for _, _, d in st["drops"]] == pytest.approx([0.05, 0.02])
    assert st["max_drop"] == pytest.approx(0.05) and st["max_below_start"] == pytest.approx(0.05)
    assert st["has_regression"] and st["start"] == 0.5
    # lower is better (NFR): 0 -> 0.1 is a worsening
    st = regression_stats([0, 0.5, 1], [0.0, 0.1, 0.05], higher_is_better=False)
    assert st["points_below_start"] == [0.5, 1.0]
    assert st["drops"] == [(0.0, 0.5, pytest.approx(0.1))]
    # monotone curve with a flat step (a tie is not a drop)
    st = regression_stats([0, 0.5, 1], [0.3, 0.3, 0.4])
    assert st == {
        "start": 0.3,
        "points_below_start": [],
        "drops": [],
        "max_drop": 0.0,
        "max_below_start": 0.0,
        "has_regression": False,
    }


@pytest.mark.parametrize("higher", [True, False])
def test_curves_vs_brute_force_random_with_ties(higher):
    rng = np.random.default_rng(int(higher))
    for _ in range(30):
        n = int(rng.integers(2, 12))
        t = np.sort(rng.choice(np.arange(1, 100), size=n - 2, replace=False)) / 100.0
        t = [0.0] + t.tolist() + [1.0]
        v = (rng.integers(0, 4, size=n) / 4.0).tolist()  # quantised: many ties
        assert auc(t, v) == pytest.approx(bf_auc(t, v), abs=1e-12)
        below, drops = bf_regression(t, v, higher)
        st = regression_stats(t, v, higher_is_better=higher)
        assert st["points_below_start"] == below
        assert st["drops"] == drops
        assert st["has_regression"] == bool(below or drops)
