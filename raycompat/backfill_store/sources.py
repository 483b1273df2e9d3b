"""Where a run's new vectors come from: a parquet (``--new-vectors``) or the Ray Data pipeline over
the items' images (docs/stores.md, "New vectors")."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from raycompat.backfill_store.options import BackfillStoreOptions
from raycompat.config import ConfigError


# -- sources of new vectors -----------------------------------------------------------------
def store_labels(store) -> tuple[np.ndarray, np.ndarray]:
    ids, labels = [], []
    for block in store.read_blocks(("id", "label"), 65536):
        ids.append(block["id"])
        labels.append(block["label"])
    return np.concatenate(ids), np.concatenate(labels)


def vector_source(store, opts: BackfillStoreOptions, order, position: int, fp: str | None):
    """``--new-vectors`` (checked: columns, dimension, labels, every item of the order left),
    or the pipeline over the store's images."""
    info = store.describe()
    left = np.asarray(order)[int(position) :]
    if opts.new_vectors:
        return _parquet_source(store, info, opts.new_vectors, left)
    return PipelineVectors(store, opts, info, np.asarray(order), fp or "")


def _parquet_source(store, info, path: str, left: np.ndarray):
    from raycompat.stores import StoreError
    from raycompat.stores.backfill import NewVectorsParquet

    try:
        src = NewVectorsParquet(path)
    except StoreError as exc:
        raise ConfigError(str(exc)) from None
    cols = store.columns
    if src.dim != info.new_dim:
        raise ConfigError(
            f"--new-vectors {path}: column 'new' has vectors of dimension {src.dim}, but "
            f"column {cols.new!r} of {store.where} has dimension {info.new_dim}"
        )
    missing = src.missing(left)
    if missing.size:
        raise ConfigError(
            f"--new-vectors {path}: column 'item_id' lacks {missing.size} item(s) of "
            f"{store.where} still to upgrade, e.g. {missing[:5].tolist()}"
        )
    ids, labels = store_labels(store)
    theirs, name = None, None
    if info.label_type == "int64" and src.labels is not None:
        theirs, name = src.labels, "label"
    elif info.label_type == "string" and src.class_names is not None:
        theirs, name = src.class_names, "class_name"
    elif info.label_type == "string" and src.labels is not None:
        theirs, name = src.labels, "label"
    if theirs is not None:
        at = np.searchsorted(src.ids, ids)
        inside = (at < len(src.ids)) & (src.ids[np.minimum(at, len(src.ids) - 1)] == ids)
        mine = np.asarray([str(v) for v in labels[inside]], object)
        other = np.asarray([str(v) for v in theirs[at[inside]]], object)
        differ = ids[inside][mine != other]
        if differ.size:
            raise ConfigError(
                f"--new-vectors {path}: column {name!r} disagrees with column {cols.label!r} "
                f"of {store.where} for {differ.size} item(s), e.g. ids {differ[:5].tolist()}"
            )
    return src


@dataclass
class _Record:
    item_id: int
    path: str
    label: int


class PipelineVectors:
    """New vectors from the store's images: the Ray Data gallery pipeline
    (:func:`raycompat.pipeline.embed_gallery`, column ``new``) runs on one segment of the order
    at a time (``--embed-chunk`` items) into a cache folder (resumable shards), and batches
    are read from it."""

    def __init__(self, store, opts: BackfillStoreOptions, info, order: np.ndarray, fp: str):
        from raycompat.cluster import connect
        from raycompat.console import quiet_ray
        from raycompat.models.fingerprint import embedder_info
        from raycompat.pipeline.sources import RecordSource

        if store.columns.image_uri is None:
            raise ConfigError(
                f"{store.where} maps no image column: give --new-vectors PARQUET, or map the "
                "images' URIs with --store-columns image_uri=COLUMN"
            )
        emb = embedder_info(opts.new_model)
        if int(emb["embed_dim"]) != int(info.new_dim):
            raise ConfigError(
                f"--new-model {opts.new_model} embeds {emb['embed_dim']} dims, but column "
                f"{store.columns.new!r} of {store.where} has dimension {info.new_dim}"
            )
        ids, uris, labels = [], [], []
        for block in store.read_blocks(("id", "image_uri", "label"), 65536):
            ids.append(block["id"])
            uris.extend(block["image_uri"].tolist())
            labels.append(block["label"])
        ids = np.concatenate(ids)
        labels = np.concatenate(labels)
        if labels.dtype.kind not in "iu":
            labels = np.unique(labels.astype(str), return_inverse=True)[1]
        records = [
            _Record(int(i), str(u), int(lab))
            for i, u, lab in zip(ids.tolist(), uris, labels.tolist(), strict=True)
        ]
        self.order = order
        self.chunk = int(opts.pipeline.embed_chunk)
        key = hashlib.sha256(np.ascontiguousarray(order, "<i8").tobytes()).hexdigest()
        digest = hashlib.sha256(f"{store.uri.raw}|{key}|{fp}".encode()).hexdigest()[:16]
        self.cache = opts.pipeline.cache or os.path.join(
            tempfile.gettempdir(), "raycompat-backfill-store", digest
        )
        self.source = RecordSource(
            records,
            "store_images",
            self.cache,
            split="gallery",
            resolution=int(emb.get("resolution") or 32),
            in_chans=int(emb.get("in_chans") or 1),
        )
        self.new_model = opts.new_model
        self.model_stages = opts.pipeline.model_stages
        self.verbose = opts.verbose
        self.segment: tuple[int, dict] | None = None
        quiet_ray(opts.verbose)
        connect(opts.pipeline.address, num_cpus=opts.pipeline.num_cpus)
        self._pos = {int(i): p for p, i in enumerate(self.order.tolist())}

    def _embed(self, seg: int) -> dict:
        from raycompat.pipeline import PipelineOptions, embed_gallery

        ids = self.order[seg * self.chunk : (seg + 1) * self.chunk]
        out = os.path.join(self.cache, f"segment-{seg:06d}")
        log = print if self.verbose else (lambda _m: None)
        run = embed_gallery(
            out,
            self.source,
            new_model=self.new_model,
            columns=("new",),
            ids=ids,
            options=PipelineOptions(progress_every_s=30.0, model_stages=self.model_stages),
            log=log,
        )
        table = run.table(columns=["item_id", "new"])
        got = table.column("item_id").to_numpy()
        vecs = np.asarray(table.column("new").to_pylist(), np.float32)
        return dict(zip(got.tolist(), vecs, strict=True))

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        out = []
        for i in np.asarray(ids).tolist():
            seg = self._pos[int(i)] // self.chunk
            if self.segment is None or self.segment[0] != seg:
                self.segment = (seg, self._embed(seg))
            out.append(self.segment[1][int(i)])
        return np.stack(out).astype(np.float32)
