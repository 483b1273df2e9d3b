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
    from raycompat.backfill import GalleryEmbeddings, simulate_backfill

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
