"""A pool of Ray actors holding the new model: embeds gallery items on demand for the backfill
controller (glyph items rendered by :class:`raycompat.data.glyphs.GlyphRenderer`), and images
for image queries.  Shared image decoding for the router lives here too (:func:`decode_images`).
"""

from __future__ import annotations

import json

import numpy as np

from raycompat.config import ConfigError

__all__ = ["ImageInputError", "decode_images", "ModelEmbedder", "EmbedderPool"]


class ImageInputError(ValueError):
    """A query image is bad (base64, size, format); the message names which one."""


def decode_images(
    images_b64: list[str],
    resolution: int,
    in_chans: int,
    max_bytes: int,
    max_pixels: int,
    max_total_pixels: int | None = None,
) -> np.ndarray:
    """base64 PNG/JPEG strings -> uint8 ``[n, R, R]`` grey (``in_chans`` 1) or ``[n, R, R, 3]``
    colour images (resized + centre-cropped as :func:`raycompat.data.readers.load_image`);
    raises :class:`ImageInputError`.  ``max_total_pixels``: the request's pixel budget, checked
    from the images' headers before any is decoded."""
    from raycompat.data.readers import CorruptImageError, load_image

    colour = int(in_chans) > 1
    shape = (resolution, resolution, 3) if colour else (resolution, resolution)
    out = np.empty((len(images_b64), *shape), np.uint8)
    raws = [_checked_raw(s, i, max_bytes, max_pixels) for i, s in enumerate(images_b64)]
    total = sum(size[0] * size[1] for _, size in raws)
    if max_total_pixels is not None and total > max_total_pixels:
        raise ImageInputError(
            f"images: {total:,} pixels in this request exceed its budget of {max_total_pixels:,}"
        )
    for i, (raw, _) in enumerate(raws):
        where = f"images[{i}]"
        try:
            img = load_image(
                raw, mode="RGB" if colour else "L", resolution=resolution, source=where
            )
        except CorruptImageError as exc:
            raise ImageInputError(str(exc)) from None
        except Exception as exc:
            raise ImageInputError(f"{where}: corrupt image ({type(exc).__name__}: {exc})") from None
        out[i] = np.asarray(img, np.uint8)
    return out


def _checked_raw(s: str, i: int, max_bytes: int, max_pixels: int) -> tuple[bytes, tuple]:
    """One base64 image's bytes and its size from its header (PNG or JPEG, within the limits);
    raises :class:`ImageInputError` naming ``images[i]``."""
    import base64
    import binascii
    import io

    from PIL import Image

    where = f"images[{i}]"
    try:
        raw = base64.b64decode(s.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"{where}: invalid base64 ({exc})") from None
    if not raw:
        raise ImageInputError(f"{where}: empty image")
    if len(raw) > max_bytes:
        raise ImageInputError(
            f"{where}: image of {len(raw)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        with Image.open(io.BytesIO(raw)) as probe:
            fmt, size = probe.format, probe.size
    except Exception as exc:  # PIL raises many types for garbage
        raise ImageInputError(f"{where}: not a PNG or JPEG image ({type(exc).__name__})") from None
    if fmt not in ("PNG", "JPEG"):
        raise ImageInputError(f"{where}: format {fmt} is not accepted; send PNG or JPEG")
    if size[0] * size[1] > max_pixels or min(size) < 1:
        raise ImageInputError(
            f"{where}: {size[0]}x{size[1]} pixels exceeds the limit of {max_pixels}"
        )
    return raw, size


class ModelEmbedder:
    """The new model's embedder in one process (raw, un-normalised embeddings)."""

    def __init__(self, bundle_path: str, resolution: int | None = None, data_seed: int = 0):
        import torch

        from raycompat.models import ModelBundle

        torch.set_num_threads(1)
        self.bundle = ModelBundle.load(bundle_path).eval()
        self.in_chans = int(self.bundle.manifest.get("in_chans", 1))
        self.resolution = int(resolution or self.bundle.manifest.get("resolution") or 32)
        self.embed_dim = int(self.bundle.embed_dim)
        self.data_seed = int(data_seed)
        self._renderer = None

    def embed_images(self, images: np.ndarray) -> np.ndarray:
        import torch

        from raycompat.data import images_to_tensor

        with torch.no_grad():
            return self.bundle.embedder(images_to_tensor(images, self.in_chans)).float().numpy()

    def embed_keys(self, keys: list[str], source: dict) -> np.ndarray:
        """Your images by key (``source``: the scenario's source), decoded as training did."""
        from raycompat.data.source import ItemImages, SourceSpec
        from raycompat.evaluation import embed_keys

        images = ItemImages(SourceSpec.from_dict(source), self.resolution, self.in_chans)
        return embed_keys(self.bundle, images, list(keys))

    def embed_glyphs(self, classes: np.ndarray, instances: np.ndarray) -> np.ndarray:
        from raycompat.data import GlyphRenderer, default_catalog
        from raycompat.evaluation import embed_glyphs

        if self._renderer is None:
            self._renderer = GlyphRenderer(
                default_catalog(), resolution=self.resolution, seed=self.data_seed
            )
        return embed_glyphs(self.bundle, self._renderer, np.asarray(classes), np.asarray(instances))


class EmbedderPool:
    """``size`` Ray actors each holding a :class:`ModelEmbedder`; ``new_vectors(ids)`` renders the
    items (``items`` parquet: item_id, label = glyph class index, instance) and embeds them,
    split across the actors.  Returns L2-normalised vectors (after ``new_map``, rho in the
    rank_merge mode, when the controller sets it)."""

    new_map = None

    def __init__(
        self,
        bundle_path: str,
        items_path: str,
        size: int = 1,
        num_cpus: float = 0.5,
        resolution: int | None = None,
        data_seed: int = 0,
    ):
        import pyarrow.parquet as pq
        import ray

        if not items_path:
            raise ConfigError(
                "the embedder pool needs an items table (option 'items': item_id, label, instance)"
            )
        t = pq.read_table(items_path)
        for c in ("item_id", "label", "instance"):
            if c not in t.column_names:
                raise ConfigError(f"items table {items_path} lacks column {c!r}")
        ids = t.column("item_id").to_numpy().astype(np.int64)
        o = np.argsort(ids, kind="stable")
        self._sorted, self._rows = ids[o], o
        self.classes = t.column("label").to_numpy().astype(np.int64)
        self.instances = t.column("instance").to_numpy().astype(np.int64)
        # your images: a key per item and the source in the metadata; glyphs: rendered
        self.keys = t.column("key").to_pylist() if "key" in t.column_names else None
        meta = t.schema.metadata or {}
        self.source = json.loads(meta[b"source"]) if self.keys is not None else None
        actor = ray.remote(num_cpus=num_cpus)(ModelEmbedder)
        self.actors = [actor.remote(bundle_path, resolution, data_seed) for _ in range(int(size))]

    def new_vectors(self, ids) -> np.ndarray:
        import ray

        from raycompat.serving.gallery_source import rows_of
        from raycompat.serving.scoring import stored_new

        rows = rows_of(self._sorted, self._rows, ids)
        parts = np.array_split(np.arange(rows.size), len(self.actors))
        refs = [
            a.embed_keys.remote([self.keys[r] for r in rows[p]], self.source)
            if self.keys is not None
            else a.embed_glyphs.remote(self.classes[rows[p]], self.instances[rows[p]])
            for a, p in zip(self.actors, parts, strict=False)
            if p.size
        ]
        return stored_new(np.concatenate(ray.get(refs)), self.new_map)

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
