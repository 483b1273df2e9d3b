"""Reports (JSON round trip, markdown tables, PNGs), flat rows, summaries, cost model, inputs."""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from galleries import clustered_gallery  # noqa: E402

from raycompat.embeddings.gallery import BackfillInputError, GalleryEmbeddings
from raycompat.metrics import auc, regression_stats  # noqa: E402
from raycompat.simulator.memory_engine import backfill_curve_rows, simulate_backfill
from raycompat.simulator.report import load_json, markdown_report, write_reports  # noqa: E402
from raycompat.upgrade.cost import CostModel


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


# ----------------------------------------------------------------------------- intervals
@pytest.fixture(scope="module")
def with_intervals(data):
    """The same simulation with bootstrap intervals (a few resamples keep it quick)."""
    from raycompat.metrics.bootstrap import BootstrapOptions

    def simulate():
        return simulate_backfill(
            data,
            ["random", "sequential"],
            ["compatible", "cold"],
            grid_step=10,
            k=10,
            references={"new*-new*": {"mAP@10": 0.9, "mAP": 0.8, "top1": 0.95}},
            bootstrap=BootstrapOptions(resamples=200, bootstrap_seed=7),
        )

    return simulate


def _inside(low, value, high) -> bool:
    return low <= value <= high


def test_intervals_in_json_and_markdown(with_intervals, tmp_path):
    """Every row carries its band, every AUC and AUC gain its interval; the paired AUC difference
    to random and the regression verdicts are one of the three outcomes, as their intervals
    say."""
    result = with_intervals()
    paths = write_reports(result, str(tmp_path), plots=False)
    back = load_json(paths["json"])
    assert back["bootstrap"] == {"resamples": 200, "confidence": 0.95, "bootstrap_seed": 7}
    for curve in back["curves"]:
        for m, values in curve["metrics"].items():
            band = curve["bands"][m]
            assert all(map(_inside, band["low"], values, band["high"])), (curve["policy"], m)
    rows = [r for r in back["rows"] if r["value"] is not None]
    assert rows and all(_inside(r["low"], r["value"], r["high"]) for r in rows)
    outcomes = {"held", "not held", "inconclusive"}
    compared = 0
    for s in back["summary"]:
        if s["auc"] is not None:
            low, high = s["auc_interval"]
            assert low <= s["auc"] <= high
        if s["auc_gain"] is not None:
            low, high = s["auc_gain_interval"]
            assert low <= s["auc_gain"] <= high
        assert s["regression_verdict"] in outcomes
        assert (s["regression_verdict"] == "held") == (s["regression_held"] > 0)
        vs = s["vs_random"]
        if (s["policy"], s["mode"]) == ("sequential", "compatible"):
            compared += 1
            assert _inside(vs["low"], vs["value"], vs["high"])
            expect = "held" if vs["low"] > 0 else "not held" if vs["high"] <= 0 else "inconclusive"
            assert vs["verdict"] == expect
        else:
            assert vs is None  # random itself, and the cold curve
    assert compared == 4
    md = open(paths["markdown"]).read()
    assert "| AUC gain | better than random (AUC, paired) | regression |" in md
    seq = next(ln for ln in md.splitlines() if ln.startswith("| sequential | compatible | mAP@10"))
    assert seq.count("[") == 6  # t=0, t=50%, t=100%, AUC, AUC gain, vs random
    assert "; regression " in seq
    assert "| old-old | " in md and md.split("| old-old | ")[1].count("[") >= 3


def test_paired_difference_and_determinism(with_intervals):
    """The AUC difference to random is paired (the same draws for both curves), and the same
    seed gives the same intervals, value for value."""
    from raycompat.metrics.bootstrap import Bootstrap
    from raycompat.simulator.report import auc_difference, curve_bootstrap, curve_intervals

    a, b = with_intervals(), with_intervals()
    assert curve_intervals(a) == curve_intervals(b)
    assert [c.bands for c in a.curves] == [c.bands for c in b.curves]
    seq, rnd = a.curve("sequential", "compatible"), a.curve("random", "compatible")
    boot = curve_bootstrap(a)
    paired = auc_difference(a, boot, seq, rnd, "mAP@10")
    assert paired.estimate == pytest.approx(
        seq.summary["mAP@10"]["auc"] - rnd.summary["mAP@10"]["auc"]
    )
    # a curve against itself: exactly 0 in every resample (the draws are shared)
    same = auc_difference(a, boot, seq, seq, "mAP@10")
    assert (same.low, same.estimate, same.high) == (0.0, 0.0, 0.0)
    assert isinstance(boot, Bootstrap) and curve_bootstrap(a).options == a.bootstrap
