"""Simulate backfilling saved embeddings: exact curves for every backfill policy and query mode.

The simulate-backfill job reads a parquet of old / new (/ adapted) embeddings (or, with
``--store``, the gallery from a LanceDB table or a Milvus collection and the queries from a
parquet: :mod:`raycompat.simulator.store_inputs`) and, optionally, the model bundles; it
writes exact mAP@k / mAP / top-1 / NFR@1 curves with AUCs, regression statistics and a
simulated time axis as JSON, markdown and PNG reports (see docs/methods.md, Backfill
policies), every number with its bootstrap interval over the query classes and every
curve with its band (``--resamples``, ``--confidence``, ``--bootstrap-seed``; docs/methods.md,
"Uncertainty"). ``main`` is ``raycompat simulate-backfill`` / ``jobs/simulate_backfill.py``;
:func:`run` is the library call.

Every input problem raises :class:`~raycompat.embeddings.gallery.BackfillInputError` (or a
``ConfigError`` for an option) with a one-line message; ``main`` prints it on stderr and
exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass

from raycompat.config import (
    ConfigError,
    add_options,
    choices,
    make_parser,
    option,
    options_from_args,
    positive,
)
from raycompat.console import fail, job_main
from raycompat.data.scenarios import ScenarioSizes
from raycompat.data.source import DataSourceOptions
from raycompat.data.workload import ZipfWorkload
from raycompat.embeddings.gallery import BackfillInputError, load_parquet
from raycompat.metrics.bootstrap import BootstrapOptions
from raycompat.models.uncertainty_head import UncertaintyHead
from raycompat.simulator.store_inputs import StoreInputOptions
from raycompat.upgrade.canary import CanaryOptions
from raycompat.upgrade.modes import MODES, apply_bundle_modules, available_modes, parse_modes
from raycompat.upgrade.policies import POLICIES, PolicyOptions, parse_policies

__all__ = ["BackfillJobOptions", "build_parser", "run", "main"]


@dataclass(frozen=True)
class BackfillJobOptions:
    """Every flag of the simulate-backfill job."""

    embeddings: str | None = option(
        None,
        help="parquet file or folder: item_id, label, split (query/gallery/distractor), "
        "class_name, old, new, optional adapted; none: embed --scenario / --source first",
    )
    store_input: StoreInputOptions = option(
        StoreInputOptions(),
        help="instead of --embeddings: the gallery in a LanceDB table or a Milvus collection, "
        "the queries in a parquet (docs/simulator.md, 'A gallery in a vector store')",
    )
    data: DataSourceOptions = option(
        DataSourceOptions(),
        help="without --embeddings: the images the job embeds first (with --old-model and "
        "--new-model, into <out>/embeddings)",
    )
    sizes: ScenarioSizes = option(
        ScenarioSizes(),
        help="without --embeddings: the scenario whose queries, gallery and distractors are "
        "embedded first",
    )
    new_model: str | None = option(
        None,
        help="new model bundle: its head drives the uncertainty "
        "policies; psi, fct, rho, psi_rev modules give the adapted, fct and "
        "rank_merge modes",
    )
    candidates: str | None = option(
        None,
        help="several candidate models in one pass: comma-separated name=column (or column) of "
        "the dataset's new-vector columns; each candidate's report goes to <out>/<name>, the "
        "comparison to <out>/candidates.md (docs/simulator.md, 'Several candidates')",
    )
    old_model: str | None = option(
        None, help="old model bundle (checked against the 'old' column's dimension)"
    )
    allow_unrelated: bool = option(
        False, help="use a --new-model whose recorded predecessor is not --old-model"
    )
    policies: str | None = option(
        None,
        help=f"comma-separated; allowed: {', '.join(POLICIES)} (none: all that the inputs allow)",
    )
    modes: str | None = option(
        None, help=f"comma-separated; allowed: {', '.join(MODES)} (none: all that the inputs allow)"
    )
    bootstrap: BootstrapOptions = option(
        BootstrapOptions(), help="bootstrap intervals over the query classes"
    )
    cost_column: str | None = option(
        None,
        help="gallery column of every item's backfill cost (bytes, pixels, a storage tier's "
        "price; > 0): the cost-aware policy divides by it and the time axis sums it, the rate "
        "(--items-per-s-per-gpu) then counting its units per second; none: 1 per item",
    )
    query_log: str | None = option(
        None,
        help="parquet query log: query_id (+ count, order, new/old vectors) or item_id (+ count) "
        "of returned items; for demand, upgrade-on-read and the frequency-weighted metrics",
    )
    workload: ZipfWorkload = option(
        ZipfWorkload(),
        help="without --query-log: a generated Zipf log over the embeddings' queries "
        "(written to <out>/query_log.parquet)",
    )
    policy_options: PolicyOptions = option(
        PolicyOptions(), help="the bases of cost-aware, demand and upgrade-on-read"
    )
    canary: str | None = option(
        None,
        help="a canary parquet, or the URI of a store a live index serves (its registered "
        "canary): its curve along every simulated order, as the live index measures it, "
        "into canary.json",
    )
    canary_options: CanaryOptions = option(
        CanaryOptions(), help="the canary's positions, cut-off, intervals and guards (--canary)"
    )
    grid_step: float = positive(5.0, help="grid step in percent (5: 21 points)")
    k: int = positive(100, help="cut-off of mAP@k")
    seed: int = option(0, help="seed of the random and learned policies")
    items_per_s_per_gpu: float | None = option(
        None,
        min=1e-12,
        help="backfill rate per GPU for the time axis (none: measured with --new-model)",
    )
    gpus: int = positive(1, help="number of GPUs backfilling")
    newstar_metrics: str | None = option(
        None, help="JSON file {metric: value} of the paragon new*-new* (enables AUC gain)"
    )
    learned_sample: float = option(0.02, help="held-out sample fraction of the learned policy")
    rank_merge_distance: str = choices(
        "sq_l2", "sq_l2_raw", default="sq_l2", help="distance of the rank_merge mode"
    )
    device: str = option("auto", help="torch device for scoring (auto: cuda if available)")
    engine: str = choices(
        "auto",
        "memory",
        "ray",
        default="auto",
        help="memory: load the gallery into this process; ray: stream its parquet row groups "
        "through Ray tasks (any size; the driver holds one number per item); auto: ray above "
        "--distributed-above-mb of vectors",
    )
    distributed_above_mb: float = positive(
        1024.0, help="with --engine auto: vector columns larger than this (MiB on disk) go to ray"
    )
    storage: str | None = option(
        None,
        help="shared storage: a local path or any URI pyarrow opens "
        "(s3://bucket/prefix, gs://..., file:///nfs/...); checked for "
        "writing at start; the report goes to <storage>/backfill/<name> "
        "unless --out is given",
    )
    name: str = option("simulation", help="report folder name under <storage>/backfill")
    out: str | None = option(
        None,
        help="report folder or URI (none: backfill_out, or "
        "<storage>/backfill/<name> with --storage)",
    )
    overwrite: bool = option(
        False, help="write into a report folder that holds another run's report"
    )
    reference_cache: str = option(
        "auto",
        help="folder of old-old references, reused by any later run on the same old vectors, "
        "queries, labels and k (auto: reference_cache beside the report folder; none: off)",
    )
    plots: bool = option(True, help="write the PNG plots (--no-plots skips them)")
    quiet: bool = option(False, help="no progress messages")


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "simulate-backfill",
        description="Simulate hot-refresh backfilling of a gallery: exact mAP@k / mAP / top-1 / "
        "NFR@1 "
        "curves for each backfill policy and query mode, with AUCs, regression statistics, "
        "a simulated time axis, and JSON / markdown / PNG reports.",
    )
    add_options(parser, BackfillJobOptions, exclude=("images_per_class", "resolution", "backbone"))
    parser.add_argument(
        "embeddings",
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="DATASET",
        help="the parquet dataset (same as --embeddings)",
    )
    return parser


def _load_bundle(path: str, what: str):
    from raycompat.models import ModelBundle

    if not os.path.isdir(path):
        raise BackfillInputError(f"{what} not found: {path}")
    try:
        return ModelBundle.load(path)
    except FileNotFoundError as exc:
        raise BackfillInputError(f"{what}: {exc}") from exc
    except Exception as exc:
        raise BackfillInputError(
            f"{what}: cannot load bundle {path}: {exc}".splitlines()[0]
        ) from exc


def _input_location(path: str, flag: str = "--embeddings") -> str:
    """``--embeddings`` (or ``flag``) resolved (:class:`raycompat.storage.Location`): an
    absolute path or a normalised URI; a URI pyarrow cannot open is a ``BackfillInputError``."""
    from raycompat.storage import StorageError, resolve_location

    try:
        return resolve_location(path, flag).uri
    except StorageError as exc:
        raise BackfillInputError(str(exc)) from exc


def _store_flags(opts: BackfillJobOptions) -> BackfillJobOptions:
    """``--store`` and the flags that go with it checked (``ConfigError`` naming them), the
    ``--queries`` path resolved; ``opts`` as it is without them."""
    given = opts.store_input
    if not given.store:
        if given.queries or given.store_columns:
            raise ConfigError("--queries and --store-columns go with --store")
        return opts
    clash = [
        flag
        for flag, value in (
            ("--embeddings (DATASET)", opts.embeddings),
            ("--candidates", opts.candidates),
            ("--cost-column", opts.cost_column),
        )
        if value
    ]
    if clash:
        raise ConfigError(
            f"--store reads the gallery from the store: not with {', '.join(clash)}, which "
            "read an embeddings parquet"
        )
    if opts.engine == "ray":
        raise ConfigError(
            "--store reads the gallery into this process: --engine ray streams the row "
            "groups of a parquet dataset only (use --engine memory or auto)"
        )
    if not given.queries:
        raise ConfigError("--store needs --queries (the queries, embedded by both models)")
    from raycompat.simulator.store_inputs import parse_store_columns

    parse_store_columns(given.store_columns)  # a bad item named before the output folder
    queries = _input_location(given.queries, "--queries")
    return dataclasses.replace(opts, store_input=dataclasses.replace(given, queries=queries))


def _output(opts: BackfillJobOptions):
    """The checked output location (an unwritable one is reported now, not after the simulation)."""
    from raycompat.outputs import resolve_job_output
    from raycompat.storage import StorageError

    try:
        return resolve_job_output(
            "backfill",
            out=opts.out,
            storage=opts.storage,
            name=opts.name,
            default_out="backfill_out",
            config=opts,
            overwrite=opts.overwrite,
            ignore=("device",),
        )
    except StorageError as exc:
        raise BackfillInputError(str(exc)) from exc


def _use_ray(opts: BackfillJobOptions, say) -> bool:
    """Whether the dataset goes through the distributed engine (``--engine``; auto: by the
    size of its vector columns on disk)."""
    if opts.store_input.store:  # a store is read into this process
        return False
    if opts.engine != "auto":
        return opts.engine == "ray"
    from raycompat.embeddings.dataset import vector_bytes

    size = vector_bytes(opts.embeddings)
    big = size > opts.distributed_above_mb * 2**20
    say(
        f"{size / 2**20:,.0f} MiB of vectors: "
        + ("the distributed engine (Ray)" if big else "in memory")
        + f" (--distributed-above-mb {opts.distributed_above_mb:g})"
    )
    return big


def _gallery_modules(bundle) -> dict:
    """The new bundle's modules applied to gallery rows (psi, fct, rho, psi_rev)."""
    return {k: m for k, m in bundle.modules.items() if k in ("psi", "fct", "rho", "psi_rev")}


def _load_inputs(opts: BackfillJobOptions, say, streamed: bool = False):
    """``(data, new bundle or None, uncertainty head or None)``, dimensions checked, the new
    bundle's psi / rho / psi_rev applied (``streamed``: data is a
    :class:`~raycompat.embeddings.dataset.ParquetGallery`; the tasks apply them to each block)."""
    new_bundle = _load_bundle(opts.new_model, "--new-model") if opts.new_model else None
    old_bundle = _load_bundle(opts.old_model, "--old-model") if opts.old_model else None
    column = {side: f"column {side!r}" for side in ("old", "new")}
    if old_bundle is not None and new_bundle is not None:
        from raycompat.models.fingerprint import check_predecessor

        warning = check_predecessor(opts.old_model, opts.new_model, opts.allow_unrelated)
        if warning:
            say(f"warning: {warning}")
    compatible_dim = new_bundle.manifest.get("compatible_dim") if new_bundle is not None else None
    if opts.store_input.store:
        from raycompat.simulator.store_inputs import load_store_gallery, parse_store_columns

        store = opts.store_input
        say(f"opening {store.store} (the gallery) and {store.queries} (the queries)")
        data = load_store_gallery(store, compatible_dim=compatible_dim, say=say)
        columns = parse_store_columns(store.store_columns)
        column = {s: f"column {columns.physical(s)!r} of --store {store.store}" for s in column}
        note = None
    elif streamed:
        from raycompat.embeddings.dataset import ParquetGallery

        say(f"opening {opts.embeddings} (labels, ids and queries; vectors stay where they are)")
        data = ParquetGallery.open(
            opts.embeddings, compatible_dim=compatible_dim, cost_column=opts.cost_column
        )
        note = data.label_note
        say(f"{len(data.files)} shard(s), {len(data.groups)} row groups")
    else:
        say(f"loading {opts.embeddings}")
        data = load_parquet(
            opts.embeddings, compatible_dim=compatible_dim, cost_column=opts.cost_column
        )
        note = data.extra.get("label_note")
    say(
        f"{data.n_items:,} gallery items, {data.n_queries:,} queries, old dim {data.old_dim}, "
        f"new dim {data.new_dim}"
    )
    if note:
        say(str(note))
    if old_bundle is not None and old_bundle.embed_dim != data.old_dim:
        raise BackfillInputError(
            f"dimension mismatch: --old-model embeds {old_bundle.embed_dim} dims, "
            f"{column['old']} has {data.old_dim}"
        )
    head = None
    if new_bundle is not None:
        if new_bundle.embed_dim != data.new_dim:
            raise BackfillInputError(
                f"dimension mismatch: --new-model embeds {new_bundle.embed_dim} dims, "
                f"{column['new']} has {data.new_dim}"
            )
        if not streamed:
            data = apply_bundle_modules(data, new_bundle)
        if "head" in new_bundle.modules:
            head = UncertaintyHead.from_classifier_head(new_bundle.head)
    return data, new_bundle, head


def _default_policies(data, head, opts: BackfillJobOptions, log) -> tuple[str, ...]:
    """Every policy the inputs allow: uncertainty needs the new head or stored uncertainty
    columns, learned the adapted or compatible old features, cost-aware a cost column,
    demand and upgrade-on-read a query log."""
    pols = list(_embedding_policies(data, head))
    if opts.cost_column and opts.policy_options.cost_base in pols:
        pols.append("cost-aware")
    if log is not None:
        pols += ["demand", "upgrade-on-read"]
    return tuple(pols)


def _embedding_policies(data, head) -> tuple[str, ...]:
    """The policies that need no more than the embeddings and the new model's head."""
    pols = ["random", "sequential"]
    stored = data.extra.get("uncertainty", {})
    pols += [
        p
        for p in POLICIES
        if p.startswith("uncertainty:") and (head is not None or p.split(":")[1] in stored)
    ]
    pols.append("hinge-benefit")
    if data.gallery_adapted is not None or data.compat_dim == data.old_dim:
        pols.append("learned")
    return tuple(pols)


def _cost_model(opts: BackfillJobOptions, new_bundle, say):
    """The time axis: a given rate per GPU, or the new embedder's rate measured on the CPU
    (labelled "items/s on cpu"); with a cost column the given rate counts its units."""
    from raycompat.upgrade.cost import CostModel, measure_items_per_s

    if opts.items_per_s_per_gpu is not None:
        unit = opts.cost_column or "items"
        return CostModel(opts.items_per_s_per_gpu, opts.gpus, source="given", unit=unit)
    if opts.cost_column and new_bundle is not None:
        raise ConfigError(
            f"--cost-column {opts.cost_column}: the time axis sums the items' costs, so give the "
            f"rate in {opts.cost_column} per second per GPU (--items-per-s-per-gpu); a measured "
            "rate counts items"
        )
    if new_bundle is None:
        return None
    rate = measure_items_per_s(new_bundle, device="cpu")
    say(f"measured {rate:.1f} items/s on cpu for the new embedder")
    return CostModel(rate, opts.gpus, source="measured: new embedder, random inputs", device="cpu")


def _references(path: str | None) -> dict | None:
    """``{"new*-new*": metrics}`` from ``--newstar-metrics``."""
    if not path:
        return None
    try:
        with open(path) as f:
            ns = json.load(f)
    except (OSError, ValueError) as exc:
        raise BackfillInputError(f"--newstar-metrics: cannot read {path}: {exc}") from exc
    if not isinstance(ns, dict) or not all(isinstance(v, (int, float)) for v in ns.values()):
        raise BackfillInputError("--newstar-metrics must be a JSON object {metric: number}")
    return {"new*-new*": ns}


def _query_log(opts: BackfillJobOptions, data, output, say):
    """The query log: ``--query-log``, or a Zipf log over the embeddings' queries generated
    into ``<out>/query_log.parquet`` (``--zipf-exponent``), or None."""
    from raycompat.upgrade.query_log import read_query_log

    if opts.query_log:
        log = read_query_log(opts.query_log)
    elif opts.workload.zipf_exponent is not None:
        from raycompat.data.workload import write_query_log, zipf_query_log

        w = opts.workload
        columns = zipf_query_log(
            data.query_ids,
            data.query_labels,
            searches=w.zipf_searches,
            exponent=w.zipf_exponent,
            seed=w.zipf_seed,
        )
        path = write_query_log(output.path("query_log.parquet"), columns, overwrite=True)
        say(f"Zipf query log (exponent {w.zipf_exponent:g}, {w.zipf_searches} searches): {path}")
        log = read_query_log(path)
    else:
        return None
    say(f"query log: {log.searches:,} searches of {log.keys.size:,} distinct {log.kind}")
    return log


def _published(written: dict, output) -> dict:
    """``written``'s paths at the output's destination (a URI after :meth:`publish`)."""
    where = output.publish()
    if where == output.local:
        return written
    rename = lambda p: where + "/" + os.path.basename(p)  # noqa: E731
    out = {
        "json": rename(written["json"]),
        "markdown": rename(written["markdown"]),
        "plots": [rename(p) for p in written["plots"]],
    }
    for key in ("canary", "samples"):
        if written.get(key):
            out[key] = rename(written[key])
    return out


def _embed_first(opts: BackfillJobOptions, output, say) -> str:
    """Without ``--embeddings``: the scenario's queries, gallery and distractors embedded by both
    models with the Ray Data pipeline into ``<out>/embeddings``; returns that folder."""
    from raycompat.data.user_scenarios import resolve_scenario, write_scenario_file
    from raycompat.models import ModelBundle
    from raycompat.pipeline.job import EmbedGalleryOptions, run_job

    if not (opts.old_model and opts.new_model):
        raise ConfigError(
            "give --embeddings, or --old-model and --new-model to embed --scenario / --source first"
        )
    sizes = opts.sizes
    if opts.data.user and not sizes.scenario_file:  # the allocation, written where it is used
        scenario = resolve_scenario(sizes, opts.data)
        path = write_scenario_file(scenario, output.path("scenario.json"))
        sizes = dataclasses.replace(sizes, scenario=path)
    has_head = ModelBundle.load(opts.new_model).has_head
    embed = EmbedGalleryOptions(
        out=output.path("embeddings"),
        old_model=opts.old_model,
        new_model=opts.new_model,
        allow_unrelated=opts.allow_unrelated,
        columns=("old", "new"),
        uncertainty=has_head,
        data=opts.data,
        sizes=sizes,
    )
    say(f"embedding the scenario's queries and gallery into {embed.out}")
    return run_job(embed).path


def run(opts: BackfillJobOptions, log=None) -> dict[str, object]:
    """Load inputs, simulate, write reports; returns the written paths.

    Cheap checks (names, parquet schema and values) run before torch is imported,
    so bad input fails fast."""
    say = log or (lambda msg: None)
    opts = _store_flags(opts)
    store = opts.store_input.store
    if opts.embeddings:  # one form (absolute path or URI) for the readers and job.json
        opts = dataclasses.replace(opts, embeddings=_input_location(opts.embeddings))
    output = _output(opts)
    if not opts.embeddings and not store:
        opts = dataclasses.replace(opts, embeddings=_embed_first(opts, output, say))
    if opts.candidates:
        return run_candidates(opts, output, say)
    # validate names before the (possibly long) loading
    req_policies = parse_policies(opts.policies) if opts.policies else None
    req_modes = parse_modes(opts.modes) if opts.modes else None
    distributed = _use_ray(opts, say)
    data, new_bundle, head = _load_inputs(opts, say, streamed=distributed)
    from raycompat.simulator.report import write_reports

    probe = data.probe() if distributed else data
    if distributed and new_bundle is not None:
        probe = apply_bundle_modules(probe, new_bundle)
    modes = req_modes or available_modes(probe)
    if not modes:
        raise BackfillInputError("no query mode is possible with these inputs")
    log = _query_log(opts, data, output, say)
    policies = req_policies or _default_policies(probe, head, opts, log)
    cost = _cost_model(opts, new_bundle, say)
    say(f"policies: {', '.join(policies)}; modes: {', '.join(modes)}")
    common = dict(
        grid_step=opts.grid_step,
        k=opts.k,
        seed=opts.seed,
        head=head,
        cost=cost,
        references=_references(opts.newstar_metrics),
        learned_sample_fraction=opts.learned_sample,
        rank_merge_distance=opts.rank_merge_distance,
        progress=say,
        bootstrap=opts.bootstrap,
        query_log=log,
        policy_options=opts.policy_options,
        reference_cache=_reference_cache(opts, output, say),
    )
    if distributed:
        from raycompat.simulator.ray_engine import simulate_backfill_dataset

        modules = None if new_bundle is None else _gallery_modules(new_bundle)
        result = simulate_backfill_dataset(data, policies, modes, modules=modules, **common)
    else:
        from raycompat.simulator.memory_engine import simulate_backfill

        device = None if opts.device == "auto" else opts.device
        result = simulate_backfill(data, policies, modes, device=device, **common)
    title = f"Backfill simulation: {store or os.path.basename(opts.embeddings.rstrip('/'))}"
    written = write_reports(result, output.local, plots=opts.plots, title=title)
    if opts.canary:
        written["canary"] = _canary_curves(opts, result, data, new_bundle, output, distributed)
    return _published(written, output)


def parse_candidates(text: str) -> dict[str, str]:
    """``--candidates``: ``name=column`` or ``column`` items -> ``{name: column}``."""
    from raycompat.simulator.candidates import check_candidates

    out: dict[str, str] = {}
    for item in (t.strip() for t in text.split(",")):
        name, _, column = item.partition("=")
        name, column = name.strip(), (column or name).strip()
        if not column or name in out:
            raise ConfigError(f"--candidates: {item!r} is empty or repeats a name")
        out[name] = column
    check_candidates(out, "--candidates")
    return out


_NOT_WITH_CANDIDATES = ("new_model", "old_model", "query_log", "canary", "cost_column")


def run_candidates(opts: BackfillJobOptions, output, say) -> dict[str, object]:
    """Several candidates of one embeddings dataset in one pass: each one's reports in
    ``<out>/<name>``, their comparison in ``candidates.md`` / ``candidates.json``."""
    from raycompat.simulator.report import write_candidates_summary, write_reports

    given = [f"--{f.replace('_', '-')}" for f in _NOT_WITH_CANDIDATES if getattr(opts, f)]
    if given or opts.workload.zipf_exponent is not None:
        raise ConfigError(
            "--candidates takes new-vector columns of --embeddings only, not "
            f"{given or ['a workload']}"
        )
    columns = parse_candidates(opts.candidates)
    common = dict(
        grid_step=opts.grid_step,
        k=opts.k,
        seed=opts.seed,
        cost=_cost_model(opts, None, say),
        references=_references(opts.newstar_metrics),
        learned_sample_fraction=opts.learned_sample,
        rank_merge_distance=opts.rank_merge_distance,
        progress=say,
        bootstrap=opts.bootstrap,
        policy_options=opts.policy_options,
        reference_cache=_reference_cache(opts, output, say),
    )
    say(f"candidates: {', '.join(f'{n} ({c})' for n, c in columns.items())}")
    first = next(iter(columns.values()))

    def names(probe):  # as a single run of the first candidate: what its inputs allow
        policies = parse_policies(opts.policies) if opts.policies else None
        policies = policies or _default_policies(probe, None, opts, None)
        return policies, parse_modes(opts.modes) if opts.modes else available_modes(probe)

    if _use_ray(opts, say):
        from raycompat.embeddings.dataset import ParquetGallery
        from raycompat.simulator.ray_candidates import simulate_candidates_dataset

        ds = ParquetGallery.open(opts.embeddings)
        policies, modes = names(ds.candidate_view(first).probe())
        results = simulate_candidates_dataset(ds, columns, policies, modes, **common)
    else:
        from raycompat.embeddings.gallery import load_candidates
        from raycompat.simulator.candidates import simulate_candidates

        say(f"loading {opts.embeddings}")
        datas = load_candidates(load_parquet(opts.embeddings), opts.embeddings, columns)
        policies, modes = names(next(iter(datas.values())))
        device = None if opts.device == "auto" else opts.device
        results = simulate_candidates(datas, policies, modes, device=device, **common)
    name = os.path.basename(opts.embeddings.rstrip("/"))
    written = {
        n: write_reports(r, output.path(n), plots=opts.plots, title=f"Candidate {n}: {name}")
        for n, r in results.items()
    }
    summary = write_candidates_summary(results, columns, written, output.local)
    where = output.publish()
    return {"json": summary["json"], "markdown": summary["markdown"], "plots": [],
            "candidates": written, "destination": where}  # fmt: skip


def _reference_cache(opts: BackfillJobOptions, output, say):
    """The :class:`ReferenceCache` of ``--reference-cache``, or None (``none``, or ``auto``
    with a report going to a URI)."""
    from raycompat.simulator.reference_cache import ReferenceCache

    where = opts.reference_cache
    if where == "none":
        return None
    if where == "auto":
        if output.remote:
            say("no reference cache for a report at a URI (give --reference-cache <folder>)")
            return None
        where = os.path.join(os.path.dirname(os.path.abspath(output.local)), "reference_cache")
    return ReferenceCache(where, say)


def _canary_curves(opts, result, data, new_bundle, output, distributed: bool) -> str:
    """``canary.json``: the canary of ``--canary`` along every simulated order."""
    from raycompat.upgrade.canary import write_canary_curves

    if distributed:
        raise BackfillInputError("--canary needs the in-memory engine: pass --engine memory")
    return write_canary_curves(
        result, data, opts.canary, opts.canary_options, output.local, new_bundle
    )


@job_main
def main(argv: list[str] | None = None) -> int:
    opts = options_from_args(BackfillJobOptions, build_parser().parse_args(argv))

    def log(msg: str) -> None:
        if not opts.quiet:
            print(msg, file=sys.stderr, flush=True)

    try:
        paths = run(opts, log)
    except BackfillInputError as exc:
        return fail(str(exc))
    print(f"report: {paths['markdown']}")
    print(f"json:   {paths['json']}")
    for p in paths["plots"]:
        print(f"plot:   {p}")
    if "canary" in paths:
        print(f"canary: {paths['canary']}")
    return 0
