"""Training data for the loop: a split of the built-in glyph scenario, one or two views.

Old and new models see two independent augmentations of the same image (docs/methods.md,
Notation): view 0 feeds the new model, view 1 the frozen old one. Images are rendered
deterministically on first use and kept as uint8 (1 KB per 32 px view), so later epochs
cost no rendering.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from raycompat.data import GlyphRenderer, Scenario, catalog_for
from raycompat.data.datasets import images_to_tensor
from raycompat.distributed import shard_indices
from raycompat.methods.base import TrainBatch


class TrainingSet(Dataset):
    """Items of one split -> ``(x_new, x_old, label)``; ``x_old`` is empty with one view."""

    def __init__(
        self,
        labels: np.ndarray,
        instances: np.ndarray,
        renderer: GlyphRenderer,
        views: int = 2,
        in_chans: int = 1,
    ):
        self.labels = np.asarray(labels, dtype=np.int64)
        self.instances = np.asarray(instances, dtype=np.int64)
        self.renderer = renderer
        self.views = views
        self.in_chans = in_chans
        r = renderer.resolution
        self._images = np.zeros((len(self.labels), views, r, r), np.uint8)
        self._rendered = np.zeros(len(self.labels), bool)
        self.classes = sorted(int(c) for c in np.unique(self.labels))

    def __len__(self) -> int:
        return len(self.labels)

    def images(self, index: int) -> np.ndarray:
        if not self._rendered[index]:
            c, i = int(self.labels[index]), int(self.instances[index])
            for v in range(self.views):
                self._images[index, v] = self.renderer.render(c, i, view=v)
            self._rendered[index] = True
        return self._images[index]

    def __getitem__(self, index: int):
        views = images_to_tensor(self.images(index), self.in_chans)
        x_old = views[1] if self.views > 1 else torch.zeros(0)
        return views[0], x_old, int(self.labels[index])


def build_training_set(cfg, views: int) -> TrainingSet:
    scenario = Scenario.from_dict(cfg.scenario)
    split = scenario.splits[cfg.split]
    renderer = GlyphRenderer(catalog_for(scenario), resolution=cfg.resolution, seed=cfg.data_seed)
    return TrainingSet(split.labels, split.instances, renderer, views=views, in_chans=cfg.in_chans)


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
