"""Where a job's images come from: one notion of "data source" shared by every job.

``--source glyphs`` is the built-in glyph renderer (labels are glyph catalog classes). The
user sources hold labelled images on disk, each item named by a stable string *key* and a
*class name*:

=================  ==================================================  ======================
``--source``       ``--path``                                          key / class name
=================  ==================================================  ======================
``image_folder``   ``root/<class>/<image>``                            ``<class>/<image>`` /
                                                                       the folder name
``parquet``        parquet file or folder: ``--id-column`` (integers),  the id / the value of
                   ``--class-column``, ``--image-column`` (bytes)        ``--class-column``
``gldv2``          GLDv2 ``train.csv`` (``id,url,landmark_id``) with     the image id / the
                   ``--image-root`` (``a/b/c/<id>.jpg``)                 landmark id
=================  ==================================================  ======================

Class names, never positions in one folder's class list, tie items to classes: the labels of
a scenario are indices into its sorted class names (docs/architecture.md, "Formats").
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import numpy as np

from raycompat.config import ConfigError, choices, option, positive
from raycompat.data.parquet_images import ParquetImageSource

#: The data sources every job accepts (``--source``).
SOURCE_KINDS = ("glyphs", "image_folder", "parquet", "gldv2")
#: The user sources (everything but the built-in glyphs).
USER_SOURCES = SOURCE_KINDS[1:]


@dataclass(frozen=True)
class DataSourceOptions:
    """``--source``, ``--path`` ... : where the images come from, the same flags in every job.
    ``eval_fraction`` and ``distractor_fraction`` allocate a user source's classes when no
    ``--scenario scenario.json`` is given (docs/methods.md, "Upgrade scenarios")."""

    source: str = choices(
        *SOURCE_KINDS, default="glyphs", help="glyphs (built in) or your labelled images"
    )
    path: str | None = option(
        None,
        help="your images: an image folder root/<class>/<image>, a parquet file or folder "
        "with image bytes, or a GLDv2 csv",
    )
    image_root: str | None = option(None, help="GLDv2 image root (a/b/c/<id>.jpg layout)")
    image_column: str = option("image", help="parquet source: the image bytes column")
    class_column: str = option("label", help="parquet source: the class column (name or id)")
    id_column: str = option("item_id", help="parquet source: the integer item id column")
    eval_fraction: float = positive(
        0.25, help="your images: share of classes held out for queries and gallery"
    )
    distractor_fraction: float = option(
        0.0, min=0, help="your images: share of classes held out as gallery distractors"
    )

    def __post_init__(self):
        if self.path and self.source == "glyphs":  # never train on glyphs when photos were meant
            raise ConfigError(
                f"--path {self.path} needs --source {'|'.join(USER_SOURCES)}: the built-in "
                "glyphs read no files"
            )

    @property
    def user(self) -> bool:
        return self.source != "glyphs"

    def spec(self) -> SourceSpec:
        """The checked :class:`SourceSpec` of a user source (``ConfigError`` naming the flag)."""
        if not self.user:
            raise ConfigError("--source glyphs has no files; this needs your images")
        if not self.path:
            raise ConfigError(f"--source {self.source} needs --path")
        if self.source == "gldv2" and not self.image_root:
            raise ConfigError("--source gldv2 needs --image-root")
        if not 0 < self.eval_fraction < 1 or not 0 <= self.distractor_fraction < 1:
            raise ConfigError("--eval-fraction must be in (0, 1), --distractor-fraction in [0, 1)")
        if self.eval_fraction + self.distractor_fraction >= 1:
            raise ConfigError("--eval-fraction + --distractor-fraction leave no training classes")
        path = os.path.abspath(os.path.expanduser(self.path))
        if not os.path.exists(path):
            raise ConfigError(f"--path {self.path}: no such file or folder")
        root = os.path.abspath(os.path.expanduser(self.image_root)) if self.image_root else None
        parquet = self.source == "parquet"
        return SourceSpec(
            self.source,
            path,
            root,
            self.image_column if parquet else None,
            self.class_column if parquet else None,
            self.id_column if parquet else None,
        )


@dataclass(frozen=True)
class SourceSpec:
    """A user source as recorded in ``scenario.json``: kind, absolute path and columns."""

    kind: str
    path: str
    image_root: str | None = None
    image_column: str | None = None
    class_column: str | None = None
    id_column: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict, where: str = "scenario") -> SourceSpec:
        if not isinstance(d, dict) or d.get("kind") not in USER_SOURCES or not d.get("path"):
            raise ConfigError(
                f"{where}: field 'source' must be an object with 'kind' (one of "
                f"{', '.join(USER_SOURCES)}) and 'path', got {d!r}"
            )
        known = {f: d.get(f) for f in cls.__dataclass_fields__}
        return cls(**known)

    def describe(self) -> str:
        return f"{self.kind} {self.path}"


@dataclass
class LabelledItems:
    """Every item of a user source: its key and class name, in the source's sorted order."""

    spec: SourceSpec
    keys: list[str]
    classes: list[str]

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def class_names(self) -> list[str]:
        """Sorted unique class names: label ``i`` of a scenario is ``class_names[i]``."""
        return sorted(set(self.classes))


def list_items(spec: SourceSpec) -> LabelledItems:
    """The keys and class names of every item of ``spec`` (reads listings, not images)."""
    if spec.kind == "image_folder":
        from raycompat.data.readers import read_image_folder

        try:
            records = read_image_folder(spec.path)
        except (OSError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        keys = [os.path.relpath(r.path, spec.path) for r in records]
        return LabelledItems(spec, keys, [records.class_names[r.label] for r in records])
    if spec.kind == "gldv2":
        from raycompat.data.readers import read_gldv2_csv

        try:
            records = read_gldv2_csv(spec.path, spec.image_root, check_files=False)
        except (OSError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        keys = [os.path.basename(r.path)[: -len(".jpg")] for r in records]
        return LabelledItems(spec, keys, [records.class_names[r.label] for r in records])
    return _list_parquet(spec)


def _list_parquet(spec: SourceSpec) -> LabelledItems:
    source = ParquetImageSource(
        spec.path, spec.image_column, spec.class_column, spec.id_column, split="gallery"
    )
    missing = np.flatnonzero(source.labels < 0)
    if missing.size:
        raise ConfigError(
            f"parquet source {spec.path}: {missing.size} item(s) have no value in class column "
            f"{spec.class_column!r}, e.g. item ids {source.ids[missing[:5]].tolist()}"
        )
    names = [str(c) for c in source.class_values]
    return LabelledItems(
        spec, [str(i) for i in source.ids.tolist()], [names[i] for i in source.labels]
    )


class ItemImages:
    """Decodes a user source's items by key: uint8 ``[H, W]`` (``in_chans`` 1) or
    ``[H, W, 3]``, shorter side resized to ``resolution`` and centre-cropped. A missing or
    undecodable image raises ``CorruptImageError`` / ``FileNotFoundError`` naming it."""

    def __init__(self, spec: SourceSpec, resolution: int, in_chans: int = 3):
        self.spec, self.resolution, self.in_chans = spec, int(resolution), int(in_chans)
        self._parquet = None

    def __getstate__(self):
        return {**self.__dict__, "_parquet": None}

    def path_of(self, key: str) -> str:
        if self.spec.kind == "image_folder":
            return os.path.join(self.spec.path, key)
        from raycompat.data.readers import gldv2_image_path

        return gldv2_image_path(self.spec.image_root, key)

    def load(self, key: str, size: int | None = None) -> np.ndarray:
        """One image at ``size`` pixels (default ``resolution``)."""
        from raycompat.data.readers import load_image

        mode = "L" if self.in_chans == 1 else "RGB"
        size = size or self.resolution
        if self.spec.kind != "parquet":
            return np.asarray(load_image(self.path_of(key), mode=mode, resolution=size))
        if self._parquet is None:
            s = self.spec
            self._parquet = ParquetImageSource(
                s.path, s.image_column, s.class_column, s.id_column, resolution=size,
                in_chans=self.in_chans,
            )  # fmt: skip
        self._parquet.resolution = size
        return self._parquet.load(np.array([int(key)]))["image"][0]
