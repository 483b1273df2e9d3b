"""Upgrade scenario splits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raycompat.data import SCENARIOS, Scenario, Split, build_scenario, format_allocation

SMALL = dict(
    catalog=1000,
    num_train_classes=40,
    images_per_class=20,
    num_eval_classes=30,
    queries_per_class=2,
    gallery_per_class=5,
    num_distractor_classes=20,
    distractors_per_class=3,
)


def pairs(split: Split) -> set[tuple[int, int]]:
    return set(zip(split.labels.tolist(), split.instances.tolist(), strict=False))


@pytest.mark.parametrize("name", SCENARIOS)
def test_eval_splits_and_disjointness(name):
    s = build_scenario(name, **SMALL)
    q, g, d = s["query"], s["gallery"], s["distractors"]
    assert (len(q.classes), len(q)) == (30, 60)
    assert (len(g.classes), len(g)) == (30, 150)
    assert (len(d.classes), len(d)) == (20, 60)
    assert set(q.classes) <= set(g.classes)  # every query has gallery positives
    assert not set(d.classes) & set(q.classes)
    train = set(s.train_classes.tolist())
    assert len(train) == 40
    assert not train & set(s.eval_classes.tolist())
    assert not pairs(q) & pairs(g)  # a query is never its own gallery item
    for key in ("old_train", "new_train", *s.train_generations()):
        split = s[key]
        assert split.labels.dtype == np.int64 and split.instances.dtype == np.int64
        assert len(pairs(split)) == len(split)
        assert split.labels.max() < 1000


def test_extended_data():
    s = build_scenario("extended-data", **SMALL)
    old, new = s["old_train"], s["new_train"]
    assert np.array_equal(old.classes, new.classes) and len(new.classes) == 40
    assert len(old) == 40 * 6 and len(new) == 40 * 20
    assert pairs(old) <= pairs(new)


def test_open_data():
    s = build_scenario("open-data", **SMALL)
    old, new = s["old_train"], s["new_train"]
    assert np.array_equal(old.classes, new.classes)
    assert len(old) == 40 * 6 and len(new) == 40 * 14
    assert not pairs(old) & pairs(new)


def test_open_class():
    s = build_scenario("open-class", **SMALL)
    old, new = s["old_train"], s["new_train"]
    assert len(old.classes) == 12 and len(new.classes) == 28
    assert not set(old.classes) & set(new.classes)
    assert len(old) == 12 * 20


def test_extended_class_and_fraction_parameter():
    s = build_scenario("extended-class", **SMALL)
    assert len(s["old_train"].classes) == 12 and len(s["new_train"].classes) == 40
    assert set(s["old_train"].classes) <= set(s["new_train"].classes)
    s = build_scenario("extended-class", old_fraction=0.5, **SMALL)
    assert len(s["old_train"].classes) == 20


def test_sequential():
    s = build_scenario("sequential", **SMALL)
    assert s.train_generations() == ["train_1", "train_2", "train_3"]
    sizes = [len(s[g].classes) for g in s.train_generations()]
    assert sizes == [10, 20, 40]
    assert set(s["train_1"].classes) <= set(s["train_2"].classes) <= set(s["train_3"].classes)
    assert s["old_train"] is s["train_1"] and s["new_train"] is s["train_3"]
    s = build_scenario("sequential", sequential_fractions=(0.5, 1.0), **SMALL)
    assert s.train_generations() == ["train_1", "train_2"]


def test_deterministic_and_seeded():
    a = build_scenario("open-class", seed=1, **SMALL)
    assert a == build_scenario("open-class", seed=1, **SMALL)
    b = build_scenario("open-class", seed=2, **SMALL)
    assert not np.array_equal(a["query"].classes, b["query"].classes)
    # Same seed: the same eval set in every scenario (comparable results).
    c = build_scenario("extended-data", seed=1, **SMALL)
    assert a["gallery"] == c["gallery"] and a["query"] == c["query"]


@pytest.mark.parametrize("name", ["open-data", "sequential"])
def test_json_roundtrip(name):
    s = build_scenario(name, **SMALL)
    back = Scenario.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s
    assert back.allocation_table() == s.allocation_table()
    assert back.train_generations() == s.train_generations()


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError) as e:
        build_scenario("extended-datum", **SMALL)
    assert "extended-datum" in str(e.value) and all(n in str(e.value) for n in SCENARIOS)
    with pytest.raises(ValueError, match="too few classes"):
        build_scenario("open-data", **dict(SMALL, catalog=50))
    with pytest.raises(ValueError, match="old_fraction"):
        build_scenario("open-class", old_fraction=1.5, **SMALL)
    with pytest.raises(ValueError, match="images_per_class"):
        build_scenario("open-data", **dict(SMALL, images_per_class=0))


def test_allocation_table():
    s = build_scenario("open-class", **SMALL)
    table = s.allocation_table()
    assert format_allocation(s) == table == str(s)
    lines = table.splitlines()
    assert "| split | #classes | #images |" in lines
    assert "| old_train | 12 | 240 |" in lines
    assert "| new_train | 28 | 560 |" in lines
    assert "| query | 30 | 60 |" in lines and "| gallery | 30 | 150 |" in lines
    assert "| distractors | 20 | 60 |" in lines
    seq = build_scenario("sequential", **SMALL).allocation_table()
    assert "| old_train (= train_1) | 10 | 200 |" in seq


def test_default_sizes_on_glyph_catalog():
    s = build_scenario("extended-class")
    assert len(s["new_train"].classes) == 200 and len(s["new_train"]) == 200 * 40
    assert len(s["old_train"].classes) == 60
    assert (len(s["query"]), len(s["gallery"]), len(s["distractors"])) == (200, 1000, 500)
    assert s.params["num_catalog_classes"] > 2000


def test_scenario_from_options_reads_the_jobs_size_options():
    import argparse
    import dataclasses

    from raycompat.data import ScenarioSizes, build_scenario, scenario_from_options

    sizes = ScenarioSizes(
        scenario="extended-class",
        train_classes=12,
        images_per_class=6,
        eval_classes=5,
        queries_per_class=1,
        gallery_per_class=3,
        distractor_classes=4,
        distractors_per_class=2,
        data_seed=3,
    )
    got = scenario_from_options(sizes, name="open-class", catalog=60)
    want = build_scenario(
        "open-class",
        catalog=60,
        seed=3,
        num_train_classes=12,
        images_per_class=6,
        num_eval_classes=5,
        queries_per_class=1,
        gallery_per_class=3,
        num_distractor_classes=4,
        distractors_per_class=2,
    )
    assert got.to_dict() == want.to_dict()
    # a job's defaults: the sizes it does not set are build_scenario's defaults
    partial = dataclasses.replace(
        ScenarioSizes(),
        scenario="open-class",
        train_classes=12,
        eval_classes=5,
        distractor_classes=4,
        data_seed=3,
    )
    assert (
        scenario_from_options(partial, catalog=60).to_dict()
        == build_scenario(
            "open-class",
            catalog=60,
            seed=3,
            num_train_classes=12,
            num_eval_classes=5,
            num_distractor_classes=4,
        ).to_dict()
    )
    with pytest.raises(TypeError, match="must be a ScenarioSizes"):  # no silent defaults
        scenario_from_options(argparse.Namespace(train_classes=12), catalog=60)
