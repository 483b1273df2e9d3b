"""Where a served gallery's vectors come from: an embeddings parquet or a seeded synthetic
gallery (benchmarks).  Parquet (a file, a folder or a URI) is read by the simulator's one reader
of that schema (:mod:`raycompat.embeddings.format`; docs/architecture.md, "Formats"),
so the live index refuses bad input with the simulator's messages.

A source answers three questions: the dimension of each representation, the initial
(old-state) vectors of the items placed on one shard, and the new-model vectors of any ids
(what the backfill controller upserts).  Vectors are returned L2-normalised
(:func:`raycompat.index.search.l2_normalize`, the same function the simulator uses), so a
served item scores exactly like the simulator's gallery row.  ``new_map`` (set by the
controller: rho in the rank_merge mode) is applied to the raw new-model vectors first
(:func:`raycompat.serving.scoring.stored_new`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from raycompat.config import ConfigError
from raycompat.embeddings.vector_parquet import write_options
from raycompat.index.search import l2_normalize
from raycompat.serving.placement import _mix, shard_of

__all__ = [
    "GallerySource",
    "ParquetGallerySource",
    "PipelineOutput",
    "SyntheticGallery",
    "open_gallery",
    "gallery_classes",
    "gallery_labels",
    "rows_of",
    "write_gallery_parquet",
]


def rows_of(sorted_ids: np.ndarray, rows_by_sorted: np.ndarray, ids) -> np.ndarray:
    """Row numbers of ``ids`` given ``sorted_ids`` (ascending) and their rows; unknown ids raise."""
    ids = np.asarray(ids, np.int64)
    pos = np.searchsorted(sorted_ids, ids)
    pos = np.minimum(pos, max(sorted_ids.size - 1, 0))
    bad = sorted_ids.size == 0 or (sorted_ids[pos] != ids).any()
    if bad:
        miss = ids if sorted_ids.size == 0 else ids[sorted_ids[pos] != ids]
        raise KeyError(f"unknown item id(s) {miss[:10].tolist()}")
    return rows_by_sorted[pos]


class GallerySource:
    """Interface (see the module docstring)."""

    old_dim: int
    new_dim: int
    n_items: int
    new_map = None  # raw new vector -> stored new vector (rho in rank_merge), or None

    def dims(self) -> dict[str, int]:
        return {"old": self.old_dim, "adapted": self.new_dim, "new": self.new_dim}

    def gallery_ids(self) -> np.ndarray:  # in gallery (row) order
        raise NotImplementedError

    def initial_vectors(self, rep: str, shard: int, n_shards: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def new_vectors(self, ids) -> np.ndarray:
        raise NotImplementedError


class ParquetGallerySource(GallerySource):
    """Gallery rows of an embeddings parquet (columns item_id, label, split, old, new[, adapted]),
    read by :func:`raycompat.embeddings.gallery.load_parquet`.

    ``adapted`` (:func:`raycompat.serving.scoring.adapted_transform`) says what an ``adapted``
    item holds: ``"psi"``: the column or, when a new model bundle with a ``psi`` module is
    given, psi(old); ``"fct"``: FCT's h(old) from the new bundle's ``fct`` module, never the
    column (psi's) (:func:`raycompat.upgrade.modes.apply_bundle_modules`)."""

    def __init__(
        self,
        path: str,
        new_model: str | None = None,
        adapted: str | None = None,
        need_rank_merge: bool = False,
    ):
        from raycompat.embeddings.gallery import BackfillInputError, load_parquet

        try:
            data = load_parquet(path)
            if (
                need_rank_merge
            ):  # rho / psi_rev arrays: the hinge-benefit policy ranks with the mode's sides
                from raycompat.models import ModelBundle
                from raycompat.serving.scoring import rank_merge_maps
                from raycompat.upgrade.modes import apply_bundle_modules

                rank_merge_maps(new_model)  # names a missing model or module
                # rho of the unit new vectors: what the store holds and a shard maps
                unit = data.with_arrays(gallery_new=l2_normalize(data.gallery_new))
                rho_sides = apply_bundle_modules(unit, ModelBundle.load(new_model))
                data = data.with_arrays(
                    gallery_rho=rho_sides.gallery_rho,
                    query_rho=rho_sides.query_rho,
                    query_rev=rho_sides.query_rev,
                )
            if adapted == "fct":
                data = _fct_as_adapted(data, new_model)
            elif adapted == "psi" and data.gallery_adapted is None:
                if not new_model:
                    raise ConfigError(
                        f"mode 'adapted' needs an 'adapted' column in {path} or a new model "
                        "with a psi module"
                    )
                from raycompat.models import ModelBundle
                from raycompat.upgrade.modes import apply_bundle_modules

                data = apply_bundle_modules(data, ModelBundle.load(new_model))
                if data.gallery_adapted is None:
                    raise ConfigError(
                        f"mode 'adapted': the new model {new_model} has no psi module"
                    )
        except BackfillInputError as exc:
            raise ConfigError(str(exc)) from exc
        self.data = data
        self.path = path
        self.old_dim = data.old_dim
        self.new_dim = int(data.gallery_new.shape[1])
        self.n_items = data.n_items
        ids = data.gallery_ids.astype(np.int64)
        o = np.argsort(ids, kind="stable")
        self._sorted, self._rows = ids[o], o

    def gallery_ids(self) -> np.ndarray:
        return self.data.gallery_ids.astype(np.int64)

    def _array(self, rep: str) -> np.ndarray:
        return {
            "old": self.data.gallery_old,
            "adapted": self.data.gallery_adapted,
            "new": self.data.gallery_new,
        }[rep]

    def initial_vectors(self, rep, shard, n_shards):
        ids = self.gallery_ids()
        mine = np.flatnonzero(shard_of(ids, n_shards) == shard)
        return ids[mine], l2_normalize(self._array(rep)[mine])

    def vectors_of(self, rep: str, ids) -> np.ndarray:
        """The L2-normalised ``old`` or ``adapted`` vectors of ``ids`` (``new``: as the
        backfill writes them, :meth:`new_vectors`)."""
        if rep == "new":
            return self.new_vectors(ids)
        return l2_normalize(self._array(rep)[rows_of(self._sorted, self._rows, ids)])

    def new_vectors(self, ids) -> np.ndarray:
        from raycompat.serving.scoring import stored_new

        return stored_new(
            self.data.gallery_new[rows_of(self._sorted, self._rows, ids)], self.new_map
        )


def _fct_as_adapted(data, new_model: str | None):
    """``data`` whose ``gallery_adapted`` (and ``gallery_fct``) is FCT's h(old), by the new
    bundle's ``fct`` module applied as the simulator applies it; ``ConfigError`` naming the
    missing model or module, or h's wrong output dimension."""
    from types import SimpleNamespace

    from raycompat.models import ModelBundle
    from raycompat.upgrade.modes import apply_bundle_modules

    if not new_model:
        raise ConfigError(
            "mode 'fct' needs the option new_model: a bundle with an 'fct' module (FCT's h, "
            "trained with --method fct)"
        )
    module = ModelBundle.load(new_model).modules.get("fct")
    if module is None:
        raise ConfigError(
            f"mode 'fct': the new model {new_model} has no fct module (train it with --method fct)"
        )
    only_h = SimpleNamespace(modules={"fct": module})  # not psi, rho: only h is needed
    h = apply_bundle_modules(data.with_arrays(gallery_fct=None), only_h).gallery_fct
    if h.shape[1] != data.gallery_new.shape[1]:
        raise ConfigError(
            f"mode 'fct': the fct module of {new_model} maps to {h.shape[1]} dims, the "
            f"gallery's new vectors have {data.gallery_new.shape[1]}"
        )
    return data.with_arrays(gallery_adapted=h, gallery_fct=h)


class PipelineOutput(GallerySource):
    """New vectors read from the Ray Data pipeline's parquet output (item_id + ``new`` column
    of every row, by the simulator's reader of the schema: a file, a folder or a URI)."""

    def __init__(self, path: str, column: str = "new"):
        from raycompat.embeddings.format import BackfillInputError, EmbeddingsParquet

        try:
            reader = EmbeddingsParquet.open(path, required=("item_id", column))
            rows = reader.collect([column])
        except BackfillInputError as exc:
            raise ConfigError(f"pipeline output: {exc}") from exc
        ids = rows.ids
        self.vectors = rows.values[column]
        o = np.argsort(ids, kind="stable")
        self._sorted, self._rows = ids[o], o
        self.new_dim = int(self.vectors.shape[1])

    def new_vectors(self, ids) -> np.ndarray:
        from raycompat.serving.scoring import stored_new

        return stored_new(self.vectors[rows_of(self._sorted, self._rows, ids)], self.new_map)


@dataclass
class SyntheticGallery(GallerySource):
    """``n_items`` items with ids ``0..n-1`` and seeded vectors, reproducible anywhere without
    storing the gallery (docs/indexes.md, "Synthetic clustered gallery").

    Each stream (old, new, adapted) draws Gaussian rows per block of 256 ids
    (``default_rng([seed, stream, block])``).  ``clusters == 0``: an item's vector is its row,
    normalised (i.i.d. directions).  ``clusters = C > 0``: item i belongs to cluster
    ``splitmix64(i ^ salt) mod C`` and its vector is ``normalize(centre[c] + row / sqrt(D))``,
    so a cluster is a cloud of directions at cosine ~0.7 from its centre and ~0.5 from each
    other.  The centres are shared by the streams (the first ``D`` columns of one seeded draw of
    ``max(D_old, D_new)`` columns, normalised): as in a compatible upgrade, an item's new vector
    lies in the same cluster as its old one, so a query near a cluster finds its items in
    every representation."""

    n_items: int
    old_dim: int = 128
    new_dim: int = 128
    seed: int = 0
    clusters: int = 0
    block: int = 256
    _centre_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def gallery_ids(self) -> np.ndarray:
        return np.arange(self.n_items, dtype=np.int64)

    def _rows(self, ids: np.ndarray, stream: int, dim: int) -> np.ndarray:
        """The raw Gaussian rows of ``ids`` in ``stream`` (unnormalised)."""
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_items):
            raise KeyError(
                f"unknown item id(s) {ids[(ids < 0) | (ids >= self.n_items)][:10].tolist()}"
            )
        out = np.empty((ids.size, dim), np.float32)
        blocks = ids // self.block
        for b in np.unique(blocks):
            sel = np.flatnonzero(blocks == b)
            rows = np.random.default_rng([self.seed, stream, int(b)]).standard_normal(
                (self.block, dim), dtype=np.float32
            )
            out[sel] = rows[ids[sel] - b * self.block]
        return out

    def _draw(self, ids: np.ndarray, stream: int, dim: int) -> np.ndarray:
        rows = self._rows(ids, stream, dim)
        if self.clusters == 0:
            return l2_normalize(rows)
        centres = self._centres(stream, dim)[self.cluster_of(ids)]
        return l2_normalize(centres + rows / np.float32(np.sqrt(dim)))

    def cluster_of(self, ids) -> np.ndarray:
        """The cluster of every id (``clusters > 0``): ``splitmix64(id ^ salt) mod C``, a hash
        independent of the shard placement's."""
        salted = np.asarray(ids, np.int64) ^ np.int64(_CLUSTER_SALT)
        return (_mix(salted) % np.uint64(self.clusters)).astype(np.int64)

    def _centres(self, stream: int, dim: int) -> np.ndarray:
        """``[C, dim]`` unit centres (the same for every stream of that dimension): the first
        ``dim`` columns of ``default_rng([seed, 3, C])``'s draw of ``max(D_old, D_new)``
        columns (a key no block of rows uses), normalised."""
        if dim not in self._centre_cache:
            rng = np.random.default_rng([self.seed, 3, self.clusters])
            width = max(self.old_dim, self.new_dim)
            draw = rng.standard_normal((self.clusters, width), dtype=np.float32)
            self._centre_cache[dim] = l2_normalize(draw[:, :dim])
        return self._centre_cache[dim]

    def _stream(self, rep: str) -> tuple[int, int]:
        """``(stream, dim)`` of representation ``rep``."""
        return _STREAMS[rep], self.old_dim if rep == "old" else self.new_dim

    def vectors_of(self, rep: str, ids) -> np.ndarray:
        """The L2-normalised vectors of ``ids`` in representation ``rep``: ``old`` / ``adapted``
        as a shard loads them, ``new`` as the backfill upserts them (:meth:`new_vectors`)."""
        if rep == "new":
            return self.new_vectors(ids)
        return self._draw(ids, *self._stream(rep))

    def query_vectors(self, n: int, seed: int = 0, rep: str = "new") -> np.ndarray:
        """``[n, dim]`` benchmark queries in representation ``rep``: perturbed copies
        ``normalize(v + g / (2 sqrt(D)))`` of the vectors ``v`` of n random items
        (``default_rng([self.seed, 6, seed])``), so each query has one clear nearest item and
        its cluster's items after it (docs/indexes.md, "Synthetic clustered gallery")."""
        stream, dim = self._stream(rep)
        rng = np.random.default_rng([self.seed, 6, int(seed)])
        items = rng.integers(0, self.n_items, int(n))
        noise = rng.standard_normal((int(n), dim), dtype=np.float32)
        base = self._draw(items, stream, dim)
        return l2_normalize(base + noise / np.float32(2.0 * np.sqrt(dim)))

    def initial_vectors(self, rep, shard, n_shards):
        ids = self.gallery_ids()
        mine = ids[shard_of(ids, n_shards) == shard]
        return mine, self.vectors_of(rep, mine)

    def new_vectors(self, ids) -> np.ndarray:
        from raycompat.serving.scoring import stored_new

        return stored_new(self._draw(ids, 1, self.new_dim), self.new_map)


def gallery_labels(src: GallerySource) -> np.ndarray:
    """The label of every gallery item, in :meth:`GallerySource.gallery_ids` order: an
    embeddings parquet's ``label`` column, a clustered synthetic gallery's cluster numbers,
    else 0."""
    ids = src.gallery_ids()
    if isinstance(src, ParquetGallerySource):
        return np.asarray(src.data.gallery_labels)
    if isinstance(src, SyntheticGallery) and src.clusters:
        return src.cluster_of(ids)
    return np.zeros(ids.size, np.int64)


def gallery_classes(src: GallerySource) -> tuple[np.ndarray, np.ndarray | None]:
    """``(gallery ids, the class name of each)``: an embeddings parquet's ``class_name``
    column (else ``label``, as text), a clustered synthetic gallery's cluster numbers;
    ``None`` for a gallery without classes."""
    ids = src.gallery_ids()
    if isinstance(src, SyntheticGallery):
        return ids, (src.cluster_of(ids).astype(str) if src.clusters else None)
    if not isinstance(src, ParquetGallerySource):
        return ids, None
    from raycompat.embeddings.format import (
        GALLERY,
        EmbeddingsParquet,
        split_kinds,
    )

    reader = EmbeddingsParquet.open(src.path)
    name_of: dict[int, str] = {}
    for f in reader.files:
        table = reader._read_key_table(f)
        column = "class_name" if "class_name" in table.column_names else "label"
        gallery = split_kinds(f, table) == GALLERY
        names = [str(v) for v in table.column(column).to_pylist()]
        row_ids = table.column("item_id").to_numpy().astype(np.int64)
        name_of.update(zip(row_ids[gallery].tolist(), np.asarray(names)[gallery], strict=True))
    return ids, np.asarray([name_of[i] for i in ids.tolist()])


_STREAMS = {"old": 0, "new": 1, "adapted": 2}
_CLUSTER_SALT = 0x5851F42D4C957F2D
_SYNTHETIC_FORM = "synthetic:N[:D_old[:D_new[:seed[:clusters]]]]"


def open_gallery(
    spec: str,
    new_model: str | None = None,
    adapted: str | None = None,
    need_rank_merge: bool = False,
) -> GallerySource:
    """``synthetic:N[:D_old[:D_new[:seed[:clusters]]]]`` or an embeddings parquet (a file, a
    folder or a URI); ``adapted``: what an ``adapted`` item holds (:class:`ParquetGallerySource`; a
    synthetic gallery draws its own ``adapted`` stream)."""
    if spec.startswith("synthetic:"):
        return _synthetic(spec)
    return ParquetGallerySource(  # a missing file or folder is named by the reader
        spec, new_model=new_model, adapted=adapted, need_rank_merge=need_rank_merge
    )


def _synthetic(spec: str) -> SyntheticGallery:
    parts = spec.split(":")[1:]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"gallery {spec!r}: expected {_SYNTHETIC_FORM} (integers)") from None
    if not 1 <= len(vals) <= 5:
        raise ConfigError(f"gallery {spec!r}: expected {_SYNTHETIC_FORM}")
    names = ("N", "D_old", "D_new", "seed", "clusters")
    lows = (1, 1, 1, 0, 0)
    for name, value, low in zip(names, vals, lows, strict=False):
        if value < low:
            raise ConfigError(f"gallery {spec!r}: {name} = {value} must be >= {low}")
    return SyntheticGallery(*vals)


def write_gallery_parquet(path: str, data, items: dict | None = None) -> str:
    """Write a :class:`~raycompat.embeddings.gallery.GalleryEmbeddings` in the simulator's parquet
    schema: query rows first, then gallery rows (``adapted`` when present).  ``items``:
    optional extra columns, one value per written row in that order (e.g. ``instance``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def vec(a):
        a = np.ascontiguousarray(a, dtype=np.float32)
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), a.shape[1])

    nq, ng = data.n_queries, data.n_items
    cols = {
        "item_id": pa.array(np.concatenate([data.query_ids, data.gallery_ids]).astype(np.int64)),
        "label": pa.array(np.concatenate([data.query_labels, data.gallery_labels])),
        "split": pa.array(["query"] * nq + ["gallery"] * ng),
        "old": vec(np.concatenate([data.query_old, data.gallery_old])),
        "new": vec(np.concatenate([data.query_new, data.gallery_new])),
    }
    if data.gallery_adapted is not None:
        q_ad = (
            data.query_new
        )  # queries are never adapted; the column needs a value of the right dim
        cols["adapted"] = vec(np.concatenate([q_ad, data.gallery_adapted]))
    for name, values in (items or {}).items():
        cols[name] = pa.array(np.asarray(values))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    table = pa.table(cols)
    pq.write_table(table, path, **write_options(table.schema))
    return path
