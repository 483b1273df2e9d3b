"""The main job: old model -> BCT and independent new models -> cross evaluation -> report.

Everything runs on the Ray cluster ``connect`` finds (an embedded local one by default).
The backfill simulation is not part of this job yet (see README, Status).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass

from raycompat.config import ConfigError


@dataclass
class QuickstartOptions:
    out: str = "quickstart_out"
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
    from raycompat.train import TrainConfig, fit

    cfg = TrainConfig.from_dict(dict(
        method=method, backbone=opts.backbone, embed_dim=opts.embed_dim, head=opts.head,
        epochs=epochs, batch_size=opts.batch_size, lr=opts.lr, seed=opts.seed,
        scenario=scenario.to_dict(), split=split, resolution=opts.resolution,
        data_seed=opts.data_seed, num_workers=opts.workers, use_gpu=opts.gpus > 0,
        gpus_per_worker=opts.gpus if opts.gpus > 0 else 1.0, storage_path=runs_dir,
        run_name=f"{name}-{_config_tag(opts, scenario)}", old_model=old_model, log_every=50))
    started = time.time()
    run = fit(cfg, export_to=os.path.join(models_dir, name))
    return run, time.time() - started


def _config_tag(opts: QuickstartOptions, scenario) -> str:
    """Identical options -> identical run names, so a re-run resumes instead of retraining."""
    import hashlib

    blob = json.dumps([dataclasses.asdict(opts), scenario.to_dict()], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def run_quickstart(opts: QuickstartOptions) -> dict:
    from raycompat.cluster import connect
    from raycompat.data import build_scenario, default_catalog
    from raycompat.evaluation import cross_evaluate, embed_scenario, scenario_eval_items
    from raycompat.models import ModelBundle
    from raycompat.report import write_json

    started = time.time()
    out = os.path.abspath(opts.out)
    os.makedirs(out, exist_ok=True)
    runs_dir, models_dir = os.path.join(out, "runs"), os.path.join(out, "models")
    timings: dict[str, float] = {}

    def phase(message: str) -> None:
        print(f"[quickstart {time.time() - started:6.1f}s] {message}", flush=True)

    phase("starting Ray")
    connect(opts.address)
    t = time.time()
    catalog = default_catalog()
    scenario = build_scenario(
        opts.scenario, catalog=catalog, num_train_classes=opts.train_classes,
        images_per_class=opts.images_per_class, num_eval_classes=opts.eval_classes,
        queries_per_class=opts.queries_per_class, gallery_per_class=opts.gallery_per_class,
        num_distractor_classes=opts.distractor_classes,
        distractors_per_class=opts.distractors_per_class, seed=opts.data_seed)
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

    phase("embedding query and gallery with every model, evaluating")
    t = time.time()
    (q_labels, _), (g_labels, _) = scenario_eval_items(scenario)
    embedded = {name: embed_scenario(name, ModelBundle.load(path), scenario, opts.resolution,
                                     opts.data_seed) for name, path in models.items()}
    evaluations, verdicts = cross_evaluate(
        embedded["old"], [embedded["bct"], embedded["independent"]], q_labels, g_labels,
        paragon="independent")
    timings["evaluate_s"] = time.time() - t
    timings["total_s"] = time.time() - started

    report = dict(
        job="quickstart", options=dataclasses.asdict(opts),
        scenario=dict(name=scenario.name, seed=scenario.seed,
                      allocation=scenario.allocation_rows()),
        catalog=dict(num_classes=catalog.num_classes, exclusions={
            k: (len(v) if isinstance(v, (list, dict)) else v) for k, v in catalog.exclusions.items()}),
        models=train_info, evaluations=evaluations, verdicts=verdicts,
        compatibility={v["model"]: v["compatible"] for v in verdicts}, timings=timings)
    write_json(os.path.join(out, "report.json"), report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(report, scenario.allocation_table()))
    phase(f"done in {timings['total_s']:.0f} s; report: {os.path.join(out, 'report.md')}")
    for v in verdicts:
        print(f"  {v['model']:12s} M(n,o)={v['m_new_old']:.4f} vs M(o,o)={v['m_old_old']:.4f} "
              f"-> {'compatible' if v['compatible'] else 'NOT compatible'}; "
              f"update gain {v['update_gain']:.3f}", flush=True)
    return report


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
             "## Timings", "",
             markdown_table(["phase", "seconds"], [(k, v) for k, v in report["timings"].items()], digits=1),
             ""]
    lines.append(f"Verdicts: " + "; ".join(
        f"{v['model']} is {'compatible' if v['compatible'] else 'not compatible'} "
        f"(M(n,o)={fmt(v['m_new_old'])} vs M(o,o)={fmt(v['m_old_old'])})" for v in report["verdicts"]))
    return "\n".join(lines) + "\n"
