"""Main job: old, BCT and independent models on built-in glyphs; evaluation, backfill curves.

Writes report.md and report.json (``--out``, or ``<storage>/quickstart/<name>``).

Old model -> BCT and independent new models -> cross evaluation -> backfill curves -> report.
Everything runs on the Ray cluster ``connect`` finds (an embedded local one by default).
Queries and gallery are embedded by the Ray Data pipeline (:mod:`raycompat.pipeline`), the
path that scales to a billion items.
The job ends with the backfill simulation of its models (:func:`simulate_backfill_curves`): the
curves of a hot refresh (the new model served at once while the gallery is backfilled;
docs/methods.md, "Hot refresh"), exact for every policy and query mode the BCT model
allows, with the independent model (new*) as the AUC-gain paragon and as the
incompatible counter-example. The console gets one summary line per phase
(:func:`raycompat.console.phase`); see docs/architecture.md, "Jobs".

Every retrieval number of the report carries its bootstrap interval over the query classes
(``--resamples``, ``--confidence``, ``--bootstrap-seed``; docs/methods.md, "Uncertainty"), every
backfill curve its band, and the BCT verdict is the paired interval's: held, not held or
inconclusive.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from raycompat import console
from raycompat.config import (
    add_options,
    choices,
    make_parser,
    nonnegative,
    option,
    options_from_args,
    positive,
)
from raycompat.data.scenarios import ScenarioSizes
from raycompat.data.source import DataSourceOptions
from raycompat.metrics.bootstrap import BootstrapOptions
from raycompat.outputs import NEUTRAL_OPTIONS, OutputOptions
from raycompat.pipeline.options import MODEL_STAGES
from raycompat.quickstart_report import difference_text, render_markdown

__all__ = ["QuickstartOptions", "QUICKSTART_SIZES", "build_parser", "main", "run_quickstart"]

#: the main job's data: 480 training classes of 20 images, the old model trained on 7 % of them
#: (33 classes, so that the new model has much to gain), 150 held-out classes with 4 queries each,
#: test_resnet; chosen so that the verdicts hold across seeds and thread counts (README)
QUICKSTART_SIZES = dataclasses.replace(
    ScenarioSizes(),
    scenario="extended-class",
    train_classes=480,
    images_per_class=20,
    old_fraction=0.07,
    eval_classes=150,
    queries_per_class=4,
    gallery_per_class=8,
    distractor_classes=150,
    distractors_per_class=4,
    resolution=32,
    backbone="test_resnet",
    data_seed=0,
)


@dataclass(frozen=True)
class QuickstartOptions:
    """Options of the main job."""

    output: OutputOptions = option(OutputOptions(name="main"), help="where the report goes")
    address: str | None = option(None, help="Ray address; none: an embedded local Ray")
    data: DataSourceOptions = option(
        DataSourceOptions(), help="data: the built-in glyphs or your images"
    )
    sizes: ScenarioSizes = option(
        QUICKSTART_SIZES,
        help="data: the scenario (your images: only --scenario, --queries-per-class, "
        "--resolution, --backbone and --data-seed apply)",
    )
    embed_dim: int = positive(128, help="embedding dimension")
    head: str = choices("softmax", "cosface", "arcface", default="cosface", help="classifier head")
    old_epochs: int = positive(24, help="epochs of the old model")
    new_epochs: int = positive(14, help="epochs of each new model")
    bct_lambda: float = positive(
        2.0, help="weight lambda of BCT's influence loss (BCT Eq. 8, docs/methods.md)"
    )
    batch_size: int = positive(128, help="global batch size")
    lr: float = positive(0.1, help="peak learning rate")
    workers: int = nonnegative(
        1,
        help="DDP workers per training run (Ray Train; 0: Ray Train's local mode, the loop "
        "in this process, one run at a time)",
    )
    parallel: int = positive(
        1,
        help="Ray Train runs at a time (a BCT model starts once its old model is trained); "
        "the numbers do not depend on it",
    )
    gpus: float = nonnegative(0.0, help="GPUs per worker (0: CPU)")
    seed: int = nonnegative(0, help="seed of the models and of the backfill simulation")
    seeds: int = positive(
        2,
        help="train every model this many times, with seeds --seed, --seed+1, ...; every "
        "interval resamples the seeds as well as the query classes, so the verdicts count the "
        "training variation (the backfill curves use the first seed's models)",
    )
    threads: int = nonnegative(
        0,
        help="torch threads per training worker (0: this machine's cores / workers); the "
        "float rounding, and so the last digits of every number, depend on it",
    )
    model_stages: str = choices(
        *MODEL_STAGES,
        default="actors",
        help="the Ray Data pipeline's models as actor pools or Ray tasks (docs/simulator.md, "
        "'Actors or tasks'); the numbers do not depend on it",
    )
    bootstrap: BootstrapOptions = option(
        BootstrapOptions(), help="bootstrap intervals over the query classes"
    )
    verbose: bool = option(False, help="keep Ray's own INFO lines and print every table")


#: options that say where things go, how things run (runs at a time, the pipeline's model
#: stages) or what is printed, not what is trained: the report folders' neutral options and the
#: pipeline's model stages
LOCATION_OPTIONS = NEUTRAL_OPTIONS + ("model_stages",)
#: the training seeds: in each run's name instead of its tag, so ``--seeds 3`` reuses the runs
#: of ``--seeds 2``
SEED_OPTIONS = ("seed", "seeds")
#: options of the report's intervals, not of what is trained or embedded
INTERVAL_OPTIONS = tuple(f.name for f in dataclasses.fields(BootstrapOptions))


def options_record(opts: QuickstartOptions) -> dict:
    """Every option as one flat ``{name: value}`` (the report's ``options``)."""
    flat = {}
    for key, value in dataclasses.asdict(opts).items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def _config_tag(opts: QuickstartOptions, scenario) -> str:
    """Identical training options -> identical run names, so a re-run resumes instead of
    retraining (wherever its report goes)."""
    from raycompat.train.runs import config_tag

    skip = LOCATION_OPTIONS + INTERVAL_OPTIONS + SEED_OPTIONS
    trained = {k: v for k, v in options_record(opts).items() if k not in skip}
    return config_tag(trained, scenario.to_dict())


def _train(
    opts: QuickstartOptions,
    scenario,
    name: str,
    method: str,
    split: str,
    epochs: int,
    old_model: str | None,
    runs_dir: str,
    models_dir: str,
    seed: int,
):
    from raycompat.train.runs import train_named

    s = opts.sizes
    values = dict(
        method=method,
        backbone=s.backbone,
        embed_dim=opts.embed_dim,
        head=opts.head,
        epochs=epochs,
        batch_size=opts.batch_size,
        lr=opts.lr,
        seed=seed,
        split=split,
        **s.training_data(scenario),
        num_workers=opts.workers,
        use_gpu=opts.gpus > 0,
        gpus_per_worker=opts.gpus if opts.gpus > 0 else 1.0,
        old_model=old_model,
        log_every=50,
        threads_per_worker=opts.threads,
    )
    if method == "bct":
        values["method_options"] = {"lambda_compat": opts.bct_lambda}
    tag = f"seed{seed}-{_config_tag(opts, scenario)}"
    return train_named(values, name, tag, runs_dir, models_dir, overwrite=opts.output.overwrite)


def training_seeds(opts: QuickstartOptions) -> list[int]:
    """The seeds every model is trained with: ``--seed``, ``--seed + 1``, ... (``--seeds``)."""
    return [opts.seed + i for i in range(opts.seeds)]


def models_folder(out: str, seed_index: int, seed: int) -> str:
    """Where a seed's bundles go: ``<out>/models`` for the first seed (what ``hot-refresh
    --models`` and the guides use), ``<out>/models/seed<s>`` for the others."""
    base = os.path.join(out, "models")
    return base if seed_index == 0 else os.path.join(base, f"seed{seed}")


def _train_models(
    opts: QuickstartOptions, scenario, runs_dir: str, out: str, timings: dict
) -> list[dict]:
    """For every training seed: old (independent on old_train), then bct and independent on
    new_train, up to ``--parallel`` Ray Train runs at a time (threads of the driver), each BCT
    run once its seed's old model is exported; one line each. Returns one ``{name: info}`` per
    seed."""
    from concurrent.futures import ThreadPoolExecutor

    seeds = training_seeds(opts)
    per_seed: list[dict[str, dict]] = [{} for _ in seeds]
    futures: dict[tuple, object] = {}

    def train_one(i: int, step: tuple) -> None:
        name, method, split, epochs, predecessor = step
        old_model = None
        if predecessor:
            futures[(i, predecessor)].result()  # a failed old model fails its BCT model too
            old_model = per_seed[i][predecessor]["path"]
        seed = seeds[i]
        models_dir = models_folder(out, i, seed)
        run, wall = _train(
            opts, scenario, name, method, split, epochs, old_model, runs_dir, models_dir, seed
        )
        info = dict(
            method=method,
            split=split,
            epochs=epochs,
            seed=seed,
            path=run.bundle_path,
            run_path=run.run_path,
            wall_s=wall,
            history=run.history,
        )
        per_seed[i][name] = info
        _trained_line(opts, name, seed, info, run.history, wall)

    with ThreadPoolExecutor(max_workers=opts.parallel) as pool:
        for i, step in _training_order(opts, len(seeds)):
            futures[(i, step[0])] = pool.submit(train_one, i, step)
        for future in futures.values():
            future.result()
    for train_info in per_seed:  # the plan's order, whatever order the runs finished in
        train_info_sorted = {step[0]: train_info[step[0]] for step in _training_plan(opts)}
        train_info.clear()
        train_info.update(train_info_sorted)
        for name, info in train_info.items():
            timings[f"train_{name}_s"] = timings.get(f"train_{name}_s", 0.0) + info["wall_s"]
    return per_seed


def _training_order(opts: QuickstartOptions, n_seeds: int) -> list[tuple[int, tuple]]:
    """``(seed index, plan step)`` in submission order: seed by seed in the plan's order with
    one run at a time (the console's order), else every model without a predecessor first, so
    that a run waiting for its old model never holds a slot another run could use."""
    steps = [(i, step) for i in range(n_seeds) for step in _training_plan(opts)]
    if opts.parallel == 1:
        return steps
    return sorted(steps, key=lambda item: item[1][4] is not None)


def _training_plan(opts: QuickstartOptions) -> list[tuple]:
    """(name, method, split, epochs, predecessor) of the three models, in training order."""
    return [
        ("old", "independent", "old_train", opts.old_epochs, None),
        ("bct", "bct", "new_train", opts.new_epochs, "old"),
        ("independent", "independent", "new_train", opts.new_epochs, None),
    ]


def _trained_line(opts, name: str, seed: int, info: dict, history: list, wall: float) -> None:
    last = history[-1]
    which = f"{name} (seed {seed})" if opts.seeds > 1 else name
    console.phase(
        f"trained {which}",
        f"{info['method']} on {info['split']}, {len(history)} epochs, "
        f"{opts.workers or 'local mode, 1'} worker(s): "
        f"final loss {last.get('loss/loss', float('nan')):.4f}, "
        f"{last.get('images_per_s', float('nan')):.0f} images/s",
        wall,
    )


def _build_scenario(opts: QuickstartOptions, out: str, timings: dict):
    from raycompat.data.user_scenarios import resolve_scenario
    from raycompat.report import write_json

    t = time.time()
    scenario = resolve_scenario(opts.sizes, opts.data)
    data = data_record(scenario)
    timings["data_s"] = time.time() - t
    write_json(os.path.join(out, "scenario.json"), scenario.to_dict())
    rows = {r["split"]: r for r in scenario.allocation_rows()}
    console.phase(
        "scenario",
        f"{scenario.name} (seed {scenario.seed}) on {data['description']}: "
        f"old_train {rows['old_train']['images']} / new_train {rows['new_train']['images']} "
        f"images, {rows['query']['images']} queries, "
        f"{rows['gallery']['images'] + rows['distractors']['images']} gallery items",
        timings["data_s"],
    )
    if console.is_verbose():
        print(scenario.allocation_table(), flush=True)
    return data, scenario


def data_record(scenario) -> dict:
    """What the report says of the data: the glyph catalog, or your images' source."""
    if scenario.user_data:
        n = len(scenario.class_names)
        src = scenario.source
        return dict(
            kind=src["kind"],
            path=src["path"],
            num_classes=n,
            description=f"your images ({src['kind']} {src['path']}, {n} classes)",
        )
    from raycompat.data import catalog_for

    catalog = catalog_for(scenario)
    return dict(
        kind="glyphs",
        num_classes=catalog.num_classes,
        exclusions={
            k: (len(v) if isinstance(v, (list, dict)) else v) for k, v in catalog.exclusions.items()
        },
        description=f"built-in glyphs, {catalog.num_classes} usable classes",
    )


def _evaluate(
    opts: QuickstartOptions, scenario, embedded_by_seed: list[dict], timings: dict
) -> tuple[list, list, tuple]:
    """Every query model against every gallery model, with intervals over the query classes and
    the training seeds; one line with the verdicts (the paired interval of M(n,o) - M(o,o))."""
    from raycompat.evaluation import cross_evaluate_seeds, scenario_eval_items

    t = time.time()
    (q_labels, _), (g_labels, _) = scenario_eval_items(scenario)
    evaluations, verdicts = cross_evaluate_seeds(
        [(e["old"], [e["bct"], e["independent"]]) for e in embedded_by_seed],
        q_labels,
        g_labels,
        paragon="independent",
        bootstrap=opts.bootstrap,
    )
    timings["evaluate_s"] = time.time() - t
    console.phase(
        "evaluated",
        "mAP@100 "
        + "; ".join(
            f"{v['model']}: M(n,o)={v['m_new_old']:.4f} vs M(o,o)={v['m_old_old']:.4f}, "
            f"difference {difference_text(v)}: compatibility {v['verdict']}"
            for v in verdicts
        ),
        timings["evaluate_s"],
    )
    return evaluations, verdicts, (q_labels, g_labels)


def _embed_seeds(opts, scenario, per_seed: list[dict], out: str, timings: dict):
    """Every seed's queries and gallery through the Ray Data pipeline; one line."""
    t = time.time()
    embedded_by_seed, paths_by_seed = [], []
    for train_info in per_seed:
        models = {name: info["path"] for name, info in train_info.items()}
        seed = next(iter(train_info.values()))["seed"]
        folder = f"seed{seed}-{_config_tag(opts, scenario)}"
        embedded, paths = embed_with_pipeline(
            scenario,
            models,
            os.path.join(out, "embeddings", folder),
            resolution=opts.sizes.resolution,
            data_seed=opts.sizes.data_seed,
            model_stages=opts.model_stages,
        )
        embedded_by_seed.append(embedded)
        paths_by_seed.append(paths)
    timings["embed_s"] = time.time() - t
    first = embedded_by_seed[0]
    console.phase(
        "embedded",
        f"{len(first['old'].query)} queries and {len(first['old'].gallery)} "
        f"gallery items with {', '.join(first)}"
        + (f", {len(per_seed)} seeds" if len(per_seed) > 1 else "")
        + " (Ray Data pipeline)",
        timings["embed_s"],
    )
    return embedded_by_seed, paths_by_seed


def run_quickstart(opts: QuickstartOptions) -> dict:
    """Run the main job with ``opts``; returns the report dict (also written as report.json)."""
    from raycompat.cluster import connect
    from raycompat.models import ModelBundle

    started = time.time()
    output = opts.output.resolve("quickstart", default_out="quickstart_out", config=opts)
    out = output.local
    timings: dict[str, float] = {}
    console.quiet_ray(opts.verbose)
    connect(opts.address)
    data, scenario = _build_scenario(opts, out, timings)
    per_seed = _train_models(opts, scenario, output.runs, out, timings)
    embedded_by_seed, paths_by_seed = _embed_seeds(opts, scenario, per_seed, out, timings)
    evaluations, verdicts, (q_labels, g_labels) = _evaluate(
        opts, scenario, embedded_by_seed, timings
    )
    train_info, embedded = per_seed[0], embedded_by_seed[0]
    models = {name: info["path"] for name, info in train_info.items()}

    t = time.time()
    paragon = {  # new* of the first seed, whose models the backfill simulation uses
        row["metric"]: row.get("per_seed", [row["value"]])[0]
        for row in evaluations
        if row["model"] == row["query"] == row["gallery"] == "independent"
    }
    backfill = simulate_backfill_curves(
        embedded,
        q_labels,
        g_labels,
        ModelBundle.load(models["bct"]),
        os.path.join(out, "backfill"),
        paragon,
        seed=opts.seed,
        log=print if console.is_verbose() else None,
        bootstrap=opts.bootstrap,
    )
    timings["backfill_s"] = time.time() - t
    console.phase(
        "backfill curves",
        f"{len({(r['model'], r['policy'], r['mode']) for r in backfill['rows']})} "
        f"curves (policies x query modes) for bct and independent",
        timings["backfill_s"],
    )
    timings["total_s"] = time.time() - started
    report = _report(
        opts,
        scenario,
        data,
        per_seed,
        paths_by_seed,
        evaluations,
        verdicts,
        backfill,
        out,
        timings,
    )
    where = output.publish()
    console.phase(
        "report",
        f"{os.path.join(out, 'report.md') if where == out else where + '/report.md'}",
        timings["total_s"],
    )
    return report


def _report(
    opts,
    scenario,
    data,
    per_seed,
    paths_by_seed,
    evaluations,
    verdicts,
    backfill,
    out: str,
    timings: dict,
) -> dict:
    """The report dict, written to ``out`` as report.json and report.md."""
    from raycompat.report import with_version, write_json

    report = dict(
        job="quickstart",
        options=options_record(opts),
        scenario=dict(
            name=scenario.name, seed=scenario.seed, allocation=scenario.allocation_rows()
        ),
        catalog=data,
        models=per_seed[0],
        embeddings=paths_by_seed[0],
        seeds=seeds_record(per_seed, paths_by_seed, verdicts),
        evaluations=evaluations,
        verdicts=verdicts,
        compatibility={v["model"]: v["compatible"] for v in verdicts},
        curves=backfill["rows"],
        backfill=backfill["summary"],
        backfill_plots={
            model: [os.path.relpath(p, out) for p in r["plots"]]
            for model, r in backfill["reports"].items()
        },
        timings=timings,
    )
    write_json(os.path.join(out, "report.json"), with_version(report))
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(report, scenario.allocation_table()))
    return report


def seeds_record(per_seed: list[dict], paths_by_seed: list[dict], verdicts: list[dict]) -> dict:
    """The training seeds behind every number: the seeds, each seed's models and embeddings,
    and per seed M(o,o), every new model's M(n,o) and the difference (``rows``)."""
    seeds = [next(iter(info.values()))["seed"] for info in per_seed]
    rows = []
    for i, seed in enumerate(seeds):
        row = dict(seed=seed)
        for v in verdicts:
            ivs = v["intervals"]
            row["m_old_old"] = _seed_value(ivs["m_old_old"], i)
            row[f"m_{v['model']}_old"] = _seed_value(ivs["m_new_old"], i)
            row[f"difference_{v['model']}"] = _seed_value(v["difference"], i)
        rows.append(row)
    return dict(
        count=len(seeds),
        seeds=seeds,
        models=[{name: info["path"] for name, info in m.items()} for m in per_seed],
        embeddings=paths_by_seed,
        rows=rows,
    )


def _seed_value(interval: dict, i: int) -> float:
    """Seed ``i``'s value of an interval dict (its only value with one seed)."""
    return interval.get("per_seed", [interval["value"]])[i]


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("quickstart", __doc__)
    add_options(parser, QuickstartOptions)
    return parser


@console.job_main
def main(argv: list[str] | None = None) -> int:
    opts = options_from_args(QuickstartOptions, build_parser().parse_args(argv))
    run_quickstart(opts)
    return 0


def embed_with_pipeline(
    scenario,
    models: dict,
    out_dir: str,
    resolution: int,
    data_seed: int,
    model_stages: str = "actors",
):
    """Queries, gallery and distractors of ``scenario`` through the Ray Data pipeline
    (:func:`raycompat.pipeline.embed_gallery`, its model stages ``model_stages``): ``old`` +
    ``bct`` in one pass (parquet with ``old`` and ``new`` columns, what
    ``jobs/simulate_backfill.py`` reads), ``independent`` in a second (``new`` only). Returns
    ``({name: EmbeddedSet}, {pass: parquet folder})``; a re-run with the same models reuses
    complete shards."""
    import pyarrow.compute as pc

    from raycompat.evaluation import EmbeddedSet
    from raycompat.pipeline import GlyphGallerySource, PipelineOptions, embed_gallery
    from raycompat.pipeline.sources import ScenarioItemSource

    if scenario.user_data:
        source = ScenarioItemSource(scenario, resolution=resolution, in_chans=scenario.in_chans)
    else:
        source = GlyphGallerySource(scenario, resolution=resolution, data_seed=data_seed)
    passes = {
        "old_bct": dict(old_model=models["old"], new_model=models["bct"], columns=("old", "new")),
        "independent": dict(new_model=models["independent"], columns=("new",)),
    }
    embedded, paths = {}, {}
    for pass_name, kwargs in passes.items():
        run = embed_gallery(
            os.path.join(out_dir, pass_name),
            source,
            options=PipelineOptions(model_stages=model_stages),
            log=lambda m: None,
            **kwargs,
        )
        paths[pass_name] = run.path
        table = run.table()  # sorted by item_id: queries, gallery, distractors
        is_query = pc.equal(table.column("split"), "query").to_numpy(zero_copy_only=False)
        for column, name in (
            ("old", "old"),
            ("new", "bct" if pass_name == "old_bct" else "independent"),
        ):
            if column not in table.column_names:
                continue
            values = table.column(column).combine_chunks()
            vectors = values.flatten().to_numpy().astype(np.float32).reshape(len(values), -1)
            with open(os.path.join(models[name], "manifest.json")) as f:
                compatible = int(json.load(f).get("compatible_dim", vectors.shape[1]))
            embedded[name] = EmbeddedSet(
                name=name,
                query=vectors[is_query],
                gallery=vectors[~is_query],
                compatible_dim=compatible,
            )
    return embedded, paths


CURVE_POLICIES = (
    "random",
    "sequential",
    "uncertainty:least_confidence",
    "uncertainty:margin",
    "uncertainty:entropy",
    "hinge-benefit",
    "learned",
)
CURVE_MODES = ("compatible", "naive_merge", "cold")


def simulate_backfill_curves(
    embedded: dict,
    query_labels,
    gallery_labels,
    bct_bundle,
    out_dir: str,
    paragon: dict,
    seed: int = 0,
    log=None,
    bootstrap: BootstrapOptions | None = None,
) -> dict:
    """Backfill curves of the main job's upgrade (docs/methods.md: Backfill policies, Query
    strategies, Metrics).

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
    With ``bootstrap``, rows carry their band (``low``/``high``), curves and PNGs their bands,
    summaries their intervals and verdicts (:func:`raycompat.simulator.report.curve_intervals`;
    the independent model's new-new per-query terms are new*-new*'s, resampled with the rest).
    """
    from raycompat.models.uncertainty_head import UncertaintyHead
    from raycompat.upgrade.cost import CostModel, measure_items_per_s

    say = log or (lambda message: None)
    cost = CostModel(
        measure_items_per_s(bct_bundle, batch_size=128),
        1,
        source="measured: BCT embedder on this machine",
        device="cpu",
    )
    head = UncertaintyHead.from_classifier_head(bct_bundle.head)
    runs = [
        ("independent", ("random",), ("compatible", "cold"), None),
        ("bct", CURVE_POLICIES, CURVE_MODES, head),
    ]
    # The scenario lists the gallery class by class with the distractors last; a real gallery
    # is stored in ingestion order, so `sequential` walks a seeded shuffle of the items.
    stored = np.random.default_rng([seed, 1]).permutation(
        len(gallery_labels)
    )  # not the random policy's stream
    rows, summary, reports, newstar = [], [], {}, None
    for name, policies, modes, uncertainty_head in runs:
        data = _stored_gallery(embedded, name, query_labels, gallery_labels, stored)
        result = _simulate_model(
            data, policies, modes, uncertainty_head, cost, paragon, seed, bootstrap
        )
        if name == "independent":  # new*: the independent model, the first run
            newstar = result.reference_samples.get("new-new")
        got = _model_reports(result, name, out_dir, newstar)
        reports[name] = got["files"]
        rows += got["rows"]
        summary += got["summary"]
        say(
            f"  {name}: {len(result.curves)} curves in {result.stats['seconds']:.1f} s -> "
            f"{reports[name]['markdown']}"
        )
    return dict(rows=rows, summary=summary, reports=reports)


def _stored_gallery(embedded: dict, name: str, query_labels, gallery_labels, stored):
    """The old model and model ``name``'s embeddings, the gallery in its ``stored`` order."""
    from raycompat.embeddings.gallery import GalleryEmbeddings

    old, new = embedded["old"], embedded[name]
    return GalleryEmbeddings(
        gallery_labels=np.asarray(gallery_labels)[stored],
        gallery_old=old.gallery[stored],
        gallery_new=new.gallery[stored],
        gallery_ids=stored,
        query_labels=query_labels,
        query_old=old.query,
        query_new=new.query,
        compatible_dim=new.compatible_dim,
        source=f"quickstart: old -> {name}",
    )


def _simulate_model(data, policies, modes, head, cost, paragon: dict, seed: int, bootstrap):
    """One model's backfill curves, new*-new* (``paragon``) as the AUC gains' reference."""
    from raycompat.simulator.memory_engine import simulate_backfill

    return simulate_backfill(
        data,
        policies,
        modes,
        seed=seed,
        head=head,
        cost=cost,
        references={"new*-new*": paragon},
        bootstrap=bootstrap,
    )


def _model_reports(result, name: str, out_dir: str, newstar) -> dict:
    """One model's curves.{json,md} and PNGs (``files``), and its curve and summary rows."""
    from raycompat.simulator.report import curve_intervals, curve_rows, summary_rows, write_reports

    intervals = curve_intervals(result, newstar)
    files = write_reports(
        result,
        os.path.join(out_dir, name),
        title=f"Backfill curves: old -> {name}",
        intervals=intervals,
    )
    return dict(
        files=files,
        rows=[dict(model=name, **r) for r in curve_rows(result)],
        summary=[dict(model=name, **r) for r in summary_rows(result, intervals)],
    )
