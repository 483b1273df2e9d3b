"""The gallery embedding run: a Ray Data streaming pipeline from a source to parquet shards.

``embed_gallery`` is the library call (the main job and the backfill use it);
``main`` is ``jobs/embed_gallery.py``. Stages (``raycompat.pipeline.stages``)::

    chunk ids -> load_images (render / decode) -> preprocess -> [new embedder pool]
              -> [old embedder pool] -> [psi + uncertainty pool] -> driver: shard writer

Only the stages the requested columns need are built. Output (``raycompat.pipeline.writer``):
``<out>/part-<chunk>.parquet`` shards, ``<out>/_manifest.json``, ``<out>/_summary.json``;
``raycompat.backfill.gallery.load_parquet(<out>)`` reads the folder directly. ``<out>`` is a
local folder or a URI (``raycompat.pipeline.location``); the job's ``--storage S`` puts it at
``S/embeddings/<--name>``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from raycompat.config import ConfigError
from raycompat.data.readers import CorruptImageError
from raycompat.pipeline.ids import IdPlan, parse_ids_option
from raycompat.pipeline.options import (PipelineOptions, add_pipeline_arguments, parse_columns,
                                        pipeline_options_from_args)
from raycompat.pipeline.stages import UNCERTAINTY_COLUMNS

SUMMARY_NAME = "_summary.json"


@dataclass
class GalleryRun:
    """Result of :func:`embed_gallery`: the output folder (a parquet dataset; a local path or
    a URI) and the summary."""

    path: str
    summary: dict

    def load(self, **kw):
        """The output as ``raycompat.backfill.GalleryEmbeddings`` (needs old and new columns)."""
        from raycompat.backfill.gallery import load_parquet

        return load_parquet(self.path, **kw)

    def table(self, columns=None):
        """The output as one pyarrow table sorted by ``item_id``."""
        import pyarrow.parquet as pq

        return pq.read_table(self.path, columns=columns).sort_by("item_id")


def _resolve_models(columns, uncertainty, old_model, new_model, stored_old_dim: int | None = None):
    """Which stages run and the output dims. ``stored_old_dim``: the source already holds old
    features (``OldFeatureSource``) of that dimension, so no image stage and no old model."""
    from raycompat.pipeline.bundles import embedder_info

    if stored_old_dim is not None:
        if "new" in columns:
            raise ConfigError("column 'new' needs images; the old-feature source only has old features "
                              "(it serves 'old', 'adapted' and uncertainty)")
        old_model = None
    need_old = stored_old_dim is None and ("old" in columns or "adapted" in columns or uncertainty)
    need_new_bundle = "new" in columns or "adapted" in columns or uncertainty
    if need_old and not old_model:
        raise ConfigError("the old model is required for columns old/adapted and uncertainty: pass --old-model "
                          "(a saved bundle folder) or --random-init DIR for a smoke run")
    if need_new_bundle and not new_model:
        raise ConfigError("the new model is required for columns new/adapted and uncertainty: pass --new-model "
                          "(a saved bundle folder) or --random-init DIR for a smoke run")
    old_info = embedder_info(old_model) if need_old else None
    if stored_old_dim is not None:
        old_info = {"embed_dim": int(stored_old_dim)}
    new_info = embedder_info(new_model) if need_new_bundle else None
    dims = {}
    for c in columns:
        if c == "old":
            dims["old"] = old_info["embed_dim"]
        elif c == "new":
            dims["new"] = new_info["embed_dim"]
        else:
            if new_info["psi_dims"] is None:
                raise ConfigError(f"column 'adapted' needs psi, but the new model {new_model!r} has no 'psi' "
                                  f"module (modules: {new_info['modules']}); psi comes from DMU training")
            if new_info["psi_dims"][0] != old_info["embed_dim"]:
                raise ConfigError(f"psi of {new_model!r} expects {new_info['psi_dims'][0]}-dim old features, "
                                  f"the old model gives {old_info['embed_dim']}")
            dims["adapted"] = new_info["psi_dims"][1]
    if uncertainty and "head" not in new_info["modules"]:
        raise ConfigError(f"uncertainty needs the new model's classifier head; {new_model!r} has none")
    if uncertainty and old_info["embed_dim"] > new_info["embed_dim"]:
        raise ConfigError(f"uncertainty needs D_old <= D_new, got {old_info['embed_dim']} > {new_info['embed_dim']}")
    return need_old, "new" in columns, "adapted" in columns or uncertainty, dims


def _gpus(stage, opts: PipelineOptions, cluster_gpus: float) -> float:
    if stage.num_gpus is not None:
        return float(stage.num_gpus)
    return opts.gpu_fraction if cluster_gpus > 0 else 0.0


def _resources(stage):
    return dict(stage.resources) if stage.resources else None


def build_dataset(todo, plan, source, old_model, new_model, need_old, need_new, need_feature_stage,
                  columns, uncertainty, opts: PipelineOptions):
    """The lazy Ray Data pipeline for chunks ``todo``."""
    import ray
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    from raycompat.pipeline.stages import EmbedStage, OldFeatureStage, load_images, preprocess

    st = opts.stages
    cluster_gpus = float(ray.cluster_resources().get("GPU", 0))
    # The input is the ids themselves, one block per render batch (not per chunk), so results
    # stream out of the render tasks batch by batch instead of a whole chunk at a time.
    import pyarrow as pa

    size = st["render"].batch_size
    blocks = [pa.table({"item_id": ids[k:k + size]})
              for ids in (plan.chunk_ids(c) for c in todo) for k in range(0, len(ids), size)]
    ds = ray.data.from_arrow(blocks)
    ds = ds.map_batches(load_images, fn_kwargs={"source": source, "on_corrupt": opts.on_corrupt},
                        batch_size=st["render"].batch_size, num_cpus=st["render"].num_cpus,
                        resources=_resources(st["render"]), compute=TaskPoolStrategy(size=st["render"].concurrency))
    if getattr(source, "provides_old", False):  # stored old features: no image, no backbone
        need_old = need_new = False
    else:
        ds = ds.map_batches(preprocess, batch_size=st["preprocess"].batch_size,
                            num_cpus=st["preprocess"].num_cpus, resources=_resources(st["preprocess"]),
                            compute=TaskPoolStrategy(size=st["preprocess"].concurrency))
    if need_new:
        s = st["new"]
        g = _gpus(s, opts, cluster_gpus)
        ds = ds.map_batches(EmbedStage, fn_constructor_kwargs=dict(
            bundle_path=new_model, column="new", threads=opts.threads, use_gpu=g > 0, drop_pixels=not need_old),
            batch_size=s.batch_size, num_cpus=s.num_cpus, num_gpus=g or None, resources=_resources(s),
            compute=ActorPoolStrategy(size=s.concurrency))
    if need_old:
        s = st["old"]
        g = _gpus(s, opts, cluster_gpus)
        ds = ds.map_batches(EmbedStage, fn_constructor_kwargs=dict(
            bundle_path=old_model, column="old", threads=opts.threads, use_gpu=g > 0, drop_pixels=True),
            batch_size=s.batch_size, num_cpus=s.num_cpus, num_gpus=g or None, resources=_resources(s),
            compute=ActorPoolStrategy(size=s.concurrency))
    if need_feature_stage:
        s = st["adapt"]
        g = _gpus(s, opts, cluster_gpus)
        ds = ds.map_batches(OldFeatureStage, fn_constructor_kwargs=dict(
            new_bundle_path=new_model, adapt="adapted" in columns, uncertainty=uncertainty,
            drop_old="old" not in columns, threads=opts.threads, use_gpu=g > 0),
            batch_size=s.batch_size, num_cpus=s.num_cpus, num_gpus=g or None, resources=_resources(s),
            compute=ActorPoolStrategy(size=s.concurrency))
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


def embed_gallery(out, source, *, old_model: str | None = None, new_model: str | None = None,
                  columns=("old", "new"), uncertainty: bool = False, ids=None,
                  options: PipelineOptions | None = None, log=print) -> GalleryRun:
    """Embed ``source``'s items (all, or ``ids``) into parquet shards under ``out``: a local
    folder, any URI pyarrow's filesystems open (``s3://bucket/gallery``, ``file:///nfs/g``),
    or a checked ``raycompat.pipeline.location.OutputDir``; it is created and checked for
    writing first (``StorageError`` naming it otherwise).

    ``columns``: any of ``old``, ``new``, ``adapted`` (psi(old), DMU); ``uncertainty`` adds
    ``unc_least_confidence``, ``unc_margin``, ``unc_entropy`` (RACT Eq.9-11, new head on old
    features). Models are saved bundle folders (``ModelBundle.save``); psi and the new head come
    from ``new_model``. Resumes an interrupted run with the same settings; raises
    ``ConfigError`` for different ones. Uses the connected Ray cluster (connects an embedded
    one if none)."""
    from raycompat.cluster import connect
    from raycompat.pipeline.location import OutputDir
    from raycompat.pipeline.manifest import check_or_write, content_manifest
    from raycompat.pipeline.summary import MemorySampler, format_summary, stage_times
    from raycompat.pipeline.writer import ChunkAssembler, ShardStore, output_schema
    from raycompat.report import _clean

    opts = options or PipelineOptions()
    opts.check()
    columns = parse_columns(columns)
    if not columns and not uncertainty:
        raise ConfigError("nothing to compute: --columns is empty and uncertainty is off")
    stored_old_dim = source.old_dim if getattr(source, "provides_old", False) else None
    need_old, need_new, need_feature_stage, dims = _resolve_models(columns, uncertainty, old_model, new_model,
                                                                   stored_old_dim)
    if stored_old_dim is not None:
        old_model = None
    if ids is not None:
        ids = np.asarray(ids, np.int64)
        plan = IdPlan.from_ids(ids, opts.chunk_size)
        source.check_ids(plan.ids)
    elif source.all_ids() is not None:
        plan = IdPlan.from_ids(source.all_ids(), opts.chunk_size)
    else:
        plan = IdPlan(opts.chunk_size, 0, source.num_ids())
    unc_cols = tuple(UNCERTAINTY_COLUMNS.values()) if uncertainty else ()
    location = OutputDir.open(out)     # created and checked for writing (StorageError otherwise)
    out = location.uri
    if opts.overwrite:
        location.clear()
    manifest = content_manifest(source, plan, columns, unc_cols,
                                {"old": old_model if need_old else None,
                                 "new": new_model if (need_new or need_feature_stage) else None}, dims)
    resuming = check_or_write(location, manifest)
    schema = output_schema(dims, unc_cols)
    store = ShardStore(location, schema)
    removed = store.remove_temp_files()
    done = store.completed(plan.num_chunks, plan.chunk_length)
    todo = [c for c in range(plan.num_chunks) if c not in done]
    resumed_items = sum(plan.chunk_length(c) for c in done)
    log(f"[embed_gallery] {source.kind} source, {len(plan)} items in {plan.num_chunks} chunks of "
        f"{plan.chunk_size}; columns {list(columns)}{' + uncertainty' if uncertainty else ''} -> {out}")
    if resuming:
        log(f"[embed_gallery] resuming: {len(done)} chunks ({resumed_items} items) already complete, "
            f"{len(todo)} to do{f', {removed} partial temp file(s) removed' if removed else ''}")

    connect(None)
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.per_stage_map_timing = True
    ctx.enable_progress_bars = sys.stderr.isatty() if opts.ray_progress_bars is None else opts.ray_progress_bars
    planned = sum(plan.chunk_length(c) for c in todo)
    assembler = ChunkAssembler(store, plan, [f.name for f in schema] + ["error"])
    started = time.perf_counter()
    stages: list[dict] = []
    first = None
    with MemorySampler(opts.memory_interval_s, progress=lambda: assembler.received) as memory:
        if todo:
            ds = build_dataset(todo, plan, source, old_model, new_model, need_old, need_new, need_feature_stage,
                               columns, uncertainty, opts)
            last = started
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
                        log(f"[embed_gallery] {got}/{planned} items embedded ({100 * got / planned:.1f} %), "
                            f"{assembler.written_chunks}/{len(todo)} shards written, {rate:.0f} items/s, "
                            f"ETA {eta:.0f} s, peak memory PSS {memory.peak_pss_mib:.0f} MiB")
            except Exception as exc:  # Ray Data wraps a failing stage's exception
                message = _find_corrupt(exc)
                if message:
                    raise CorruptImageError(
                        f"{message}. {assembler.written_chunks} complete shard(s) kept in {out}; rerun with "
                        "--on-corrupt skip to skip such images (the run resumes)") from None
                raise
            stages = stage_times(ds)
    seconds = time.perf_counter() - started
    if assembler.open_chunks:
        raise RuntimeError(f"{assembler.open_chunks} chunk(s) received only part of their ids")
    skipped = assembler.skipped
    summary = {
        "out": out, "items_planned": planned, "items_total": len(plan), "items_resumed": resumed_items,
        "items_written": assembler.written_items, "items_skipped": len(skipped), "skipped": skipped[:1000],
        "shards_written": assembler.written_chunks, "seconds": seconds,
        "items_per_s": (assembler.written_items + len(skipped)) / seconds if seconds > 0 else 0.0,
        "first_output_s": first[0] if first else None,
        "steady_items_per_s": ((assembler.received - first[1]) / (seconds - first[0])
                               if first and seconds > first[0] else None),
        "columns": list(columns), "uncertainty_columns": list(unc_cols), "dims": dims,
        "memory": {"peak_rss_mib": memory.peak_rss_mib, "peak_pss_mib": memory.peak_pss_mib,
                   "what": "sum over the driver and every process it started (embedded Ray: GCS, raylet, "
                           "workers, actors); PSS splits shared pages such as the object store",
                   **memory.halves(), "series_s_items_rss_pss": memory.thinned_series()},
        "stages": stages, "options": asdict(opts),
        # where the embedding stages ran (this run's rows): {stage: {Ray node id: rows}}
        "nodes": {stage: dict(sorted(per_node.items())) for stage, per_node in sorted(assembler.node_items.items())},
    }
    location.write_bytes(SUMMARY_NAME, json.dumps(_clean(summary), indent=2).encode())
    for s in skipped[:20]:
        log(f"[embed_gallery] skipped corrupt image: {s['error']}")
    log(format_summary(summary))
    return GalleryRun(out, summary)


# ----------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="embed_gallery",
        description="Embed a gallery with the old model, the new model and psi (Ray Data, streaming, "
                    "resumable) into parquet shards: item_id, label, split, old/new/adapted vectors, "
                    "uncertainty scores.")
    o = p.add_argument_group("where the output goes (checked for writing before anything starts)")
    o.add_argument("--storage", default=None,
                   help="shared storage: a local path or any URI pyarrow opens (s3://bucket/prefix, gs://..., "
                        "file:///nfs/...); the output goes to <storage>/embeddings/<name> unless --out is given")
    o.add_argument("--name", default="gallery", help="output folder name under <storage>/embeddings "
                                                     "(default gallery)")
    o.add_argument("--out", default=None,
                   help="output folder or URI (parquet shards + _manifest.json + _summary.json); default "
                        "gallery_out, or <storage>/embeddings/<name> with --storage")
    p.add_argument("--address", default=None, help="Ray address (default: an embedded local cluster)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded local cluster")
    m = p.add_argument_group("models")
    m.add_argument("--old-model", help="old model bundle folder")
    m.add_argument("--new-model", help="new model bundle folder (its psi and head give adapted/uncertainty)")
    m.add_argument("--random-init", metavar="DIR",
                   help="smoke run without trained models: create (or reuse) random-init lcnet_050 bundles "
                        "under DIR (old 64-d, new 128-d with psi) and use them")
    w = p.add_argument_group("what to compute")
    w.add_argument("--columns", default="old,new,adapted",
                   help="representations: any of old,new,adapted (default all three); e.g. 'old' for the "
                        "initial gallery, 'new' with --ids for a backfill batch")
    w.add_argument("--uncertainty", action="store_true",
                   help="also compute unc_least_confidence, unc_margin, unc_entropy (RACT Eq.9-11)")
    w.add_argument("--ids", default=None, help="only these item ids: START:STOP, or a file of ids (text or .npy)")
    s = p.add_argument_group("source")
    s.add_argument("--source", choices=("glyphs", "image_folder", "parquet", "gldv2", "old_features"),
                   default="glyphs", help="old_features: refresh stored old features (an earlier output) with "
                                          "psi / uncertainty, no images")
    s.add_argument("--path", help="image folder, parquet file/folder, GLDv2 csv, or old-feature parquet folder")
    s.add_argument("--image-root", help="GLDv2 image root (a/b/c/<id>.jpg layout)")
    s.add_argument("--image-column", default="image")
    s.add_argument("--label-column", default="label")
    s.add_argument("--id-column", default="item_id")
    s.add_argument("--split", default="gallery", choices=("query", "gallery", "distractor"),
                   help="split of every item of a folder/parquet/GLDv2 source")
    s.add_argument("--resolution", type=int, default=None,
                   help="image side in pixels (default: the old model's training resolution, else 32)")
    g = p.add_argument_group("built-in glyph source")
    g.add_argument("--scenario-json", help="a saved scenario (e.g. quickstart_out/scenario.json)")
    g.add_argument("--scenario", default="extended-class")
    g.add_argument("--train-classes", type=int, default=200)
    g.add_argument("--eval-classes", type=int, default=100)
    g.add_argument("--queries-per-class", type=int, default=2)
    g.add_argument("--gallery-per-class", type=int, default=10)
    g.add_argument("--distractor-classes", type=int, default=100)
    g.add_argument("--distractors-per-class", type=int, default=5)
    g.add_argument("--data-seed", type=int, default=0, help="scenario and renderer seed")
    g.add_argument("--distractors", type=int, default=0, help="extra generated distractors")
    g.add_argument("--items", type=int, default=None,
                   help="total items (scenario + generated distractors); overrides --distractors")
    add_pipeline_arguments(p)
    return p


def source_from_args(args, in_chans: int, resolution: int):
    from raycompat.pipeline.sources import GlyphGallerySource, ParquetImageSource, RecordSource

    if args.source == "glyphs":
        from raycompat.data import Scenario, default_catalog, scenario_from_options

        if args.scenario_json:
            import json

            with open(args.scenario_json) as fh:
                scenario = Scenario.from_dict(json.load(fh))
        else:
            try:
                scenario = scenario_from_options(args.scenario, args, seed=args.data_seed, catalog=default_catalog())
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        extra = args.distractors
        n0 = sum(len(scenario.splits[k]) for k in ("query", "gallery", "distractors"))
        if args.items is not None:
            if args.items < n0:
                raise ConfigError(f"--items {args.items} is smaller than the scenario's {n0} items")
            extra = args.items - n0
        return GlyphGallerySource(scenario, extra, resolution, args.data_seed)
    if not args.path:
        raise ConfigError(f"--source {args.source} needs --path")
    if args.source == "old_features":
        from raycompat.pipeline.sources import OldFeatureSource

        return OldFeatureSource(args.path)
    kw = dict(split=args.split, resolution=resolution, in_chans=in_chans)
    try:
        if args.source == "image_folder":
            return RecordSource.image_folder(args.path, **kw)
        if args.source == "gldv2":
            if not args.image_root:
                raise ConfigError("--source gldv2 needs --image-root")
            return RecordSource.gldv2(args.path, args.image_root, **kw)
        return ParquetImageSource(args.path, args.image_column, args.label_column or None, args.id_column, **kw)
    except (FileNotFoundError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None


def run_from_args(args) -> GalleryRun:
    from raycompat.cluster import connect
    from raycompat.pipeline.bundles import embedder_info, make_random_bundles
    from raycompat.pipeline.location import resolve_output

    # the output location first: a missing or unwritable one stops the job before models or Ray
    output = resolve_output(args.out, args.storage, args.name)
    options = pipeline_options_from_args(args)
    columns = parse_columns(args.columns)
    old_model, new_model = args.old_model, args.new_model
    if args.random_init:
        if old_model or new_model:
            raise ConfigError("--random-init replaces --old-model/--new-model; pass one or the other")
        old_model, new_model = make_random_bundles(args.random_init)
    # every check that needs no cluster runs before one starts
    if args.source == "old_features":
        source = source_from_args(args, 1, 32)
        _resolve_models(columns, args.uncertainty, None, new_model, source.old_dim)
    else:
        _resolve_models(columns, args.uncertainty, old_model, new_model)
        info = embedder_info(old_model or new_model)
        resolution = args.resolution or info.get("resolution") or 32
        source = source_from_args(args, info["in_chans"], int(resolution))
    ids = parse_ids_option(args.ids) if args.ids else None
    connect(args.address, num_cpus=args.num_cpus)
    return embed_gallery(output, source, old_model=old_model, new_model=new_model, columns=columns,
                         uncertainty=args.uncertainty, ids=ids, options=options)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run_from_args(args)
    except (ConfigError, CorruptImageError) as exc:
        print(f"embed_gallery: error: {exc}", file=sys.stderr)
        return 2
    return 0
