"""The main job: old model -> BCT and independent new models -> cross evaluation -> report.

Everything runs on the Ray cluster ``connect`` finds (an embedded local one by default).
Queries and gallery are embedded by the Ray Data pipeline (:mod:`raycompat.pipeline`), the
path that scales to a billion items.
The job ends with the hot-refresh backfill simulation of its models
(:func:`simulate_hot_refresh`): exact curves for every policy and query mode the BCT model
allows, with the independent model (new*) as the AUC-gain paragon and as the
incompatible counter-example.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from raycompat.config import ConfigError


@dataclass
class QuickstartOptions:
    out: str | None = None       # default quickstart_out, or <storage>/quickstart/<name>
    storage: str | None = None   # shared storage for checkpoints and reports (raycompat.outputs)
    name: str = "main"
    address: str | None = None
    scenario: str = "extended-class"
    train_classes: int = 240
    images_per_class: int = 40
    eval_classes: int = 150
    queries_per_class: int = 2
    gallery_per_class: int = 8
    distractor_classes: int = 150
    distractors_per_class: int = 4
    data_seed: int = 0
    resolution: int = 32
    backbone: str = "lcnet_050"
    embed_dim: int = 128
    head: str = "cosface"
    old_epochs: int = 24
    new_epochs: int = 14
    batch_size: int = 128
    lr: float = 0.1
    workers: int = 1
    gpus: float = 0.0
    seed: int = 0

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            kind = {"int": int, "float": float}.get(str(field.type), str)
            parser.add_argument(flag, type=kind, default=field.default,
                                help=f"default: {field.default}")

    @classmethod
    def from_args(cls, args) -> "QuickstartOptions":
        opts = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
        for name in ("train_classes", "images_per_class", "eval_classes", "old_epochs",
                     "new_epochs", "batch_size", "workers", "resolution", "embed_dim"):
            if getattr(opts, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(opts, name)}")
        return opts


def _train(opts: QuickstartOptions, scenario, name: str, method: str, split: str, epochs: int,
           old_model: str | None, runs_dir: str, models_dir: str):
    from raycompat.train.runs import train_named

    values = dict(
        method=method, backbone=opts.backbone, embed_dim=opts.embed_dim, head=opts.head,
        epochs=epochs, batch_size=opts.batch_size, lr=opts.lr, seed=opts.seed,
        scenario=scenario.to_dict(), split=split, resolution=opts.resolution,
        data_seed=opts.data_seed, num_workers=opts.workers, use_gpu=opts.gpus > 0,
        gpus_per_worker=opts.gpus if opts.gpus > 0 else 1.0, old_model=old_model, log_every=50)
    return train_named(values, name, _config_tag(opts, scenario), runs_dir, models_dir)


#: options that say where things go, not what is trained
LOCATION_OPTIONS = ("out", "storage", "name", "address")


def _config_tag(opts: QuickstartOptions, scenario) -> str:
    """Identical training options -> identical run names, so a re-run resumes instead of
    retraining (wherever its report goes)."""
    from raycompat.train.runs import config_tag

    trained = {k: v for k, v in dataclasses.asdict(opts).items() if k not in LOCATION_OPTIONS}
    return config_tag(trained, scenario.to_dict())


def run_quickstart(opts: QuickstartOptions) -> dict:
    from raycompat.cluster import connect
    from raycompat.data import default_catalog, scenario_from_options
    from raycompat.evaluation import cross_evaluate, scenario_eval_items
    from raycompat.models import ModelBundle
    from raycompat.report import write_json

    from raycompat.outputs import resolve_job_output

    started = time.time()
    output = resolve_job_output("quickstart", out=opts.out, storage=opts.storage, name=opts.name,
                                default_out="quickstart_out")
    out = output.local
    runs_dir, models_dir = output.runs, os.path.join(out, "models")
    timings: dict[str, float] = {}

    def phase(message: str) -> None:
        print(f"[quickstart {time.time() - started:6.1f}s] {message}", flush=True)

    phase("starting Ray")
    connect(opts.address)
    t = time.time()
    catalog = default_catalog()
    scenario = scenario_from_options(opts.scenario, opts, seed=opts.data_seed, catalog=catalog)
    timings["data_s"] = time.time() - t
    write_json(os.path.join(out, "scenario.json"), scenario.to_dict())
    phase(f"glyph catalog: {catalog.num_classes} classes; scenario {scenario.name}:")
    print(scenario.allocation_table(), flush=True)

    models, train_info = {}, {}
    plan = [("old", "independent", "old_train", opts.old_epochs, None),
            ("bct", "bct", "new_train", opts.new_epochs, "old"),
            ("independent", "independent", "new_train", opts.new_epochs, None)]
    for name, method, split, epochs, predecessor in plan:
        phase(f"training {name} ({method} on {split}, {epochs} epochs, {opts.workers} worker(s))")
        run, wall = _train(opts, scenario, name, method, split, epochs,
                           models.get(predecessor), runs_dir, models_dir)
        models[name] = run.bundle_path
        timings[f"train_{name}_s"] = wall
        train_info[name] = dict(method=method, split=split, epochs=epochs, path=run.bundle_path,
                                run_path=run.run_path, wall_s=wall, history=run.history)

    phase("embedding queries and gallery with every model (Ray Data pipeline)")
    t = time.time()
    embedded, embedding_paths = embed_with_pipeline(
        scenario, models, os.path.join(out, "embeddings", _config_tag(opts, scenario)),
        resolution=opts.resolution, data_seed=opts.data_seed)
    timings["embed_s"] = time.time() - t
    phase("evaluating every query model against every gallery model")
    t = time.time()
    (q_labels, _), (g_labels, _) = scenario_eval_items(scenario)
    evaluations, verdicts = cross_evaluate(
        embedded["old"], [embedded["bct"], embedded["independent"]], q_labels, g_labels,
        paragon="independent")
    timings["evaluate_s"] = time.time() - t

    phase("hot-refresh backfill simulation (every policy and query mode)")
    t = time.time()
    paragon = {row["metric"]: row["value"] for row in evaluations
               if row["model"] == row["query"] == row["gallery"] == "independent"}
    backfill = simulate_hot_refresh(embedded, q_labels, g_labels, ModelBundle.load(models["bct"]),
                                    os.path.join(out, "backfill"), paragon, seed=opts.seed, log=phase)
    timings["backfill_s"] = time.time() - t
    timings["total_s"] = time.time() - started

    report = dict(
        job="quickstart", options=dataclasses.asdict(opts),
        scenario=dict(name=scenario.name, seed=scenario.seed,
                      allocation=scenario.allocation_rows()),
        catalog=dict(num_classes=catalog.num_classes, exclusions={
            k: (len(v) if isinstance(v, (list, dict)) else v) for k, v in catalog.exclusions.items()}),
        models=train_info, embeddings=embedding_paths, evaluations=evaluations, verdicts=verdicts,
        compatibility={v["model"]: v["compatible"] for v in verdicts},
        curves=backfill["rows"], backfill=backfill["summary"],
        backfill_plots={model: [os.path.relpath(p, out) for p in r["plots"]]
                        for model, r in backfill["reports"].items()}, timings=timings)
    write_json(os.path.join(out, "report.json"), report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(report, scenario.allocation_table()))
    where = output.publish()
    phase(f"done in {timings['total_s']:.0f} s; report: "
          f"{os.path.join(out, 'report.md') if where == out else where + '/report.md'}")
    for v in verdicts:
        print(f"  {v['model']:12s} M(n,o)={v['m_new_old']:.4f} vs M(o,o)={v['m_old_old']:.4f} "
              f"-> {'compatible' if v['compatible'] else 'NOT compatible'}; "
              f"update gain {v['update_gain']:.3f}", flush=True)
    return report


def embed_with_pipeline(scenario, models: dict, out_dir: str, resolution: int, data_seed: int):
    """Queries, gallery and distractors of ``scenario`` through the Ray Data pipeline
    (:func:`raycompat.pipeline.embed_gallery`): ``old`` + ``bct`` in one pass (parquet with
    ``old`` and ``new`` columns, what ``jobs/simulate_backfill.py`` reads), ``independent`` in a
    second (``new`` only). Returns ``({name: EmbeddedSet}, {pass: parquet folder})``; a re-run
    with the same models reuses complete shards."""
    import pyarrow.compute as pc

    from raycompat.evaluation import EmbeddedSet
    from raycompat.pipeline import GlyphGallerySource, embed_gallery

    source = GlyphGallerySource(scenario, resolution=resolution, data_seed=data_seed)
    passes = {"old_bct": dict(old_model=models["old"], new_model=models["bct"], columns=("old", "new")),
              "independent": dict(new_model=models["independent"], columns=("new",))}
    embedded, paths = {}, {}
    for pass_name, kwargs in passes.items():
        run = embed_gallery(os.path.join(out_dir, pass_name), source, log=lambda m: None, **kwargs)
        paths[pass_name] = run.path
        table = run.table()                     # sorted by item_id: queries, gallery, distractors
        is_query = pc.equal(table.column("split"), "query").to_numpy(zero_copy_only=False)
        for column, name in (("old", "old"), ("new", "bct" if pass_name == "old_bct" else "independent")):
            if column not in table.column_names:
                continue
            values = table.column(column).combine_chunks()
            vectors = values.flatten().to_numpy().astype(np.float32).reshape(len(values), -1)
            with open(os.path.join(models[name], "manifest.json")) as f:
                compatible = int(json.load(f).get("compatible_dim", vectors.shape[1]))
            embedded[name] = EmbeddedSet(name=name, query=vectors[is_query], gallery=vectors[~is_query],
                                         compatible_dim=compatible)
    return embedded, paths


HOT_REFRESH_POLICIES = ("random", "sequential", "uncertainty:least_confidence", "uncertainty:margin",
                        "uncertainty:entropy", "oracle", "learned")
HOT_REFRESH_MODES = ("compatible", "naive_merge", "cold")


def simulate_hot_refresh(embedded: dict, query_labels, gallery_labels, bct_bundle, out_dir: str,
                         paragon: dict, seed: int = 0, log=None) -> dict:
    """Backfill curves of the main job's upgrade (METHODS.md: policies, query modes, metrics).

    * ``bct``: every policy x ``compatible`` / ``naive_merge`` / ``cold``; uncertainty from
      the BCT classifier on old gallery features (RACT Eq.9-11).
    * ``independent``: ``random`` x ``compatible`` / ``cold``: what a hot refresh does with
      a model trained without compatibility.

    Gallery items are stored in a seeded random order (their ``item_id`` is the index in the
    scenario's gallery), the order ``sequential`` follows.

    ``paragon``: ``{metric: value}`` of new*-new* (the independent model), for AUC gains
    (RM Table 1). The time axis uses the BCT embedder's measured items/s on this machine.
    Writes ``<out_dir>/<model>/curves.{json,md}`` and PNGs; returns ``{"rows", "summary",
    "reports"}`` where rows are ``{model, policy, mode, fraction, metric, value, ...}``.
    """
    from raycompat.backfill import CostModel, GalleryEmbeddings, UncertaintyHead, measure_items_per_s
    from raycompat.backfill import simulate_backfill
    from raycompat.backfill.report import write_reports

    say = log or (lambda message: None)
    old = embedded["old"]
    cost = CostModel(measure_items_per_s(bct_bundle, batch_size=128), 1,
                     source="measured: BCT embedder on this machine's CPU")
    head = UncertaintyHead.from_classifier_head(bct_bundle.head)
    runs = [("independent", ("random",), ("compatible", "cold"), None),
            ("bct", HOT_REFRESH_POLICIES, HOT_REFRESH_MODES, head)]
    # The scenario lists the gallery class by class with the distractors last; a real gallery
    # is stored in ingestion order, so `sequential` walks a seeded shuffle of the items.
    stored = np.random.default_rng([seed, 1]).permutation(len(gallery_labels))  # not the random policy's stream
    rows, summary, reports = [], [], {}
    for name, policies, modes, uncertainty_head in runs:
        new = embedded[name]
        data = GalleryEmbeddings(
            gallery_labels=np.asarray(gallery_labels)[stored], gallery_old=old.gallery[stored],
            gallery_new=new.gallery[stored], gallery_ids=stored, query_labels=query_labels,
            query_old=old.query, query_new=new.query, compatible_dim=new.compatible_dim,
            source=f"quickstart: old -> {name}")
        result = simulate_backfill(data, policies, modes, seed=seed, head=uncertainty_head,
                                   cost=cost, references={"new*-new*": paragon})
        reports[name] = write_reports(result, os.path.join(out_dir, name),
                                      title=f"Hot refresh: old -> {name}")
        rows += [dict(model=name, **r) for r in result.rows()]
        summary += [dict(model=name, **r) for r in result.summary_rows()]
        say(f"  {name}: {len(result.curves)} curves in {result.stats['seconds']:.1f} s -> "
            f"{reports[name]['markdown']}")
    return dict(rows=rows, summary=summary, reports=reports)


def render_markdown(report: dict, allocation: str) -> str:
    from raycompat.report import fmt, markdown_table

    metrics = ["mAP@100", "mAP", "top1", "top5"]
    by_pair: dict[tuple, dict] = {}
    for row in report["evaluations"]:
        by_pair.setdefault((row["model"], row["query"], row["gallery"]), {})[row["metric"]] = row["value"]
    lines = ["# raycompat quickstart report", "",
             f"Scenario `{report['scenario']['name']}` (seed {report['scenario']['seed']}), "
             f"built-in glyphs, {report['catalog']['num_classes']} usable classes.", "",
             "## Data allocation", "", allocation, "",
             "## Training", "",
             markdown_table(["model", "method", "split", "epochs", "final loss", "images/s", "wall s"], [
                 (name, m["method"], m["split"], m["epochs"], m["history"][-1].get("loss/loss"),
                  m["history"][-1].get("images_per_s"), m["wall_s"]) for name, m in report["models"].items()],
                 digits=3), "",
             "## Retrieval (query embedder -> gallery embedder)", "",
             markdown_table(["model", "query", "gallery"] + metrics,
                            [k + tuple(v.get(m) for m in metrics) for k, v in by_pair.items()]), "",
             "## Compatibility (BCT criterion on mAP@100, new* = independent)", "",
             markdown_table(["model", "M(o,o)", "M(n,o)", "M(n,n)", "update gain", "Delta_up",
                             "Delta_down", "compatible"],
                            [(v["model"], v["m_old_old"], v["m_new_old"], v["m_new_new"], v["update_gain"],
                              v["delta_up"], v["delta_down"], v["compatible"]) for v in report["verdicts"]]),
             "",
             "## Hot refresh (backfill simulation)", "",
             "The gallery is backfilled item by item with the new model while the new model "
             "already answers queries. Values at 0 %, 50 % and 100 % backfilled, the area under "
             "the curve over the fraction backfilled, the AUC gain against the independent model "
             "(new*, RM Table 1), and regressions (RACT Eq.3: grid points worse than t=0, and steps "
             "between grid points that make the metric worse; for NFR@1 worse means higher). "
             "Full curves: `backfill/<model>/curves.md`, plots below.", "",
             _backfill_table(report), "",
             *[f"![{os.path.splitext(os.path.basename(p))[0]} ({model})]({p})\n"
               for model, plots in report["backfill_plots"].items() for p in plots
               if p.endswith("_vs_fraction.png") and os.path.basename(p) != "mAP_vs_fraction.png"],
             "## Timings", "",
             markdown_table(["phase", "seconds"], [(k, v) for k, v in report["timings"].items()], digits=1),
             ""]
    lines.append("Verdicts: " + "; ".join(
        f"{v['model']} is {'compatible' if v['compatible'] else 'not compatible'} "
        f"(M(n,o)={fmt(v['m_new_old'])} vs M(o,o)={fmt(v['m_old_old'])})" for v in report["verdicts"]))
    return "\n".join(lines) + "\n"


def _backfill_table(report: dict) -> str:
    from raycompat.report import markdown_table

    def value_at(model, policy, mode, metric, fraction):
        for r in report["curves"]:
            if (r["model"], r["policy"], r["mode"], r["metric"]) == (model, policy, mode, metric) \
                    and abs(r["fraction"] - fraction) < 1e-9:
                return r["value"]
        return None

    def regression(s):
        reg = s.get("regression")
        if not reg or not reg.get("has_regression"):
            return "none"
        return (f"{len(reg['points_below_start'])} points worse than t=0, "
                f"{len(reg['drops'])} worsening steps")

    rows = []
    for s in report["backfill"]:
        if s["metric"] not in ("mAP@100", "NFR@1"):
            continue
        if s["mode"] == "cold" and s["policy"] != "random":
            continue  # the cold curve does not depend on the policy
        rows.append((s["model"], "-" if s["mode"] == "cold" else s["policy"], s["mode"], s["metric"],
                     *(value_at(s["model"], s["policy"], s["mode"], s["metric"], f) for f in (0, .5, 1)),
                     s.get("auc"), s.get("auc_gain"), regression(s)))
    return markdown_table(["model", "policy", "mode", "metric", "t=0", "t=50%", "t=100%", "AUC",
                           "AUC gain", "regression"], rows)
