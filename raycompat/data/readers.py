"""Readers for user data: image folders, GLDv2 csv files, revisited Oxford/Paris
ground truth, and parquet files with image bytes.

Every reader returns plain records (path or bytes, label, item id, split). Images
that cannot be read are never dropped silently: with ``on_error='raise'`` the error
names the file (or item), with ``on_error='skip'`` a warning names it and the
reader's ``skipped`` list records it.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".png",
    ".bmp",
    ".gif",
    ".webp",
    ".tif",
    ".tiff",
    ".ppm",
    ".pgm",
)
ON_ERROR = ("raise", "skip")
#: How many skipped paths a warning lists before summarising.
_LIST_LIMIT = 20


class CorruptImageError(ValueError):
    """An image file or byte string that cannot be decoded; the message names it."""


@dataclass
class ImageRecord:
    """One image: a file ``path`` or in-memory ``data`` bytes, its class ``label``
    (-1 when unlabelled), a stable ``item_id``, the ``split`` it belongs to, and an
    optional crop box ``bbox`` (x0, y0, x1, y1) for queries."""

    path: str | None
    label: int
    item_id: int
    split: str = "train"
    data: bytes | None = field(default=None, repr=False)
    bbox: tuple[float, float, float, float] | None = None

    @property
    def source(self) -> str:
        """Human-readable name used in error messages."""
        if self.data is not None:
            return f"{self.path or 'bytes'} (item_id={self.item_id})"
        return str(self.path)


@dataclass
class RecordSet:
    """Records plus the class-name mapping (``class_names[label]``) and the
    sources that were skipped as unreadable."""

    records: list[ImageRecord]
    class_names: list[str]
    skipped: list[str] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def __getitem__(self, i: int) -> ImageRecord:
        return self.records[i]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def labels(self) -> np.ndarray:
        return np.array([r.label for r in self.records], dtype=np.int64)


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


def report_skipped(where: str, skipped: list[str]) -> None:
    """Log one warning with the count and (the first few) skipped sources."""
    if not skipped:
        return
    shown = ", ".join(skipped[:_LIST_LIMIT])
    more = f" (+{len(skipped) - _LIST_LIMIT} more)" if len(skipped) > _LIST_LIMIT else ""
    logger.warning("skipped %d unreadable image(s) in %s: %s%s", len(skipped), where, shown, more)


def load_image(
    src,
    *,
    mode: str | None = None,
    resolution: int | None = None,
    on_error: str = "raise",
    source: str | None = None,
    bbox=None,
) -> Image.Image | None:
    """Decode an image fully from a path, bytes or an ``ImageRecord``.

    ``mode`` converts (e.g. ``'L'``, ``'RGB'``); ``bbox`` crops (x0, y0, x1, y1);
    ``resolution`` resizes the shorter side and centre-crops to a square. A missing
    file raises ``FileNotFoundError`` and an undecodable one ``CorruptImageError``,
    both naming ``source`` (default: the path or item id); with ``on_error='skip'``
    a warning names it and ``None`` is returned.
    """
    _check_on_error(on_error)
    if isinstance(src, ImageRecord):
        source = source or src.source
        bbox = src.bbox if bbox is None else bbox
        src = src.data if src.data is not None else src.path
    if isinstance(src, (bytes, bytearray, memoryview)):
        name = source or "<image bytes>"
        opener = lambda: Image.open(io.BytesIO(bytes(src)))  # noqa: E731
    else:
        name = source or str(src)
        if src is None or not os.path.isfile(src):
            err = FileNotFoundError(f"image file not found: {name}")
            if on_error == "raise":
                raise err
            logger.warning("skipping missing image %s", name)
            return None
        opener = lambda: Image.open(src)  # noqa: E731
    try:
        with opener() as im:
            im.load()
            img = im.convert(mode) if mode is not None and im.mode != mode else im.copy()
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:
        if on_error == "raise":
            raise CorruptImageError(f"cannot decode image {name}: {exc}") from exc
        logger.warning("skipping unreadable image %s: %s", name, exc)
        return None
    if bbox is not None:
        x0, y0, x1, y1 = (float(v) for v in bbox)
        img = img.crop((int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))))
    if resolution is not None:
        img = resize_center_crop(img, int(resolution))
    return img


def resize_center_crop(img: Image.Image, size: int) -> Image.Image:
    """Resize so the shorter side is ``size``, then crop the centre square."""
    w, h = img.size
    scale = size / max(1, min(w, h))
    nw, nh = max(size, int(round(w * scale))), max(size, int(round(h * scale)))
    img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    return img.crop((left, top, left + size, top + size))


def verify_records(records: list[ImageRecord], on_error: str = "raise", where: str = "records"):
    """Decode every record once; returns ``(readable_records, skipped_sources)``."""
    _check_on_error(on_error)
    good, skipped = [], []
    for rec in records:
        if load_image(rec, on_error=on_error) is None:
            skipped.append(rec.source)
        else:
            good.append(rec)
    report_skipped(where, skipped)
    return good, skipped


def _finish(records, class_names, skipped, source, verify, on_error) -> RecordSet:
    if verify:
        records, bad = verify_records(records, on_error, where=source)
        skipped = skipped + bad
    return RecordSet(records, class_names, skipped, source)


def _require_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")


def read_image_folder(
    root,
    *,
    split: str = "train",
    extensions=IMAGE_EXTENSIONS,
    verify: bool = False,
    on_error: str = "raise",
) -> RecordSet:
    """``root/<class_name>/<images>`` (ImageNet layout). Labels follow sorted class
    names; item ids follow sorted (class, file name). ``verify`` decodes every image."""
    _check_on_error(on_error)
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root}")
    exts = tuple(e.lower() for e in extensions)
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise ValueError(f"no class sub-folders in image folder {root}")
    records, names = [], []
    for d in class_dirs:
        files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in exts)
        if not files:
            logger.warning(
                "class folder %s has no images with extensions %s; ignored", d, ", ".join(exts)
            )
            continue
        label = len(names)
        names.append(d.name)
        base = len(records)
        records.extend(ImageRecord(str(p), label, base + i, split) for i, p in enumerate(files))
    if not records:
        raise ValueError(f"no images with extensions {', '.join(exts)} under {root}")
    return _finish(records, names, [], str(root), verify, on_error)


def gldv2_image_path(image_root, image_id: str) -> str:
    """GLDv2 layout: ``image_root/a/b/c/abc....jpg`` from the id's first 3 chars."""
    if len(image_id) < 3:
        raise ValueError(f"GLDv2 image id too short for the a/b/c layout: {image_id!r}")
    return str(Path(image_root) / image_id[0] / image_id[1] / image_id[2] / f"{image_id}.jpg")


def read_gldv2_csv(
    csv_path,
    image_root,
    *,
    split: str = "train",
    check_files: bool = True,
    verify: bool = False,
    on_error: str = "raise",
) -> RecordSet:
    """Google Landmarks v2 ``train.csv`` (columns ``id,url,landmark_id``; ``url`` is
    optional) or ``train_clean.csv`` (``landmark_id,images`` with space-separated ids).
    Labels are landmark ids renumbered 0..n-1 in sorted order (``class_names`` holds
    the original ids). ``check_files`` requires every image file to exist."""
    _check_on_error(on_error)
    csv_path = Path(csv_path)
    _require_file(csv_path, "GLDv2 csv")
    rows: list[tuple[str, str]] = []
    with open(csv_path, newline="") as fh:
        reader = csv.DictReader(fh)
        cols = [c.strip() for c in (reader.fieldnames or [])]
        reader.fieldnames = cols
        if "landmark_id" in cols and "id" in cols:
            for line, row in enumerate(reader, start=2):
                if not row["id"] or row["landmark_id"] in (None, ""):
                    raise ValueError(f"{csv_path}:{line}: empty 'id' or 'landmark_id'")
                rows.append((row["id"].strip(), row["landmark_id"].strip()))
        elif "landmark_id" in cols and "images" in cols:
            for row in reader:
                rows.extend((i, row["landmark_id"].strip()) for i in (row["images"] or "").split())
        else:
            need = ["id", "landmark_id"] if "images" not in cols else ["landmark_id"]
            missing = [c for c in need if c not in cols]
            raise ValueError(
                f"GLDv2 csv {csv_path} lacks column(s) {missing}; has {cols} "
                f"(expected id,url,landmark_id or landmark_id,images)"
            )
    if not rows:
        raise ValueError(f"GLDv2 csv {csv_path} has no rows")
    try:
        keys = sorted({lm for _, lm in rows}, key=int)
    except ValueError:
        keys = sorted({lm for _, lm in rows})
    label_of = {k: i for i, k in enumerate(keys)}
    records, skipped = [], []
    for item, (image_id, lm) in enumerate(rows):
        path = gldv2_image_path(image_root, image_id)
        if check_files and not os.path.isfile(path):
            if on_error == "raise":
                raise FileNotFoundError(
                    f"image file not found: {path} (id {image_id} in {csv_path})"
                )
            skipped.append(path)
            continue
        records.append(ImageRecord(path, label_of[lm], item, split))
    report_skipped(str(csv_path), skipped)
    return _finish(records, keys, skipped, str(csv_path), verify, on_error)


REVISITED_LEVELS = ("easy", "medium", "hard")


@dataclass
class RevisitedData:
    """Revisited Oxford/Paris: gallery (``imlist``) and query (``qimlist``, with
    ``bbox``) records and per-query ground truth. ``item_id`` of a record is its
    position in ``imlist``/``qimlist``; ground-truth indices refer to gallery item ids."""

    dataset: str
    gallery: list[ImageRecord]
    queries: list[ImageRecord]
    ground_truth: list[dict]
    skipped: list[str] = field(default_factory=list)

    def protocol(self, level: str) -> list[dict]:
        """Per query ``{'ok': positives, 'junk': ignored}`` gallery ids for the
        revisited protocol level: easy (ok=easy, junk=junk+hard), medium
        (ok=easy+hard, junk=junk), hard (ok=hard, junk=junk+easy)."""
        if level not in REVISITED_LEVELS:
            raise ValueError(
                f"unknown revisited protocol level {level!r}; expected one of {REVISITED_LEVELS}"
            )
        out = []
        for g in self.ground_truth:
            easy, hard, junk = g["easy"], g["hard"], g["junk"]
            if level == "easy":
                ok, ign = easy, np.concatenate([junk, hard])
            elif level == "medium":
                ok, ign = np.concatenate([easy, hard]), junk
            else:
                ok, ign = hard, np.concatenate([junk, easy])
            out.append(
                {"ok": np.unique(ok).astype(np.int64), "junk": np.unique(ign).astype(np.int64)}
            )
        return out


def read_revisited(
    root, dataset: str, *, check_files: bool = True, verify: bool = False, on_error: str = "raise"
) -> RevisitedData:
    """``root/gnd_<dataset>.pkl`` (keys ``imlist``, ``qimlist``, ``gnd``) and
    ``root/jpg/<name>.jpg``; the revisitop layout ``root/<dataset>/...`` also works."""
    _check_on_error(on_error)
    root = Path(root)
    pkl = root / f"gnd_{dataset}.pkl"
    if not pkl.is_file() and (root / dataset / f"gnd_{dataset}.pkl").is_file():
        root = root / dataset
        pkl = root / f"gnd_{dataset}.pkl"
    _require_file(pkl, f"revisited ground truth for {dataset!r}")
    try:
        with open(pkl, "rb") as fh:
            cfg = pickle.load(fh)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        raise ValueError(f"cannot read revisited ground truth {pkl}: {exc}") from exc
    for key in ("imlist", "qimlist", "gnd"):
        if key not in cfg:
            raise ValueError(f"revisited ground truth {pkl} lacks key {key!r}")
    if len(cfg["gnd"]) != len(cfg["qimlist"]):
        raise ValueError(
            f"{pkl}: {len(cfg['gnd'])} ground-truth entries for {len(cfg['qimlist'])} queries"
        )
    n = len(cfg["imlist"])
    gts = []
    for q, g in enumerate(cfg["gnd"]):
        entry = {}
        for key in ("easy", "hard", "junk"):
            if key not in g:
                raise ValueError(f"{pkl}: ground truth of query {q} lacks {key!r}")
            idx = np.asarray(g[key], dtype=np.int64).ravel()
            if idx.size and (idx.min() < 0 or idx.max() >= n):
                raise ValueError(f"{pkl}: query {q} {key!r} index out of range [0, {n})")
            entry[key] = idx
        entry["bbx"] = None if g.get("bbx") is None else tuple(float(v) for v in np.ravel(g["bbx"]))
        gts.append(entry)
    jpg = root / "jpg"

    def records(names, split, boxes):
        recs, skipped = [], []
        for i, name in enumerate(names):
            path = str(jpg / f"{name}.jpg")
            if check_files and not os.path.isfile(path):
                if on_error == "raise":
                    raise FileNotFoundError(f"image file not found: {path} ({split} {i} of {pkl})")
                skipped.append(path)
                continue
            recs.append(ImageRecord(path, -1, i, split, bbox=boxes[i] if boxes else None))
        return recs, skipped

    gallery, skip_g = records(cfg["imlist"], "gallery", None)
    queries, skip_q = records(cfg["qimlist"], "query", [g["bbx"] for g in gts])
    skipped = skip_g + skip_q
    report_skipped(str(pkl), skipped)
    if verify:
        gallery, bad_g = verify_records(gallery, on_error, where=f"{pkl} gallery")
        queries, bad_q = verify_records(queries, on_error, where=f"{pkl} queries")
        skipped += bad_g + bad_q
    return RevisitedData(dataset, gallery, queries, gts, skipped)


def read_parquet_images(
    path,
    image_column: str = "image",
    label_column: str | None = "label",
    id_column: str | None = "item_id",
    *,
    split: str = "train",
    verify: bool = False,
    on_error: str = "raise",
) -> RecordSet:
    """Parquet rows with encoded image bytes (binary column, or a struct with a
    ``bytes`` field as Hugging Face writes). Labels are renumbered 0..n-1 in sorted
    order of the label values (``class_names`` keeps them); ``label_column=None``
    gives -1 labels, ``id_column=None`` uses row numbers as item ids."""
    import pyarrow.parquet as pq

    _check_on_error(on_error)
    path = Path(path)
    _require_file(path, "parquet file")
    schema = pq.read_schema(path)
    wanted = [c for c in (image_column, label_column, id_column) if c is not None]
    missing = [c for c in wanted if c not in schema.names]
    if missing:
        raise ValueError(
            f"parquet {path} lacks column(s) {missing}; has {schema.names}"
            + (" (pass id_column=None to number rows)" if id_column in missing else "")
        )
    table = pq.read_table(path, columns=wanted)
    images = table.column(image_column).to_pylist()
    ids = table.column(id_column).to_pylist() if id_column else list(range(table.num_rows))
    try:
        ids = [int(i) for i in ids]
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"parquet {path}: id column {id_column!r} must hold integers ({exc})"
        ) from exc
    if label_column is not None:
        raw = table.column(label_column).to_pylist()
        keys = sorted({v for v in raw if v is not None})
        label_of = {k: i for i, k in enumerate(keys)}
        labels = [label_of.get(v, -1) for v in raw]
        names = [str(k) for k in keys]
    else:
        labels, names = [-1] * table.num_rows, []
    records, skipped = [], []
    for row, (img, label, item) in enumerate(zip(images, labels, ids, strict=False)):
        if isinstance(img, dict):
            img = img.get("bytes")
        where = f"{path}#{row}"
        if not isinstance(img, (bytes, bytearray)) or not img:
            if on_error == "raise":
                raise CorruptImageError(
                    f"no image bytes in {where} (item_id={item}, column {image_column!r})"
                )
            skipped.append(f"{where} (item_id={item})")
            continue
        records.append(ImageRecord(where, label, item, split, data=bytes(img)))
    report_skipped(str(path), skipped)
    return _finish(records, names, skipped, str(path), verify, on_error)
