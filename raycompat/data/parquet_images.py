"""Parquet files with encoded image bytes as an item source, read lazily by row group (the
bytes are never all in memory); ids from an id column. :class:`ParquetRowGroupSource` is the
part shared with the pipeline's stored old features
(:class:`raycompat.pipeline.sources.OldFeatureSource`)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from raycompat.config import ConfigError
from raycompat.data.item_source import (
    ItemSource,
    check_split,
    decode_item_image,
    image_columns,
)
from raycompat.data.readers import CorruptImageError


class ParquetRowGroupSource(ItemSource):
    """Shared by the parquet sources: the file list, an index from sorted item id to
    (file, row group, row), and a description keyed by the files. Only the columns named by a
    subclass are read up front; the rest is read per row group when a batch needs it."""

    def _list_files(self, path: str, what: str) -> None:
        self.location = os.path.abspath(path)
        if os.path.isdir(path):
            # "_" and "." files are metadata (a pipeline's _manifest.json, _common_metadata, ...)
            files = sorted(
                os.path.join(path, f)
                for f in os.listdir(path)
                if f.endswith(".parquet") and not f.startswith((".", "_"))
            )
        elif os.path.isfile(path):
            files = [path]
        else:
            raise ConfigError(f"{what} not found: {path}")
        if not files:
            raise ConfigError(f"no .parquet files in {path}")
        self.files = [os.path.abspath(f) for f in files]

    def _index_row_groups(self, check_file, read_group, where: str) -> list:
        """Build the id index over every row group of every file. ``check_file(file,
        ParquetFile)`` validates a file's schema once; ``read_group(ParquetFile, group)`` returns
        ``(ids, columns)`` with ``columns`` a tuple of per-row numpy arrays. Sorts by item id
        (refusing non-integer or duplicate ids, named by ``where``) and returns the columns in
        that order."""
        import pyarrow.parquet as pq

        ids, file_of, group_of, row_of, columns = [], [], [], [], None
        for f_index, f in enumerate(self.files):
            pf = pq.ParquetFile(f)
            check_file(f, pf)
            for g in range(pf.num_row_groups):
                group_ids, group_columns = read_group(pf, g)
                n = len(group_ids)
                ids.append(np.asarray(group_ids))
                columns = [[] for _ in group_columns] if columns is None else columns
                for chunks, col in zip(columns, group_columns, strict=False):
                    chunks.append(col)
                file_of.append(np.full(n, f_index, np.int32))
                group_of.append(np.full(n, g, np.int32))
                row_of.append(np.arange(n, dtype=np.int64))
        if not ids:
            raise ConfigError(f"no rows in the parquet file(s) at {self.location}")
        ids = np.concatenate(ids)
        if ids.dtype.kind not in "iu":
            raise ConfigError(f"{where}: the item id column must hold integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        order = np.argsort(ids, kind="stable")
        self.ids = ids[order]
        if (np.diff(self.ids) == 0).any():
            dup = self.ids[1:][np.diff(self.ids) == 0]
            raise ConfigError(f"{where}: duplicate item ids, e.g. {dup[:5].tolist()}")
        self.file_of = np.concatenate(file_of)[order]
        self.group_of = np.concatenate(group_of)[order]
        self.row_of = np.concatenate(row_of)[order]
        return [np.concatenate(chunks)[order] for chunks in columns]

    def num_ids(self) -> int:
        return int(self.ids.size)

    def all_ids(self) -> np.ndarray:
        return self.ids

    def _files_digest(self) -> str:
        h = hashlib.sha256(self.ids.tobytes())
        for f in self.files:
            h.update(f"{f}:{os.path.getsize(f)};".encode())
        return h.hexdigest()[:16]


class ParquetImageSource(ParquetRowGroupSource):
    """Parquet files (one file or a folder) with encoded image bytes in ``image_column`` (binary,
    or a struct with a ``bytes`` field), ids in ``id_column``, labels in ``label_column``
    (renumbered 0..n-1 in sorted order of the values; ``None`` gives -1). Only the id and label
    columns are read up front; image bytes are read per row group when a batch needs them."""

    kind = "parquet"

    def __init__(
        self,
        path: str,
        image_column: str = "image",
        label_column: str | None = "label",
        id_column: str = "item_id",
        split: str = "gallery",
        resolution: int = 32,
        in_chans: int = 1,
    ):
        self._list_files(path, "parquet source")
        self.image_column, self.label_column, self.id_column = image_column, label_column, id_column
        self.split = check_split(split)
        self.resolution, self.in_chans = int(resolution), int(in_chans)

        def check_file(f, pf):
            names = pf.schema_arrow.names
            missing = [
                c
                for c in (image_column, label_column, id_column)
                if c is not None and c not in names
            ]
            if missing:
                raise ConfigError(f"parquet {f} lacks column(s) {missing}; has {names}")

        def read_group(pf, g):
            t = pf.read_row_group(g, columns=[id_column] + ([label_column] if label_column else []))
            labels = t.column(label_column).to_pylist() if label_column else [None] * t.num_rows
            return t.column(id_column).to_numpy(zero_copy_only=False), (
                np.asarray(labels, dtype=object),
            )

        (raw_labels,) = self._index_row_groups(
            check_file, read_group, f"parquet source {path} (id column {id_column!r})"
        )
        keys = sorted({v for v in raw_labels if v is not None}) if label_column else []
        #: the sorted distinct values of the label column: label ``i`` is ``class_values[i]``
        self.class_values = keys
        self.class_names = [str(k) for k in keys] + [""]  # label -1 (no value): no name
        label_of = {k: i for i, k in enumerate(keys)}
        self.labels = np.array([label_of.get(v, -1) for v in raw_labels.tolist()], np.int64)
        self._cache: dict[tuple[int, int], list] = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "location": self.location,
            "items": self.num_ids(),
            "split": self.split,
            "resolution": self.resolution,
            "in_chans": self.in_chans,
            "image_column": self.image_column,
            "files_sha256": self._files_digest(),
        }

    def _group(self, f: int, g: int) -> list:
        key = (f, g)
        if key not in self._cache:
            import pyarrow.parquet as pq

            self._cache.clear()  # one row group per process: bounded memory
            col = pq.ParquetFile(self.files[f]).read_row_group(g, columns=[self.image_column])
            self._cache[key] = col.column(self.image_column).to_pylist()
        return self._cache[key]

    def load(self, ids, on_corrupt: str = "fail") -> dict[str, np.ndarray]:
        ids = np.asarray(ids, np.int64)
        pos = np.searchsorted(self.ids, ids)
        mode = "L" if self.in_chans == 1 else "RGB"
        decoded: list[Any] = [None] * ids.size
        order = np.lexsort((self.row_of[pos], self.group_of[pos], self.file_of[pos]))
        for k in order.tolist():
            p = int(pos[k])
            f, g, r = int(self.file_of[p]), int(self.group_of[p]), int(self.row_of[p])
            value = self._group(f, g)[r]
            if isinstance(value, dict):
                value = value.get("bytes")
            where = f"{self.files[f]}#rowgroup{g}/row{r}"
            if not isinstance(value, (bytes, bytearray)) or not value:
                message = (
                    f"item_id={int(ids[k])} path={where}: "
                    f"no image bytes in column {self.image_column!r}"
                )
                if on_corrupt == "fail":
                    raise CorruptImageError(f"corrupt image {message}")
                decoded[k] = (None, message)
            else:
                decoded[k] = decode_item_image(
                    bytes(value), int(ids[k]), where, mode, self.resolution, on_corrupt
                )
        return image_columns(
            ids,
            self.labels[pos],
            self.split,
            decoded,
            self.resolution,
            self.in_chans,
            self.class_names,
        )
