"""The reproduction report (``jobs/reproduce.py``): the papers' scenarios at a small scale on
the built-in glyphs with every method, paper-shaped tables, and a verdict on each headline
claim of docs/methods.md (Headline claims).

``plan`` (scenarios x methods, scale presets), ``runner`` (training, evaluation, hot
refresh), ``evidence`` (the per-query samples), ``intervals`` (seeds merged, intervals
attached), ``claims`` (one function per claim), ``report`` (markdown tables, plots).
"""

from __future__ import annotations

import os
import sys
import time

from raycompat import console
from raycompat.reproduce.claims import CLAIMS, evaluate_claims, shown_verdict
from raycompat.reproduce.evidence import Evidence
from raycompat.reproduce.plan import (
    SCALES,
    SCENARIOS,
    VARIANTS,
    ReproduceOptions,
    Scale,
    ScaleOptions,
)

#: the per-query samples beside a report (:class:`~raycompat.reproduce.evidence.Evidence`)
SAMPLES_FILE = "samples.npz"
#: what a ``--train-only`` run writes instead of a report: the models that exist and those left
TRAINING_FILE = "training.json"


def run_reproduce(opts: ReproduceOptions) -> dict:
    """Train, evaluate, decide the claims; write ``report.md``, ``report.json`` and PNGs to
    ``opts.output``. Returns the report dict."""
    from raycompat.cluster import connect
    from raycompat.report import machine_description, with_version, write_json
    from raycompat.reproduce.report import plot_backfill_curves, plot_class_scaling, render_markdown
    from raycompat.reproduce.runner import Reproduction, options_dict
    from raycompat.reproduce.spread import seed_spread

    started = time.time()
    output = opts.output.resolve(
        "reproduce",
        default_out="reproduce_out",
        config=opts,
        ignore=("parallel", "train_budget_minutes", "train_only", "seed_spread_from"),
    )
    out = output.local
    load_before = os.getloadavg()[0]

    def log(message: str) -> None:
        # one write per line: two training threads log at once
        sys.stdout.write(f"[reproduce {time.time() - started:7.1f}s] {message}\n")
        sys.stdout.flush()

    log(f"scale {opts.scale}; scenarios {', '.join(opts.scenarios)}")
    for scenario in opts.scenarios:
        log(f"  {scenario}: {', '.join(v.label for v in opts.method_plan(scenario))}")
    # an embedded cluster gets a logical CPU per concurrent training worker
    console.quiet_ray(opts.verbose)
    connect(
        opts.address,
        num_cpus=None
        if opts.address
        else max(os.cpu_count() or 1, opts.parallel * max(1, opts.training.workers)),
    )
    reproduction = Reproduction(opts, out, output.runs, log)
    results = reproduction.run()
    if opts.train_only:
        return _write_training_summary(opts, output, results, load_before, started, log)
    # the per-query samples behind every number: the claims can be decided again from disk
    reproduction.evidence.save(os.path.join(out, SAMPLES_FILE))
    claims = evaluate_claims(results, reproduction.evidence)
    plots_dir = os.path.join(out, "plots")
    pngs = plot_backfill_curves(results, plots_dir)
    pngs += plot_class_scaling(results.get("class_scaling"), plots_dir)
    plots = [os.path.relpath(p, out) for p in pngs]
    timings = dict(results.pop("timings"))
    timings["total_s"] = time.time() - started
    report = dict(
        job="reproduce",
        options=options_dict(opts),
        machine=machine_description(load_before),
        skipped={s: opts.skipped(s) for s in opts.scenarios},
        claims=claims,
        seed_spread=seed_spread(claims, results["seeds"], opts.seed_spread_from),
        results=results,
        plots=plots,
        timings=timings,
    )
    write_json(os.path.join(out, "report.json"), with_version(report))
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(report))
    where = output.publish()
    log(
        f"done in {timings['total_s']:.0f} s; report: "
        f"{os.path.join(out, 'report.md') if where == out else where + '/report.md'}"
    )
    for c in claims:
        shown = f" ({shown_verdict(c)})" if c.get("premise") else ""
        print(f"  [{c['verdict']:>12s}] {c['paper']}: {c['claim']}{shown}", flush=True)
    return report


def _write_training_summary(opts, output, results, load_before, started, log) -> dict:
    """``--train-only``: write ``training.json`` (the models that exist, those left and why)
    and leave any report of an earlier run in place."""
    from raycompat.report import machine_description, with_version, write_json
    from raycompat.reproduce.runner import options_dict

    timings = dict(results.pop("timings"))
    timings["total_s"] = time.time() - started
    # a model two scenarios share (architecture's old model is extended-data's) counts once
    reused = {m["key"]: m["reused"] for m in results["models"].values()}
    summary = dict(
        job="reproduce",
        train_only=True,
        options=options_dict(opts),
        machine=machine_description(load_before),
        trained=sum(not r for r in reused.values()),
        reused=sum(reused.values()),
        left=len({m["key"] for m in results["not_trained"]}),
        results=results,
        timings=timings,
    )
    write_json(os.path.join(output.local, TRAINING_FILE), with_version(summary))
    output.publish()
    log(
        f"done in {timings['total_s']:.0f} s (--train-only): {summary['trained']} models "
        f"trained, {summary['reused']} reused, {summary['left']} left; "
        f"{os.path.join(output.local, TRAINING_FILE)}"
    )
    return summary


__all__ = [
    "CLAIMS",
    "SAMPLES_FILE",
    "TRAINING_FILE",
    "Evidence",
    "SCALES",
    "SCENARIOS",
    "VARIANTS",
    "ReproduceOptions",
    "Scale",
    "ScaleOptions",
    "evaluate_claims",
    "run_reproduce",
]
