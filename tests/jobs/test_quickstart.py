"""The main job end to end at its smallest scale (the session's ``main_job``: two training
seeds, every phase), the verdict logic on its numbers, and its determinism: a second run reusing
the trained models gives the first seed's numbers bit for bit.

What the main job concludes at its full scale (BCT held and the independent model not held,
across seeds and torch thread counts) is a result of the science, not a behaviour of the code:
``bench/verdict_spread.py`` measures it (docs/benchmarks.md, "Verdicts across seeds and thread
counts")."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_MAIN_JOB

from raycompat.quickstart import main

# the first test of this file runs the tiny main job (58 s alone) in its setup:
# 300 s leaves room for a busy machine
pytestmark = pytest.mark.timeout(300)

#: the tiny main job's queries per class (TINY_MAIN_JOB)
QUERIES_PER_CLASS = 1
EMBED_DIM = 8


def test_report_files_and_schema(main_job):
    out, _, report = main_job
    on_disk = json.loads(_read(out, "report.json"))
    assert on_disk["evaluations"] == report["evaluations"]
    import raycompat

    assert on_disk["raycompat_version"] == raycompat.__version__  # the code that made it
    pairs = {(e["model"], e["query"], e["gallery"]) for e in on_disk["evaluations"]}
    assert pairs == {
        ("old", "old", "old"),
        ("bct", "bct", "bct"),
        ("bct", "bct", "old"),
        ("independent", "independent", "independent"),
        ("independent", "independent", "old"),
    }
    for entry in on_disk["evaluations"]:
        assert {"model", "query", "gallery", "metric", "value", "low", "high", "dropped"} <= set(
            entry
        )
        assert 0.0 <= entry["low"] <= entry["value"] <= entry["high"] <= 1.0
    assert {e["metric"] for e in on_disk["evaluations"]} >= {"mAP@100", "mAP", "top1"}
    assert set(on_disk["compatibility"]) == {"bct", "independent"}
    markdown = _read(out, "report.md")
    assert "## Compatibility" in markdown and "bct" in markdown
    assert on_disk["options"]["resamples"] == 1000 and on_disk["options"]["confidence"] == 0.95
    bct_row = next(ln for ln in markdown.splitlines() if ln.startswith("| bct | bct | old |"))
    assert bct_row.count("[") == 4  # mAP@100, mAP, top1, top5 with their intervals
    for models in ("models", "models/seed1"):
        for name in ("old", "bct", "independent"):
            assert _exists(out, f"{models}/{name}/manifest.json"), (models, name)


def test_seeds_are_trained_and_resampled(main_job):
    """``--seeds 2``: every model trained with seeds 0 and 1 (different models, different
    numbers), one row per seed, and every interval resamples the seeds as well as the query
    classes: it is wider than the first seed's own interval would allow for the mean of two
    different values."""
    _, _, report = main_job
    seeds = report["seeds"]
    assert seeds["count"] == 2 and seeds["seeds"] == [0, 1]
    rows = seeds["rows"]
    assert [r["seed"] for r in rows] == [0, 1]
    assert rows[0]["m_old_old"] != rows[1]["m_old_old"]  # two trained models, not one twice
    assert len(seeds["models"]) == len(seeds["embeddings"]) == 2
    for name in ("old", "bct", "independent"):
        first, second = (seeds["models"][i][name] for i in (0, 1))
        assert first != second and first == report["models"][name]["path"]
    mean = [r for r in report["evaluations"] if r["metric"] == "mAP@100"]
    for row in mean:
        assert len(row["per_seed"]) == 2
        assert row["value"] == pytest.approx(sum(row["per_seed"]) / 2)
    for v in report["verdicts"]:
        assert v["difference"]["seeds"] == 2
    assert "2 training seeds" in _read(main_job[0], "report.md")


def test_verdicts_follow_their_interval(main_job):
    """The main job's verdict on BCT's criterion M(n,o) > M(o,o) is its paired interval's:
    held if the interval is above 0, not held if it is at or below 0, else inconclusive; the
    point criterion ``compatible`` is the verdict "held". (Which verdict the full-scale job
    reaches is bench/verdict_spread.py's.)"""
    out, _, report = main_job
    verdicts = {v["model"]: v for v in report["verdicts"]}
    assert set(verdicts) == {"bct", "independent"}
    for v in verdicts.values():
        d = v["difference"]
        assert d["low"] <= d["value"] <= d["high"]
        assert d["value"] == pytest.approx(v["m_new_old"] - v["m_old_old"])
        expected = "held" if d["low"] > 0 else "not held" if d["high"] <= 0 else "inconclusive"
        assert v["verdict"] == expected
        assert v["compatible"] == (v["verdict"] == "held")
        assert d["queries"] == QUERIES_PER_CLASS * d["classes"] > 0
        for key, iv in v["intervals"].items():
            if v[key] == v[key]:  # a defined number (update gain: new* better than old-old)
                assert iv["value"] == pytest.approx(v[key]), key  # the seeds' mean, as shown
                # an interval whose resamples are undefined past 1 % has no bounds (None)
                assert iv["low"] is None or iv["low"] <= iv["value"] <= iv["high"], key
    assert report["compatibility"] == {m: v["verdict"] == "held" for m, v in verdicts.items()}
    rows = [r for r in report["evaluations"] if r["metric"] == "mAP@100"]
    assert rows and all(r["low"] <= r["value"] <= r["high"] for r in rows)
    markdown = _read(out, "report.md")
    bct = verdicts["bct"]
    assert f"bct: M(n,o) > M(o,o) {bct['verdict']} (" in markdown
    d = bct["difference"]
    assert f"{d['queries']} queries in {d['classes']} classes" in markdown


def test_hot_refresh_curves_in_report(main_job):
    """report.json `curves`: every policy x mode x fraction x metric; the ends of each hot curve
    equal the first seed's static cross evaluations (t=0: new query vs old gallery, t=1: new vs
    new); the cold curve is old-old until its switch."""
    from raycompat.quickstart import CURVE_MODES, CURVE_POLICIES

    out, _, report = main_job
    curves = report["curves"]
    for row in curves:
        assert {"model", "policy", "mode", "fraction", "metric", "value"} <= set(row)
    grid = sorted({row["fraction"] for row in curves})
    assert len(grid) == 21 and grid[0] == 0.0 and grid[-1] == 1.0
    bct = {(r["policy"], r["mode"]) for r in curves if r["model"] == "bct"}
    assert bct == {(p, m) for p in CURVE_POLICIES for m in CURVE_MODES}
    static = {  # the first seed's models are the ones the backfill simulation uses
        (e["model"], e["query"], e["gallery"], e["metric"]): e["per_seed"][0]
        for e in report["evaluations"]
    }
    for model in ("bct", "independent"):
        for metric in ("mAP@100", "mAP", "top1"):
            ends = {
                r["fraction"]: r["value"]
                for r in curves
                if (r["model"], r["policy"], r["mode"], r["metric"])
                == (model, "random", "compatible", metric)
                and r["fraction"] in (0.0, 1.0)
            }
            assert ends[0.0] == pytest.approx(static[(model, model, "old", metric)], abs=1e-6)
            assert ends[1.0] == pytest.approx(static[(model, model, model, metric)], abs=1e-6)
    for metric in ("mAP@100", "mAP", "top1"):
        cold = [
            r["value"]
            for r in curves
            if (r["model"], r["policy"], r["mode"], r["metric"])
            == ("bct", "random", "cold", metric)
            and r["fraction"] < 1.0
        ]
        oo = static[("old", "old", "old", metric)]
        assert cold and all(v == pytest.approx(oo, rel=1e-12, abs=1e-15) for v in cold), metric
    cold_nfr = [
        r["value"]
        for r in curves
        if (r["model"], r["mode"], r["metric"]) == ("bct", "cold", "NFR@1")
        and r["policy"] == "random"
        and r["fraction"] < 1.0
    ]
    assert cold_nfr and all(v == 0.0 for v in cold_nfr)  # old-old until the switch
    markdown = _read(out, "report.md")
    assert "## Backfill curves" in markdown
    for model, plots in report["backfill_plots"].items():
        assert plots, model
        for plot in plots:
            assert _exists(out, plot)
        assert any(f"]({plot})" in markdown for plot in plots), model
    for model in ("bct", "independent"):
        assert _exists(out, f"backfill/{model}/curves.json")


def test_hot_refresh_intervals(main_job):
    """Every curve value carries its band (report.json and curves.json), every AUC and AUC gain
    its interval; the paired AUC differences to random and the regression verdicts are one of
    the three outcomes, as their intervals say; the report's backfill table shows them."""
    out, _, report = main_job
    values = [r for r in report["curves"] if r["value"] is not None]
    banded = [r for r in values if r["low"] is not None]
    assert banded and all(r["low"] <= r["value"] <= r["high"] for r in banded)
    # with 4 queries, NFR@1's resamples are mostly undefined (few old-old successes): no band
    assert {r["metric"] for r in values if r["low"] is None} <= {"NFR@1"}
    outcomes = {"held", "not held", "inconclusive"}
    compared = set()
    for s in report["backfill"]:
        for key in ("auc", "auc_gain"):
            if s[key] is None:
                continue
            low, high = s[f"{key}_interval"]
            if low is None:  # refused: undefined resamples (NFR@1 with 4 queries)
                assert s["metric"] == "NFR@1", s
                continue
            assert low <= s[key] <= high
        assert s["regression_verdict"] in outcomes
        vs = s["vs_random"]
        if vs is not None:
            compared.add((s["model"], s["policy"], s["mode"]))
            if vs.get("refused"):  # no interval (undefined resamples): nothing is decided
                assert vs["low"] is None and vs["verdict"] == "inconclusive", vs
                continue
            expect = "held" if vs["low"] > 0 else "not held" if vs["high"] <= 0 else "inconclusive"
            assert vs["verdict"] == expect and vs["low"] <= vs["value"] <= vs["high"]
    assert ("bct", "sequential", "compatible") in compared
    assert not any(model == "independent" or mode == "cold" for model, _, mode in compared)
    for model in ("bct", "independent"):
        curves = json.loads(_read(out, f"backfill/{model}/curves.json"))
        assert curves["bootstrap"]["resamples"] == 1000
        assert all(set(c["bands"]) >= {"mAP@100", "top1"} for c in curves["curves"])
    markdown = _read(out, "report.md")
    row = next(ln for ln in markdown.splitlines() if ln.startswith("| bct | sequential |"))
    assert row.count("[") >= 5 and row.rstrip(" |").split("regression ")[-1] in outcomes


def test_gallery_embedded_by_the_pipeline(main_job):
    """The main job's embeddings are the Ray Data pipeline's parquet output, which the
    simulator's loader reads as it is."""
    from raycompat.embeddings.gallery import load_parquet

    out, _, report = main_job
    paths = report["embeddings"]
    assert set(paths) == {"old_bct", "independent"}
    data = load_parquet(paths["old_bct"])
    scenario = json.loads(_read(out, "scenario.json"))
    n_query = len(scenario["splits"]["query"]["labels"])
    assert data.n_queries == n_query and data.n_items > 0
    assert data.old_dim == EMBED_DIM and data.new_dim == EMBED_DIM


def test_a_rerun_reuses_the_models_and_gives_the_first_seed_bit_for_bit(main_job, tmp_path):
    """The main job run again, with one seed, on the same storage: it reuses the trained runs
    (named by a hash of their options) instead of training, embeds, evaluates and simulates
    again, and every number equals the first seed's in the two-seed run, value for value --
    the per-seed numbers of a report are those of the single-seed runs. (That two trainings of
    one configuration give the same model bit for bit is tests/train/test_train.py's.)"""
    first_out, storage, first = main_job
    flags = [*TINY_MAIN_JOB]
    flags[flags.index("--seeds") + 1] = "1"
    out = tmp_path / "again"
    assert main([*flags, "--out", str(out), "--storage", storage, "--model-stages", "tasks"]) == 0
    again = json.loads((out / "report.json").read_text())
    for name in ("old", "bct", "independent"):
        assert again["models"][name]["run_path"] == first["models"][name]["run_path"], name
        histories = (r["models"][name]["history"] for r in (first, again))
        losses = [[e.get("loss/loss") for e in history] for history in histories]
        assert losses[0] == losses[1], name
    first_values = {_key(r): r["per_seed"][0] for r in first["evaluations"]}
    again_values = {_key(r): r["value"] for r in again["evaluations"]}
    assert again_values and again_values == first_values
    assert again["seeds"]["rows"] == first["seeds"]["rows"][:1]
    assert [r["value"] for r in again["curves"]] == [r["value"] for r in first["curves"]]
    assert [(r["low"], r["high"]) for r in again["curves"]] == [
        (r["low"], r["high"]) for r in first["curves"]
    ]
    assert "1 training seed" in (out / "report.md").read_text()


def _key(row: dict) -> tuple:
    return (row["model"], row["query"], row["gallery"], row["metric"])


def _read(out, relative: str) -> str:
    with open(f"{out}/{relative}") as fh:
        return fh.read()


def _exists(out, relative: str) -> bool:
    import os

    return os.path.exists(f"{out}/{relative}")
