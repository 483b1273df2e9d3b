"""Training data for the loop: a split of a scenario (glyphs or your images), one or two views.

Old and new models see two independent augmentations of the same image (docs/methods.md,
Notation): view 0 feeds the new model, view 1 the frozen old one. Images are rendered
deterministically on first use and kept as uint8 (1 KB per 32 px view), so later epochs
cost no rendering.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import Dataset

from raycompat.config import ConfigError
from raycompat.data import GlyphRenderer, Scenario, catalog_for
from raycompat.data.datasets import images_to_tensor
from raycompat.methods.base import TrainBatch
from raycompat.torch_distributed import shard_indices


class TrainingSet(Dataset):
    """Items of one split -> ``(x_new, x_old, label)``; ``x_old`` is empty with one view.

    ``view_image(index, view)`` gives one uint8 view ``[H, W]`` (glyphs) or ``[H, W, 3]``
    (your images); views are made once, on first use, and kept."""

    def __init__(
        self, labels: np.ndarray, view_image, shape: tuple, views: int = 2, in_chans: int = 1
    ):
        self.labels = np.asarray(labels, dtype=np.int64)
        self.view_image = view_image
        self.views = views
        self.in_chans = in_chans
        self._images = np.zeros((len(self.labels), views, *shape), np.uint8)
        self._rendered = np.zeros(len(self.labels), bool)
        self.classes = sorted(int(c) for c in np.unique(self.labels))

    def __len__(self) -> int:
        return len(self.labels)

    def images(self, index: int) -> np.ndarray:
        if not self._rendered[index]:
            for v in range(self.views):
                self._images[index, v] = self.view_image(index, v)
            self._rendered[index] = True
        return self._images[index]

    def __getitem__(self, index: int):
        views = images_to_tensor(self.images(index), self.in_chans)
        x_old = views[1] if self.views > 1 else torch.zeros(0)
        return views[0], x_old, int(self.labels[index])


class UserImageViews:
    """Views of your images: decoded once at 9/8 of the resolution, then a seeded random crop
    of ``resolution`` pixels and a random horizontal flip per (item, view), so both views of an
    item differ and every run sees the same ones (docs/methods.md, Notation)."""

    def __init__(self, images, keys: list[str], seed: int):
        self.images, self.keys, self.seed = images, keys, int(seed)
        self.size = images.resolution
        self.margin = max(1, images.resolution // 8)
        self._decoded: tuple[int, np.ndarray] | None = None  # the views of one item share it

    def __call__(self, index: int, view: int) -> np.ndarray:
        if self._decoded is None or self._decoded[0] != index:
            self._decoded = (index, self.images.load(self.keys[index], self.size + self.margin))
        full = self._decoded[1]
        rng = np.random.default_rng([self.seed, int(index), int(view), 0x71E5])
        x, y = (int(v) for v in rng.integers(0, self.margin + 1, size=2))
        crop = full[y : y + self.size, x : x + self.size]
        return crop[:, ::-1] if rng.random() < 0.5 else crop


def build_training_set(cfg, views: int) -> TrainingSet:
    """The training set of ``cfg.split``: rendered glyphs, or your images by key."""
    scenario = Scenario.from_dict(cfg.scenario)
    split = scenario.splits[cfg.split]
    r = cfg.resolution
    if scenario.user_data:
        from raycompat.data.source import ItemImages, SourceSpec

        images = ItemImages(SourceSpec.from_dict(scenario.source), r, cfg.in_chans)
        view_image = UserImageViews(images, split.items, cfg.data_seed)
        shape = (r, r) if cfg.in_chans == 1 else (r, r, cfg.in_chans)
        return TrainingSet(split.labels, view_image, shape, views, cfg.in_chans)
    renderer = GlyphRenderer(catalog_for(scenario), resolution=r, seed=cfg.data_seed)

    def render(index: int, view: int) -> np.ndarray:
        return renderer.render(int(split.labels[index]), int(split.instances[index]), view=view)

    return TrainingSet(split.labels, render, (r, r), views, cfg.in_chans)


def check_training_images(cfg) -> None:
    """Decode every image of ``cfg.split`` on the driver, before Ray starts (your images only:
    glyphs are rendered, not read). The first missing or undecodable one, in item order, is a
    ``ConfigError`` naming its file, so the job prints one ``error: <path>: ...`` line and
    exits 2 instead of failing in a Ray worker after the first epoch started."""
    scenario = Scenario.from_dict(cfg.scenario)
    if not scenario.user_data:
        return
    from raycompat.data.readers import CorruptImageError
    from raycompat.data.source import ItemImages, SourceSpec

    images = ItemImages(SourceSpec.from_dict(scenario.source), cfg.resolution, cfg.in_chans)
    keys = list(scenario.splits[cfg.split].items)

    def problem(key: str):
        try:
            images.load(key)
        except (CorruptImageError, FileNotFoundError) as exc:
            return key, exc
        return None

    threads = 1 if images.spec.kind == "parquet" else min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for found in pool.map(problem, keys):  # in item order: the first bad one is named
            if found is not None:
                raise ConfigError(_bad_image_message(images, cfg.split, *found))


def _bad_image_message(images, split: str, key: str, exc: Exception) -> str:
    """``<path>: <what is wrong> ...``: the file first (a parquet source: the file and the
    item id)."""
    if images.spec.kind == "parquet":
        where, why = f"{images.spec.path} (item_id {key})", str(exc)
    else:
        where = images.path_of(key)
        missing = isinstance(exc, FileNotFoundError)
        why = "no such file" if missing else f"cannot decode the image ({exc.__cause__ or exc})"
    return f"{where}: {why}; it is in the training split {split!r}: fix or remove it"


class EpochPassLoader:
    """Callable yielding this worker's shard of a training set once, for per-epoch passes, as
    ``TrainBatch`` objects (both views when there are two), with no shuffle and no padding, so
    that the shards of all workers partition the set exactly."""

    def __init__(
        self,
        dataset: TrainingSet,
        batch_size: int,
        new_target: torch.Tensor,
        old_target: torch.Tensor,
        device: torch.device | str = "cpu",
    ):
        self.dataset, self.batch_size = dataset, batch_size
        self.new_target, self.old_target = new_target, old_target
        self.device = device

    def __call__(self) -> Iterator[TrainBatch]:
        indices = shard_indices(len(self.dataset))
        for start in range(0, len(indices), self.batch_size):
            chunk = indices[start : start + self.batch_size]
            images = images_to_tensor(
                np.stack([self.dataset.images(int(i)) for i in chunk]), self.dataset.in_chans
            ).to(self.device)  # [B, V, C, H, W]
            labels = torch.from_numpy(self.dataset.labels[chunk]).to(self.device)
            yield TrainBatch(
                x_new=images[:, 0],
                labels=labels,
                new_targets=self.new_target.to(self.device)[labels],
                x_old=images[:, 1] if self.dataset.views > 1 else None,
                old_targets=self.old_target.to(self.device)[labels],
            )
