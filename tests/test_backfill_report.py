"""Reports (JSON round trip, markdown tables, PNGs), flat rows, summaries, cost model, inputs."""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from galleries import clustered_gallery  # noqa: E402

from raycompat.backfill import (  # noqa: E402
    BackfillInputError,
    CostModel,
    GalleryEmbeddings,
    backfill_curve_rows,
    simulate_backfill,
)
from raycompat.backfill.report import load_json, markdown_report, write_reports  # noqa: E402
from raycompat.metrics import auc, regression_stats  # noqa: E402


@pytest.fixture(scope="module")
def data():
    return clustered_gallery(0, 300, 25, 8, 6)


@pytest.fixture(scope="module")
def result(data):
    return simulate_backfill(
        data,
        ["random", "sequential"],
        ["compatible", "naive_merge", "cold"],
        grid_step=10,
        k=10,
        cost=CostModel(2.0, num_gpus=3),
        references={"new*-new*": {"mAP@10": 0.9, "mAP": 0.8, "top1": 0.95}},
    )


def test_json_round_trip_holds_every_number(result, tmp_path):
    paths = write_reports(result, str(tmp_path), plots=False)
    back = load_json(paths["json"])
    assert back["fractions"] == [float(x) for x in result.fractions]
    for c, cj in zip(result.curves, back["curves"], strict=False):
        assert (c.policy, c.mode) == (cj["policy"], cj["mode"])
        for name, v in c.metrics.items():
            assert cj["metrics"][name] == [float(x) for x in v]  # exact: repr round trip
        assert cj["items_backfilled"] == c.backfilled.tolist()
        assert cj["items_served_new"] == c.counts.tolist()
        assert cj["seconds"] == pytest.approx(list(c.backfilled / 6.0))
    assert back["references"]["old-old"]["mAP@10"] == result.references["old-old"]["mAP@10"]
    assert json.dumps(back)  # standard JSON (no NaN)


def test_rows_and_summaries(result, data):
    rows = result.rows()
    # every requested (policy, mode) pair, every grid point, every metric
    assert len(rows) == 2 * 3 * 11 * 4
    r = [
        x
        for x in rows
        if x["policy"] == "sequential" and x["mode"] == "cold" and x["metric"] == "top1"
    ]
    assert [x["fraction"] for x in r] == pytest.approx(list(np.linspace(0, 1, 11)))
    assert r[-1]["items_backfilled"] == data.n_items and r[-1]["seconds"] == pytest.approx(
        data.n_items / 6.0
    )
    c = result.curve("random", "compatible")
    s = c.summary["mAP@10"]
    assert s["auc"] == auc(c.fractions, c.metrics["mAP@10"])
    oo, ns = result.references["old-old"]["mAP@10"], 0.9
    assert s["auc_gain"] == pytest.approx((s["auc"] - oo) / (ns - oo))  # RM Table 1
    assert s["regression"] == regression_stats(c.fractions, c.metrics["mAP@10"])
    nfr = c.summary["NFR@1"]
    assert nfr["auc_gain"] is None
    assert nfr["regression"] == regression_stats(
        c.fractions, c.metrics["NFR@1"], higher_is_better=False
    )
    # every curve ends at new-new, cold stays at old-old until t = 1
    for cv in result.curves:
        assert cv.metrics["mAP"][-1] == result.references["new-new"]["mAP"]
    cold = result.curve("random", "cold")
    assert (cold.metrics["mAP"][:-1] == result.references["old-old"]["mAP"]).all()
    assert (cold.metrics["NFR@1"][:-1] == 0).all()
    lib = backfill_curve_rows(data, ["random"], ["compatible"], grid_step=50, k=10)
    assert {x["metric"] for x in lib["rows"]} == {"mAP@10", "mAP", "top1", "NFR@1"}
    assert len(lib["summary"]) == 4 and "old-old" in lib["references"]
    assert len(result.summary_rows()) == 2 * 3 * 4


def test_markdown_has_the_tables(result):
    md = markdown_report(result)
    assert "## References (static searches)" in md
    assert "| policy | mode | metric | t=0 | t=50% | t=100% | AUC | AUC gain | regression |" in md
    for name in ("mAP@10", "mAP", "top1", "NFR@1"):
        assert f"## {name} (%) at each backfill fraction" in md
    assert "| backfilled | time (s) | random / compatible |" in md
    assert "Cost model (given): 2 items/s per GPU x 3 GPU(s)" in md


def test_pngs_are_written(result, tmp_path):
    paths = write_reports(result, str(tmp_path))
    names = sorted(p.split("/")[-1] for p in paths["plots"])
    assert names == sorted(
        f"{m}_vs_{x}.png" for m in ("mAPat10", "mAP", "NFRat1") for x in ("fraction", "time")
    )
    for p in paths["plots"]:
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n"
    assert "![mAPat10_vs_fraction.png](mAPat10_vs_fraction.png)" in open(paths["markdown"]).read()


def test_cost_model():
    cm = CostModel(100.0, 4)
    assert cm.seconds([0, 400, 1000]).tolist() == [0.0, 1.0, 2.5]
    with pytest.raises(BackfillInputError):
        CostModel(0.0)
    with pytest.raises(BackfillInputError):
        CostModel(10.0, 0)


def test_input_errors_name_the_problem(data):
    with pytest.raises(
        BackfillInputError, match="NaN or inf embeddings in gallery_new .* item ids \\[3\\]"
    ):
        g = data.gallery_new.copy()
        g[3, 0] = np.nan
        data.with_arrays(gallery_new=g)
    with pytest.raises(
        BackfillInputError,
        match="dimension mismatch: query_new has dim 8 but gallery_new has dim 5",
    ):
        data.with_arrays(gallery_new=np.ones((data.n_items, 5), np.float32))
    with pytest.raises(BackfillInputError, match="empty gallery"):
        GalleryEmbeddings(
            gallery_labels=np.zeros(0),
            gallery_old=np.zeros((0, 4), np.float32),
            query_labels=np.zeros(2),
            query_new=np.ones((2, 4), np.float32),
        )
    with pytest.raises(BackfillInputError, match="mode 'adapted' needs|needs gallery_adapted"):
        simulate_backfill(data, ["random"], ["adapted"])
    with pytest.raises(BackfillInputError, match="mode 'rank_merge' needs"):
        simulate_backfill(data, ["random"], ["rank_merge"])
    with pytest.raises(BackfillInputError, match="does not divide"):
        simulate_backfill(data, ["random"], ["compatible"], grid_step=7)


def test_without_old_queries_nfr_is_undefined_but_curves_exist(data):
    d2 = GalleryEmbeddings(
        gallery_labels=data.gallery_labels,
        query_labels=data.query_labels,
        gallery_old=data.gallery_old,
        gallery_new=data.gallery_new,
        query_new=data.query_new,
    )
    r = simulate_backfill(d2, ["random"], ["compatible"], grid_step=50, k=5)
    c = r.curves[0]
    assert all(math.isnan(x) for x in c.metrics["NFR@1"])
    assert np.isfinite(c.metrics["mAP"]).all()
    assert c.summary["NFR@1"]["auc"] is None
