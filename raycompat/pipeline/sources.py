"""Where gallery images come from, addressed by stable integer item ids.

Every source maps an item id to ``(label, split, image)`` deterministically, so any subset
of ids (a resumed chunk, a backfill batch asking for "the new column of these ids") can be
produced again on any worker:

* :class:`GlyphGallerySource` -- the built-in renderer, procedural from the id (no files).
  Item id layout for a scenario with ``Q`` queries, ``G`` gallery and ``D`` distractor
  images (the scenario's own order within each split):

  ===========================  ============  ===================================================
  ids                          split         image
  ===========================  ============  ===================================================
  ``[0, Q)``                   query         scenario ``query`` item ``id``
  ``[Q, Q+G)``                 gallery       scenario ``gallery`` item ``id - Q``
  ``[Q+G, N0)``, N0=Q+G+D      distractor    scenario ``distractors`` item ``id - Q - G``
  ``[N0, N0+E)``               distractor    extra item ``j = id - N0``: class
                                             ``pool[j % P]``, instance
                                             ``EXTRA_INSTANCE_BASE + j // P``
  ===========================  ============  ===================================================

  ``pool`` is the sorted list of the ``P`` catalog classes that are neither query nor
  gallery classes, so extra distractors never hold a positive of a query. An image is
  ``GlyphRenderer(catalog, resolution, data_seed).render(class, instance)``: the same
  (scenario, data seed, resolution) always gives the same picture for the same id.
* :class:`RecordSource` -- image folders and GLDv2 csv files (``raycompat.data.readers``),
  ids as the readers number them.
* :class:`~raycompat.data.parquet_images.ParquetImageSource` -- parquet files with encoded
  image bytes, read lazily by row group; it lives in the data layer (``raycompat.data``), as
  does the base :class:`~raycompat.data.item_source.ItemSource`.
* :class:`ScenarioItemSource` -- a scenario of your images; :class:`OldFeatureSource` -- the
  old features of an earlier run, no images.

Undecodable images raise :class:`~raycompat.data.readers.CorruptImageError` naming the item id
and path (``on_corrupt='fail'``) or come back with ``error`` set (``'skip'``).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from raycompat.config import ConfigError
from raycompat.data.item_source import (
    SPLIT_NAMES,
    ItemSource,
    check_split,
    decode_item_image,
    image_columns,
)
from raycompat.data.parquet_images import ParquetRowGroupSource
from raycompat.data.readers import CorruptImageError

#: Instance numbers of extra distractors start here (far above any scenario instance).
EXTRA_INSTANCE_BASE = 1_000_000
#: Per-process renderer cache (one entry), see ``GlyphGallerySource.renderer``.
_RENDERERS: dict = {}
_SCENARIO_SPLITS = (("query", "query"), ("gallery", "gallery"), ("distractors", "distractor"))


class GlyphGallerySource(ItemSource):
    """The built-in glyph gallery of ``scenario`` plus ``extra_distractors`` generated
    distractors (id layout in the module docstring)."""

    kind = "glyphs"

    def __init__(
        self,
        scenario,
        extra_distractors: int = 0,
        resolution: int = 32,
        data_seed: int = 0,
        catalog=None,
    ):
        from raycompat.data import catalog_for

        if int(extra_distractors) < 0:
            raise ConfigError(f"extra distractors must be >= 0, got {extra_distractors}")
        if int(resolution) < 4:
            raise ConfigError(f"resolution must be >= 4, got {resolution}")
        catalog = catalog if catalog is not None else catalog_for(scenario)
        self.scenario_name = scenario.name
        self.scenario_seed = int(scenario.seed)
        self.scenario_params = dict(scenario.params)
        self.catalog_fingerprint = catalog.fingerprint
        self.codepoints = np.asarray(catalog.codepoints, np.int64)
        self.resolution = int(resolution)
        self.data_seed = int(data_seed)
        self.extra_distractors = int(extra_distractors)
        parts = [scenario.splits[name] for name, _ in _SCENARIO_SPLITS]
        self.labels = np.concatenate([p.labels for p in parts]).astype(np.int64)
        self.instances = np.concatenate([p.instances for p in parts]).astype(np.int64)
        self.split_codes = np.concatenate(
            [np.full(len(p), code, np.int8) for code, p in enumerate(parts)]
        )
        self.split_sizes = {
            out: len(p) for (_, out), p in zip(_SCENARIO_SPLITS, parts, strict=False)
        }
        eval_classes = np.union1d(
            scenario.splits["query"].labels, scenario.splits["gallery"].labels
        )
        self.pool = np.setdiff1d(np.arange(catalog.num_classes, dtype=np.int64), eval_classes)
        if self.extra_distractors and self.pool.size == 0:
            raise ConfigError("no catalog classes left for extra distractors")
        self._renderer = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_renderer"] = None
        return state

    @property
    def num_scenario_items(self) -> int:
        return int(self.labels.size)

    def num_ids(self) -> int:
        return self.num_scenario_items + self.extra_distractors

    def items(self, ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(labels, instances, split_codes)`` of ``ids`` (split code indexes ``SPLIT_NAMES``)."""
        ids = np.asarray(ids, dtype=np.int64)
        n0 = self.num_scenario_items
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_ids()):
            raise IndexError(f"item ids out of range [0, {self.num_ids()})")
        inside = ids < n0
        j = np.where(inside, 0, ids - n0)
        labels = np.where(
            inside, self.labels[np.where(inside, ids, 0)], self.pool[j % max(len(self.pool), 1)]
        )
        instances = np.where(
            inside,
            self.instances[np.where(inside, ids, 0)],
            EXTRA_INSTANCE_BASE + j // max(len(self.pool), 1),
        )
        codes = np.where(inside, self.split_codes[np.where(inside, ids, 0)], 2).astype(np.int8)
        return labels.astype(np.int64), instances.astype(np.int64), codes

    def renderer(self):
        """This process's renderer; shared by every task the process runs, so the glyph cache
        stays warm across batches (Ray Data ships a fresh copy of the source to each task)."""
        if self._renderer is None:
            key = (self.catalog_fingerprint, self.resolution, self.data_seed)
            if key not in _RENDERERS:
                from raycompat.data import GlyphRenderer, default_catalog

                catalog = default_catalog()
                if catalog.fingerprint != self.catalog_fingerprint:
                    raise RuntimeError(
                        f"this worker's glyph catalog {catalog.fingerprint} "
                        "differs from the driver's "
                        f"{self.catalog_fingerprint}: "
                        "fonts, Pillow or FreeType differ between machines"
                    )
                _RENDERERS.clear()
                _RENDERERS[key] = GlyphRenderer(
                    catalog, resolution=self.resolution, seed=self.data_seed
                )
            self._renderer = _RENDERERS[key]
        return self._renderer

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "scenario": self.scenario_name,
            "scenario_seed": self.scenario_seed,
            "scenario_params": self.scenario_params,
            "catalog": self.catalog_fingerprint,
            "resolution": self.resolution,
            "data_seed": self.data_seed,
            "extra_distractors": self.extra_distractors,
            "split_sizes": self.split_sizes,
            "extra_instance_base": EXTRA_INSTANCE_BASE,
        }

    def load(self, ids, on_corrupt: str = "fail") -> dict[str, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        labels, instances, codes = self.items(ids)
        images = self.renderer().render_batch(labels, instances)
        return {
            "item_id": ids,
            "label": labels,
            "split": np.asarray(SPLIT_NAMES, dtype=object)[codes],
            "class_name": np.asarray([f"U+{c:04X}" for c in self.codepoints[labels]], object),
            "image": images,
            "error": np.full(ids.size, "", dtype=object),
        }


class ScenarioItemSource(ItemSource):
    """The query, gallery and distractor items of a scenario of your images
    (``raycompat scenario``), with the id layout of :class:`GlyphGallerySource` (queries,
    then gallery, then distractors, each in the scenario's order); labels, splits and class
    names come from the scenario, images from its source by key."""

    kind = "scenario"

    def __init__(self, scenario, resolution: int = 32, in_chans: int = 3):
        from raycompat.data.source import ItemImages, SourceSpec

        if not scenario.user_data:
            raise ConfigError("ScenarioItemSource needs a scenario of your images")
        parts = [scenario.splits[name] for name, _ in _SCENARIO_SPLITS]
        self.keys = [k for p in parts for k in p.items]
        self.labels = np.concatenate([p.labels for p in parts]).astype(np.int64)
        self.splits = np.concatenate(
            [
                np.full(len(p), out, dtype=object)
                for (_, out), p in zip(_SCENARIO_SPLITS, parts, strict=True)
            ]
        )
        self.class_names = list(scenario.class_names)
        self.spec = SourceSpec.from_dict(scenario.source)
        self.resolution, self.in_chans = int(resolution), int(in_chans)
        self.images = ItemImages(self.spec, self.resolution, self.in_chans)
        self.scenario_digest = hashlib.sha256(
            json.dumps([self.keys, self.labels.tolist(), self.class_names]).encode()
        ).hexdigest()[:16]

    def num_ids(self) -> int:
        return len(self.keys)

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "source": self.spec.to_dict(),
            "items": self.num_ids(),
            "resolution": self.resolution,
            "in_chans": self.in_chans,
            "scenario_sha256": self.scenario_digest,
        }

    def load(self, ids, on_corrupt: str = "fail") -> dict[str, np.ndarray]:
        ids = np.asarray(ids, np.int64)
        decoded = []
        for i in ids.tolist():
            where = f"{self.spec.describe()} item {self.keys[i]!r}"
            try:
                decoded.append((self.images.load(self.keys[i]), ""))
            except (CorruptImageError, FileNotFoundError) as exc:
                if on_corrupt == "fail":
                    raise CorruptImageError(f"corrupt image item_id={i} {where}: {exc}") from None
                decoded.append((None, f"item_id={i} {where}: {exc}"))
        return image_columns(
            ids,
            self.labels[ids],
            self.splits[ids],
            decoded,
            self.resolution,
            self.in_chans,
            self.class_names,
        )


class RecordSource(ItemSource):
    """Images listed by a reader (``read_image_folder`` / ``read_gldv2_csv``): decoded from
    files, resized (shorter side) and centre-cropped to ``resolution``."""

    def __init__(
        self,
        records,
        kind: str,
        location: str,
        split: str = "gallery",
        resolution: int = 32,
        in_chans: int = 1,
    ):
        self.kind = kind
        self.location = os.path.abspath(location)
        self.split = check_split(split)
        self.resolution, self.in_chans = int(resolution), int(in_chans)
        recs = list(records.records if hasattr(records, "records") else records)
        if not recs:
            raise ConfigError(f"{kind} source {location}: no images")
        self.ids = np.array([r.item_id for r in recs], np.int64)
        order = np.argsort(self.ids, kind="stable")
        self.ids = self.ids[order]
        if (np.diff(self.ids) == 0).any():
            raise ConfigError(f"{kind} source {location}: duplicate item ids")
        self.paths = [recs[i].path for i in order]
        self.labels = np.array([recs[i].label for i in order], np.int64)
        names = getattr(records, "class_names", None)  # a RecordSet; plain records: label ids
        self.class_names = [str(c) for c in names or range(int(self.labels.max()) + 1)]

    @classmethod
    def image_folder(cls, root: str, **kw) -> RecordSource:
        from raycompat.data.readers import read_image_folder

        return cls(read_image_folder(root), "image_folder", root, **kw)

    @classmethod
    def gldv2(cls, csv_path: str, image_root: str, **kw) -> RecordSource:
        from raycompat.data.readers import read_gldv2_csv

        # Missing files are reported per item when they are loaded (skip or fail), not here.
        return cls(read_gldv2_csv(csv_path, image_root, check_files=False), "gldv2", csv_path, **kw)

    def num_ids(self) -> int:
        return int(self.ids.size)

    def all_ids(self) -> np.ndarray:
        return self.ids

    def describe(self) -> dict:
        h = hashlib.sha256(self.ids.tobytes())
        for p in self.paths:
            h.update(p.encode() + b"\0")
        return {
            "kind": self.kind,
            "location": self.location,
            "items": self.num_ids(),
            "split": self.split,
            "resolution": self.resolution,
            "in_chans": self.in_chans,
            "records_sha256": h.hexdigest()[:16],
        }

    def load(self, ids, on_corrupt: str = "fail") -> dict[str, np.ndarray]:
        ids = np.asarray(ids, np.int64)
        pos = np.searchsorted(self.ids, ids)
        mode = "L" if self.in_chans == 1 else "RGB"
        decoded = [
            decode_item_image(
                self.paths[p], int(i), self.paths[p], mode, self.resolution, on_corrupt
            )
            for p, i in zip(pos.tolist(), ids.tolist(), strict=False)
        ]
        return image_columns(
            ids,
            self.labels[pos],
            self.split,
            decoded,
            self.resolution,
            self.in_chans,
            self.class_names,
        )


class OldFeatureSource(ParquetRowGroupSource):
    """Stored old features (an earlier output of this pipeline, or any parquet with
    ``item_id``, ``label``, ``split`` and an ``old`` vector column): the gallery refresh with
    psi needs no image and no backbone pass (DMU forward adaptation). ``load`` returns the
    ``old`` column instead of an image; features are read per row group."""

    kind = "old_features"
    provides_old = True

    def __init__(self, path: str):
        import pyarrow as pa

        self._list_files(path, "old-feature source")
        self.old_dim = None

        def check_file(f, pf):
            schema = pf.schema_arrow
            missing = [c for c in ("item_id", "label", "split", "old") if c not in schema.names]
            if missing:
                raise ConfigError(f"parquet {f} lacks column(s) {missing}; has {schema.names}")
            for name in ("item_id", "label"):
                if not pa.types.is_integer(schema.field(name).type):
                    raise ConfigError(
                        f"column {name!r} of {f} must hold integers, got {schema.field(name).type}"
                    )
            t = schema.field("old").type
            if not pa.types.is_fixed_size_list(t):
                raise ConfigError(f"column 'old' of {f} must be fixed_size_list<float32>, got {t}")
            if self.old_dim not in (None, t.list_size):
                raise ConfigError(
                    f"column 'old' has dimension {t.list_size} in {f}, {self.old_dim} elsewhere"
                )
            self.old_dim = t.list_size

        def read_group(pf, g):
            named = "class_name" in pf.schema_arrow.names
            columns = ["item_id", "label", "split"] + (["class_name"] if named else [])
            tab = pf.read_row_group(g, columns=columns)
            names = tab.column("class_name").to_pylist() if named else [""] * tab.num_rows
            return (
                tab.column("item_id").to_numpy(),
                (
                    tab.column("label").to_numpy().astype(np.int64),
                    np.asarray(tab.column("split").to_pylist(), dtype=object),
                    np.asarray(names, dtype=object),
                ),
            )

        self.labels, self.splits, self.item_classes = self._index_row_groups(
            check_file, read_group, f"old-feature source {path}"
        )

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "location": self.location,
            "items": self.num_ids(),
            "old_dim": self.old_dim,
            "files_sha256": self._files_digest(),
        }

    def load(self, ids, on_corrupt: str = "fail") -> dict[str, np.ndarray]:
        import pyarrow.parquet as pq

        ids = np.asarray(ids, np.int64)
        pos = np.searchsorted(self.ids, ids)
        old = np.empty((ids.size, self.old_dim), np.float32)
        keys = np.stack([self.file_of[pos], self.group_of[pos]], 1)
        for f, g in np.unique(keys, axis=0).tolist():
            mask = (keys[:, 0] == f) & (keys[:, 1] == g)
            col = (
                pq.ParquetFile(self.files[f])
                .read_row_group(g, columns=["old"])
                .column("old")
                .combine_chunks()
            )
            values = col.flatten().to_numpy().reshape(len(col), self.old_dim)
            old[mask] = values[self.row_of[pos[mask]]]
        return {
            "item_id": ids,
            "label": self.labels[pos],
            "split": self.splits[pos],
            "class_name": self.item_classes[pos],
            "old": old,
            "error": np.full(ids.size, "", dtype=object),
        }
