"""The simulate-backfill job on tiny parquet files: a good run as a program
(``python jobs/simulate_backfill.py``), and every other run and bad input through its command
line in this process."""

from __future__ import annotations

import json

import numpy as np
import pytest
from simulator_inputs import make_bundle, run_job, run_job_program, write_parquet


@pytest.mark.subprocess
def test_good_run_writes_every_report(tmp_path):
    emb = write_parquet(tmp_path / "emb.parquet")
    model = make_bundle(tmp_path / "new_model")
    out = tmp_path / "out"
    r = run_job_program(
        "--embeddings",
        emb,
        "--new-model",
        model,
        "--grid-step",
        25,
        "--k",
        10,
        "--gpus",
        2,
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    assert "report:" in r.stdout
    data = json.loads((out / "curves.json").read_text())
    assert set(data["modes"]) >= {"compatible", "adapted", "naive_merge", "cold"}
    assert "uncertainty:margin" in data["policies"] and "learned" in data["policies"]
    assert data["cost_model"]["num_gpus"] == 2 and data["cost_model"]["items_per_s_per_gpu"] > 0
    rows = data["rows"]
    assert {r["metric"] for r in rows} == {"mAP@10", "mAP", "top1", "NFR@1"}
    assert len(data["fractions"]) == 5
    md = (out / "curves.md").read_text()
    assert "| policy | mode | metric |" in md
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "mAPat10_vs_fraction.png" in pngs and "NFRat1_vs_time.png" in pngs
    assert all((out / p).stat().st_size > 1000 for p in pngs)


def test_given_rate_and_explicit_names(tmp_path):
    emb = write_parquet(tmp_path / "emb.parquet", adapted=False)
    out = tmp_path / "out"
    r = run_job(
        "--embeddings",
        emb,
        "--policies",
        "random,sequential",
        "--modes",
        "compatible,cold",
        "--items-per-s-per-gpu",
        5,
        "--grid-step",
        50,
        "--k",
        5,
        "--no-plots",
        "--quiet",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads((out / "curves.json").read_text())
    assert data["policies"] == ["random", "sequential"] and data["modes"] == ["compatible", "cold"]
    c = data["curves"][0]
    assert c["seconds"][-1] == pytest.approx(60 / 5)  # 60 gallery items at 5 items/s
    # every curve has its bootstrap band and AUC interval; the report shows them
    assert data["bootstrap"]["resamples"] == 1000
    m = data["metrics"][0]  # mAP@5
    for curve in data["curves"]:
        band, values = curve["bands"][m], curve["metrics"][m]
        assert all(
            lo <= v <= hi for lo, v, hi in zip(band["low"], values, band["high"], strict=True)
        )
        low, high = curve["summary"][m]["auc_interval"]
        assert low <= curve["summary"][m]["auc"] <= high
    rows = [r for r in data["rows"] if r["value"] is not None]
    assert rows and all(r["low"] <= r["value"] <= r["high"] for r in rows)
    for s in data["summary"]:
        vs = s["vs_random"]
        if (s["policy"], s["mode"]) != ("sequential", "compatible"):
            assert vs is None
            continue
        assert vs["low"] <= vs["value"] <= vs["high"]  # the paired AUC difference to random
        expect = "held" if vs["low"] > 0 else "not held" if vs["high"] <= 0 else "inconclusive"
        assert vs["verdict"] == expect
        assert s["regression_verdict"] in ("held", "not held", "inconclusive")
    markdown = (out / "curves.md").read_text()
    assert "better than random (AUC, paired)" in markdown and " [" in markdown
    # the per-fraction tables show every value with its band
    table = markdown.split(f"## {m} (%) at each backfill fraction")[1].split("##")[0]
    assert table.count("[") == 3 * len(data["curves"])  # 3 fractions x every curve


def test_bootstrap_flags_and_determinism(tmp_path):
    """--resamples / --confidence / --bootstrap-seed reach the report; the same seed gives the
    same bands and intervals, value for value."""
    emb = write_parquet(tmp_path / "emb.parquet", adapted=False)
    flags = ["--policies", "random,sequential", "--modes", "compatible", "--grid-step", 50]
    flags += ["--k", 5, "--no-plots", "--quiet", "--resamples", 300, "--confidence", 0.9]
    reports = []
    for run in ("a", "b"):
        r = run_job("--embeddings", emb, *flags, "--bootstrap-seed", 3, "--out", tmp_path / run)
        assert r.returncode == 0, r.stderr
        reports.append(json.loads((tmp_path / run / "curves.json").read_text()))
    a, b = reports
    assert a["bootstrap"] == {"resamples": 300, "confidence": 0.9, "bootstrap_seed": 3}
    assert [c["bands"] for c in a["curves"]] == [c["bands"] for c in b["curves"]]
    assert a["summary"] == b["summary"] and a["reference_intervals"] == b["reference_intervals"]


def test_compatibility_verdict_in_the_report(tmp_path):
    """curves.json and curves.md give BCT's criterion as the main job does: the paired
    M(n,o) - M(o,o) on mAP@k with its interval and its verdict."""
    emb = write_parquet(tmp_path / "emb.parquet", adapted=False)
    out = tmp_path / "out"
    flags = ["--policies", "random", "--modes", "compatible,cold", "--grid-step", 50, "--k", 5]
    r = run_job("--embeddings", emb, *flags, "--no-plots", "--quiet", "--out", out)
    assert r.returncode == 0, r.stderr
    data = json.loads((out / "curves.json").read_text())
    compat = data["compatibility"]
    refs = data["references"]
    assert compat["metric"] == "mAP@5" and compat["criterion"] == "M(new, old) > M(old, old)"
    assert compat["m_new_old"] == refs["new-old"]["mAP@5"]
    assert compat["m_old_old"] == refs["old-old"]["mAP@5"]
    d = compat["difference"]
    assert d["value"] == pytest.approx(compat["m_new_old"] - compat["m_old_old"])
    assert d["low"] <= d["value"] <= d["high"]
    assert (d["queries"], d["resamples"], d["dropped"]) == (8, 1000, 0)
    expect = "held" if d["low"] > 0 else "not held" if d["high"] <= 0 else "inconclusive"
    assert compat["verdict"] == expect and compat["compatible"] == (expect == "held")
    markdown = (out / "curves.md").read_text()
    section = markdown.split("## Compatibility (BCT criterion on mAP@5)")[1].split("##")[0]
    header, row = [ln for ln in section.splitlines() if ln.startswith("| ")]
    assert "M(n,o) - M(o,o) [95 % interval] (paired)" in header
    low, high = 100 * d["low"], 100 * d["high"]
    assert f"{100 * d['value']:.2f} [{low:.2f}, {high:.2f}]" in row
    assert row.rstrip(" |").endswith(compat["verdict"])


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing_column", "missing column(s) ['old']"),
        ("dim_mismatch", "dimension mismatch in column 'new'"),
        ("unknown_policy", "unknown policy 'fastest'; allowed: random, sequential"),
        (
            "unknown_mode",
            "unknown mode 'lukewarm'; allowed: compatible, adapted, fct, rank_merge, naive_merge, "
            "cold",
        ),
        ("empty_gallery", "empty gallery"),
        ("nan", "NaN or inf embeddings in gallery_new for 1 item(s), item ids [1005]"),
        ("no_file", "embeddings not found"),
    ],
)
def test_bad_input_names_the_problem(tmp_path, case, expect):
    path = tmp_path / "emb.parquet"
    args = []
    if case == "missing_column":
        write_parquet(path, drop="old")
    elif case == "dim_mismatch":
        write_parquet(path, bad_new_dim=True)
    elif case == "empty_gallery":
        write_parquet(path, no_gallery=True)
    elif case == "nan":
        write_parquet(path, nan_ids=(1005,))
    elif case == "no_file":
        path = tmp_path / "missing.parquet"
    else:
        write_parquet(path)
        args = (
            ["--policies", "random,fastest"]
            if case == "unknown_policy"
            else ["--modes", "lukewarm"]
        )
    r = run_job("--embeddings", path, "--out", tmp_path / "out", *args)
    assert r.returncode == 2
    assert expect in r.stderr
    assert "Traceback" not in r.stderr
    err_lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1


@pytest.mark.parametrize(
    "args, named",
    [
        (["--polices", "random"], "unrecognized arguments: --polices"),
        (["--grid", "25"], "unrecognized arguments: --grid"),  # no abbreviations
        (["--k", "0"], "option 'k' = 0 must be >= 1"),
        (["--gpus", "two"], "option 'gpus' must be an integer, got 'two'"),
        (["--rank-merge-distance", "l1"], "option 'rank_merge_distance' = 'l1' is not allowed"),
    ],
)
def test_bad_flag_exits_2_before_reading_anything(tmp_path, args, named):
    r = run_job(
        "--embeddings",
        tmp_path / "never_read.parquet",
        "--out",
        tmp_path / "out",
        *args,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert named in r.stderr and "error:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.subprocess
def test_missing_embeddings_is_an_error(tmp_path):
    """As a program: the folder a failed run made is removed when the process exits."""
    r = run_job_program("--out", tmp_path / "out", timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert "error: give --embeddings, or --old-model and --new-model" in r.stderr
    assert not (tmp_path / "out").exists()  # a failed run leaves no empty folder


def test_bundle_modules_fill_the_adapted_and_rank_merge_arrays():
    import types

    import torch

    from raycompat.embeddings.gallery import GalleryEmbeddings
    from raycompat.models import ProjectionMLP
    from raycompat.simulator.memory_engine import simulate_backfill
    from raycompat.upgrade.modes import apply_bundle_modules, available_modes

    torch.manual_seed(0)
    mods = {
        "psi": ProjectionMLP(8, 12, hidden_dim=16, num_blocks=1).eval(),
        "rho": ProjectionMLP(12, 6, hidden_dim=16, num_blocks=1, role="rho").eval(),
        "psi_rev": ProjectionMLP(6, 8, hidden_dim=16, num_blocks=1, role="psi_rev").eval(),
    }
    rng = np.random.default_rng(0)
    data = GalleryEmbeddings(
        gallery_labels=rng.integers(0, 4, 50),
        query_labels=rng.integers(0, 4, 6),
        gallery_old=rng.standard_normal((50, 8)).astype(np.float32),
        gallery_new=rng.standard_normal((50, 12)).astype(np.float32),
        query_old=rng.standard_normal((6, 8)).astype(np.float32),
        query_new=rng.standard_normal((6, 12)).astype(np.float32),
    )
    out = apply_bundle_modules(data, types.SimpleNamespace(modules=mods))
    with torch.no_grad():
        psi = mods["psi"](torch.from_numpy(data.gallery_old)).numpy()
        rho_q = mods["rho"](torch.from_numpy(data.query_new))
        rev = mods["psi_rev"](rho_q).numpy()
    np.testing.assert_allclose(out.gallery_adapted, psi, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.query_rev, rev, rtol=1e-5, atol=1e-6)
    assert set(available_modes(out)) == {
        "compatible",
        "adapted",
        "rank_merge",
        "naive_merge",
        "cold",
    }
    r = simulate_backfill(out, ["random"], ["adapted", "rank_merge"], grid_step=50, k=5)
    assert [c.mode for c in r.curves] == ["adapted", "rank_merge"]
    r2 = simulate_backfill(
        out, ["random"], ["rank_merge"], grid_step=50, k=5, rank_merge_distance="sq_l2_raw"
    )
    assert np.isfinite(r2.curves[0].metrics["mAP"]).all()


def test_reports_go_to_storage_uri(tmp_path):
    """--storage URI: embeddings read from it, the report written under
    <storage>/backfill/<name>."""
    store = tmp_path / "store"
    store.mkdir()
    write_parquet(store / "emb.parquet")
    res = run_job(
        *[
            "--embeddings",
            f"file://{store}/emb.parquet",
            "--storage",
            f"file://{store}",
            "--name",
            "exp1",
            "--policies",
            "random",
            "--modes",
            "compatible",
            "--no-plots",
        ]
    )
    assert res.returncode == 0, res.stderr
    assert f"file://{store}/backfill/exp1/curves.json" in res.stdout
    assert json.loads((store / "backfill" / "exp1" / "curves.json").read_text())["n_items"] == 60


def test_unwritable_storage_fails_before_simulating(tmp_path):
    write_parquet(tmp_path / "emb.parquet")
    res = run_job("--embeddings", str(tmp_path / "emb.parquet"), "--storage", "/proc/raycompat")
    assert res.returncode == 2
    assert "--storage /proc/raycompat is not writable" in res.stderr


def test_dataset_is_positional_and_small_ones_stay_in_memory(tmp_path):
    from raycompat.simulator.job import BackfillJobOptions, _use_ray

    emb = write_parquet(tmp_path / "emb.parquet")
    out = tmp_path / "out"
    r = run_job(emb, "--policies", "random", "--modes", "compatible", "--out", out, "--no-plots")
    assert r.returncode == 0, r.stderr
    assert "in memory (--distributed-above-mb 1024)" in r.stderr
    assert "distributed" not in json.loads((out / "curves.json").read_text())["stats"]
    tiny = BackfillJobOptions(embeddings=str(emb), distributed_above_mb=1e-6)
    assert _use_ray(tiny, lambda msg: None)
    assert not _use_ray(BackfillJobOptions(embeddings=str(emb), engine="memory"), print)
