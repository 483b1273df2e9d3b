"""Backfill reports: an undefined AUC gain is n/a with its reason, the cold curve's time axis is
the real backfill time, and the cost label names the device the rate was measured on."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from galleries import clustered_gallery

from raycompat.metrics.curves import auc_gain, auc_gain_note
from raycompat.simulator.memory_engine import simulate_backfill
from raycompat.simulator.report import auc_gain_notes, markdown_report, write_reports
from raycompat.upgrade.cost import CostModel
from raycompat.upgrade.grid import backfill_counts, cold_counts


@pytest.fixture(scope="module")
def data():
    return clustered_gallery(3, 200, 20, 8, 5)


def simulate(data, newstar, cost=None):
    return simulate_backfill(
        data,
        ["random", "sequential"],
        ["cold", "compatible"],
        grid_step=10,
        k=10,
        cost=cost,
        references={"new*-new*": newstar},
    )


def test_auc_gain_is_undefined_unless_newstar_beats_oldold():
    # new* below old-old and the method below old-old: the ratio would be +2.0, not a gain
    assert math.isnan(auc_gain(0.25, 0.35, 0.30))
    assert math.isnan(auc_gain(0.40, 0.35, 0.35))
    assert auc_gain(0.40, 0.30, 0.35) == pytest.approx(2.0)
    gains = auc_gain([0.4, 0.4], [0.3, 0.3], [0.35, 0.25])
    assert gains[0] == pytest.approx(2.0) and math.isnan(gains[1])
    assert auc_gain_note(0.35, 0.31) == "new*-new* (0.31) is not better than old-old (0.35)"
    assert auc_gain_note(0.35, 0.35) == "new*-new* (0.35) is not better than old-old (0.35)"
    assert auc_gain_note(0.30, 0.35) is None


def test_gain_null_with_reason_in_json_and_markdown(data, tmp_path):
    probe = simulate(data, {"mAP@10": 1.0})
    oo = probe.references["old-old"]["mAP@10"]
    result = simulate(data, {"mAP@10": oo - 0.05})  # new* worse than old-old
    note = auc_gain_note(oo, oo - 0.05)
    for c in result.curves:
        s = c.summary["mAP@10"]
        assert s["auc"] is not None and s["auc_gain"] is None and s["auc_gain_note"] == note
        assert c.summary["mAP"]["auc_gain_note"] == "no new*-new* reference for mAP"
    good = probe.curve("random", "compatible").summary["mAP@10"]
    assert good["auc_gain"] is not None and good["auc_gain_note"] is None
    paths = write_reports(result, str(tmp_path), plots=False)
    back = json.loads(open(paths["json"]).read())
    s = next(x for x in back["summary"] if x["metric"] == "mAP@10" and x["mode"] == "compatible")
    assert s["auc_gain"] is None and s["auc_gain_note"] == note
    md = markdown_report(result)
    rows = [ln for ln in md.splitlines() if ln.startswith("| random | compatible | mAP@10 |")]
    assert len(rows) == 1 and rows[0].split("|")[8].strip() == "n/a"
    assert md.count(note) == 1
    assert f"- AUC gain n/a for mAP@10: {note}." in md


def test_auc_gain_notes_once_per_reason():
    summaries = [
        {"metric": "mAP@100", "auc_gain_note": "why"},
        {"metric": "mAP@100", "auc_gain_note": "why"},
        {"metric": "mAP@100", "auc_gain_note": None},
        {"metric": "top1", "auc_gain_note": "why"},
    ]
    assert auc_gain_notes(summaries) == [
        "AUC gain n/a for mAP@100: why.",
        "AUC gain n/a for top1: why.",
    ]


def test_cold_curve_time_axis_is_the_backfill_time(data):
    result = simulate(data, {"mAP@10": 1.0}, cost=CostModel(4.0))
    n, grid = data.n_items, result.fractions
    cold = result.curve("random", "cold")
    hot = result.curve("random", "compatible")
    assert np.array_equal(cold.counts, cold_counts(grid, n))  # served: old-old until t = 1
    assert np.array_equal(cold.backfilled, backfill_counts(grid, n))
    assert np.all(np.diff(cold.seconds) > 0)
    assert np.array_equal(cold.seconds, hot.seconds)
    assert cold.seconds.tolist() == pytest.approx((backfill_counts(grid, n) / 4.0).tolist())
    rows = [
        r
        for r in result.rows()
        if r["policy"] == "sequential" and r["mode"] == "cold" and r["metric"] == "mAP"
    ]
    assert [r["items_backfilled"] for r in rows] == backfill_counts(grid, n).tolist()
    assert [r["seconds"] for r in rows] == pytest.approx(cold.seconds.tolist())
    cj = next(c for c in result.to_dict()["curves"] if c["mode"] == "cold")
    assert cj["items_served_new"] == cold_counts(grid, n).tolist()
    # metric values unchanged: old-old until the switch
    assert (cold.metrics["mAP"][:-1] == result.references["old-old"]["mAP"]).all()


def test_cost_label_names_the_device(data):
    cpu = CostModel(50.0, 2, source="measured: new embedder, random inputs", device="cpu")
    assert cpu.describe() == "50 items/s on cpu x 2 cpu worker(s)"
    assert "GPU" not in cpu.describe() and cpu.to_dict()["device"] == "cpu"
    assert CostModel(50.0, 2).describe() == "50 items/s per GPU x 2 GPU(s)"
    assert CostModel(50.0, device="cuda:0").rate_label == "items/s per GPU"
    md = markdown_report(simulate(data, {"mAP@10": 1.0}, cost=cpu))
    assert "Cost model (measured: new embedder, random inputs): 50 items/s on cpu" in md
    assert "per GPU" not in md and "items/s/GPU" not in md
