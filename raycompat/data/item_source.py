"""Image sources addressed by stable integer item ids: the base class every source of the
embedding pipeline derives from and the columns its ``load`` returns (``item_id, label, split,
class_name, image, error``).

Every source maps an item id to ``(label, split, image)`` deterministically, so any subset of
ids (a resumed chunk, a backfill batch asking for "the new column of these ids") can be
produced again on any worker. The sources themselves: :mod:`raycompat.data.parquet_images`
(parquet files of image bytes) and :mod:`raycompat.pipeline.sources` (glyphs, image folders,
GLDv2, a scenario of your images, stored old features).

Undecodable images raise :class:`~raycompat.data.readers.CorruptImageError` naming the item id
and path (``on_corrupt='fail'``) or come back with ``error`` set (``'skip'``).
"""

from __future__ import annotations

import numpy as np

from raycompat.config import ConfigError
from raycompat.data.readers import CorruptImageError, load_image

#: Output split names (the backfill loader's vocabulary).
SPLIT_NAMES = ("query", "gallery", "distractor")


class ItemSource:
    """Base: ``load(ids)`` -> columns ``item_id, label, split, image, error``."""

    kind = "abstract"
    in_chans = 1
    resolution = 32

    def num_ids(self) -> int:
        raise NotImplementedError

    def all_ids(self) -> np.ndarray | None:
        """Sorted ids when they are not ``range(num_ids())``."""
        return None

    def check_ids(self, ids: np.ndarray) -> None:
        """Raise ``ConfigError`` naming ids this source does not have."""
        known = self.all_ids()
        if known is None:
            bad = ids[(ids < 0) | (ids >= self.num_ids())]
        else:
            bad = ids[~np.isin(ids, known)]
        if bad.size:
            raise ConfigError(
                f"{bad.size} item id(s) not in the {self.kind} source, e.g. "
                f"{bad[:5].tolist()} (the source has {self.num_ids()} items)"
            )

    def describe(self) -> dict:
        raise NotImplementedError

    def load(self, ids: np.ndarray, on_corrupt: str = "fail") -> dict[str, np.ndarray]:
        raise NotImplementedError


def decode_item_image(src, item_id: int, where: str, mode: str, resolution: int, on_corrupt: str):
    """One image as uint8, or ``(None, message)`` when skipping a bad one."""
    try:
        img = load_image(src, mode=mode, resolution=resolution, on_error="raise", source=where)
    except (CorruptImageError, FileNotFoundError) as exc:
        message = f"item_id={item_id} path={where}: {exc}"
        if on_corrupt == "fail":
            raise CorruptImageError(f"corrupt image {message}") from None
        return None, message
    return np.asarray(img, dtype=np.uint8), ""


def image_columns(ids, labels, split, decoded, resolution: int, in_chans: int, class_names) -> dict:
    """The columns ``load`` returns; ``split`` is one name or one per item, ``class_names``
    the name of every label (``class_names[label]``)."""
    shape = (resolution, resolution) if in_chans == 1 else (resolution, resolution, in_chans)
    images = np.zeros((len(ids), *shape), np.uint8)
    errors = np.full(len(ids), "", dtype=object)
    for k, (img, err) in enumerate(decoded):
        if img is not None:
            images[k] = img
        errors[k] = err
    return {
        "item_id": np.asarray(ids, np.int64),
        "label": np.asarray(labels, np.int64),
        "split": np.full(len(ids), split, dtype=object) if isinstance(split, str) else split,
        "class_name": np.asarray([class_names[i] for i in np.asarray(labels).tolist()], object),
        "image": images,
        "error": errors,
    }


def check_split(split: str) -> str:
    if split not in SPLIT_NAMES:
        raise ConfigError(f"split {split!r} is not allowed; allowed: {list(SPLIT_NAMES)}")
    return split
