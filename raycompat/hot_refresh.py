"""Serve a gallery, backfill it live under one policy, and compare its HTTP curve \
with the simulator.

The hot-refresh job measures mAP / NFR of the live index (Ray Serve) at given backfill
fractions and compares them with the simulator's (offline == online; see docs/architecture.md,
Serving, and docs/methods.md, Backfill policies). Embeddings, in order of preference:
``--embeddings`` (a parquet in the simulator's schema, e.g. the Ray Data pipeline's output);
``--models DIR`` with ``old/`` and ``<new-name>/`` bundles (the main job's
``quickstart_out/models``), embedded on a small glyph scenario (``DIR/../scenario.json`` when
present); otherwise tiny old + new models are trained first (a couple of minutes on 2 CPU
cores). Writes ``report.json`` and ``report.md`` to ``--out`` (default ``hot_refresh_out``), or
to ``<--storage>/hot_refresh/<--name>`` with ``--storage`` (training checkpoints then go to
``<--storage>/runs``).

The simulator and the shards rank by the same canonical scores (:mod:`raycompat.index.canonical`),
so with an exact index (``--index flat``, the default) the live curve equals the simulator's
exactly, near-ties included; with an approximate index (``--index ivf_flat|ivf_pq|hnsw``) the
report gives the difference, and at every fraction the recall@k of the served results against
exact search of the same live gallery (docs/indexes.md, "Recall").
Both curves carry their bootstrap band over the query classes (``--resamples``,
``--confidence``, ``--bootstrap-seed``; docs/methods.md, "Uncertainty"): the simulator's from its
per-query terms, the live one's from the per-query values of the searches it made; report.md
shows every value with its interval and ``live_vs_simulator.png`` both curves with their bands.
This module lives outside :mod:`raycompat.serving` because it trains models.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass

import numpy as np

from raycompat.config import (
    ConfigError,
    add_options,
    choices,
    make_parser,
    nonnegative,
    option,
    options_from_args,
    positive,
)
from raycompat.console import job_main, quiet_ray
from raycompat.data.scenarios import ScenarioSizes
from raycompat.data.source import DataSourceOptions
from raycompat.index.ann import IndexOptions
from raycompat.metrics.bootstrap import BootstrapOptions
from raycompat.serving.scoring import SERVED_MODES
from raycompat.upgrade.policies import POLICIES

__all__ = ["HotRefreshOptions", "TINY_SIZES", "run_hot_refresh", "build_parser", "main"]


DEFAULT_OUT = "hot_refresh_out"

#: the tiny default scenario (only used without --embeddings / --models)
TINY_SIZES = dataclasses.replace(
    ScenarioSizes(),
    train_classes=60,
    images_per_class=16,
    eval_classes=60,
    gallery_per_class=6,
    distractor_classes=40,
    distractors_per_class=3,
)


@dataclass(frozen=True)
class HotRefreshOptions:
    """Every flag of the hot-refresh job."""

    out: str | None = option(
        None,
        help=f"report folder or URI (none: {DEFAULT_OUT}, or "
        "<storage>/hot_refresh/<name> with --storage)",
    )
    storage: str | None = option(
        None,
        help="shared storage: a local path or any URI pyarrow opens; the "
        "report goes to <storage>/hot_refresh/<name>, checkpoints to "
        "<storage>/runs",
    )
    name: str = option("default", help="report folder name under <storage>/hot_refresh")
    overwrite: bool = option(
        False, help="write into a report folder that holds another run's report"
    )
    address: str | None = option(None, help="Ray address (none: an embedded local cluster)")
    verbose: bool = option(False, help="keep Ray's own INFO lines")
    embeddings: str | None = option(
        None,
        help="a parquet in the simulator's schema (else --models, else tiny models trained first)",
    )
    models: str | None = option(None, help="folder with old/ and <new-name>/ model bundles")
    new_name: str | None = option(
        None, help="the new bundle in --models (none: the mode's tiny method)"
    )
    policy: str = choices(*POLICIES, default="random", help="backfill policy")
    mode: str = choices(*SERVED_MODES, default="compatible", help="query mode")
    seed: int = option(0, help="seed of the policy, the ingestion order and the tiny training")
    bootstrap: BootstrapOptions = option(
        BootstrapOptions(), help="bootstrap bands of the live and simulated curves"
    )
    fractions: str = option(
        "0,0.1,0.25,0.5,0.75,1", help="comma-separated backfill fractions to measure at"
    )
    k: int = positive(100, help="cut-off of mAP@k")
    num_shards: int = positive(2, help="index shards")
    port: int = nonnegative(0, help="HTTP port (0: a free port)")
    host: str = option("127.0.0.1", help="HTTP host")
    batch_size: int = positive(64, help="items per backfill upsert")
    rate: float | None = option(None, help="backfill items per second (none: as fast as possible)")
    vectors_from: str = choices(
        "gallery",
        "pipeline",
        "embedder",
        default="gallery",
        help="where the backfill's new vectors come from",
    )
    index: IndexOptions = option(
        factory=IndexOptions, help="the live index's search index (docs/indexes.md)"
    )
    data: DataSourceOptions = option(
        DataSourceOptions(), help="data: the built-in glyphs or your images"
    )
    sizes: ScenarioSizes = option(
        TINY_SIZES, help="the tiny default scenario (or --scenario scenario.json)"
    )
    old_epochs: int = positive(8, help="epochs of the tiny old model")
    new_epochs: int = positive(6, help="epochs of the tiny new model(s)")
    embed_dim: int = positive(64, help="embedding dimension of the tiny models")


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("hot-refresh", __doc__)
    add_options(parser, HotRefreshOptions)
    return parser


def parse_fractions(text: str) -> np.ndarray:
    from raycompat.upgrade.grid import check_grid

    try:
        return check_grid([float(x) for x in text.split(",") if x.strip()])
    except ValueError as exc:
        raise ConfigError(f"--fractions {text!r}: {exc}") from None


# ----------------------------------------------------------------------------- embeddings
def _scenario(opts: HotRefreshOptions, models_dir: str | None):
    from raycompat.data import default_catalog, scenario_from_options
    from raycompat.data.scenarios import Scenario
    from raycompat.data.user_scenarios import resolve_scenario

    if opts.data.user or opts.sizes.scenario_file:
        return resolve_scenario(opts.sizes, opts.data)
    if models_dir:
        sj = os.path.join(os.path.dirname(os.path.abspath(models_dir)), "scenario.json")
        if os.path.isfile(sj):
            with open(sj) as fh:
                return Scenario.from_dict(json.load(fh))
    try:
        return scenario_from_options(opts.sizes, catalog=default_catalog())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def training_tag_values(opts: HotRefreshOptions) -> dict:
    """The options the tiny default training depends on (its run names carry their hash)."""
    s = opts.sizes
    return dict(
        train_classes=s.train_classes,
        images_per_class=s.images_per_class,
        eval_classes=s.eval_classes,
        resolution=s.resolution,
        backbone=s.backbone,
        embed_dim=opts.embed_dim,
        old_epochs=opts.old_epochs,
        new_epochs=opts.new_epochs,
        data_seed=s.data_seed,
        seed=opts.seed,
    )


#: the new model each served mode needs, trained by the tiny default: BCT's compatible
#: subspace, DMU's psi, FCT's h and RM's rho + psi_rev (fct and mcl on a frozen independent new
#: model), and for RM's naive merge of two systems an independent new model
TINY_METHOD = {
    "compatible": "bct",
    "adapted": "dmu",
    "fct": "fct",
    "rank_merge": "mcl",
    "naive_merge": "independent",
}


def new_model_name(opts: HotRefreshOptions) -> str:
    return opts.new_name or TINY_METHOD[opts.mode]


def tiny_training_plan(mode: str, old_epochs: int, new_epochs: int) -> list:
    """The tiny default's runs for ``mode``, in order: ``(name, method, split, epochs, old model,
    init model)``; old (independent on old_train), then the mode's method (:data:`TINY_METHOD`)
    against it; fct, mcl (and naive_merge) need an independent new model, trained first. The
    last run's name is the served new model (:func:`new_model_name`)."""
    method = TINY_METHOD[mode]
    plan = [("old", "independent", "old_train", old_epochs, None, None)]
    if method in ("fct", "mcl", "independent"):  # fct, mcl: on a frozen independent new model
        plan.append(("independent", "independent", "new_train", new_epochs, None, None))
    if method != "independent":
        init = "independent" if method in ("fct", "mcl") else None
        plan.append((method, method, "new_train", new_epochs, "old", init))
    return plan


def _train_tiny(opts: HotRefreshOptions, scenario, runs_dir: str, models_dir: str, log) -> str:
    """Train :func:`tiny_training_plan` with Ray Train (:func:`raycompat.train.runs.train_named`).
    Runs are named by a hash of the training options, so a re-run with the same options reuses
    them."""
    from raycompat.train.runs import config_tag, train_named

    tag = config_tag(training_tag_values(opts), scenario.to_dict())
    os.makedirs(models_dir, exist_ok=True)
    models = {}
    plan = tiny_training_plan(opts.mode, opts.old_epochs, opts.new_epochs)
    for name, meth, split, epochs, pred, init in plan:
        log(f"training tiny {name} model ({meth}, {epochs} epochs)")
        values = dict(
            method=meth,
            backbone=opts.sizes.backbone,
            embed_dim=opts.embed_dim,
            epochs=epochs,
            batch_size=64,
            seed=opts.seed,
            split=split,
            **opts.sizes.training_data(scenario),
            old_model=models.get(pred),
            init_model=models.get(init),
            log_every=50,
        )
        run, wall = train_named(values, name, tag, runs_dir, models_dir, overwrite=opts.overwrite)
        models[name] = run.bundle_path
        log(f"  {name}: {wall:.0f} s -> {run.bundle_path}")
    return models_dir


def _load_bundles(models_dir: str, new_name: str) -> tuple[dict, dict]:
    """``({name: path}, {name: ModelBundle})`` of ``old`` and ``new_name`` in ``models_dir``."""
    from raycompat.models import ModelBundle

    paths = {n: os.path.join(models_dir, n) for n in ("old", new_name)}
    for n, p in paths.items():
        if not os.path.isfile(os.path.join(p, "manifest.json")):
            raise ConfigError(
                f"no model bundle {n!r} at {p} (expected old/ and {new_name}/ in --models)"
            )
    return paths, {n: ModelBundle.load(p) for n, p in paths.items()}


def _embedded_gallery(opts: HotRefreshOptions, scenario, bundles: dict, new_name: str, log):
    """The scenario's queries and gallery embedded by both models, the gallery in a seeded
    ingestion order (as the main job): ``(GalleryEmbeddings, stored order, gallery labels,
    gallery instances)``."""
    from raycompat.embeddings.gallery import GalleryEmbeddings
    from raycompat.evaluation import embed_scenario, scenario_eval_items

    resolution = int(bundles[new_name].manifest.get("resolution") or opts.sizes.resolution)
    log(
        f"embedding {scenario.name} query + gallery with old and {new_name} "
        f"(resolution {resolution})"
    )
    emb = {
        n: embed_scenario(n, b, scenario, resolution, opts.sizes.data_seed)
        for n, b in bundles.items()
    }
    (q_labels, _), (g_labels, g_inst) = scenario_eval_items(scenario)
    n = len(g_labels)
    stored = np.random.default_rng([opts.seed, 1]).permutation(
        n
    )  # ingestion order (as the main job)
    new = emb[new_name]
    data = GalleryEmbeddings(
        gallery_labels=np.asarray(g_labels)[stored],
        gallery_old=emb["old"].gallery[stored],
        gallery_new=new.gallery[stored],
        gallery_ids=np.arange(n, dtype=np.int64),
        query_labels=np.asarray(q_labels),
        query_old=emb["old"].query,
        query_new=new.query,
        query_ids=np.arange(n, n + len(q_labels), dtype=np.int64),
        compatible_dim=new.compatible_dim,
    )
    return data, stored, np.asarray(g_labels), np.asarray(g_inst)


def _write_items(path: str, stored, g_labels, g_inst, scenario) -> str:
    """``item_id, label, instance`` of the stored gallery: what the embedder pool renders; for
    your images also ``key`` (and the source in the table's metadata): what it decodes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycompat.evaluation import scenario_eval_keys

    n = len(stored)
    columns = {
        "item_id": pa.array(np.arange(n, dtype=np.int64)),
        "label": pa.array(g_labels[stored].astype(np.int64)),
        "instance": pa.array(g_inst[stored].astype(np.int64)),
    }
    table = pa.table(columns)
    if scenario.user_data:
        keys = scenario_eval_keys(scenario)[1]
        table = table.append_column("key", pa.array([keys[i] for i in stored]))
        table = table.replace_schema_metadata({"source": json.dumps(scenario.source)})
    pq.write_table(table, path)
    return path


def build_embeddings(opts: HotRefreshOptions, out: str, runs_dir: str, log):
    """``(parquet path, items parquet or None, new model path or None, old model path or None)``."""
    from raycompat.serving.gallery_source import write_gallery_parquet

    if opts.embeddings:
        if not os.path.exists(opts.embeddings):
            raise ConfigError(f"--embeddings not found: {opts.embeddings}")
        new_model = os.path.join(opts.models, new_model_name(opts)) if opts.models else None
        old_model = os.path.join(opts.models, "old") if opts.models else None
        return opts.embeddings, None, new_model, old_model
    models_dir = opts.models
    scenario = _scenario(opts, models_dir)
    if not models_dir:
        models_dir = _train_tiny(opts, scenario, runs_dir, os.path.join(out, "models"), log)
    new_name = new_model_name(opts)
    paths, bundles = _load_bundles(models_dir, new_name)
    data, stored, g_labels, g_inst = _embedded_gallery(opts, scenario, bundles, new_name, log)
    if opts.mode == "adapted":
        from raycompat.upgrade.modes import apply_bundle_modules

        data = apply_bundle_modules(data, bundles[new_name])
        if data.gallery_adapted is None:
            raise ConfigError(
                f"--mode adapted needs a new model with a psi module ({paths[new_name]})"
            )
    path = write_gallery_parquet(os.path.join(out, "embeddings.parquet"), data)
    items = _write_items(os.path.join(out, "items.parquet"), stored, g_labels, g_inst, scenario)
    log(f"  {len(stored)} gallery items, {data.n_queries} queries -> {path}")
    return path, items, paths[new_name], paths["old"]


# ----------------------------------------------------------------------------- the run
@dataclass
class _Prepared:
    """The gallery both sides see, and what the serving side needs to build it."""

    data: object
    parquet: str
    items: str | None
    new_model: str | None
    old_model: str | None
    head: object
    k: int
    compatible_dim: int | None


def _prepare(opts: HotRefreshOptions, out: str, runs_dir: str, say) -> _Prepared:
    """The embeddings (given, embedded or trained and embedded), with the mode's modules applied."""
    from raycompat.embeddings.gallery import load_parquet
    from raycompat.models.uncertainty_head import UncertaintyHead

    parquet, items, new_model, old_model = build_embeddings(opts, out, runs_dir, say)
    data = load_parquet(parquet)
    compat = data.compat_dim
    data = data.with_arrays(compatible_dim=compat) if compat is not None else data
    if opts.mode == "fct":  # h(old): what the shards store as adapted items
        from raycompat.serving.gallery_source import open_gallery

        data = data.with_arrays(
            gallery_fct=open_gallery(parquet, new_model, "fct").data.gallery_fct
        )
    if (
        opts.mode == "rank_merge"
    ):  # rho(new), rho(q), psi_rev(rho(q)): what the router and controller apply
        from raycompat.models import ModelBundle
        from raycompat.serving.scoring import rank_merge_maps
        from raycompat.upgrade.modes import apply_bundle_modules

        rank_merge_maps(new_model)  # names a missing model or module
        data = apply_bundle_modules(data, ModelBundle.load(new_model))
    head = None
    if new_model and (opts.policy.startswith("uncertainty:") or opts.policy == "learned"):
        from raycompat.models import ModelBundle

        head = UncertaintyHead.from_classifier_head(ModelBundle.load(new_model).head)
    return _Prepared(
        data, parquet, items, new_model, old_model, head, min(int(opts.k), data.n_items), compat
    )


class _RecordingClient:
    """The serving client, keeping the result ids of the labelled-query searches the live curve
    makes: ``model="new"`` at every fraction, ``model="old"`` for the old-old reference."""

    def __init__(self, client):
        self._client = client
        self.searches: dict[str, list] = {"new": [], "old": []}

    def __getattr__(self, name):
        return getattr(self._client, name)

    def search(self, vectors, *args, **kwargs):
        out = self._client.search(vectors, *args, **kwargs)
        if kwargs.get("model") in self.searches and not kwargs.get("exact"):
            self.searches[kwargs["model"]].append(np.asarray(out[0]))
        return out


def live_samples(searches: dict, data, k: int, n_fractions: int) -> dict:
    """Per-query terms (``{metric: Sample}``, ``[1, Q, J]``) of the live curve from its searches'
    ids: AP@k and top-1 over the queries with a positive, NFR@1 over the old-old successes
    (:func:`raycompat.serving.live_eval.live_metrics`'s definitions); empty unless there is one
    search per fraction."""
    from raycompat.metrics import average_precision_at_k, correct_at_k
    from raycompat.metrics.bootstrap import Sample
    from raycompat.metrics.rank_metrics import METRIC_NAMES, positive_pairs
    from raycompat.simulator.results import QUERIES

    if len(searches["new"]) != n_fractions:
        return {}
    order = np.argsort(data.gallery_ids)
    gid, glab = np.asarray(data.gallery_ids)[order], np.asarray(data.gallery_labels)[order]
    ql = np.asarray(data.query_labels)[:, None]

    def relevance(ids):
        pos = np.clip(np.searchsorted(gid, ids), 0, len(gid) - 1)
        return (ids >= 0) & (gid[pos] == ids) & (glab[pos] == ql)

    npos = positive_pairs(data.query_labels, data.gallery_labels)[2]
    rel = [relevance(ids) for ids in searches["new"]]
    c1 = np.stack([correct_at_k(r, 1) for r in rel], axis=1)  # [Q, J]
    names = METRIC_NAMES(k)
    out = {
        names[0]: Sample.mean(
            QUERIES, np.stack([average_precision_at_k(r, npos, k) for r in rel], axis=1)
        ),
        names[2]: Sample.mean(QUERIES, np.where((npos > 0)[:, None], c1, np.nan)),
    }
    if len(searches["old"]) == 1:
        base = correct_at_k(relevance(searches["old"][0]), 1)
        out[names[3]] = Sample.rate(QUERIES, base[:, None] & ~c1, base)
    return out


def recall_name(k: int) -> str:
    return f"recall@{k}"


def recall_sample(live: dict):
    """The per-query recall@k of the served results against exact search, ``[1, Q, J]``."""
    from raycompat.metrics.bootstrap import Sample
    from raycompat.simulator.results import QUERIES

    return Sample.mean(QUERIES, np.asarray(live["recall_per_query"], np.float64))


def live_bands(samples: dict, data, options: BootstrapOptions) -> dict:
    """``{metric: {"low": [J], "high": [J], "dropped": [J]}}``: the live curve's bootstrap band
    (``dropped``: resamples with an undefined value; past 1 % of them a point has no interval and
    its bounds are NaN)."""
    from raycompat.metrics.bootstrap import Bootstrap
    from raycompat.simulator.results import QUERIES

    boot = Bootstrap(options)
    boot.add_query_set(QUERIES, data.query_labels)
    bands = {m: boot.interval(curve=s) for m, s in samples.items()}
    return {
        m: {
            "low": [float(x) for x in b["low"]],
            "high": [float(x) for x in b["high"]],
            "dropped": [int(x) for x in b["dropped"]],
        }
        for m, b in bands.items()
    }


def _serve_and_measure(opts: HotRefreshOptions, prep: _Prepared, fractions, out: str, say) -> dict:
    """Serve the gallery, backfill it live through HTTP and measure at ``fractions``:
    ``{"url", "live", "status", "image_check"}``; ``live["bands"]``: the live curve's bootstrap
    band (:func:`live_samples`)."""
    from raycompat.serving.app import start_serving, stop_serving
    from raycompat.serving.auth import TOKEN_ENV
    from raycompat.serving.client import ServingClient
    from raycompat.serving.config import serving_config
    from raycompat.serving.live_eval import live_backfill_curve

    token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    os.environ[TOKEN_ENV] = token
    state_dir = os.path.join(out, "serving_state")
    shutil.rmtree(state_dir, ignore_errors=True)
    port = opts.port or _serving_port(opts)
    cfg = serving_config(
        gallery=prep.parquet,
        state_dir=state_dir,
        mode=opts.mode,
        num_shards=opts.num_shards,
        host=opts.host,
        port=port,
        index=opts.index,
        new_model=prep.new_model,
        old_model=prep.old_model,
        items=prep.items,
        compatible_dim=prep.compatible_dim,
        app_name="hot_refresh",
        data_seed=opts.sizes.data_seed,
        max_k=max(1000, prep.k),
    )
    say(
        f"serving {prep.data.n_items} items on {opts.num_shards} shards at http://{opts.host}:{port}"
    )
    url = start_serving(cfg, opts.address)
    try:
        client = ServingClient(url, token=token)
        client.wait_ready()
        say(
            f"live backfill through {url} "
            f"(vectors from {opts.vectors_from}, batch {opts.batch_size})"
        )
        recorder = _RecordingClient(client)
        live = live_backfill_curve(
            recorder,
            prep.data,
            fractions,
            policy=opts.policy,
            seed=opts.seed,
            k=prep.k,
            source=opts.vectors_from,
            batch_size=opts.batch_size,
            rate=opts.rate,
            log=say,
        )
        samples = live_samples(recorder.searches, prep.data, prep.k, len(fractions))
        samples[recall_name(prep.k)] = recall_sample(live)
        live["bands"] = live_bands(samples, prep.data, opts.bootstrap)
        status = client.status()
        image_check = (
            _image_query_check(client, prep.data, opts, prep.new_model, prep.old_model, prep.items)
            if prep.new_model
            else None
        )
    finally:
        stop_serving(cfg)
    return {"url": url, "live": live, "status": status, "image_check": image_check}


def _with_band(value, band: dict | None, j: int):
    """The value at grid point ``j`` with its bootstrap band, ``v [low, high]``."""
    value = float(value)
    if not band or not np.isfinite(value):
        return value
    return f"{value:.4f} [{band['low'][j]:.4f}, {band['high'][j]:.4f}]"


def _curve_table(live: dict, sim_curve, fractions) -> tuple[list, list]:
    """``(headers, rows)``: live and simulated values of every metric either side measured, and
    the recall@k of the served results against exact search."""
    names = list(live["metrics"])
    rname = recall_name(live["k"])
    rows = []
    for j, t in enumerate(fractions):
        rows.append(
            [
                f"{100 * t:.0f}%",
                live["counts"][j],
                _with_band(live["recall"][j], live.get("bands", {}).get(rname), j),
            ]
            + sum(
                (
                    [
                        _with_band(live["metrics"][m][j], live.get("bands", {}).get(m), j),
                        _with_band(sim_curve.metrics[m][j], sim_curve.bands.get(m), j),
                    ]
                    for m in names
                    if np.isfinite(live["metrics"][m][j]) or np.isfinite(sim_curve.metrics[m][j])
                ),
                [],
            )
        )
    headers = ["t", "items new", f"{rname} live vs exact"] + sum(
        (
            [f"{m} live", f"{m} sim"]
            for m in names
            if np.isfinite(live["metrics"][m]).any() or np.isfinite(sim_curve.metrics[m]).any()
        ),
        [],
    )
    return headers, rows


def _markdown(opts: HotRefreshOptions, data, k: int, cmp: dict, table: tuple, image_check) -> str:
    from raycompat.report import markdown_table

    headers, rows = table
    md = [
        "# Hot refresh, live vs simulator",
        "",
        f"{data.n_items} gallery items on {opts.num_shards} shards (index `{opts.index.kind}`), "
        f"{data.n_queries} queries through `POST /search`; "
        f"policy `{opts.policy}`, mode `{opts.mode}`, "
        f"seed {opts.seed}, "
        f"new vectors from `{opts.vectors_from}`. "
        "NFR@1 against old-old top-1 measured live at t=0. Values carry their "
        f"{100 * opts.bootstrap.confidence:g} % bootstrap band over the query classes "
        f"({opts.bootstrap.resamples} resamples, seed {opts.bootstrap.bootstrap_seed}; "
        "docs/methods.md, Uncertainty): `live` from the per-query values of the live searches, "
        "`sim` from the simulator's, on the same draws.",
        "",
        markdown_table(headers, rows, digits=4),
        "",
        "Largest |live - simulator| per metric: "
        + ", ".join(f"{m} {d:.2e}" for m, d in cmp["max_abs_diff"].items())
        + f" -> **{'equal' if cmp['equal'] else 'DIFFERENT'}**"
        + (
            "."
            if opts.index.kind == "flat"
            else f" (an approximate index, `{opts.index.kind}`: the simulator is exact, so the "
            "difference is what the index gives up, with the recall column beside it)."
        ),
        f"Recall@{k} of the served top-{k} against exact search of the same live gallery "
        f'(`"exact": true`): lowest {min(cmp["recall"]):.4f}, mean {np.mean(cmp["recall"]):.4f} '
        "over the fractions.",
        "",
    ]
    nt = cmp["near_ties"]
    md.append(
        f"Near-ties: {nt['t0']} (t=0) and {nt['t1']} (t=1) of {data.n_queries} queries have two of "
        f"their top {k + 1} cosines within {nt['gap']:g}. "
        "Float32 rounding (faiss in the shards, torch "
        "in the simulator) could order those differently; both sides rank by the same canonical "
        "float64 scores (`raycompat.index.canonical`), so they do not."
    )
    md.append("")
    md += ["", f"![live vs simulator]({PLOT_NAME})", ""]
    if image_check:
        md.append(
            f"Image queries (base64 PNG, embedded by the router): {image_check['agree_top1']}/"
            f"{image_check['n']} top-1 ids equal to the vector search of the same embedding."
        )
    return "\n".join(md) + "\n"


PLOT_NAME = "live_vs_simulator.png"


def plot_live_vs_simulator(live: dict, sim_curve, path: str) -> str | None:
    """One panel per metric measured live: the simulated curve with its band (shaded) and the
    live values with theirs (error bars); None when no metric was measured."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = [m for m, v in live["metrics"].items() if np.isfinite(v).any()]
    if not names:
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    x = 100.0 * np.asarray(live["fractions"])
    for ax, m in zip(axes[0], names, strict=True):
        ax.plot(x, sim_curve.metrics[m], color="tab:blue", label="simulator")
        band = sim_curve.bands.get(m)
        if band:
            ax.fill_between(x, band["low"], band["high"], color="tab:blue", alpha=0.2, linewidth=0)
        y, lb = np.asarray(live["metrics"][m], dtype=float), live.get("bands", {}).get(m)
        err = None if not lb else np.abs(np.stack([y - lb["low"], np.asarray(lb["high"]) - y]))
        ax.errorbar(x, y, yerr=err, fmt="o", color="tab:orange", capsize=3, label="live (HTTP)")
        ax.set_xlabel("fraction backfilled (%)")
        ax.set_title(m)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _serving_port(opts) -> int:
    """The port of the Serve instance already running on the cluster, else a free one."""
    from raycompat.cluster import connect
    from raycompat.serving.app import free_port
    from raycompat.serving.proxy import running_http_address

    connect(opts.address)
    running = running_http_address()
    return running[1] if running and running[0] == opts.host else free_port(opts.host)


def _simulator_curve(opts: HotRefreshOptions, prep: _Prepared, fractions, say):
    """The simulator's curve of ``opts.policy`` in ``opts.mode`` on the prepared gallery."""
    from raycompat.simulator.memory_engine import simulate_backfill

    say(
        f"simulator: policy {opts.policy}, mode {opts.mode}, seed {opts.seed}, "
        f"{len(fractions)} fractions"
    )
    sim = simulate_backfill(
        prep.data,
        [opts.policy],
        [opts.mode],
        fractions=fractions,
        k=prep.k,
        seed=opts.seed,
        head=prep.head,
        bootstrap=opts.bootstrap,
    )
    return sim.curve(opts.policy, opts.mode)


def run_hot_refresh(opts: HotRefreshOptions, log=None) -> dict:
    """The job: embeddings, the simulator's curve, the live curve through HTTP, and the report
    comparing them; returns the report (``report["out"]``: where it was written)."""
    from raycompat.cluster import connect
    from raycompat.outputs import resolve_job_output
    from raycompat.report import with_version, write_json
    from raycompat.serving.live_eval import compare_curves

    t0 = time.time()
    say = log or (lambda m: print(f"[hot_refresh {time.time() - t0:6.1f}s] {m}", flush=True))
    fractions = parse_fractions(opts.fractions)
    # where everything goes, checked for writing before any work (StorageError otherwise)
    output = resolve_job_output(
        "hot_refresh",
        out=opts.out,
        storage=opts.storage,
        name=opts.name,
        default_out=DEFAULT_OUT,
        config=opts,
        overwrite=opts.overwrite,
        ignore=("port", "host", "rate"),
    )
    out = output.local
    connect(opts.address)
    prep = _prepare(opts, out, output.runs, say)
    data, k = prep.data, prep.k
    sim_curve = _simulator_curve(opts, prep, fractions, say)
    served = _serve_and_measure(opts, prep, fractions, out, say)
    live, status = served["live"], served["status"]
    cmp = compare_curves(live, sim_curve, tol=1e-9)
    cmp["near_ties"] = near_ties(data, k, opts.mode)
    cmp["recall"] = live["recall"]
    report = {
        "job": "hot_refresh",
        "options": dataclasses.asdict(opts),
        "out": output.destination,
        "embeddings": prep.parquet,
        "url": served["url"],
        "n_items": data.n_items,
        "n_queries": data.n_queries,
        "k": k,
        "live": live,
        "simulator": {
            "fractions": sim_curve.fractions.tolist(),
            "counts": sim_curve.counts.tolist(),
            "metrics": {m: [float(x) for x in v] for m, v in sim_curve.metrics.items()},
            "bands": sim_curve.bands,
            "bootstrap": dataclasses.asdict(opts.bootstrap),
        },
        "plot": PLOT_NAME,
        "comparison": cmp,
        "final_status": {"items": status["items"], "backfill": status["backfill"]},
        "image_queries": served["image_check"],
        "seconds": time.time() - t0,
    }
    write_json(os.path.join(out, "report.json"), with_version(report))
    plot_live_vs_simulator(live, sim_curve, os.path.join(out, PLOT_NAME))
    with open(os.path.join(out, "report.md"), "w") as fh:
        table = _curve_table(live, sim_curve, fractions)
        fh.write(_markdown(opts, data, k, cmp, table, served["image_check"]))
    destination = output.publish()
    say(
        f"live == simulator: {cmp['equal']} (max diffs {cmp['max_abs_diff']}); "
        f"recall@{k} vs exact: min {min(live['recall']):.4f}; report: {destination}/report.md"
    )
    report["out"] = destination
    return report


def near_ties(data, k: int, mode: str, gap: float = 1e-6) -> dict:
    """Queries whose top-(k+1) scores of the mode's old side (all-old state, t=0) and new side
    (all-new state, t=1) contain two values closer than ``gap``: where float32 rounding alone
    could order items differently (canonical scores decide them, on both sides)."""
    from raycompat.upgrade.modes import SideBuilder

    out = {"gap": gap}
    _, old_side, new_side = SideBuilder(data).mode_sides(mode)
    for key, side in (("t0", old_side), ("t1", new_side)):
        S = side.queries.astype(np.float64) @ side.gallery.astype(np.float64).T
        top = -np.sort(-S, axis=1)[:, : k + 1]
        out[key] = int((np.diff(-top, axis=1) < gap).any(axis=1).sum()) if top.shape[1] > 1 else 0
    return out


def _query_images(data, n: int, emb, data_seed: int, items: str):
    """``n`` query images and their base64 PNGs: gallery-class glyph instances rendered afresh
    (instance numbers beyond the gallery's), or your first ``n`` gallery images."""
    import base64
    import io

    import pyarrow.parquet as pq
    from PIL import Image

    from raycompat.data import GlyphRenderer, default_catalog

    table = pq.read_table(items)
    if "key" in table.column_names:
        from raycompat.data.source import ItemImages, SourceSpec

        source = SourceSpec.from_dict(json.loads(table.schema.metadata[b"source"]))
        images = ItemImages(source, emb.resolution, emb.in_chans)
        imgs = np.stack([images.load(k) for k in table.column("key").to_pylist()[:n]])
    else:
        renderer = GlyphRenderer(default_catalog(), resolution=emb.resolution, seed=data_seed)
        labels = np.asarray(data.query_labels[:n]).astype(np.int64)
        imgs = renderer.render_batch(labels, np.full(n, 10_000, np.int64))
    b64 = []
    for im in imgs:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="PNG")
        b64.append(base64.b64encode(buf.getvalue()).decode())
    return imgs, b64


def _image_query_check(
    client, data, opts: HotRefreshOptions, new_model, old_model, items
) -> dict | None:
    """A few query images sent as base64 PNG: the router's embedding must retrieve what the
    offline embedding of the same images retrieves (top-1)."""
    if items is None:
        return None
    from raycompat.serving.embedder_pool import ModelEmbedder

    seed = opts.sizes.data_seed
    emb = ModelEmbedder(new_model, data_seed=seed)
    n = min(8, data.n_queries)
    imgs, b64 = _query_images(data, n, emb, seed, items)
    res = client.search_images(b64, k=5)
    offline = emb.embed_images(imgs)
    offline_old = None
    if opts.mode == "naive_merge":  # the router embeds the images with the old model as well
        offline_old = ModelEmbedder(old_model, data_seed=seed).embed_images(imgs)
    ids, _, _ = client.search(offline, k=5, old_vectors=offline_old)
    agree = sum(int(r[0]["id"] == ids[i, 0]) for i, r in enumerate(res["results"]) if r)
    return {"n": n, "agree_top1": agree}


@job_main
def main(argv: list[str] | None = None) -> int:
    opts = options_from_args(HotRefreshOptions, build_parser().parse_args(argv))
    quiet_ray(opts.verbose)
    run_hot_refresh(opts)
    return 0
