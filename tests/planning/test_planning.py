"""raycompat plan-upgrade: the arithmetic by hand on tiny curves, the binding constraint when
nothing meets the constraints, each bad input as one ``error:`` line, the rate read from a real
embed-gallery run, and one end-to-end run on a real simulate-backfill output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import locations
import pytest
from simulator_inputs import make_bundle, run_job, write_parquet

from raycompat.planning.job import main

ROOT = locations.REPO
OLD_OLD = 0.32
#: the hand-made curves: (policy, mode) -> mAP@10 and NFR@1 at t = 0, 0.5, 1 (bands +-0.05)
CURVES = {
    ("random", "compatible"): ([0.30, 0.40, 0.50], [0.0, 0.1, 0.2]),
    ("random", "adapted"): ([0.34, 0.42, 0.50], [0.0, 0.1, 0.2]),
    ("random", "naive_merge"): ([0.32, 0.36, 0.50], [0.0, 0.05, 0.2]),
}
#: 7,200 items at 1 item/s per device on 2 devices: the whole gallery in 1 h; psi at 2 vectors/s
#: per device: 0.5 h; price 5 per device-hour: 10 per hour
HARDWARE = [
    "--items", "7200", "--devices", "2", "--device-kind", "cpu", "--items-per-s", "1",
    "--price-per-device-hour", "5", "--no-plots",
]  # fmt: skip
PSI = ["--psi-per-s", "2"]


def curve_entry(policy, mode, quality, nfr, n_items=8):
    fractions = [0.0, 0.5, 1.0]
    return {
        "policy": policy,
        "mode": mode,
        "fractions": fractions,
        "items_backfilled": [round(f * n_items) for f in fractions],
        "seconds": None,
        "metrics": {"mAP@10": quality, "NFR@1": nfr},
        "bands": {
            "mAP@10": {"low": [q - 0.05 for q in quality], "high": [q + 0.05 for q in quality]}
        },
    }


def write_curves(folder, curves=CURVES, *, old_old=OLD_OLD, n_items=8, policy=None, mode=None):
    """A curves.json as simulate-backfill writes it (the fields the planner reads)."""
    os.makedirs(folder, exist_ok=True)
    entries = [curve_entry(p, m, q, n, n_items) for (p, m), (q, n) in curves.items()]
    if policy or mode:
        entries[0].update(policy=policy or entries[0]["policy"], mode=mode or entries[0]["mode"])
    entries.append(curve_entry("any", "cold", [old_old, old_old, 0.5], [0.0, 0.0, 0.2], n_items))
    payload = {
        "k": 10,
        "fractions": [0.0, 0.5, 1.0],
        "n_items": n_items,
        "n_queries": 4,
        "metrics": ["mAP@10", "mAP", "top1", "NFR@1"],
        "references": {
            "old-old": {"mAP@10": old_old, "NFR@1": 0.0},
            "new-new": {"mAP@10": 0.5, "NFR@1": 0.2},
        },
        "reference_intervals": {
            "old-old": {"mAP@10": {"low": old_old - 0.04, "high": old_old + 0.04}},
            "new-new": {"mAP@10": {"low": 0.45, "high": 0.55}},
        },
        "cost_model": None,
        "curves": entries,
    }
    with open(os.path.join(folder, "curves.json"), "w") as f:
        json.dump(payload, f)
    return str(folder)


def main_job_folder(root):
    """A main job's report folder: report.json and backfill/<model>/curves.json."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "report.json"), "w") as f:
        json.dump({"job": "quickstart"}, f)
    write_curves(os.path.join(root, "backfill", "bct"))
    compatible = {("random", "compatible"): CURVES[("random", "compatible")]}
    write_curves(os.path.join(root, "backfill", "independent"), compatible)
    return str(root)


def plan(tmp_path, *args, out="plan"):
    out = tmp_path / out
    rc = main(["--out", str(out), *HARDWARE, *PSI, *map(str, args)])
    assert rc == 0
    return json.loads((out / "plan.json").read_text()), out


def option(payload, model, mode, policy="random"):
    return next(
        o
        for o in payload["options"]
        if (o["model"], o["policy"], o["mode"]) == (model, policy, mode)
    )


def test_top1_stands_at_every_milestone_and_at_switch_on(tmp_path):
    """Top-1 beside NFR@1 at every milestone (linear between grid points), the references' top-1
    for a cold refresh and for staying on the old model, the switch-on point in the summary."""
    folder = write_curves(tmp_path / "sim")
    path = os.path.join(folder, "curves.json")
    payload = json.load(open(path))
    for entry in payload["curves"]:
        entry["metrics"]["top1"] = [0.2, 0.6, 0.8]
        entry["bands"]["top1"] = {"low": [0.1, 0.5, 0.7], "high": [0.3, 0.7, 0.9]}
        if entry["mode"] != "cold":  # one that flips at switch-on: 10 %
            entry["metrics"]["NFR@1"] = [0.1, 0.15, 0.2]
        nfr = entry["metrics"]["NFR@1"]
        entry["bands"]["NFR@1"] = {"low": [0.5 * v for v in nfr], "high": [2 * v for v in nfr]}
    payload["references"]["old-old"]["top1"] = 0.7
    payload["references"]["new-new"]["top1"] = 0.9
    payload["reference_intervals"]["old-old"]["top1"] = {"low": 0.65, "high": 0.75}
    payload["reference_intervals"]["new-new"]["top1"] = {"low": 0.85, "high": 0.95}
    payload["reference_intervals"]["new-new"]["NFR@1"] = {"low": 0.15, "high": 0.25}
    json.dump(payload, open(path, "w"))
    result, out = plan(tmp_path, "--results", folder)
    compatible = option(result, "sim", "compatible")["milestones"]
    tops = {m["fraction"]: m["top1"] for m in compatible}
    assert tops == pytest.approx({0.0: 0.2, 0.25: 0.4, 0.5: 0.6, 0.9: 0.76, 1.0: 0.8})
    # every top-1 and NFR@1 carries its interval, linear between grid points like the value
    assert [m["top1_low"] for m in compatible] == pytest.approx([0.1, 0.3, 0.5, 0.66, 0.7])
    assert [m["top1_high"] for m in compatible] == pytest.approx([0.3, 0.5, 0.7, 0.86, 0.9])
    for m in compatible:
        assert (m["nfr_low"], m["nfr_high"]) == pytest.approx((0.5 * m["nfr"], 2 * m["nfr"]))
    cold = option(result, "sim", "cold", policy="any")
    assert [m["top1"] for m in cold["milestones"]] == pytest.approx([0.7] * 4 + [0.9])
    assert (cold["milestones"][-1]["nfr_low"], cold["milestones"][-1]["nfr_high"]) == (0.15, 0.25)
    stay = next(o for o in result["options"] if o["kind"] == "stay on old")
    assert [m["top1"] for m in stay["milestones"]] == pytest.approx([0.7] * 5)
    assert {(m["top1_low"], m["top1_high"]) for m in stay["milestones"]} == {(0.65, 0.75)}
    text = (out / "plan.md").read_text()
    assert "| at switch-on (0 %): NFR@1 / top-1 (%) |" in text
    switch_on = "| 0 % | 0 | 0.00 | 30.00 [25.00, 35.00] | 10.00 [5.00, 20.00] |"
    assert switch_on + " 20.00 [10.00, 30.00] |" in text
    # a simulation without top-1: n/a, never a number made up
    without, out2 = plan(tmp_path, "--results", write_curves(tmp_path / "plain"), out="p2")
    assert {m["top1"] for m in option(without, "plain", "compatible")["milestones"]} == {None}
    assert (
        "| 0 % | 0 | 0.00 | 30.00 [25.00, 35.00] | 0.00 | n/a |" in (out2 / "plan.md").read_text()
    )


def test_hand_arithmetic_on_a_main_job_folder(tmp_path):
    payload, out = plan(tmp_path, "--results", main_job_folder(tmp_path / "qs"))
    a = pytest.approx
    compatible = option(payload, "bct", "compatible")
    # hours = w(f) * N / (rate * devices) = f * 1 h; cost = hours * 2 devices * 5
    ms = {m["fraction"]: m for m in compatible["milestones"]}
    assert [ms[f]["hours"] for f in (0.25, 0.5, 0.9, 1.0)] == a([0.25, 0.5, 0.9, 1.0])
    assert [ms[f]["cost"] for f in (0.25, 0.5, 0.9, 1.0)] == a([2.5, 5.0, 9.0, 10.0])
    # milestones between grid points are linear: 25 % between 0.30 and 0.40, 90 % past 0.40
    assert (ms[0.25]["map"], ms[0.25]["map_low"], ms[0.25]["nfr"]) == a((0.35, 0.30, 0.05))
    assert (ms[0.9]["map"], ms[0.9]["map_high"], ms[0.25]["interpolated"]) == (
        a(0.48),
        a(0.53),
        True,
    )
    adapted = option(payload, "bct", "adapted")  # psi first: 7200 / (2 * 2) s = 0.5 h
    assert [m["hours"] for m in adapted["milestones"]] == a([0.5, 0.75, 1.0, 1.4, 1.5])
    assert adapted["total_cost"] == a(15.0) and adapted["prep_hours"] == a(0.5)
    assert payload["horizon_hours"] == a(1.5)
    # quality-hours by the trapezoid rule up to H = 1.5 h, old-old before anything new
    assert compatible["quality_hours"] == a(0.5 * 0.35 + 0.5 * 0.45 + 0.5 * 0.5)
    assert adapted["quality_hours"] == a(0.5 * OLD_OLD + 0.5 * 0.38 + 0.5 * 0.46)
    cold = option(payload, "bct", "cold", policy="any")
    stay = next(o for o in payload["options"] if o["kind"] == "stay on old")
    assert cold["quality_hours"] == a(1.0 * OLD_OLD + 0.5 * 0.5)
    assert stay["quality_hours"] == a(1.5 * OLD_OLD) and stay["total_cost"] == 0
    assert [m["hours"] for m in stay["milestones"]] == [None] * 5
    assert [m["map"] for m in cold["milestones"]] == a([OLD_OLD] * 4 + [0.5])
    # the switch-on point (0 %) stands first: the new model deployed, nothing re-embedded
    assert (ms[0.0]["hours"], ms[0.0]["map"], ms[0.0]["nfr"]) == a((0.0, 0.30, 0.0))
    # first hour the lower bound passes old-old: 0.25 + 0.2 h = 0.32 at 0.35 h; cold at 1 h
    assert compatible["passes_old_at_hours"] == a(0.35)
    assert adapted["passes_old_at_hours"] == a(0.5 + 0.5 * 0.03 / 0.08)
    assert cold["passes_old_at_hours"] == a(1.0) and stay["passes_old_at_hours"] is None
    # both models of the main job, both cold refreshes, one stay-on-old
    assert len(payload["options"]) == 3 + 1 + 2 + 1
    assert payload["recommended"]["mode"] == "compatible"
    assert "Recommended: bct / random / compatible" in (out / "plan.md").read_text()


def plotted(tmp_path, *args, out="plotted"):
    """plan-upgrade with the plots: the Plan and the output folder."""
    from raycompat.config import options_from_args
    from raycompat.planning.job import PlanUpgradeOptions, build_parser, run

    out = tmp_path / out
    hardware = [a for a in HARDWARE if a != "--no-plots"]
    argv = ["--out", str(out), *hardware, *PSI, "--quiet", *map(str, args)]
    done = run(options_from_args(PlanUpgradeOptions, build_parser().parse_args(argv)))
    return done, out


def test_no_cost_plot_when_every_upgrade_costs_the_same(tmp_path):
    folder = main_job_folder(tmp_path / "qs")
    # adapted pays for psi first (15 against 10): the costs differ, the cost plot is drawn
    done, out = plotted(tmp_path, "--results", folder, out="differ")
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == ["cost_vs_quality.png", "quality_bands.png", "quality_over_hours.png"]
    assert sorted(os.path.basename(p) for p in done["plots"]) == names
    assert "](cost_vs_quality.png)" in (out / "plan.md").read_text()
    # compatible, naive_merge and the cold refreshes all cost 10: no cost plot, none linked
    done, out = plotted(
        tmp_path, "--results", folder, "--modes", "compatible,naive_merge", out="same"
    )
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == ["quality_bands.png", "quality_over_hours.png"]
    assert sorted(os.path.basename(p) for p in done["plots"]) == names
    md = (out / "plan.md").read_text()
    assert "cost_vs_quality" not in md and "cost_vs_quality" not in (out / "plan.json").read_text()
    assert "Every upgrade costs the same (10.00" in md and "no cost plot is drawn" in md


def test_quality_plot_highlights_the_recommended_the_mode_bests_and_the_baselines(tmp_path):
    from raycompat.planning.plots import highlighted

    done, out = plotted(tmp_path, "--results", main_job_folder(tmp_path / "qs"))
    labels = [label for _, label in highlighted(done["plan"])]
    assert labels == [
        "bct / random / compatible (recommended)",  # also compatible's best: listed once
        "bct / random / adapted (best adapted)",
        "bct / random / naive_merge (best naive_merge)",
        "bct / cold refresh",
        "independent / cold refresh",
        "stay on old",
    ]
    # independent's compatible option ranks below bct's: faded, not in the legend
    assert not any(label.startswith("independent / random") for label in labels)
    assert (out / "quality_over_hours.png").stat().st_size > 5000


def test_fct_is_charged_its_gallery_transform_like_adapted(tmp_path):
    """FCT's h transforms every stored old vector before the fct mode serves, at --psi-per-s:
    the same 0.5 h of preparation as psi; without a rate the plan is refused."""
    curves = {("random", "fct"): CURVES[("random", "adapted")]}
    folder = write_curves(tmp_path / "sim", curves)
    payload, _ = plan(tmp_path, "--results", folder)
    fct = option(payload, "sim", "fct")
    assert fct["prep_hours"] == pytest.approx(0.5) and fct["total_cost"] == pytest.approx(15.0)
    assert main(["--out", str(tmp_path / "no"), *HARDWARE, "--results", folder]) == 2


def test_second_searches_are_priced(tmp_path):
    results = write_curves(tmp_path / "sim")
    payload, _ = plan(
        tmp_path, "--results", results, "--queries-per-s", 100, "--searches-per-s", 50
    )
    # naive_merge searches twice: 100 * 1 / 50 = 2 extra devices for the hour it runs
    assert option(payload, "sim", "naive_merge")["total_cost"] == pytest.approx(20.0)
    assert option(payload, "sim", "compatible")["total_cost"] == pytest.approx(10.0)


def test_a_deadline_nothing_meets_gives_the_binding_constraint(tmp_path):
    results = write_curves(tmp_path / "sim")
    payload, out = plan(tmp_path, "--results", results, "--deadline-hours", "0.5")
    assert payload["recommended"] is None
    assert not any(o["meets_constraints"] for o in payload["options"])
    (binding,) = payload["binding"]
    assert binding["constraint"] == "deadline_hours"
    # 2 device-hours of work in 0.5 h: 4 devices; the fastest options end at 1 h
    assert "sim / random / compatible would meet it with --devices 4 (" in binding["advice"]
    assert "--deadline-hours 1 would admit" in binding["advice"]
    assert "--deadline-hours binds" in (out / "plan.md").read_text()


def test_two_constraints_bind_each_with_its_advice(tmp_path):
    results = write_curves(tmp_path / "sim")
    payload, _ = plan(tmp_path, "--results", results, "--deadline-hours", 1.2, "--max-nfr", 0.1)
    binding = {b["constraint"]: b["advice"] for b in payload["binding"]}
    assert payload["recommended"] is None and set(binding) == {"max_nfr", "deadline_hours"}
    assert binding["max_nfr"] == "--max-nfr 0.2 would admit sim / random / compatible"
    assert "only staying on the old model" in binding["deadline_hours"]


#: a larger plan, whose numbers do not print exactly: 200M items at 2,000 items/s on each of 8
#: devices end at 12,500 s = 3.4722 h and cost 3.4722 h x 8 x 2.5 = 69.444; psi at 4,000
#: vectors/s per device adds 1.736 h to the adapted mode
LARGE = [
    "--items", "200000000", "--devices", "8", "--device-kind", "gpu", "--items-per-s", "2000",
    "--price-per-device-hour", "2.5", "--psi-per-s", "4000", "--no-plots", "--quiet",
]  # fmt: skip


def typed_advice(advice):
    """Each way a piece of advice offers (its text split at '; or '), as what a user types: the
    flags given with their values, and the flags it says to leave out ('without --flag')."""
    ways = []
    for way in advice.split("; or "):
        given = re.findall(r"(--[a-z][a-z-]*) (\d[\d.]*)(?![\d.])", way)
        left_out = re.findall(r"without (--[a-z][a-z-]*)", way)
        if given or left_out:
            ways.append((given, left_out))
    return ways


def retyped(args, given, left_out):
    """``args`` with the ``left_out`` flags (and their values) removed and ``given`` set."""
    out, rest = [], list(args)
    while rest:
        arg = rest.pop(0)
        if arg in left_out:  # a flag with a value takes it along; --never-below-old has none
            if rest and not rest[0].startswith("--"):
                rest.pop(0)
            continue
        out.append(arg)
    for flag, value in given:  # given later on the command line: the later value counts
        out += [flag, value]
    return out


@pytest.mark.parametrize(
    "case, constraints, expected",
    [
        # 100,000 device-seconds in 3 h: 9.26 -> 10 devices; or a deadline of 3.4722 -> 3.473 h
        ("deadline", ["--deadline-hours", "3"], ["--devices 10 (", "--deadline-hours 3.473 "]),
        # every upgrade costs 69.444 -> 69.45; only dropping the deadline admits staying put
        (
            "budget",
            ["--deadline-hours", "4", "--budget", "60"],
            ["--budget 69.45 would", "without --deadline-hours only staying"],
        ),
        # naive_merge peaks at 1 / 41 = 0.0243902 NFR@1 -> 0.0244
        ("max_nfr", ["--deadline-hours", "4", "--max-nfr", "0.01"], ["--max-nfr 0.0244 would"]),
        # no one of them alone admits an upgrade: both, or the devices with the budget
        (
            "deadline_and_budget",
            ["--deadline-hours", "3", "--budget", "60"],
            ["with --deadline-hours 3.473 --budget 69.45;", "with --devices 10 --budget 69.45 ("],
        ),
        # a start-up of 360 s: 10 devices end at 2.878 h and cost 71.944, above the budget that
        # 8 devices meet (71.444); the devices advice says the budget 10 devices need
        (
            "devices",
            ["--deadline-hours", "3", "--budget", "71.5", "--rate-summary", "SUMMARY"],
            ["with --devices 10 --budget 71.95 (", "--deadline-hours 3.573 would"],
        ),
    ],
)
def test_every_piece_of_advice_typed_back_admits_an_option(tmp_path, case, constraints, expected):
    """The advice for a deadline, a budget or a --max-nfr nothing meets, for a deadline and a
    budget that bind together, and the devices: every value rounded up at the precision
    printed, so that typing each way the advice offers gives a plan with a recommendation."""
    curves = dict(CURVES)
    curves[("random", "naive_merge")] = ([0.32, 0.36, 0.50], [0.0, 0.02, 1 / 41])
    args = [*LARGE, "--results", write_curves(tmp_path / "sim", curves), *constraints]
    if "SUMMARY" in args:  # 2,000 items at a steady 2,000 items/s in 361 s: 360 s of start-up
        summary = {"items_written": 2000, "seconds": 361.0, "steady_items_per_s": 2000.0}
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        args[args.index("SUMMARY")] = str(tmp_path / "summary.json")
        del args[args.index("--items-per-s") : args.index("--items-per-s") + 2]
    assert main(["--out", str(tmp_path / "plan"), *args]) == 0
    payload = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert payload["recommended"] is None
    advice = [b["advice"] for b in payload["binding"]]
    for text in expected:
        assert any(text in a for a in advice), (text, advice)
    if case == "deadline_and_budget":  # both named, with one piece of advice
        assert [b["constraint"] for b in payload["binding"]] == ["deadline_hours", "budget"]
        assert "--deadline-hours and --budget bind together" in payload["reason"]
    ways = [way for a in dict.fromkeys(advice) for way in typed_advice(a)]
    assert len(ways) >= len(expected)
    for i, (given, left_out) in enumerate(ways):
        out = tmp_path / f"typed{i}"
        assert main(["--out", str(out), *retyped(args, given, left_out)]) == 0
        again = json.loads((out / "plan.json").read_text())
        assert again["recommended"] is not None, (given, left_out, again["reason"])


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--price-per-device-hour", "inf", "option 'price_per_device_hour' must be a finite"),
        ("--price-per-device-hour", "nan", "option 'price_per_device_hour' must be a finite"),
        ("--items-per-s", "inf", "option 'items_per_s' must be a finite number, got 'inf'"),
        ("--psi-per-s", "nan", "option 'psi_per_s' must be a finite number, got 'nan'"),
        ("--deadline-hours", "inf", "option 'deadline_hours' must be a finite number"),
        ("--budget", "nan", "option 'budget' must be a finite number, got 'nan'"),
        ("--max-nfr", "inf", "option 'max_nfr' must be a finite number, got 'inf'"),
        ("--max-nfr", "30", "option 'max_nfr' = 30.0 must be <= 1: a fraction, 0.3 for 30 %"),
    ],
)
def test_an_infinite_number_or_a_percent_is_one_error_line(tmp_path, capsys, flag, value, named):
    args = ["--results", write_curves(tmp_path / "a"), *HARDWARE, *PSI, flag, value]
    assert main(["--out", str(tmp_path / "out"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0]
    assert not (tmp_path / "out").exists()


def test_advice_values_are_rounded_up_at_the_precision_printed():
    from raycompat.planning.recommend import _typed

    assert _typed(12500 / 3600, sig=4) == "3.473" and _typed(1.0, sig=4) == "1"
    assert _typed(1 / 41, sig=4) == "0.0244" and _typed(0.2, sig=4) == "0.2"
    assert _typed(12500 / 3600 * 8 * 2.5, places=2) == "69.45" and _typed(10.0, places=2) == "10"
    assert _typed(1234567.891, sig=4) == "1235000" and _typed(0.0, places=2) == "0"
    for x in (0.1, 1 / 3, 2 / 3, 69.444, 3.4722, 1e-7, 123456.789, 0.30000000000000004):
        assert float(_typed(x, sig=4)) >= x and float(_typed(x, places=2)) >= x


def test_never_below_old_uses_the_lower_bound(tmp_path):
    results = write_curves(tmp_path / "sim")
    payload, _ = plan(tmp_path, "--results", results, "--never-below-old")
    # compatible's lower bound 0.25 < 0.32 at 0 h, adapted's 0.29 at 0.5 h, naive_merge's 0.31
    # at 0.5 h (at 0 h naive_merge serves the old system itself: old query, old gallery)
    met = {(o["model"], o["mode"]) for o in payload["options"] if o["meets_constraints"]}
    assert met == {("sim", "cold"), ("old", "old")}
    assert payload["recommended"]["mode"] == "cold"
    # compatible alone ends with the cold refresh: H = 1 h, where cold and staying on the old
    # model have the same quality-hours; the tie goes to what serves better after H
    payload, _ = plan(
        tmp_path, "--results", results, "--never-below-old", "--modes", "compatible", out="p2"
    )
    cold, stay = (o for o in payload["options"] if o["kind"] != "candidate")
    assert cold["quality_hours"] == stay["quality_hours"] == pytest.approx(OLD_OLD)
    assert payload["recommended"]["kind"] == "cold refresh"


@pytest.mark.parametrize(
    "case, named",
    [
        ("other_old", "curves of different old models"),
        ("other_gallery", "curves of different galleries"),
        ("unknown_policy", "unknown policy 'psychic'"),
        ("unknown_mode", "unknown mode 'warm'"),
        ("policies_flag", "--policies: unknown policy 'psychic'"),
        ("negative_price", "option 'price_per_device_hour' = -1.0 must be >= 0"),
        ("no_simulation", "holds no simulation"),
        ("no_psi", "the adapted and fct modes need the gallery transform"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, case, named):
    good = write_curves(tmp_path / "a")
    args = ["--results", good, *HARDWARE, *PSI]
    if case == "other_old":
        args[1] += "," + write_curves(tmp_path / "b", old_old=0.33)
    elif case == "other_gallery":
        args[1] += "," + write_curves(tmp_path / "b", n_items=9)
    elif case in ("unknown_policy", "unknown_mode"):
        bad = {"policy": "psychic"} if case == "unknown_policy" else {"mode": "warm"}
        args[1] = write_curves(tmp_path / "b", **bad)
    elif case == "policies_flag":
        args += ["--policies", "psychic"]
    elif case == "negative_price":
        args += ["--price-per-device-hour", "-1"]
    elif case == "no_simulation":
        (tmp_path / "empty").mkdir()
        args[1] = str(tmp_path / "empty")
    else:
        args = ["--results", good, *HARDWARE]
    assert main(["--out", str(tmp_path / "out"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0]
    if case in ("other_old", "other_gallery", "unknown_policy", "unknown_mode"):
        assert str(tmp_path / "b") in lines[0]
    assert not (tmp_path / "out").exists()


def test_rate_from_a_real_embed_gallery_run(ray_cluster, tmp_path):
    """The rate measured on the spot is read from the run's own _summary.json: its steady rate,
    and a start-up that makes the prediction for the run's own item count its wall time."""
    from raycompat.planning.rates import measure_embedding_rate

    new = str(make_bundle(tmp_path / "new"))
    rate = measure_embedding_rate(new, 64, str(tmp_path / "probe"), "cpu", log=lambda m: None)
    summary = json.loads((tmp_path / "probe" / "_summary.json").read_text())
    assert summary["items_written"] == 64 and summary["columns"] == ["new"]
    steady, seconds = summary["steady_items_per_s"], summary["seconds"]
    if steady:  # more than one output: the rate after the first, the rest is start-up
        assert rate.items_per_s == steady
        assert rate.startup_s == max(0.0, seconds - 64 / steady)
    else:  # everything arrived at once: items over wall time
        assert (rate.items_per_s, rate.startup_s) == (64 / seconds, 0.0)
    assert rate.seconds(20_000, 1) == rate.startup_s + 20_000 / rate.items_per_s
    if rate.startup_s > 0 or not steady:
        assert rate.seconds(64, 1) == pytest.approx(seconds, rel=1e-12)
    assert "measured on the spot by embed-gallery" in rate.source


def test_psi_rate_measured_on_the_spot(tmp_path):
    from raycompat.planning.rates import measure_psi_rate

    psi = measure_psi_rate(str(make_bundle(tmp_path / "new")), "cpu", seconds=0.05)
    assert psi.vectors_per_s > 0 and "psi of" in psi.source and "on cpu" in psi.source


@pytest.mark.subprocess
def test_end_to_end_on_a_real_simulation(tmp_path):
    """simulate-backfill on a tiny parquet gallery, then plan-upgrade as a script: plan.md,
    plan.json and the PNGs; the same folder with other options is refused."""
    emb = write_parquet(tmp_path / "emb.parquet", adapted=False)
    sim = tmp_path / "bct"
    r = run_job(
        emb, "--modes", "compatible,naive_merge,cold", "--policies", "random,sequential",
        "--items-per-s-per-gpu", "100", "--grid-step", "25", "--k", "10", "--resamples", "50",
        "--out", sim, "--no-plots",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = tmp_path / "plan"
    command = [sys.executable, os.path.join(ROOT, "jobs", "plan_upgrade.py"), "--results"]
    common = [str(sim), "--devices", "4", "--price-per-device-hour", "2.5", "--out", str(out)]
    done = subprocess.run(command + common, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    payload = json.loads((out / "plan.json").read_text())
    modes = sorted({(o["policy"], o["mode"]) for o in payload["options"]})
    assert len(modes) == 4 + 1 + 1 and payload["items"] == 60
    rate = payload["rates"]["embedding"]["bct"]
    assert rate["items_per_s_per_device"] == 100 and "read from" in rate["source"]
    assert payload["recommended"] is not None and "recommendation: " in done.stdout
    # every upgrade re-embeds the gallery on the same devices (no search load): one cost, so
    # no cost plot
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["quality_bands.png", "quality_over_hours.png"]
    assert all((out / p).stat().st_size > 5000 for p in pngs)
    md = (out / "plan.md").read_text()
    assert "no cost plot is drawn" in md and "cost_vs_quality" not in md
    assert md.startswith("# Upgrade plan") and "### bct / sequential / naive_merge" in md
    again = subprocess.run(command + common + ["--devices", "8"], capture_output=True, text=True)
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_options_are_compared_by_paired_intervals_and_the_simplest_tied_one_is_chosen(tmp_path):
    """A simulation with a bootstrap writes samples.npz; the plan gives every option's
    quality-hours an interval and its paired difference to the best, and recommends the
    simplest option not worse than the best (docs/planning.md, "Comparing options")."""
    from serving_helpers import labelled_embeddings

    from raycompat.metrics.bootstrap import BootstrapOptions
    from raycompat.planning.recommend import MODE_NEEDS
    from raycompat.simulator import simulate_backfill
    from raycompat.simulator.report import write_reports

    data = labelled_embeddings(n_items=300, n_queries=60, classes=20, seed=4)
    res = simulate_backfill(
        data, ["random", "sequential"], ["compatible", "naive_merge"], k=10, grid_step=25.0,
        bootstrap=BootstrapOptions(resamples=200),
    )  # fmt: skip
    written = write_reports(res, str(tmp_path / "sim"), plots=False)
    assert written["samples"].endswith("samples.npz")
    payload, out = plan(tmp_path, "--results", tmp_path / "sim")
    verdicts = []
    for o in payload["options"]:
        p = o["paired"]
        qh = p["quality_hours"]
        assert qh["value"] == pytest.approx(o["quality_hours"], rel=1e-9, abs=1e-12)
        assert qh["low"] <= qh["value"] + 1e-12 and qh["value"] <= qh["high"] + 1e-12
        assert (p["verdict"] == "best") == (p["vs_best"] is None)
        if p["vs_best"] is not None:  # worse exactly when the paired interval is below 0
            assert (p["verdict"] == "worse") == (p["vs_best"]["high"] < 0)
        verdicts.append(p["verdict"])
    assert verdicts.count("best") == 1 and "worse" in verdicts  # staying on old is worse
    tied = [o for o in payload["options"] if o["paired"]["verdict"] != "worse"]
    rec = payload["recommended"]
    assert rec["paired"]["verdict"] != "worse"
    assert MODE_NEEDS.get(rec["mode"], 1) == min(MODE_NEEDS.get(o["mode"], 1) for o in tied)
    md = (out / "plan.md").read_text()
    assert "vs the best (paired)" in md and "Quality-hours carry 95 % bootstrap intervals" in md
    # without samples.npz: the values alone, and the plan says so
    os.remove(written["samples"])
    payload, out = plan(tmp_path, "--results", tmp_path / "sim", out="plan2")
    assert all(o["paired"] is None for o in payload["options"])
    assert "No paired intervals" in (out / "plan.md").read_text()


def test_a_gpu_plan_refuses_a_rate_measured_on_a_cpu(tmp_path, capsys):
    """A simulation's recorded rate says what it was measured on; a plan for another kind of
    device refuses it (one error line) unless told to use it."""
    folder = write_curves(
        tmp_path / "sim", {("random", "compatible"): CURVES[("random", "compatible")]}
    )
    path = os.path.join(folder, "curves.json")
    with open(path) as f:
        payload = json.load(f)
    payload["cost_model"] = {"items_per_s_per_gpu": 250.0, "device": "cpu", "source": "measured"}
    with open(path, "w") as f:
        json.dump(payload, f)
    base = ["--results", folder, "--items", "1000", "--no-plots"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "250.0 items/s) is a CPU rate" in err[0] and "--device-kind gpu" in err[0]
    assert "--no-rate-device-check" in err[0] and not (tmp_path / "a").exists()
    assert main([*base, "--out", str(tmp_path / "b"), "--device-kind", "cpu"]) == 0
    assert main([*base, "--out", str(tmp_path / "c"), "--no-rate-device-check"]) == 0
    plan_json = json.loads((tmp_path / "c" / "plan.json").read_text())
    assert (
        plan_json["rates"]["embedding"][next(iter(plan_json["rates"]["embedding"]))][
            "items_per_s_per_device"
        ]
        == 250.0
    )


def test_with_a_query_log_the_plan_ranks_on_the_weighted_curves_and_shows_both(tmp_path):
    """A simulation with a query log: the plan ranks on the frequency-weighted curves (with
    paired intervals from the weighted terms) and shows the unweighted quality-hours beside;
    --quality unweighted plans on the plain curves, whose numbers are those shown beside."""
    import numpy as np
    from serving_helpers import labelled_embeddings

    from raycompat.data.workload import write_query_log
    from raycompat.metrics.bootstrap import BootstrapOptions
    from raycompat.simulator import simulate_backfill
    from raycompat.simulator.report import write_reports
    from raycompat.upgrade.query_log import read_query_log

    data = labelled_embeddings(n_items=300, n_queries=60, classes=20, seed=4)
    counts = 1 + (np.arange(60) % 7) ** 2  # some queries searched 37 times, some once
    log = write_query_log(
        str(tmp_path / "log.parquet"), {"query_id": data.query_ids, "count": counts}
    )
    res = simulate_backfill(
        data, ["random", "sequential"], ["compatible", "naive_merge"], k=10, grid_step=25.0,
        bootstrap=BootstrapOptions(resamples=100), query_log=read_query_log(log),
    )  # fmt: skip
    write_reports(res, str(tmp_path / "sim"), plots=False)
    weighted, out = plan(tmp_path, "--results", tmp_path / "sim")
    assert any("frequency-weighted" in n for n in weighted["notes"])
    assert "every query once" in (out / "plan.md").read_text()
    plain, _ = plan(tmp_path, "--results", tmp_path / "sim", "--quality", "unweighted", out="p2")
    for w, p in zip(weighted["options"], plain["options"], strict=True):
        assert w["paired"] is not None and p["unweighted_quality_hours"] is None
        assert w["unweighted_quality_hours"] == pytest.approx(p["quality_hours"], rel=1e-12)
    assert any(
        w["quality_hours"] != pytest.approx(w["unweighted_quality_hours"], rel=1e-6)
        for w in weighted["options"]
    )


def test_fixed_costs_and_the_store_write_rate_by_hand(tmp_path, capsys):
    """Training, index build, storage of the second vector set and arriving items are in every
    upgrade's cost (and its table); a store that takes fewer items/s than the devices embed
    bounds the backfill."""
    a = pytest.approx
    extra = ["--training-hours", "3", "--index-build-hours", "1", "--new-dim", "256",
             "--storage-price-per-gib-hour", "2", "--new-items-per-hour", "3600"]  # fmt: skip
    payload, out = plan(tmp_path, "--results", main_job_folder(tmp_path / "qs"), *extra)
    compatible = option(payload, "bct", "compatible")
    gib = 7200 * 256 * 4 / 2**30
    # 1 h on 2 devices at 5: 10; training 3 * 5; index 1 * 5; storage gib * 1 h * 2;
    # 3600 arrivals in the hour at 1 item/s per device: 1 device-hour * 5
    fixed = {"training": 15.0, "index build": 5.0, "storage": gib * 2, "arrivals": 5.0}
    assert compatible["fixed_costs"] == a(fixed)
    assert compatible["total_cost"] == a(10.0 + sum(fixed.values()))
    stay = next(o for o in payload["options"] if o["kind"] == "stay on old")
    assert stay["fixed_costs"] == {} and stay["total_cost"] == 0
    md = (out / "plan.md").read_text()
    assert "fixed costs (in cost)" in md and "Fixed costs of every upgrade (given" in md
    # the store takes 1 item/s: 7200 items take 2 h whatever the devices
    bounded, out = plan(tmp_path, "--results", tmp_path / "qs", "--store-items-per-s", "1",
                        out="bounded")  # fmt: skip
    compatible = option(bounded, "bct", "compatible")
    assert compatible["end_hours"] == a(2.0) and compatible["total_cost"] == a(20.0)
    assert "The store takes 1.0 items/s" in (out / "plan.md").read_text()
    args = ["--results", str(tmp_path / "qs"), "--storage-price-per-gib-hour", "2"]
    assert main(["--out", str(tmp_path / "x"), *HARDWARE, *PSI, *args]) == 2
    assert "--storage-price-per-gib-hour needs --new-dim" in capsys.readouterr().err


def test_the_size_check_re_simulates_nested_subsamples(tmp_path):
    """--size-check: every candidate re-simulated on nested subsamples of its parquet gallery
    with its simulation's bootstrap, the options' quality-hours, intervals and ranks per size
    in plan.json and plan.md; the full size equals the plan itself, intervals included, and is
    recommended by the plan's own rule."""
    from raycompat.embeddings.gallery import load_parquet
    from raycompat.metrics.bootstrap import BootstrapOptions
    from raycompat.planning.size_check import nested_subsample
    from raycompat.simulator import simulate_backfill
    from raycompat.simulator.report import write_reports

    emb = write_parquet(tmp_path / "emb.parquet", adapted=False)
    data = load_parquet(str(emb))
    half, quarter = nested_subsample(data, 0.5), nested_subsample(data, 0.25)
    assert set(quarter.gallery_ids.tolist()) < set(half.gallery_ids.tolist())
    assert half.n_queries == data.n_queries and half.n_items == round(data.n_items / 2)
    res = simulate_backfill(data, ["random", "sequential"], ["compatible", "naive_merge"], k=10,
                            grid_step=25.0, bootstrap=BootstrapOptions(resamples=200))  # fmt: skip
    write_reports(res, str(tmp_path / "sim"), plots=False)
    payload, out = plan(tmp_path, "--results", tmp_path / "sim", "--size-check")
    sc = payload["size_check"]
    assert sc["sizes"] == [quarter.n_items, half.n_items, data.n_items]
    full = {
        f"{o['model']} / {o['policy']} / {o['mode']}": o["quality_hours"]
        for o in payload["options"]
        if o["kind"] == "candidate"
    }
    bands = {
        f"{o['model']} / {o['policy']} / {o['mode']}": o["paired"]["quality_hours"]
        for o in payload["options"]
        if o["kind"] == "candidate"
    }
    for label, qh in full.items():
        assert sc["quality_hours"][label][-1] == pytest.approx(qh, rel=1e-12)
        low, high = sc["quality_hours_intervals"][label][-1]
        assert (low, high) == pytest.approx((bands[label]["low"], bands[label]["high"]), rel=1e-9)
        assert all(b is not None and b[0] < b[1] for b in sc["quality_hours_intervals"][label])
    assert len(sc["recommended"]) == 3 and isinstance(sc["recommendation_changes"], bool)
    chosen = payload["recommended"]
    assert sc["recommended"][-1] == f"{chosen['model']} / {chosen['policy']} / {chosen['mode']}"
    assert "## The gallery-size check" in (out / "plan.md").read_text()


def test_one_name_on_several_seeds_plans_their_random_orders(tmp_path, capsys):
    """``--results g=A,g=B,g=C`` (one gallery simulated with three seeds): one candidate whose
    curves are the mean of the orders (quality-hours are linear in them) and whose intervals
    resample the orders beside the query classes; a seed-independent order keeps its own
    interval; the same seed twice is refused."""
    import numpy as np

    from raycompat.embeddings.gallery import load_parquet
    from raycompat.metrics.bootstrap import BootstrapOptions
    from raycompat.simulator import simulate_backfill
    from raycompat.simulator.report import write_reports

    data = load_parquet(str(write_parquet(tmp_path / "emb.parquet", adapted=False)))
    folders = []
    for seed in (0, 1, 2):
        boot = BootstrapOptions(resamples=200)
        res = simulate_backfill(data, ["random", "sequential"], ["compatible"], k=10, seed=seed,
                                grid_step=25.0, bootstrap=boot)  # fmt: skip
        folders.append(str(tmp_path / f"sim{seed}"))
        write_reports(res, folders[-1], plots=False)
    singles = [plan(tmp_path, "--results", f"g={f}", out=f"single{i}")[0]
               for i, f in enumerate(folders)]  # fmt: skip
    merged, out = plan(tmp_path, "--results", ",".join(f"g={f}" for f in folders), out="orders")
    qh = [option(p, "g", "compatible")["quality_hours"] for p in singles]
    assert len(set(qh)) == 3  # three orders, three values
    got = option(merged, "g", "compatible")
    assert got["quality_hours"] == pytest.approx(np.mean(qh), rel=1e-12)
    assert got["paired"]["quality_hours"]["seeds"] == 3
    seq = option(merged, "g", "compatible", policy="sequential")["paired"]["quality_hours"]
    alone = option(singles[0], "g", "compatible", policy="sequential")["paired"]["quality_hours"]
    assert (seq["low"], seq["high"]) == pytest.approx((alone["low"], alone["high"]), rel=1e-12)
    assert merged["inputs"][0]["order_paths"] == [os.path.join(f, "curves.json") for f in folders]
    assert "g: 3 random orders" in (out / "plan.md").read_text()
    twice = ",".join(f"g={f}" for f in (folders[0], folders[1], folders[0]))
    assert main(["--out", str(tmp_path / "bad"), *HARDWARE, "--results", twice]) == 2
    assert "are both seed 0: the same random order twice" in capsys.readouterr().err


def test_the_hours_carry_the_range_of_the_rates_timed_windows(tmp_path):
    """A rate read from an embed-gallery summary with its progress series: 8 equal-time
    windows of its steady part, the slowest and fastest of them, and every re-embedding
    option's hours and cost at both, by hand; a given rate has no range."""
    from raycompat.planning.rates import rate_from_summary, window_rates

    # first output at 10 s; 100 items/s until 50 s, then 300 items/s until 90 s
    series = [[0.0, 0, 1, 1], [10.0, 0, 1, 1]]
    series += [[t, 100 * (t - 10), 1, 1] for t in range(15, 51, 5)]
    series += [[t, 4000 + 300 * (t - 50), 1, 1] for t in range(55, 91, 5)]
    assert window_rates(series, 10.0) == pytest.approx([100.0] * 4 + [300.0] * 4)
    summary = {"items_written": 16000, "seconds": 90.0, "steady_items_per_s": 200.0,
               "first_output_s": 10.0, "memory": {"series_s_items_rss_pss": series}}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    rate = rate_from_summary(str(tmp_path / "summary.json"))
    assert rate.window_range == (100.0, 300.0) and rate.windows == 8
    assert rate.startup_s == 10.0 and "8 timed windows ran at 100.0 to 300.0 items/s" in rate.source
    hardware = [a for a in HARDWARE if a not in ("--items-per-s", "1")]
    out = tmp_path / "plan"
    args = [
        "--results",
        write_curves(tmp_path / "sim"),
        "--rate-summary",
        tmp_path / "summary.json",
    ]
    assert main(["--out", str(out), *hardware, *PSI, *map(str, args)]) == 0
    payload = json.loads((out / "plan.json").read_text())
    for o in payload["options"]:
        if o["end_hours"] is None:  # staying on the old model re-embeds nothing
            assert o["end_hours_range"] is None and o["total_cost_range"] is None
            continue
        start = o["prep_hours"] * 3600 + 10  # psi's refresh (adapted), then the start-up
        fast, slow = ((start + 7200 / (r * 2)) / 3600 for r in (300.0, 100.0))
        assert o["end_hours"] == pytest.approx((start + 7200 / 400) / 3600, rel=1e-12)
        assert o["end_hours_range"] == pytest.approx([fast, slow], rel=1e-12)
        busy = o["devices_busy"] * 5
        assert o["total_cost_range"] == pytest.approx([fast * busy, slow * busy], rel=1e-12)
    assert "the fastest and at the slowest of its 8 timed windows" in (out / "plan.md").read_text()
    given, _ = plan(tmp_path, *HARDWARE, "--results", tmp_path / "sim", out="given")
    assert all(o["end_hours_range"] is None for o in given["options"])


def test_training_hours_are_read_from_each_candidates_bundle(tmp_path):
    """Without --training-hours, a candidate's training cost is its own bundle's
    training.json (the bundle its simulation's job.json names) when it trained on the plan's
    kind of device; on another kind it is not counted and the plan says so; the flag wins."""
    sim = write_curves(tmp_path / "sim")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (tmp_path / "sim" / "job.json").write_text(json.dumps({"config": {"new_model": str(bundle)}}))

    def record(device):
        rec = {"epochs": 3, "wall_hours": 1.0, "workers": 2, "device": device, "device_hours": 2.0}
        (bundle / "training.json").write_text(json.dumps(rec))

    def training_costs(payload):
        return {o["fixed_costs"].get("training") for o in payload["options"] if o["end_hours"]}

    record("cpu")
    payload, out = plan(tmp_path, "--results", sim, out="cpu")
    assert training_costs(payload) == {2.0 * 5}  # 2 device-hours at 5 per device-hour
    assert "training 2 device-hours on cpu (3 epochs, 2 worker(s))" in (out / "plan.md").read_text()
    stay = next(o for o in payload["options"] if o["end_hours"] is None)
    assert stay["fixed_costs"] == {} and stay["total_cost"] == 0
    record("gpu")
    payload, out = plan(tmp_path, "--results", sim, out="gpu")
    assert training_costs(payload) == {None}
    assert (
        "trained 2 device-hours on gpu, the plan is for cpu: not counted"
        in (out / "plan.md").read_text()
    )
    payload, _ = plan(tmp_path, "--results", sim, "--training-hours", "1", out="given")
    assert training_costs(payload) == {5.0}
