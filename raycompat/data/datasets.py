"""PyTorch datasets over glyph splits and user image records.

Both yield ``(image, label)`` with ``image`` a float32 tensor (C, H, W) scaled to
[-1, 1] by ``(x / 255 - 0.5) / 0.5``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from .glyphs import GlyphRenderer
from .readers import (
    ImageRecord,
    RecordSet,
    _check_on_error,
    load_image,
    report_skipped,
    verify_records,
)
from .scenarios import Split

logger = logging.getLogger(__name__)


def images_to_tensor(images: np.ndarray, in_chans: int) -> torch.Tensor:
    """uint8 [..., H, W] or [..., H, W, C] with C == ``in_chans`` > 1 (any leading batch dims)
    -> float [..., C, H, W] in [-1, 1], the same scaling as ``to_tensor`` for one image."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(127.5).sub_(1.0)
    if in_chans > 1 and x.ndim >= 3 and x.shape[-1] == in_chans:
        return x.movedim(-1, -3).contiguous()
    x = x.unsqueeze(-3)
    return x.expand(*x.shape[:-3], in_chans, *x.shape[-2:]).contiguous() if in_chans > 1 else x


def to_tensor(img: np.ndarray, in_chans: int = 1) -> torch.Tensor:
    """uint8 (H, W) or (H, W, C) -> float32 (in_chans, H, W) in [-1, 1]."""
    arr = np.asarray(img)
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        arr = arr.copy()
    x = torch.from_numpy(arr).float().div_(127.5).sub_(1.0)
    x = x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)
    if x.shape[0] == in_chans:
        return x
    if x.shape[0] == 1:
        return x.expand(in_chans, -1, -1).contiguous()
    if in_chans == 1:
        return x.mean(0, keepdim=True)
    raise ValueError(f"cannot convert {x.shape[0]} channels to in_chans={in_chans}")


class GlyphDataset(Dataset):
    """Rendered glyphs of one ``Split``.

    Pass a ``GlyphRenderer`` or (``catalog``, ``resolution``, ``seed``, ``augment``).
    ``cache=True`` renders the whole split once into a uint8 array (fast epochs for
    small splits); otherwise each item is rendered on access (deterministically).
    """

    def __init__(
        self,
        split: Split,
        renderer: GlyphRenderer | None = None,
        *,
        catalog=None,
        resolution: int = 32,
        seed: int = 0,
        augment: bool = True,
        in_chans: int = 1,
        cache: bool = False,
    ):
        if renderer is None:
            if catalog is None:
                from .glyphs import default_catalog

                catalog = default_catalog()
            renderer = GlyphRenderer(catalog, resolution=resolution, seed=seed, augment=augment)
        if int(in_chans) < 1:
            raise ValueError(f"in_chans must be >= 1, got {in_chans}")
        self.split = split
        self.renderer = renderer
        self.in_chans = int(in_chans)
        self.images = renderer.render_batch(split.labels, split.instances) if cache else None

    def __len__(self) -> int:
        return len(self.split)

    @property
    def labels(self) -> np.ndarray:
        return self.split.labels

    def image(self, i: int) -> np.ndarray:
        """uint8 (H, W) image of item ``i``."""
        if self.images is not None:
            return self.images[i]
        return self.renderer.render(self.split.labels[i], self.split.instances[i])

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(
                f"index {i} out of range for split {self.split.name!r} of {len(self)} items"
            )
        return to_tensor(self.image(i), self.in_chans), int(self.split.labels[i])


class ImageRecordDataset(Dataset):
    """Images from reader records, decoded with PIL, resized (shorter side) and
    centre-cropped to ``resolution``, converted to ``in_chans`` channels.

    ``verify=True`` decodes everything up front and drops unreadable items
    (``on_error='skip'``) into ``skipped`` with one warning. Without it, an
    unreadable item raises (``'raise'``), or is logged, added to ``skipped`` and
    returned as ``None`` (``'skip'``) -- use ``collate_skip_none`` in the loader.
    ``use_bbox`` crops records that carry a box (revisited queries).
    """

    def __init__(
        self,
        records,
        resolution: int = 224,
        in_chans: int = 3,
        *,
        on_error: str = "raise",
        verify: bool = False,
        use_bbox: bool = True,
    ):
        _check_on_error(on_error)
        if isinstance(records, RecordSet):
            records = records.records
        self.records: list[ImageRecord] = list(records)
        self.resolution = int(resolution)
        self.in_chans = int(in_chans)
        self.on_error = on_error
        self.use_bbox = use_bbox
        self.skipped: list[str] = []
        if verify:
            self.records, self.skipped = verify_records(
                self.records, on_error, where="ImageRecordDataset"
            )

    def __len__(self) -> int:
        return len(self.records)

    @property
    def labels(self) -> np.ndarray:
        return np.array([r.label for r in self.records], dtype=np.int64)

    def __getitem__(self, i: int):
        rec = self.records[i]
        mode = "RGB" if self.in_chans == 3 else "L"
        bbox = rec.bbox if self.use_bbox else None
        img = load_image(
            rec.data if rec.data is not None else rec.path,
            mode=mode,
            resolution=self.resolution,
            on_error=self.on_error,
            source=rec.source,
            bbox=bbox,
        )
        if img is None:
            if rec.source not in self.skipped:
                self.skipped.append(rec.source)
            return None
        return to_tensor(np.asarray(img), self.in_chans), int(rec.label)

    def report_skipped(self) -> list[str]:
        """Log the skipped items so far (count and sources) and return them."""
        report_skipped("ImageRecordDataset", self.skipped)
        return list(self.skipped)


def collate_skip_none(batch):
    """``default_collate`` after dropping ``None`` items (skipped images); logs how
    many were dropped. Returns ``None`` for a batch with no readable item."""
    kept = [b for b in batch if b is not None]
    if len(kept) < len(batch):
        logger.warning(
            "dropped %d unreadable image(s) from a batch of %d", len(batch) - len(kept), len(batch)
        )
    return default_collate(kept) if kept else None
