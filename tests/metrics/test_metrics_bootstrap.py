"""Bootstrap intervals and three-outcome verdicts: seeded and exact, classes resampled whole,
paired comparisons, seeds, and the simulator's bands."""

from __future__ import annotations

import numpy as np
import pytest

from raycompat.metrics.bootstrap import Bootstrap, BootstrapOptions, Interval, Sample
from raycompat.metrics.verdicts import (
    HELD,
    INCONCLUSIVE,
    NOT_HELD,
    NOT_MEASURED,
    combine_all,
    combine_any,
    verdict,
)

LABELS = np.repeat(np.arange(100), 3)


def interval(low, high):
    return Interval(
        estimate=(low + high) / 2, low=low, high=high, confidence=0.95, queries=10, classes=10
    )


def test_verdicts_strict_and_not():
    assert verdict(interval(0.01, 0.2)) == HELD
    assert verdict(interval(-0.2, -0.01)) == NOT_HELD
    assert verdict(interval(-0.1, 0.1)) == INCONCLUSIVE
    assert verdict(interval(0.0, 0.0)) == NOT_HELD  # a > b is not held when a == b
    assert verdict(interval(0.0, 0.0), strict=False) == HELD  # a >= b is
    assert verdict(interval(float("nan"), 0.1)) == INCONCLUSIVE
    assert combine_all([HELD, HELD]) == HELD
    assert combine_all([HELD, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine_all([HELD, INCONCLUSIVE, NOT_HELD]) == NOT_HELD
    assert combine_any([NOT_HELD, HELD]) == HELD
    assert combine_any([NOT_HELD, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine_any([NOT_HELD, NOT_HELD]) == NOT_HELD
    assert combine_all([]) == combine_any([]) == NOT_MEASURED


def test_intervals_are_seeded_and_exact():
    values = np.random.default_rng(0).random(LABELS.size)
    a = Bootstrap(BootstrapOptions(resamples=200))
    a.add_query_set("q", LABELS)
    b = Bootstrap(BootstrapOptions(resamples=200))
    b.add_query_set("other", LABELS[:3])  # registering other sets first changes nothing
    b.add_query_set("q", LABELS)
    first = a.interval(v=Sample.mean("q", values))
    assert first == b.interval(v=Sample.mean("q", values))
    assert first.estimate == pytest.approx(values.mean())
    assert first.low < first.estimate < first.high
    c = Bootstrap(BootstrapOptions(resamples=200, bootstrap_seed=1))
    c.add_query_set("q", LABELS)
    assert c.interval(v=Sample.mean("q", values)) != first


def test_nan_queries_do_not_count_and_nfr_is_a_rate():
    boot = Bootstrap(BootstrapOptions(resamples=100))
    boot.add_query_set("q", np.arange(4))
    iv = boot.interval(v=Sample.mean("q", [1.0, 0.0, np.nan, 1.0]))
    assert iv.estimate == pytest.approx(2 / 3)
    nfr = boot.interval(v=Sample.rate("q", [True, False, True, False], [True, True, False, False]))
    assert nfr.estimate == pytest.approx(0.5)  # 1 flip among 2 old-old successes


def test_classes_are_resampled_whole():
    # every class holds three identical queries: resampling classes is three times fewer
    # independent draws than resampling queries, so the interval is wider
    per_class = np.random.default_rng(1).random(100)
    values = np.repeat(per_class, 3)
    grouped, single = (Bootstrap(BootstrapOptions(resamples=500)) for _ in range(2))
    grouped.add_query_set("q", LABELS)
    single.add_query_set("q", np.arange(LABELS.size))
    wide = grouped.interval(v=Sample.mean("q", values))
    narrow = single.interval(v=Sample.mean("q", values))
    assert wide.classes == 100 and narrow.classes == 300
    assert (wide.high - wide.low) > 1.4 * (narrow.high - narrow.low)


def test_paired_differences_use_the_same_draws():
    rng = np.random.default_rng(2)
    a = rng.random(LABELS.size)
    b = a + 0.02 + rng.normal(0, 0.01, LABELS.size)  # correlated with a, a small clear gain
    boot = Bootstrap(BootstrapOptions(resamples=500))
    boot.add_query_set("q", LABELS)
    boot.add_query_set("copy", LABELS)
    paired = boot.interval(lambda a, b: b - a, a=Sample.mean("q", a), b=Sample.mean("q", b))
    unpaired = boot.interval(lambda a, b: b - a, a=Sample.mean("q", a), b=Sample.mean("copy", b))
    assert verdict(paired) == HELD and verdict(unpaired) == INCONCLUSIVE
    assert paired.queries == LABELS.size and unpaired.queries == 2 * LABELS.size


def test_seeds_add_their_variation():
    values = np.random.default_rng(3).random(LABELS.size)
    one = Bootstrap(BootstrapOptions(resamples=500))
    one.add_query_set("q", LABELS)
    two = Bootstrap(BootstrapOptions(resamples=500), seeds=2)
    two.add_query_set("q", LABELS)
    s = Sample.mean("q", values).stacked(Sample.mean("q", values + 0.2))
    iv = two.interval(v=s)
    assert iv.seeds == 2 and iv.per_seed == pytest.approx((values.mean(), values.mean() + 0.2))
    assert iv.estimate == pytest.approx(values.mean() + 0.1)
    assert iv.spread == pytest.approx(0.2 / np.sqrt(2))
    alone = one.interval(v=Sample.mean("q", values))
    assert (iv.high - iv.low) > 2 * (alone.high - alone.low)
    with pytest.raises(ValueError, match="has 1 seeds, the bootstrap 2"):
        two.interval(v=Sample.mean("q", values))


def test_simulator_bands_contain_the_curves():
    from raycompat.embeddings.gallery import GalleryEmbeddings
    from raycompat.simulator.memory_engine import simulate_backfill

    rng = np.random.default_rng(0)
    q_labels, g_labels = rng.integers(0, 40, 120), rng.integers(0, 80, 800)
    centers = rng.normal(size=(80, 16))

    def emb(labels, noise):
        return (centers[labels] + rng.normal(size=(labels.size, 16)) * noise).astype(np.float32)

    data = GalleryEmbeddings(
        gallery_labels=g_labels,
        gallery_old=emb(g_labels, 1.5),
        gallery_new=emb(g_labels, 0.8),
        query_labels=q_labels,
        query_old=emb(q_labels, 1.5),
        query_new=emb(q_labels, 0.8),
        compatible_dim=16,
    )
    opts = BootstrapOptions(resamples=200)
    result = simulate_backfill(data, ("random",), ("compatible",), bootstrap=opts)
    curve = result.curves[0]
    for metric, values in curve.metrics.items():
        band = curve.bands[metric]
        assert all(
            lo <= v <= hi for lo, v, hi in zip(band["low"], values, band["high"], strict=True)
        )
    low, high = curve.summary["mAP@100"]["auc_interval"]
    assert low <= curve.summary["mAP@100"]["auc"] <= high
    oo = result.reference_intervals["old-old"]["mAP@100"]
    assert oo["low"] <= result.references["old-old"]["mAP@100"] <= oo["high"]
    again = simulate_backfill(data, ("random",), ("compatible",), bootstrap=opts)
    assert again.to_dict()["curves"][0]["bands"] == result.to_dict()["curves"][0]["bands"]


def _dropped_by_hand(boot: Bootstrap, base: np.ndarray) -> int:
    """Resamples that draw no query of ``base`` (their rate is undefined), from the draws."""
    weights = boot._sets["q"].weights
    return int((weights[:, base].sum(axis=1) == 0).sum())


def test_undefined_resamples_are_counted():
    """An NFR whose old-old successes are 5 classes of 100: the resamples that draw none of
    them have no rate; they are dropped and counted, and below 1 % the interval stands."""
    labels = np.arange(100)
    boot = Bootstrap(BootstrapOptions(resamples=1000))
    boot.add_query_set("q", labels)
    base = labels < 5
    iv = boot.interval(v=Sample.rate("q", labels < 2, base))
    expected = _dropped_by_hand(boot, base)
    assert 0 < expected <= 10  # (95/100)^100: about 0.6 % of the resamples
    assert (iv.dropped, iv.resamples) == (expected, 1000) and not iv.refused
    assert iv.estimate == pytest.approx(0.4) and iv.low <= iv.estimate <= iv.high
    assert iv.to_dict()["dropped"] == expected and "refused" not in iv.to_dict()
    assert f"({expected} of 1000 resamples undefined)" in iv.text()
    curve = boot.interval(v=Sample.rate("q", np.stack([labels < 2, labels < 3], 1), base))
    assert curve["dropped"].tolist() == [expected, expected]
    assert np.isfinite(curve["low"]).all()


def test_more_than_one_percent_undefined_gives_no_interval():
    """One old-old success among 100 classes: about 37 % of the resamples have no rate, so
    the statistic has no interval: NaN bounds, an inconclusive verdict, "no interval"."""
    labels = np.arange(100)
    boot = Bootstrap(BootstrapOptions(resamples=1000))
    boot.add_query_set("q", labels)
    base = labels < 1
    iv = boot.interval(v=Sample.rate("q", labels < 1, base))
    expected = _dropped_by_hand(boot, base)
    assert expected > 10 and iv.dropped == expected and iv.refused
    assert iv.estimate == 1.0 and np.isnan(iv.low) and np.isnan(iv.high)
    assert verdict(iv) == INCONCLUSIVE and verdict(iv, strict=False) == INCONCLUSIVE
    assert iv.to_dict()["refused"] is True
    assert iv.text() == f"1.000 [no interval: {expected} of 1000 resamples undefined]"
    curve = boot.interval(v=Sample.rate("q", np.stack([labels < 1, labels < 1], 1), base))
    assert np.isnan(curve["low"]).all() and np.isnan(curve["high"]).all()
    # the same statistic on its own, defined on every resample, keeps its interval
    assert not boot.interval(v=Sample.mean("q", (labels < 50).astype(float))).refused


def test_query_set_seed_uses_the_whole_name():
    """Two names with the same first 16 characters and the same length draw other resamples."""
    first, second = "scenario-extended-a", "scenario-extended-b"
    assert first[:16] == second[:16] and len(first) == len(second)
    boot = Bootstrap(BootstrapOptions(resamples=50))
    boot.add_query_set(first, LABELS)
    boot.add_query_set(second, LABELS)
    assert not np.array_equal(boot._sets[first].weights, boot._sets[second].weights)
    again = Bootstrap(BootstrapOptions(resamples=50))
    again.add_query_set(second, LABELS)  # seeded by the name alone
    assert np.array_equal(again._sets[second].weights, boot._sets[second].weights)
