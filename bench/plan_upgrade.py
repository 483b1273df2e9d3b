"""The upgrade planner: its own speed, and its embedding-time prediction against a real run.

1. ``raycompat plan-upgrade`` over 20 candidates (4 synthetic models x 5 policies, 21-point
   curves, plus a cold refresh per model and staying on the old model): wall time of the whole
   job (plan.md, plan.json, PNGs) and of the plan alone; ``--results DIR`` also times it on a
   real report folder (a main job's or simulate-backfill's).
2. The prediction: ``embed-gallery`` (the real job, its own embedded Ray, random-init lcnet_050
   bundles, column ``new``) on ``--measure-items`` glyph items; the planner's rate from that
   run's ``_summary.json`` (:func:`raycompat.planning.rates.rate_from_summary`) predicts the
   wall time of ``--predict-items``; then the real run of that size. Prints predicted, measured
   (the run's own wall time, ``_summary.json`` ``seconds``) and their ratio (goal: within 25 %),
   and each process's wall time, Ray's start included.

    python bench/plan_upgrade.py [--measure-items 2000 --predict-items 20000] [--no-embed]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("random", "sequential", "uncertainty:margin", "uncertainty:entropy", "learned")


def synthetic_curves(folder: str, seed: int, n_items: int = 10_000) -> str:
    """A curves.json of one model: 5 policies in the compatible mode and the cold curve, 21
    points, bands of +-0.03, seeded."""
    rng = np.random.default_rng(seed)
    f = np.linspace(0.0, 1.0, 21)
    old, new = 0.30, 0.30 + 0.2 * rng.random()

    def entry(policy, mode, quality):
        return {
            "policy": policy,
            "mode": mode,
            "fractions": f.tolist(),
            "items_backfilled": np.floor(f * n_items + 0.5).astype(int).tolist(),
            "seconds": None,
            "metrics": {"mAP@100": quality.tolist(), "NFR@1": (0.1 * f).tolist()},
            "bands": {
                "mAP@100": {"low": (quality - 0.03).tolist(), "high": (quality + 0.03).tolist()}
            },
        }

    curves = [
        entry(p, "compatible", old + (new - old) * f ** (0.5 + rng.random())) for p in POLICIES
    ]
    curves.append(entry("any", "cold", np.where(f < 1, old, new)))
    payload = {
        "k": 100,
        "fractions": f.tolist(),
        "n_items": n_items,
        "n_queries": 300,
        "metrics": ["mAP@100", "mAP", "top1", "NFR@1"],
        "references": {"old-old": {"mAP@100": old}, "new-new": {"mAP@100": new, "NFR@1": 0.1}},
        "reference_intervals": {
            "old-old": {"mAP@100": {"low": old - 0.03, "high": old + 0.03}},
            "new-new": {"mAP@100": {"low": new - 0.03, "high": new + 0.03}},
        },
        "cost_model": None,
        "curves": curves,
    }
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "curves.json"), "w") as fh:
        json.dump(payload, fh)
    return folder


def time_planner(results: list[str], out: str, extra=()) -> tuple[float, float]:
    """``(seconds of the whole job, seconds of the plan alone)`` on ``results``."""
    from raycompat.planning.inputs import load_results
    from raycompat.planning.job import main
    from raycompat.planning.plan import make_plan
    from raycompat.planning.rates import EmbeddingRate
    from raycompat.planning.recommend import Constraints
    from raycompat.planning.timeline import Hardware

    flags = ["--items", "200000000", "--devices", "8", "--items-per-s", "2000"]
    flags += ["--price-per-device-hour", "2.5", "--overwrite", *extra]
    started = time.perf_counter()
    assert main(["--results", ",".join(results), "--out", out, "--quiet", *flags]) == 0
    job_s = time.perf_counter() - started
    started = time.perf_counter()
    sims = load_results(results)
    hw = Hardware(items=200_000_000, devices=8, device_kind="gpu", price=2.5)
    plan = make_plan(sims, hw, Constraints(), rate=EmbeddingRate(2000.0))
    plan_s = time.perf_counter() - started
    print(f"  {len(plan.assessed)} options; job {job_s:.2f} s, plan alone {plan_s:.3f} s")
    return job_s, plan_s


def embed(out: str, items: int, models: str, chunk: int) -> tuple[dict, float]:
    """The real embed-gallery job; returns its summary and the process's wall time."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "jobs", "embed_gallery.py"),
        "--random-init",
        models,
        "--columns",
        "new",
        "--items",
        str(items),
        "--chunk-size",
        str(chunk),
        "--out",
        out,
        "--overwrite",
    ]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    with open(os.path.join(out, "_summary.json")) as fh:
        return json.load(fh), wall


def predict_embedding(work: str, measure: int, predict: int, chunk: int) -> dict:
    from raycompat.planning.rates import rate_from_summary

    models = os.path.join(work, "models")
    small, small_wall = embed(os.path.join(work, "small"), measure, models, chunk)
    rate = rate_from_summary(os.path.join(work, "small"))
    predicted = rate.seconds(predict, 1)
    big, big_wall = embed(os.path.join(work, "big"), predict, models, chunk)
    ratio = predicted / big["seconds"]
    print(f"  rate from {measure:,} items: {rate.source}")
    print(
        f"  {predict:,} items: predicted {predicted:.1f} s, measured {big['seconds']:.1f} s, "
        f"predicted / measured {ratio:.3f} ({'within' if abs(ratio - 1) <= 0.25 else 'outside'} "
        "25 %)"
    )
    print(
        f"  process wall time (Ray start included): {measure:,} items {small_wall:.1f} s, "
        f"{predict:,} items {big_wall:.1f} s"
    )
    return dict(
        measured_items=measure,
        measured_seconds=small["seconds"],
        rate_items_per_s=rate.items_per_s,
        startup_s=rate.startup_s,
        predicted_items=predict,
        predicted_s=predicted,
        measured_s=big["seconds"],
        ratio=ratio,
        process_wall_s=[small_wall, big_wall],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=None, help="also time the planner on this report folder")
    p.add_argument("--measure-items", type=int, default=2000)
    p.add_argument("--predict-items", type=int, default=20000)
    p.add_argument("--chunk-size", type=int, default=250, help="embed-gallery shard size")
    p.add_argument("--no-embed", action="store_true", help="skip the embedding prediction")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="plan_upgrade_bench_")
    figures = {}
    print("planner over 20 candidates (4 models x 5 policies, 21 points):")
    sims = [synthetic_curves(os.path.join(work, f"model{i}"), i) for i in range(4)]
    figures["synthetic_job_s"], figures["synthetic_plan_s"] = time_planner(
        sims, os.path.join(work, "plan_synthetic")
    )
    if args.results:
        print(f"planner on {args.results}:")
        figures["results_job_s"], figures["results_plan_s"] = time_planner(
            [args.results], os.path.join(work, "plan_results")
        )
    if not args.no_embed:
        print("embedding time predicted by the planner vs a real embed-gallery run:")
        figures["embedding"] = predict_embedding(
            work, args.measure_items, args.predict_items, args.chunk_size
        )
    if args.json:
        from raycompat.report import write_json

        write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
