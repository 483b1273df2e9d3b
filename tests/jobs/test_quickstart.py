"""The main job end to end at a small scale, the BCT paper's first claim on it, its verdicts
under another training seed and thread count, and its determinism (two runs from fresh folders
give the same numbers)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from raycompat.outputs import OutputOptions
from raycompat.quickstart import QuickstartOptions, main, run_quickstart

#: the main job's own scale (its verdicts are what the README promises), one training seed
SMALL = QuickstartOptions(seeds=1)
#: the smallest main job: a few glyph classes, one epoch per model
TINY_FLAGS = [
    "--seeds",
    "1",
    "--old-fraction",
    "0.5",
    "--train-classes",
    "8",
    "--images-per-class",
    "4",
    "--eval-classes",
    "4",
    "--queries-per-class",
    "1",
    "--gallery-per-class",
    "2",
    "--distractor-classes",
    "2",
    "--distractors-per-class",
    "1",
    "--backbone",
    "test_resnet",
    "--embed-dim",
    "8",
    "--old-epochs",
    "1",
    "--new-epochs",
    "1",
    "--batch-size",
    "8",
]


@pytest.fixture(scope="module")
def quickstart_report(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    report = run_quickstart(dataclasses.replace(SMALL, output=OutputOptions(out=str(out))))
    return out, report


def test_report_files_and_schema(quickstart_report):
    out, report = quickstart_report
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["evaluations"] == report["evaluations"]
    pairs = {(e["model"], e["query"], e["gallery"]) for e in on_disk["evaluations"]}
    assert pairs == {
        ("old", "old", "old"),
        ("bct", "bct", "bct"),
        ("bct", "bct", "old"),
        ("independent", "independent", "independent"),
        ("independent", "independent", "old"),
    }
    for entry in on_disk["evaluations"]:
        assert set(entry) == {
            "model",
            "query",
            "gallery",
            "metric",
            "value",
            "low",
            "high",
            "dropped",
        }
        assert 0.0 <= entry["low"] <= entry["value"] <= entry["high"] <= 1.0
        assert entry["dropped"] == 0  # every resample of a mean over queries is defined
    assert {e["metric"] for e in on_disk["evaluations"]} >= {"mAP@100", "mAP", "top1"}
    assert set(on_disk["compatibility"]) == {"bct", "independent"}
    markdown = (out / "report.md").read_text()
    assert "## Compatibility" in markdown and "bct" in markdown
    assert on_disk["options"]["resamples"] == 1000 and on_disk["options"]["confidence"] == 0.95
    bct_row = next(ln for ln in markdown.splitlines() if ln.startswith("| bct | bct | old |"))
    assert bct_row.count("[") == 4  # mAP@100, mAP, top1, top5 with their intervals
    for name in ("old", "bct", "independent"):
        assert (out / "models" / name / "manifest.json").is_file()


def test_bct_first_claim_verdicts(quickstart_report):
    """BCT's claim M(n,o) > M(o,o) on the paired interval of the difference: the BCT model is
    above M(old, old) and the interval excludes 0 (held); the independent model is far below
    (not held)."""
    out, report = quickstart_report
    verdicts = {v["model"]: v for v in report["verdicts"]}
    bct, independent = verdicts["bct"], verdicts["independent"]
    assert bct["m_new_old"] > bct["m_old_old"] and bct["verdict"] == "held"
    assert bct["compatible"] == (bct["verdict"] == "held")
    assert not independent["compatible"]
    assert independent["m_new_old"] < 0.5 * independent["m_old_old"]
    # the verdict is the paired interval's: held / not held / inconclusive
    for v in (bct, independent):
        d = v["difference"]
        assert d["low"] <= d["value"] <= d["high"]
        assert d["value"] == pytest.approx(v["m_new_old"] - v["m_old_old"])
        expected = "held" if d["low"] > 0 else "not held" if d["high"] <= 0 else "inconclusive"
        assert v["verdict"] == expected
    assert independent["verdict"] == "not held"
    rows = [r for r in report["evaluations"] if r["metric"] == "mAP@100"]
    assert rows and all(r["low"] <= r["value"] <= r["high"] for r in rows)
    # `compatible` is the verdict "held"; every number of a verdict carries its paired interval
    assert report["compatibility"] == {
        v["model"]: v["verdict"] == "held" for v in verdicts.values()
    }
    for v in (bct, independent):
        d = v["difference"]
        assert d["queries"] == SMALL.sizes.queries_per_class * d["classes"] > 0
        for key, iv in v["intervals"].items():
            if v[key] == v[key]:  # a defined number (update gain: new* better than old-old)
                assert iv["value"] == pytest.approx(v[key])
                assert iv["low"] <= iv["value"] <= iv["high"], key
    markdown = (out / "report.md").read_text()
    assert f"bct: M(n,o) > M(o,o) {bct['verdict']} (" in markdown
    assert f"{d['queries']} queries in {d['classes']} classes" in markdown


def test_verdicts_hold_under_another_seed_and_thread_count(quickstart_report, tmp_path):
    """The same verdicts from models trained with another seed and one torch thread (another
    float rounding, as on another CPU): BCT held, independent not held. The numbers differ."""
    _, report = quickstart_report
    other = run_quickstart(
        dataclasses.replace(SMALL, seed=1, threads=1, output=OutputOptions(out=str(tmp_path)))
    )
    verdicts = [{v["model"]: v["verdict"] for v in r["verdicts"]} for r in (report, other)]
    assert verdicts[0] == verdicts[1] == {"bct": "held", "independent": "not held"}
    values = [[v["m_new_old"] for v in r["verdicts"]] for r in (report, other)]
    assert values[0] != values[1]
    assert other["seeds"]["count"] == 1
    assert "1 training seed" in (tmp_path / "report.md").read_text()


def test_hot_refresh_curves_in_report(quickstart_report):
    """report.json `curves`: every policy x mode x fraction x metric; the ends of each hot curve
    equal the static cross evaluations (t=0: new query vs old gallery, t=1: new vs new)."""
    from raycompat.quickstart import HOT_REFRESH_MODES, HOT_REFRESH_POLICIES

    out, report = quickstart_report
    on_disk = json.loads((out / "report.json").read_text())
    curves = on_disk["curves"]
    assert curves == report["curves"]
    for row in curves:
        assert {"model", "policy", "mode", "fraction", "metric", "value"} <= set(row)
    grid = sorted({row["fraction"] for row in curves})
    assert len(grid) == 21 and grid[0] == 0.0 and grid[-1] == 1.0
    bct = {(r["policy"], r["mode"]) for r in curves if r["model"] == "bct"}
    assert bct == {(p, m) for p in HOT_REFRESH_POLICIES for m in HOT_REFRESH_MODES}
    static = {
        (e["model"], e["query"], e["gallery"], e["metric"]): e["value"]
        for e in on_disk["evaluations"]
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
    # one report, one ranking: old->old in the retrieval table is old->old in the hot refresh
    # (the cold curve, before its switch at t=1)
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
    markdown = (out / "report.md").read_text()
    assert "## Hot refresh" in markdown
    for model, plots in on_disk["backfill_plots"].items():
        assert plots, model
        for plot in plots:
            assert (out / plot).is_file()
        assert any(f"]({plot})" in markdown for plot in plots), model
    for model in ("bct", "independent"):
        assert (out / "backfill" / model / "curves.json").is_file()


def test_hot_refresh_intervals(quickstart_report):
    """Every curve value carries its band (report.json and curves.json), every AUC and AUC gain
    its interval; the paired AUC differences to random and the regression verdicts are one of
    the three outcomes, as their intervals say; the report's backfill table shows them."""
    out, report = quickstart_report
    values = [r for r in report["curves"] if r["value"] is not None]
    assert values and all(r["low"] <= r["value"] <= r["high"] for r in values)
    outcomes = {"held", "not held", "inconclusive"}
    compared = set()
    for s in report["backfill"]:
        if s["auc"] is not None:
            low, high = s["auc_interval"]
            assert low <= s["auc"] <= high
        if s["auc_gain"] is not None:
            low, high = s["auc_gain_interval"]
            assert low <= s["auc_gain"] <= high
        assert s["regression_verdict"] in outcomes
        vs = s["vs_random"]
        if vs is not None:
            compared.add((s["model"], s["policy"], s["mode"]))
            expect = "held" if vs["low"] > 0 else "not held" if vs["high"] <= 0 else "inconclusive"
            assert vs["verdict"] == expect and vs["low"] <= vs["value"] <= vs["high"]
    assert ("bct", "sequential", "compatible") in compared
    assert not any(model == "independent" or mode == "cold" for model, _, mode in compared)
    for model in ("bct", "independent"):
        curves = json.loads((out / "backfill" / model / "curves.json").read_text())
        assert curves["bootstrap"]["resamples"] == 1000
        assert all(set(c["bands"]) >= {"mAP@100", "top1"} for c in curves["curves"])
    markdown = (out / "report.md").read_text()
    row = next(ln for ln in markdown.splitlines() if ln.startswith("| bct | sequential |"))
    assert row.count("[") >= 5 and row.rstrip(" |").split("regression ")[-1] in outcomes


def test_gallery_embedded_by_the_pipeline(quickstart_report):
    """The main job's embeddings are the Ray Data pipeline's parquet output, which the
    simulator's loader reads as it is."""
    from raycompat.backfill.gallery import load_parquet

    out, report = quickstart_report
    paths = report["embeddings"]
    assert set(paths) == {"old_bct", "independent"}
    data = load_parquet(paths["old_bct"])
    scenario = json.loads((out / "scenario.json").read_text())
    n_query = len(scenario["splits"]["query"]["labels"])
    assert data.n_queries == n_query and data.n_items > 0
    assert data.old_dim == SMALL.embed_dim and data.new_dim == SMALL.embed_dim


def test_main_job_is_deterministic(ray_cluster, tmp_path):
    """Two runs of the main job (its command line) from fresh output and storage folders give
    the same evaluations, value for value, and the same training losses."""
    reports = []
    for run in ("a", "b"):
        out, storage = tmp_path / f"{run}-out", tmp_path / f"{run}-storage"
        assert main(TINY_FLAGS + ["--out", str(out), "--storage", str(storage)]) == 0
        reports.append(json.loads((out / "report.json").read_text()))
    first, second = reports
    assert first["evaluations"] and first["evaluations"] == second["evaluations"]
    assert first["verdicts"] == second["verdicts"]  # the same intervals, value for value
    bands = [[(r["low"], r["high"]) for r in rep["curves"]] for rep in reports]
    assert bands[0] == bands[1]
    aucs = [[s.get("auc_interval") for s in rep["backfill"]] for rep in reports]
    assert aucs[0] == aucs[1]
    for name in ("old", "bct", "independent"):
        losses = [[e.get("loss/loss") for e in r["models"][name]["history"]] for r in reports]
        assert losses[0] == losses[1], name
    assert first["models"]["old"]["run_path"] != second["models"]["old"]["run_path"]  # no reuse
