"""Embed a gallery with the old and new models (and psi) into resumable parquet shards (Ray Data).

``embed_gallery`` is the library call (the main job and the backfill use it);
``main`` is ``raycompat embed-gallery`` / ``jobs/embed_gallery.py``. Stages
(``raycompat.pipeline.stages``)::

    chunk ids -> load_images (render / decode) -> preprocess -> [new embedder pool]
              -> [old embedder pool] -> [psi + uncertainty pool] -> driver: shard writer

The model stages are actor pools, or Ray tasks with ``--model-stages tasks`` (docs/simulator.md,
"Actors or tasks"). Only the stages the requested columns need are built. Output
(``raycompat.pipeline.writer``): ``<out>/part-<chunk>.parquet`` shards, ``<out>/_manifest.json``,
``<out>/_summary.json``; ``raycompat.embeddings.gallery.load_parquet(<out>)`` reads the folder
directly. ``<out>`` is a local folder or a URI (``raycompat.pipeline.location``); the job's
``--storage S`` puts it at ``S/embeddings/<--name>``. See docs/architecture.md (Data flow, Jobs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from raycompat.config import (
    ConfigError,
    add_options,
    choices,
    make_parser,
    nonnegative,
    option,
    options_from_args,
)
from raycompat.console import fail, job_main, quiet_ray
from raycompat.data.readers import CorruptImageError
from raycompat.data.scenarios import ScenarioSizes
from raycompat.data.source import DataSourceOptions
from raycompat.pipeline.ids import IdPlan, parse_ids_option
from raycompat.pipeline.options import (
    ExecutionOptions,
    PipelineOptions,
    StageFlags,
    parse_columns,
    pipeline_options,
)
from raycompat.pipeline.stages import POSITION_COLUMN, UNCERTAINTY_COLUMNS

__all__ = ["EmbedGalleryOptions", "GalleryRun", "embed_gallery", "build_parser", "run_job", "main"]

SUMMARY_NAME = "_summary.json"


@dataclass
class GalleryRun:
    """Result of :func:`embed_gallery`: the output folder (a parquet dataset; a local path or
    a URI) and the summary."""

    path: str
    summary: dict

    def load(self, **kw):
        """The output as :class:`~raycompat.embeddings.gallery.GalleryEmbeddings` (needs old and
        new columns)."""
        from raycompat.embeddings.gallery import load_parquet

        return load_parquet(self.path, **kw)

    def table(self, columns=None):
        """The output as one pyarrow table sorted by ``item_id``."""
        import pyarrow.parquet as pq

        return pq.read_table(self.path, columns=columns).sort_by("item_id")


@dataclass(frozen=True)
class StagePlan:
    """Which model stages a run needs and the output vector dimensions per column."""

    need_old: bool
    need_new: bool
    need_feature_stage: bool
    dims: dict


# ----------------------------------------------------------------------------- models and stages
def _check_models(
    columns, uncertainty, old_model, new_model, stored_old_dim: int | None
) -> tuple[bool, bool]:
    """``(need_old, need_new_bundle)``; ``ConfigError`` when a needed model is missing."""
    if stored_old_dim is not None and "new" in columns:
        raise ConfigError(
            "column 'new' needs images; the old-feature source only has old features "
            "(it serves 'old', 'adapted' and uncertainty)"
        )
    need_old = stored_old_dim is None and ("old" in columns or "adapted" in columns or uncertainty)
    need_new_bundle = "new" in columns or "adapted" in columns or uncertainty
    if need_old and not old_model:
        raise ConfigError(
            "the old model is required for columns old/adapted and uncertainty: pass "
            "--old-model (a saved bundle folder) or --random-init DIR for a smoke run"
        )
    if need_new_bundle and not new_model:
        raise ConfigError(
            "the new model is required for columns new/adapted and uncertainty: pass "
            "--new-model (a saved bundle folder) or --random-init DIR for a smoke run"
        )
    return need_old, need_new_bundle


def _output_dims(columns, uncertainty, old_info, new_info, new_model) -> dict:
    """Vector dimension per output column; ``ConfigError`` when psi or the head do not fit."""
    dims = {}
    for c in columns:
        if c == "old":
            dims["old"] = old_info["embed_dim"]
        elif c == "new":
            dims["new"] = new_info["embed_dim"]
        else:
            if new_info["psi_dims"] is None:
                raise ConfigError(
                    f"column 'adapted' needs psi, but the new model {new_model!r} has no 'psi' "
                    f"module (modules: {new_info['modules']}); psi comes from DMU training"
                )
            if new_info["psi_dims"][0] != old_info["embed_dim"]:
                raise ConfigError(
                    f"psi of {new_model!r} expects {new_info['psi_dims'][0]}-dim old features, "
                    f"the old model gives {old_info['embed_dim']}"
                )
            dims["adapted"] = new_info["psi_dims"][1]
    if uncertainty and "head" not in new_info["modules"]:
        raise ConfigError(
            f"uncertainty needs the new model's classifier head; {new_model!r} has none"
        )
    if uncertainty and old_info["embed_dim"] > new_info["embed_dim"]:
        raise ConfigError(
            f"uncertainty needs D_old <= D_new, got {old_info['embed_dim']} > "
            f"{new_info['embed_dim']}"
        )
    return dims


def resolve_models(
    columns, uncertainty, old_model, new_model, stored_old_dim: int | None = None
) -> StagePlan:
    """Which stages run and the output dims. ``stored_old_dim``: the source already holds old
    features (``OldFeatureSource``) of that dimension, so no image stage and no old model."""
    from raycompat.models.fingerprint import embedder_info

    if stored_old_dim is not None:
        old_model = None
    need_old, need_new_bundle = _check_models(
        columns, uncertainty, old_model, new_model, stored_old_dim
    )
    old_info = embedder_info(old_model) if need_old else None
    if stored_old_dim is not None:
        old_info = {"embed_dim": int(stored_old_dim)}
    new_info = embedder_info(new_model) if need_new_bundle else None
    dims = _output_dims(columns, uncertainty, old_info, new_info, new_model)
    return StagePlan(need_old, "new" in columns, "adapted" in columns or uncertainty, dims)


def _gpus(stage, opts: PipelineOptions, cluster_gpus: float) -> float:
    if stage.num_gpus is not None:
        return float(stage.num_gpus)
    return opts.gpu_fraction if cluster_gpus > 0 else 0.0


def _resources(stage):
    return dict(stage.resources) if stage.resources else None


def _id_blocks(todo, plan: IdPlan, size: int) -> list:
    """The input: the ids and their plan positions (``POSITION_COLUMN``), one block per render
    batch (not per chunk), so results stream out of the render tasks batch by batch instead of
    a whole chunk at a time."""
    import pyarrow as pa

    blocks = []
    for chunk in todo:
        ids = plan.chunk_ids(chunk)
        first = chunk * plan.chunk_size
        for k in range(0, len(ids), size):
            part = ids[k : k + size]
            positions = np.arange(first + k, first + k + len(part), dtype=np.int64)
            blocks.append(pa.table({"item_id": part, POSITION_COLUMN: positions}))
    return blocks


def _task_stage(ds, fn, stage, **kw):
    from ray.data import TaskPoolStrategy

    return ds.map_batches(
        fn,
        batch_size=stage.batch_size,
        num_cpus=stage.num_cpus,
        resources=_resources(stage),
        compute=TaskPoolStrategy(size=stage.concurrency),
        **kw,
    )


def _model_stage(ds, cls, stage, opts: PipelineOptions, cluster_gpus: float, plan, **kwargs):
    """A model stage ``cls(**kwargs, batches=..., threads=..., use_gpu=...)``, its model run in
    the fixed sub-batches of ``plan`` of the stage's batch size: an actor pool, or with
    ``opts.model_stages`` ``tasks`` Ray tasks that keep the stage per worker process."""
    from ray.data import ActorPoolStrategy

    from raycompat.pipeline.ids import ForwardBatches
    from raycompat.pipeline.stages import TASKS

    g = _gpus(stage, opts, cluster_gpus)
    batches = ForwardBatches.of(plan, stage.batch_size)
    kwargs.update(batches=batches, threads=opts.threads, use_gpu=g > 0)
    if opts.model_stages == "tasks":
        fn_kwargs = dict(kwargs, fingerprint=_fingerprint(kwargs))
        return _task_stage(ds, TASKS[cls], stage, num_gpus=g or None, fn_kwargs=fn_kwargs)
    return ds.map_batches(
        cls,
        fn_constructor_kwargs=kwargs,
        batch_size=stage.batch_size,
        num_cpus=stage.num_cpus,
        num_gpus=g or None,
        resources=_resources(stage),
        compute=ActorPoolStrategy(size=stage.concurrency),
    )


def _fingerprint(kwargs: dict) -> str:
    """The fingerprint of a model stage's bundle: part of its worker cache key, so a bundle
    saved again at the same path is loaded again."""
    from raycompat.models.fingerprint import bundle_fingerprint

    return bundle_fingerprint(kwargs.get("bundle_path") or kwargs["new_bundle_path"])


def build_dataset(
    todo,
    plan,
    source,
    old_model,
    new_model,
    stages: StagePlan,
    columns,
    uncertainty,
    opts: PipelineOptions,
):
    """The lazy Ray Data pipeline for chunks ``todo``."""
    import ray

    from raycompat.pipeline.stages import EmbedStage, OldFeatureStage, load_images, preprocess

    st = opts.stages
    cluster_gpus = float(ray.cluster_resources().get("GPU", 0))
    ds = ray.data.from_arrow(_id_blocks(todo, plan, st["render"].batch_size))
    ds = _task_stage(
        ds, load_images, st["render"], fn_kwargs={"source": source, "on_corrupt": opts.on_corrupt}
    )
    need_old, need_new = stages.need_old, stages.need_new
    if getattr(source, "provides_old", False):  # stored old features: no image, no backbone
        need_old = need_new = False
    else:
        ds = _task_stage(ds, preprocess, st["preprocess"])
    if need_new:
        ds = _model_stage(
            ds,
            EmbedStage,
            st["new"],
            opts,
            cluster_gpus,
            plan,
            bundle_path=new_model,
            column="new",
            drop_pixels=not need_old,
        )
    if need_old:
        ds = _model_stage(
            ds,
            EmbedStage,
            st["old"],
            opts,
            cluster_gpus,
            plan,
            bundle_path=old_model,
            column="old",
            drop_pixels=True,
        )
    if stages.need_feature_stage:
        ds = _model_stage(
            ds,
            OldFeatureStage,
            st["adapt"],
            opts,
            cluster_gpus,
            plan,
            new_bundle_path=new_model,
            adapt="adapted" in columns,
            uncertainty=uncertainty,
            drop_old="old" not in columns,
        )
    return ds


def _find_corrupt(exc: BaseException) -> str | None:
    """The CorruptImageError message inside a Ray Data failure, if that is what it was (Ray
    wraps it in RayTaskError / UserCodeException; the message survives in the text)."""
    import re

    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        found = re.search(r"corrupt image item_id=[^\n]*", str(e))
        if found:
            return found.group(0)
        stack += [cause, e.__cause__, e.__context__]
    return None


# ----------------------------------------------------------------------------- the run
def _id_plan(source, ids, chunk_size: int) -> IdPlan:
    """The ids to embed (all of ``source``'s, or ``ids``), in chunks of ``chunk_size``."""
    if ids is not None:
        plan = IdPlan.from_ids(np.asarray(ids, np.int64), chunk_size)
        source.check_ids(plan.ids)
        return plan
    if source.all_ids() is not None:
        return IdPlan.from_ids(source.all_ids(), chunk_size)
    return IdPlan(chunk_size, 0, source.num_ids())


@dataclass
class _Output:
    """The opened output: where, its shard store, and what an earlier run already wrote."""

    location: object
    store: object
    schema: object
    done: set
    resuming: bool
    removed: int


def _open_output(
    out, opts: PipelineOptions, source, plan: IdPlan, columns, unc_cols, models: dict, dims: dict
) -> _Output:
    """Create and check ``out`` (``StorageError`` otherwise), write or check its manifest
    (``ConfigError`` for other settings) and find the complete shards."""
    from raycompat.pipeline.location import open_output
    from raycompat.pipeline.manifest import check_or_write, content_manifest
    from raycompat.pipeline.writer import ShardStore, output_schema

    location = open_output(out)
    if opts.overwrite:
        location.clear()
    resuming = check_or_write(
        location, content_manifest(source, plan, columns, unc_cols, models, dims)
    )
    schema = output_schema(dims, unc_cols)
    store = ShardStore(location, schema)
    removed = store.remove_temp_files()
    done = store.completed(plan.num_chunks, plan.chunk_length)
    return _Output(location, store, schema, done, resuming, removed)


def _configure_ray_data(opts: PipelineOptions) -> None:
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.per_stage_map_timing = True
    bars = opts.ray_progress_bars
    ctx.enable_progress_bars = sys.stderr.isatty() if bars is None else bars


def _stream(ds, assembler, memory, planned: int, todo, opts: PipelineOptions, out: str, log):
    """Write every batch of ``ds`` through ``assembler``, logging progress; returns the time
    and item count of the first output (``None`` if there was none)."""
    started = last = time.perf_counter()
    first = None
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1):
            assembler.add(batch)
            now = time.perf_counter()
            if first is None:
                first = (now - started, assembler.received)
            if now - last >= opts.progress_every_s:
                last = now
                got = assembler.received
                rate = got / max(now - started, 1e-9)
                eta = (planned - got) / rate if rate > 0 else float("inf")
                log(
                    f"[embed_gallery] {got}/{planned} items embedded "
                    f"({100 * got / planned:.1f} %), "
                    f"{assembler.written_chunks}/{len(todo)} shards written, {rate:.0f} items/s, "
                    f"ETA {eta:.0f} s, peak memory PSS {memory.peak_pss_mib:.0f} MiB"
                )
    except Exception as exc:  # Ray Data wraps a failing stage's exception
        message = _find_corrupt(exc)
        if message:
            raise CorruptImageError(
                f"{message}. {assembler.written_chunks} complete shard(s) kept in {out}; "
                "rerun with "
                "--on-corrupt skip to skip such images (the run resumes)"
            ) from None
        raise
    return first


def _summary(
    out: str,
    plan: IdPlan,
    planned: int,
    resumed_items: int,
    assembler,
    seconds: float,
    first,
    columns,
    unc_cols,
    dims: dict,
    memory,
    stages: list,
    opts: PipelineOptions,
) -> dict:
    """What ``_summary.json`` holds (and :func:`format_summary` prints)."""
    skipped = assembler.skipped
    return {
        "out": out,
        "items_planned": planned,
        "items_total": len(plan),
        "items_resumed": resumed_items,
        "items_written": assembler.written_items,
        "items_skipped": len(skipped),
        "skipped": skipped[:1000],
        "shards_written": assembler.written_chunks,
        "seconds": seconds,
        "items_per_s": (assembler.written_items + len(skipped)) / seconds if seconds > 0 else 0.0,
        "first_output_s": first[0] if first else None,
        "steady_items_per_s": (
            (assembler.received - first[1]) / (seconds - first[0])
            if first and seconds > first[0]
            else None
        ),
        "columns": list(columns),
        "uncertainty_columns": list(unc_cols),
        "dims": dims,
        "memory": {
            "peak_rss_mib": memory.peak_rss_mib,
            "peak_pss_mib": memory.peak_pss_mib,
            "what": "sum over the driver and every process it started (embedded Ray: GCS, raylet, "
            "workers, actors); PSS splits shared pages such as the object store",
            **memory.halves(),
            "series_s_items_rss_pss": memory.thinned_series(),
        },
        "stages": stages,
        "options": asdict(opts),
        # where the embedding stages ran (this run's rows): {stage: {Ray node id: rows}}
        "nodes": {
            stage: dict(sorted(per_node.items()))
            for stage, per_node in sorted(assembler.node_items.items())
        },
    }


def _log_start(
    log,
    source,
    plan: IdPlan,
    columns,
    uncertainty: bool,
    out: str,
    output: _Output,
    todo,
    resumed_items: int,
) -> None:
    log(
        f"[embed_gallery] {source.kind} source, {len(plan)} items in {plan.num_chunks} chunks of "
        f"{plan.chunk_size}; columns {list(columns)}"
        f"{' + uncertainty' if uncertainty else ''} -> {out}"
    )
    if output.resuming:
        removed = output.removed
        log(
            f"[embed_gallery] resuming: {len(output.done)} chunks ({resumed_items} items) "
            "already complete, "
            f"{len(todo)} to do{f', {removed} partial temp file(s) removed' if removed else ''}"
        )


def _finish(output: _Output, summary: dict, skipped: list, log) -> None:
    """Write ``_summary.json`` and log the skipped images and the summary."""
    from raycompat.pipeline.summary import format_summary
    from raycompat.report import json_safe

    output.location.write_bytes(SUMMARY_NAME, json.dumps(json_safe(summary), indent=2).encode())
    for s in skipped[:20]:
        log(f"[embed_gallery] skipped corrupt image: {s['error']}")
    log(format_summary(summary))


def _resolve_request(source, columns, uncertainty: bool, old_model, new_model):
    """``(columns, stage plan, old model)`` of a request, checked (``ConfigError``); no old
    model when ``source`` holds stored old features."""
    columns = parse_columns(columns)
    if not columns and not uncertainty:
        raise ConfigError("nothing to compute: --columns is empty and uncertainty is off")
    stored_old_dim = source.old_dim if getattr(source, "provides_old", False) else None
    stages = resolve_models(columns, uncertainty, old_model, new_model, stored_old_dim)
    return columns, stages, (None if stored_old_dim is not None else old_model)


def embed_gallery(
    out,
    source,
    *,
    old_model: str | None = None,
    new_model: str | None = None,
    columns=("old", "new"),
    uncertainty: bool = False,
    ids=None,
    options: PipelineOptions | None = None,
    log=print,
) -> GalleryRun:
    """Embed ``source``'s items (all, or ``ids``) into parquet shards under ``out``: a local
    folder, any URI pyarrow's filesystems open (``s3://bucket/gallery``, ``file:///nfs/g``),
    or a checked ``raycompat.storage.Location``; it is created and checked for
    writing first (``StorageError`` naming it otherwise).

    ``columns``: any of ``old``, ``new``, ``adapted`` (psi(old), DMU); ``uncertainty`` adds
    ``unc_least_confidence``, ``unc_margin``, ``unc_entropy`` (RACT Eq.9-11, new head on old
    features). Models are saved bundle folders (``ModelBundle.save``); psi and the new head come
    from ``new_model``. Resumes an interrupted run with the same settings; raises
    ``ConfigError`` for different ones. Uses the connected Ray cluster (connects an embedded
    one if none)."""
    from raycompat.cluster import connect
    from raycompat.pipeline.summary import MemorySampler, stage_times
    from raycompat.pipeline.writer import ChunkAssembler

    opts = options or PipelineOptions()
    opts.check()
    columns, stages, old_model = _resolve_request(
        source, columns, uncertainty, old_model, new_model
    )
    plan = _id_plan(source, ids, opts.chunk_size)
    unc_cols = tuple(UNCERTAINTY_COLUMNS.values()) if uncertainty else ()
    models = {
        "old": old_model if stages.need_old else None,
        "new": new_model if (stages.need_new or stages.need_feature_stage) else None,
    }
    output = _open_output(out, opts, source, plan, columns, unc_cols, models, stages.dims)
    out = output.location.uri
    todo = [c for c in range(plan.num_chunks) if c not in output.done]
    resumed_items = sum(plan.chunk_length(c) for c in output.done)
    _log_start(log, source, plan, columns, uncertainty, out, output, todo, resumed_items)

    connect(None)
    _configure_ray_data(opts)
    planned = sum(plan.chunk_length(c) for c in todo)
    assembler = ChunkAssembler(output.store, plan, [f.name for f in output.schema] + ["error"])
    started = time.perf_counter()
    stage_rows: list[dict] = []
    first = None
    with MemorySampler(opts.memory_interval_s, progress=lambda: assembler.received) as memory:
        if todo:
            ds = build_dataset(
                todo, plan, source, old_model, new_model, stages, columns, uncertainty, opts
            )
            first = _stream(ds, assembler, memory, planned, todo, opts, out, log)
            stage_rows = stage_times(ds)
    seconds = time.perf_counter() - started
    if assembler.open_chunks:
        raise RuntimeError(f"{assembler.open_chunks} chunk(s) received only part of their ids")
    summary = _summary(
        out,
        plan,
        planned,
        resumed_items,
        assembler,
        seconds,
        first,
        columns,
        unc_cols,
        stages.dims,
        memory,
        stage_rows,
        opts,
    )
    _finish(output, summary, assembler.skipped, log)
    return GalleryRun(out, summary)


# ----------------------------------------------------------------------------- command line
@dataclass(frozen=True)
class EmbedGalleryOptions:
    """Every flag of the embed-gallery job (``execution`` and ``stages`` do not change the
    output)."""

    storage: str | None = option(
        None,
        help="shared storage: a local path or any URI pyarrow opens "
        "(s3://bucket/prefix, gs://..., file:///nfs/...); the output "
        "goes to <storage>/embeddings/<name> unless --out is given",
    )
    name: str = option("gallery", help="output folder name under <storage>/embeddings")
    out: str | None = option(
        None,
        help="output folder or URI (parquet shards + _manifest.json + "
        "_summary.json); default gallery_out, or <storage>/embeddings/<name>",
    )
    address: str | None = option(None, help="Ray address (none: an embedded local cluster)")
    num_cpus: int | None = option(None, min=1, help="CPUs of the embedded local cluster")
    verbose: bool = option(False, help="keep Ray's own INFO lines")
    old_model: str | None = option(None, help="old model bundle folder")
    new_model: str | None = option(
        None, help="new model bundle folder (its psi and head give adapted/uncertainty)"
    )
    random_init: str | None = option(
        None,
        help="smoke run without trained models: create (or reuse) "
        "random-init lcnet_050 bundles under this folder (old 64-d, "
        "new 128-d with psi) and use them",
    )
    columns: tuple[str, ...] = option(
        ("old", "new", "adapted"),
        help="representations: any of old,new,adapted; e.g. 'old' for the "
        "initial gallery, 'new' with --ids for a backfill batch",
    )
    uncertainty: bool = option(
        False, help="also compute unc_least_confidence, unc_margin, unc_entropy (RACT Eq.9-11)"
    )
    ids: str | None = option(
        None, help="only these item ids: START:STOP, or a file of ids (text or .npy)"
    )
    data: DataSourceOptions = option(
        DataSourceOptions(), help="the images: the built-in glyphs or yours"
    )
    old_features: str | None = option(
        None,
        help="instead of images: refresh stored old features (an earlier output folder) with "
        "psi / uncertainty",
    )
    split: str = choices(
        "query",
        "gallery",
        "distractor",
        default="gallery",
        help="without a --scenario file: the split of every item of your images",
    )
    image_resolution: int | None = option(
        None,
        flag="--resolution",
        min=1,
        help="image side in pixels (default: the old model's training resolution, else 32)",
    )
    sizes: ScenarioSizes = option(
        ScenarioSizes(),
        help="the scenario: a scenario.json (its query, gallery and distractor items), or the "
        "glyphs' allocation and sizes",
    )
    distractors: int = nonnegative(0, help="built-in glyph source: extra generated distractors")
    items: int | None = option(
        None,
        min=1,
        help="built-in glyph source: total items (scenario + generated "
        "distractors); overrides --distractors",
    )
    allow_unrelated: bool = option(
        False,
        help="embed with a new model whose recorded predecessor is not --old-model "
        "(refused otherwise)",
    )
    execution: ExecutionOptions = option(ExecutionOptions(), help="how the run executes")
    stages: StageFlags = option(factory=StageFlags, help="per-stage Ray Data resources")


#: ScenarioSizes fields the gallery source does not use (``--resolution`` is the job's own)
UNUSED_SIZES = ("images_per_class", "resolution", "backbone")


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "embed-gallery",
        description="Embed a gallery with the old model, the new model and psi "
        "(Ray Data, streaming, "
        "resumable) into parquet shards: item_id, label, split, old/new/adapted vectors, "
        "uncertainty scores.",
    )
    add_options(parser, EmbedGalleryOptions, exclude=UNUSED_SIZES)
    return parser


def _glyph_source(opts: EmbedGalleryOptions, scenario, resolution: int):
    from raycompat.pipeline.sources import GlyphGallerySource

    extra = opts.distractors
    n0 = sum(len(scenario.splits[k]) for k in ("query", "gallery", "distractors"))
    if opts.items is not None:
        if opts.items < n0:
            raise ConfigError(f"--items {opts.items} is smaller than the scenario's {n0} items")
        extra = opts.items - n0
    return GlyphGallerySource(scenario, extra, resolution, opts.sizes.data_seed)


def _file_source(opts: EmbedGalleryOptions, in_chans: int, resolution: int):
    """All the images of ``--path``, every one in ``--split``."""
    from raycompat.data.parquet_images import ParquetImageSource
    from raycompat.pipeline.sources import RecordSource

    spec = opts.data.spec()
    kw = dict(split=opts.split, resolution=resolution, in_chans=in_chans)
    try:
        if spec.kind == "image_folder":
            return RecordSource.image_folder(spec.path, **kw)
        if spec.kind == "gldv2":
            return RecordSource.gldv2(spec.path, spec.image_root, **kw)
        return ParquetImageSource(
            spec.path, spec.image_column, spec.class_column or None, spec.id_column, **kw
        )
    except (FileNotFoundError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None


def source_from_options(opts: EmbedGalleryOptions, in_chans: int, resolution: int):
    """The gallery source the options name (``ConfigError`` for a bad one): stored old
    features; a scenario's query, gallery and distractor items (a ``--scenario`` file, or the
    glyphs); or every image of ``--path`` in ``--split``."""
    from raycompat.data.user_scenarios import resolve_scenario
    from raycompat.pipeline.sources import OldFeatureSource, ScenarioItemSource

    if opts.old_features:
        if opts.data.user:
            raise ConfigError("--old-features replaces the images: no --source with it")
        return OldFeatureSource(opts.old_features)
    if opts.data.user and not opts.sizes.scenario_file:
        return _file_source(opts, in_chans, resolution)
    scenario = resolve_scenario(opts.sizes, opts.data)
    if scenario.user_data:
        return ScenarioItemSource(scenario, resolution, in_chans)
    return _glyph_source(opts, scenario, resolution)


def _models(opts: EmbedGalleryOptions) -> tuple[str | None, str | None]:
    from raycompat.pipeline.bundles import make_random_bundles

    if not opts.random_init:
        return opts.old_model, opts.new_model
    if opts.old_model or opts.new_model:
        raise ConfigError("--random-init replaces --old-model/--new-model; pass one or the other")
    return make_random_bundles(opts.random_init)


def run_job(opts: EmbedGalleryOptions) -> GalleryRun:
    """The job: every check that needs no cluster first (output location, options, models,
    source), then Ray and :func:`embed_gallery`."""
    from raycompat.cluster import connect
    from raycompat.models.fingerprint import check_predecessor, embedder_info
    from raycompat.pipeline.location import resolve_output
    from raycompat.pipeline.writer import remove_at_exit_if_unwritten

    # the output location first: a missing or unwritable one stops the job before models or Ray
    output = resolve_output(opts.out, opts.storage, opts.name)
    remove_at_exit_if_unwritten(output)  # a failed first run leaves no empty folder behind
    options = pipeline_options(opts.execution, opts.stages)
    columns = parse_columns(opts.columns)
    old_model, new_model = _models(opts)
    if old_model and new_model:  # the new model must have been trained against this old one
        warning = check_predecessor(old_model, new_model, opts.allow_unrelated)
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    if opts.old_features:
        source = source_from_options(opts, 1, 32)
        resolve_models(columns, opts.uncertainty, None, new_model, source.old_dim)
    else:
        resolve_models(columns, opts.uncertainty, old_model, new_model)
        info = embedder_info(old_model or new_model)
        resolution = opts.image_resolution or info.get("resolution") or 32
        source = source_from_options(opts, info["in_chans"], int(resolution))
    ids = parse_ids_option(opts.ids) if opts.ids else None
    quiet_ray(opts.verbose)
    connect(opts.address, num_cpus=opts.num_cpus)
    return embed_gallery(
        output,
        source,
        old_model=old_model,
        new_model=new_model,
        columns=columns,
        uncertainty=opts.uncertainty,
        ids=ids,
        options=options,
    )


@job_main
def main(argv: list[str] | None = None) -> int:
    opts = options_from_args(EmbedGalleryOptions, build_parser().parse_args(argv))
    try:
        run_job(opts)
    except CorruptImageError as exc:
        return fail(str(exc))
    return 0
